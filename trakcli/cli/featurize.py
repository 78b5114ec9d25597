"""`trak featurize CONFIG`: project per-example train gradients of every checkpoint into the store."""

from __future__ import annotations

from trakcli.cli.common import (
    ConfigArg, OverridesArg, OverwriteOpt, PrintConfigOpt, QuietOpt, RichReporter, SkipNonfiniteOpt, VerifyOpt,
    err_console, handle_errors, load,
)


@handle_errors
def featurize(
    config: ConfigArg,
    overrides: OverridesArg = None,
    print_config: PrintConfigOpt = False,
    overwrite: OverwriteOpt = False,
    quiet: QuietOpt = False,
    skip_nonfinite: SkipNonfiniteOpt = False,
    verify: VerifyOpt = False,
) -> None:
    """Compute train features (projected gradients) for every checkpoint; resumes, and featurizes appended rows alone."""
    reporter = RichReporter(quiet)
    reporter.phase("reading the config, importing torch …")  # the first line, before the slow imports
    cfg = load(config, overrides, print_config)
    from trakcli.jobs.featurize import featurize as run  # after the config is valid: importing torch is slow

    res = run(cfg, overwrite=overwrite, skip_nonfinite=skip_nonfinite, verify=verify, reporter=reporter)
    if quiet:
        return
    for model_id, rows in res.skipped.items():
        more = f" and {len(rows) - 10} more" if len(rows) > 10 else ""
        err_console.print(f"[yellow]model {model_id}: skipped {len(rows)} examples with non-finite gradients: "
                          f"{rows[:10]}{more}[/]")
    kernels = f"; made {res.kernels_computed} kernels" if res.kernels_computed else ""
    if res.chunks_computed == 0:
        err_console.print(f"[green]nothing to do:[/] {res.store} already holds features of all {res.n_models} "
                          f"checkpoints ({res.n_train} train rows, proj_dim {res.proj_dim}){kernels}")
    else:
        err_console.print(f"[green]featurized[/] {res.n_models} checkpoints x {res.n_train} train rows (grad_dim "
                          f"{res.grad_dim} -> proj_dim {res.proj_dim}); computed "
                          f"{res.chunks_computed}/{res.chunks_total} chunks{kernels} -> {res.store}")
