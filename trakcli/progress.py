"""Progress reporting without a UI dependency.

Library functions take a :class:`Reporter`; the CLI passes one that draws rich
progress bars on stderr, tests and library users get the silent default.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Union

Field = Union[float, int, str]
"""A live value shown beside a progress bar (floats are shown with 4 significant digits)."""


class Task:
    """A running unit of work with a known total; the silent default ignores everything."""

    def advance(self, n: int = 1) -> None:
        """Count ``n`` more steps as done."""

    def update(self, **fields: Field) -> None:
        """Show live values beside the bar, e.g. ``task.update(loss=0.31, acc=0.92)``.

        A field keeps its value until the next call that names it; fields show in
        the order they were first given.
        """


class Reporter:
    """Silent reporter; subclasses draw progress bars and print messages."""

    @contextmanager
    def task(self, description: str, total: int) -> Iterator[Task]:
        """A task of ``total`` steps; call ``advance`` (and ``update``) on what it yields."""
        yield Task()

    def info(self, message: str) -> None:
        """A one-line human message (stderr in the CLI)."""


def format_fields(fields: dict[str, Field]) -> str:
    """``{"loss": 0.31234, "acc": 0.9}`` -> ``"loss 0.3123  acc 0.9"`` (what a progress bar shows)."""
    return "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items())


NULL_REPORTER = Reporter()
