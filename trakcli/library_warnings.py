"""Warnings of other libraries go to a debug log, not to the user's terminal (:func:`library_warnings_to_log`,
around every `trak` command and `trak eval`'s worker processes)."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from contextlib import contextmanager
from typing import Any, Iterator

from trakcli.errors import in_library

#: Where the warnings of other libraries go during a command (:func:`library_warnings_to_log`), at debug level.
warnings_log = logging.getLogger("trakcli.warnings")

#: How many :func:`library_warnings_to_log` blocks this process is in.
_active = 0

#: The files of the ``warnings`` machinery, whose frames are skipped when looking for the code that issued a warning.
_WARNING_FILES = {os.path.realpath(f) for f in (warnings.__file__, getattr(sys.modules.get("_py_warnings"), "__file__", None))
                  if f}


def _issued_by_library(filename: str) -> bool:
    """Whether the warning being shown (inside ``warnings.showwarning``) was issued by a library: the warning's
    ``filename`` or the first frame outside ``warnings`` is a library's, or that frame never calls
    ``warnings.warn`` (a C extension warned inside an operation it ran)."""
    if in_library(filename):
        return True
    frame = sys._getframe(2)  # the caller of showwarning (below: the frame that warned)
    while frame is not None and os.path.realpath(frame.f_code.co_filename) in _WARNING_FILES:
        frame = frame.f_back
    if frame is None:
        return False
    code = frame.f_code
    return in_library(code.co_filename) or not {"warn", "warn_explicit"} & set(code.co_names)


@contextmanager
def library_warnings_to_log() -> Iterator[None]:
    """During a command, the Python warnings of other libraries go to :data:`warnings_log` at debug level.

    peft's ``UserWarning: fan_in_fan_out is set to False ...``, transformers' and torch's deprecations
    say nothing a ``trak`` user can act on; warnings that trakcli's or the user's own code issues
    (``warnings.warn`` in a model file) still reach stderr. ``TRAK_DEBUG=1`` shows every warning, as
    Python does; a ``logging`` handler at DEBUG on ``trakcli.warnings`` receives them too.
    """
    if os.environ.get("TRAK_DEBUG"):
        yield
        return
    shown = warnings.showwarning

    def show(message: Any, category: type[Warning], filename: str, lineno: int, file: Any = None,
             line: str | None = None) -> None:
        if _issued_by_library(filename):
            warnings_log.debug("%s:%s: %s: %s", filename, lineno, category.__name__, message)
        else:
            shown(message, category, filename, lineno, file, line)

    global _active
    warnings.showwarning = show
    _active += 1
    try:
        yield
    finally:
        _active -= 1
        if warnings.showwarning is show:  # a nested catch_warnings restored it already otherwise
            warnings.showwarning = shown


def routing() -> bool:
    """Whether this process is inside :func:`library_warnings_to_log` now (worker processes follow their parent)."""
    return _active > 0
