"""Progress reporting without a UI dependency.

Library functions take a :class:`Reporter`; the CLI passes one that draws rich
progress bars on stderr, tests and library users get the silent default.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator


class Task:
    """A running unit of work with a known total."""

    def advance(self, n: int = 1) -> None:  # noqa: D102
        pass


class Reporter:
    """Silent reporter; subclasses draw progress bars and print messages."""

    @contextmanager
    def task(self, description: str, total: int) -> Iterator[Task]:
        """A task of ``total`` steps; call ``advance`` on what it yields."""
        yield Task()

    def info(self, message: str) -> None:
        """A one-line human message (stderr in the CLI)."""


NULL_REPORTER = Reporter()
