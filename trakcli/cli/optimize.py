"""`trak optimize CONFIG`: train N independently seeded models and write checkpoints."""

from __future__ import annotations

from trakcli.cli.common import (
    ConfigArg, OverridesArg, OverwriteOpt, PrintConfigOpt, QuietOpt, RichReporter, err_console, handle_errors, load,
)


@handle_errors
def optimize(
    config: ConfigArg,
    overrides: OverridesArg = None,
    print_config: PrintConfigOpt = False,
    overwrite: OverwriteOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Train optimize.n_models models with the config's recipe; write optimize.out_dir/model_NNN.pt.

    With optimize.projection the optimizer runs in a random subspace (per_matrix or global);
    optimize.metrics names a JSON file for per-model loss, accuracy and optimizer state size.
    """
    cfg = load(config, overrides, print_config)
    from trakcli import pipeline  # imported after the config is valid: torch import is slow
    paths = pipeline.optimize(cfg, overwrite=overwrite, reporter=RichReporter(quiet))
    if not quiet:
        err_console.print(f"[green]{len(paths)} checkpoints in {cfg.optimize.out_dir}[/]")  # type: ignore[union-attr]
