"""The picture of an LDS sweep (`trak eval sweep`): LDS against proj_dim, checkpoints and the ridge."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from trakcli.errors import ArgumentError
from trakcli.plots.common import check_plot_path, new_figure, save_figure


def plot_sweep(path: str | Path, rows: Sequence[Mapping[str, Any]], *, default: Mapping[str, Any] | None = None,
               title: str | None = None, dpi: int = 100) -> Path:
    """Draw the curves of an LDS sweep over proj_dim, checkpoints and lambda, and write the figure.

    Three panels, each point with its 95% bootstrap interval as an error bar: LDS against ``proj_dim`` (one line per
    number of checkpoints) and against the number of checkpoints (one line per proj_dim), each point at its best lambda;
    and LDS against ``lambda_rel`` (else ``lambda_reg``) at the largest number of checkpoints. The best row is marked
    with a gold star, the ``default`` settings with a black diamond.

    Args:
        path: file to write, ``.png`` / ``.pdf`` / ``.svg``.
        rows: one dict per evaluated setting: ``proj_dim``, ``n_checkpoints``, ``lambda_rel`` and ``lambda_reg``
            (float or None), ``lds`` and ``ci_low``, ``ci_high`` (the 95% bootstrap interval; None: no bar).
        default: the default settings (``proj_dim``, ``n_checkpoints``, ``lambda_rel`` or ``lambda_reg``).
        title: figure title; default: names the best setting.
        dpi: resolution of raster output.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ArgumentError: bad path or suffix, the file cannot be written, no rows, or
            a row missing a key or with a non-finite ``lds``.
    """
    path = check_plot_path(path)
    pts = _sweep_points(rows)
    best = max(pts, key=lambda p: p["lds"])
    dflt = _find_default(pts, default) if default is not None else None
    max_m = max(p["n_checkpoints"] for p in pts)
    use_rel = any(p["lambda_rel"] is not None for p in pts)
    lam_key = "lambda_rel" if use_rel else "lambda_reg"

    fig = new_figure(figsize=(15.0, 5.2), layout="constrained")
    if title is None:
        title = f"LDS sweep (error bars: 95% bootstrap interval)\n★ best: {_describe(best)}"
        if dflt is not None:
            title += f"     ◇ default: {_describe(dflt)}"
    fig.suptitle(title, fontsize=10.5)
    ax_d, ax_m, ax_l = fig.subplots(1, 3)

    # panels 1 and 2: best lambda for each (proj_dim, n_checkpoints)
    best_at: dict[tuple[int, int], dict] = {}
    for p in pts:
        key = (p["proj_dim"], p["n_checkpoints"])
        if key not in best_at or p["lds"] > best_at[key]["lds"]:
            best_at[key] = p
    dims = sorted({d for d, _ in best_at})
    ms = sorted({m for _, m in best_at})
    for i, m in enumerate(ms):
        line = [best_at[(d, m)] for d in dims if (d, m) in best_at]
        _curve(ax_d, [p["proj_dim"] for p in line], line, f"{m} checkpoint{'s' if m > 1 else ''}", _shade(i, len(ms)))
    for i, d in enumerate(dims):
        line = [best_at[(d, m)] for m in ms if (d, m) in best_at]
        _curve(ax_m, [p["n_checkpoints"] for p in line], line, f"proj_dim {d}", _shade(i, len(dims)))
    ax_d.set_xscale("log", base=2)
    _ticks(ax_d, dims)
    _ticks(ax_m, ms)
    ax_d.set(xlabel="proj_dim", ylabel="LDS", title="LDS vs proj_dim (best λ per point)")
    ax_m.set(xlabel="checkpoints (models ensembled)", ylabel="LDS", title="LDS vs checkpoints (best λ per point)")

    # panel 3: lambda at the largest number of checkpoints
    at_max = [p for p in pts if p["n_checkpoints"] == max_m and p[lam_key] is not None]
    lam_dims = sorted({p["proj_dim"] for p in at_max})
    for i, d in enumerate(lam_dims):
        line = sorted((p for p in at_max if p["proj_dim"] == d), key=lambda p: p[lam_key])
        _curve(ax_l, [p[lam_key] for p in line], line, f"proj_dim {d}", _shade(dims.index(d), len(dims)))
    if at_max and min(p[lam_key] for p in at_max) > 0:
        ax_l.set_xscale("log")
    _lambda_ticks(ax_l, [p[lam_key] for p in at_max])
    ax_l.set(xlabel="lambda_rel (ridge / mean squared feature norm)" if use_rel else "lambda_reg (absolute ridge)",
             ylabel="LDS", title=f"LDS vs λ at {max_m} checkpoint{'s' if max_m > 1 else ''}")

    # the best and default settings, where they belong on each panel's x axis
    for ax, xkey in ((ax_d, "proj_dim"), (ax_m, "n_checkpoints"), (ax_l, lam_key)):
        marks = (
            (best, "best", dict(marker="*", s=260, color="gold", edgecolors="black", zorder=6)),
            (dflt, "default", dict(marker="D", s=70, facecolors="none", edgecolors="black", linewidths=1.6, zorder=7)),
        )
        for p, name, style in marks:  # the default's marker is "default" even when it is also the best
            if p is None or p[xkey] is None or (ax is ax_l and p["n_checkpoints"] != max_m):
                continue
            ax.scatter([p[xkey]], [p["lds"]], label=name, **style)
        ax.grid(True, alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if handles:
            ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=min(3, len(handles)),
                      frameon=False)
        else:
            ax.text(0.5, 0.5, "no points", ha="center", va="center", transform=ax.transAxes, color="gray")
    save_figure(fig, path, dpi)
    return path


def _sweep_points(rows: Sequence[Mapping[str, Any]]) -> list[dict]:
    if not rows:
        raise ArgumentError("plot_sweep: no rows to draw; the sweep produced no results")
    pts = []
    for n, r in enumerate(rows):
        missing = [k for k in ("proj_dim", "n_checkpoints", "lds") if k not in r]
        if missing:
            raise ArgumentError(f"plot_sweep: rows[{n}] has no {', '.join(missing)}; each row needs proj_dim, "
                                "n_checkpoints, lambda_rel or lambda_reg, lds, ci_low, ci_high")
        lds = float(r["lds"])
        if not math.isfinite(lds):
            raise ArgumentError(f"plot_sweep: rows[{n}] has lds={r['lds']!r}; it must be a finite number")
        opt = lambda key: None if r.get(key) is None else float(r[key])  # noqa: E731
        pts.append({"proj_dim": int(r["proj_dim"]), "n_checkpoints": int(r["n_checkpoints"]),
                    "lambda_rel": opt("lambda_rel"), "lambda_reg": opt("lambda_reg"),
                    "lds": lds, "ci_low": opt("ci_low"), "ci_high": opt("ci_high")})
    return pts


def _find_default(pts: list[dict], default: Mapping[str, Any]) -> dict | None:
    """The row of the default settings: same proj_dim and checkpoints, and the same lambda_rel
    (or, if the default gives no lambda_rel, the same absolute lambda_reg)."""
    key = "lambda_rel" if default.get("lambda_rel") is not None else "lambda_reg"
    want = default.get(key)
    at = (int(default.get("proj_dim", -1)), int(default.get("n_checkpoints", -1)))
    for p in pts:
        have = p[key]
        if (p["proj_dim"], p["n_checkpoints"]) == at and (have is None) == (want is None) and (
                want is None or math.isclose(have, float(want), rel_tol=1e-6)):
            return p
    return None


def _describe(p: Mapping[str, Any]) -> str:
    lam = f"λ_rel={p['lambda_rel']:.3g}" if p.get("lambda_rel") is not None else (
        f"λ={p['lambda_reg']:.3g}" if p.get("lambda_reg") is not None else "λ default")
    return f"LDS {p['lds']:.3f} at proj_dim={p['proj_dim']}, {p['n_checkpoints']} ckpts, {lam}"


def _curve(ax: Any, x: list, line: list[dict], label: str, color: Any) -> None:
    y = np.array([p["lds"] for p in line])
    lo = np.array([p["ci_low"] if p["ci_low"] is not None else p["lds"] for p in line])
    hi = np.array([p["ci_high"] if p["ci_high"] is not None else p["lds"] for p in line])
    yerr = np.vstack([np.clip(y - lo, 0, None), np.clip(hi - y, 0, None)])
    ax.errorbar(x, y, yerr=yerr, marker="o", ms=4, capsize=3, lw=1.5, color=color, label=label)


def _shade(i: int, n: int) -> Any:
    from matplotlib import colormaps

    return colormaps["viridis"](0.85 * i / max(n - 1, 1))


def _lambda_ticks(ax: Any, values: list[float], most: int = 6) -> None:
    """Ticks at the swept λ values (at most ``most``), ``%.3g``, slanted."""
    vals = sorted(set(v for v in values if v is not None))
    _ticks(ax, vals[:: max(1, math.ceil(len(vals) / most))], "{:.3g}", rotation=30, ha="right")


def _ticks(ax: Any, values: list, fmt: str = "{}", **kwargs: Any) -> None:
    """Ticks at ``values`` only: matplotlib's minor tick labels of a short log axis overlap."""
    if values:
        ax.minorticks_off()
        ax.set_xticks(values)
        ax.set_xticklabels([fmt.format(v) for v in values], **kwargs)
