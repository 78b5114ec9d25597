"""What the pictures share: the output path check, an off-screen figure (matplotlib's Agg canvas, imported when
drawing; no pyplot state), saving, colors, text helpers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from trakcli.errors import ArgumentError
from trakcli.files import atomic_path

#: File formats the plots are written in (matplotlib's own backends, no extra dependency).
PLOT_SUFFIXES = (".png", ".pdf", ".svg")

#: Colors of the pictures: proponents green, opponents red, the target blue.
PRO_COLOR = "#1a7f37"  # proponents: green
OPP_COLOR = "#c62828"  # opponents: red
PRO_FILL = "#e8f5e9"
OPP_FILL = "#fdecea"
TARGET_COLOR = "#1f4e9a"


def check_plot_path(path: str | Path, flag: str = "plot path") -> Path:
    """``path`` as a :class:`~pathlib.Path` once a figure can be written to it (its suffix: the format), before
    any work is done; ``flag`` names it in messages (the CLI's ``"--plot"``).

    Raises:
        ArgumentError: unknown suffix, missing parent directory, a directory at ``path``, or a path the file
            system refuses.
    """
    path = Path(path)
    if path.suffix.lower() not in PLOT_SUFFIXES:
        raise ArgumentError(f"{flag} {path}: unknown format {path.suffix or '(no suffix)'!r}; use a "
                            + " / ".join(PLOT_SUFFIXES) + " path")
    try:
        if not path.parent.is_dir():
            raise ArgumentError(f"{flag} {path}: directory {path.parent} does not exist; create it or choose another "
                                "path")
        if path.is_dir():
            raise ArgumentError(f"{flag} {path} is a directory; give a file name such as {path / 'top.png'}")
    except OSError as e:  # e.g. a name too long for the file system
        raise ArgumentError(f"{flag} {path}: {e.strerror or e}; choose another path") from None
    return path


def new_figure(**kwargs: Any) -> Any:
    """A matplotlib Figure on its own off-screen Agg canvas (no pyplot, no display); ``kwargs`` go to ``Figure``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig: Any, path: Path, dpi: int) -> None:
    """Write ``fig`` atomically to ``path`` in the format of its suffix, on white, at ``dpi``
    (:class:`ArgumentError`: the file system refuses it)."""
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=dpi, format=path.suffix.lower().lstrip("."), facecolor="white")
    except OSError as e:
        raise ArgumentError(f"cannot write the plot to {path}: {e.strerror or e}; choose a writable path") from None


def as_numpy(x: Any) -> np.ndarray:
    """A numpy array of ``x`` (a CPU copy of a torch tensor, detached)."""
    if hasattr(x, "detach"):  # torch tensor
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def shorten(text: str, n: int) -> str:
    """``text`` on one line (runs of white space -> one space), cut to ``n`` characters with an ellipsis."""
    text = " ".join(str(text).split())  # newlines and runs of spaces -> one space
    return text if len(text) <= n else text[: n - 1].rstrip() + "…"


def escape_math(text: str) -> str:
    """``text`` with ``$`` escaped: matplotlib reads ``$...$`` as math."""
    return text.replace("$", r"\$")
