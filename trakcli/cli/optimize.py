"""`trak optimize CONFIG`: train N independently seeded models and write checkpoints."""

from __future__ import annotations

from trakcli.cli.common import (
    ConfigArg, OverridesArg, OverwriteOpt, PrintConfigOpt, QuietOpt, RichReporter, err_console, handle_errors,
    load,
)


@handle_errors
def optimize(
    config: ConfigArg,
    overrides: OverridesArg = None,
    print_config: PrintConfigOpt = False,
    overwrite: OverwriteOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Train optimize.n_models models with the config's recipe; write out_dir/model_NNN.pt and out_dir/manifest.json.

    The progress bar counts optimizer steps over all epochs, with the time left (measured after the first step),
    and shows the epoch, its running loss and accuracy, and data.validation's if given.

    The manifest (seed, subset indices, sha256, metrics per model) is rewritten after every finished model: point checkpoints: at it to featurize exactly these models. A rerun keeps finished models and resumes a killed one.

    optimize.projection runs the optimizer in a random subspace (per_matrix or global); optimize.metrics names a JSON file for per-model metrics with per-epoch history.
    """
    reporter = RichReporter(quiet)
    reporter.phase("reading the config, importing torch …")  # the first line, before the slow imports
    cfg = load(config, overrides, print_config)
    from trakcli.jobs.optimize import optimize as run  # after the config is valid: importing torch is slow

    paths = run(cfg, overwrite=overwrite, reporter=reporter)
    if not quiet:
        err_console.print(f"[green]{len(paths)} checkpoints in {cfg.recipe.out_dir}[/]")  # type: ignore[union-attr]
