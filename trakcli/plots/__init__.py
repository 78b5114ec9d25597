"""Pictures of TRAK results (matplotlib, usable without the CLI).

- :func:`plot_top` (:mod:`trakcli.plots.top`): targets beside their top
  proponents and opponents (images in a grid, other data in tables);
  ``trak score --plot``.
- :func:`plot_sweep` (:mod:`trakcli.plots.sweep`): the LDS curves of
  ``trak eval sweep``.
- :func:`check_plot_path` (:mod:`trakcli.plots.common`): check an output path
  before any work is done.

matplotlib is imported only when a picture is drawn, so importing this
package stays fast. Bad arguments raise :class:`trakcli.errors.ArgumentError`.
"""

from trakcli.plots.common import PLOT_SUFFIXES, check_plot_path
from trakcli.plots.sweep import plot_sweep
from trakcli.plots.top import DecodedTexts, RowTexts, image_shape_of, plot_top, top_indices

__all__ = ["PLOT_SUFFIXES", "DecodedTexts", "RowTexts", "check_plot_path", "image_shape_of", "plot_sweep", "plot_top", "top_indices"]
