"""``trak report``: one self-contained HTML page of an experiment's answers: :func:`render_report` (the page of
answer records), :func:`experiment_page` (of an experiment kept in the store), :func:`write_page`."""

from trakcli.report.html import embed_json, render_report
from trakcli.report.source import Rows, experiment_page, rows_of, stored_result, write_page

__all__ = ["Rows", "embed_json", "experiment_page", "render_report", "rows_of", "stored_result", "write_page"]
