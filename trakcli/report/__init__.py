"""``trak report``: one self-contained HTML page of an experiment's answers.

- :func:`render_report` (:mod:`trakcli.report.html`): the page of answer records
  (:mod:`trakcli.answers`), with pictures for image data and tokens shaded by their contributions
  for per-token answers; inline style and script, the data embedded once as JSON.
- :func:`experiment_page` (:mod:`trakcli.report.source`): the page of an experiment kept in the
  store (its top-k or full score matrix), with the rows' texts, pictures and labels; nothing is
  recomputed. :func:`write_page` writes it atomically.
"""

from trakcli.report.html import embed_json, render_report
from trakcli.report.source import Rows, experiment_page, rows_of, stored_result, write_page

__all__ = ["Rows", "embed_json", "experiment_page", "render_report", "rows_of", "stored_result", "write_page"]
