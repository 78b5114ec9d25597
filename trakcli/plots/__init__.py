"""Pictures of TRAK results (matplotlib, imported only when drawing; usable without the CLI): :func:`plot_top`
(``trak score --plot``), :func:`plot_sweep` (``trak eval sweep``), :func:`check_plot_path` (before any work).
Bad arguments raise :class:`trakcli.errors.ArgumentError`."""

from trakcli.plots.common import PLOT_SUFFIXES, check_plot_path
from trakcli.plots.sweep import plot_sweep
from trakcli.plots.top import DecodedTexts, RowTexts, image_shape_of, plot_top, top_indices

__all__ = ["PLOT_SUFFIXES", "DecodedTexts", "RowTexts", "check_plot_path", "image_shape_of", "plot_sweep", "plot_top",
           "top_indices"]
