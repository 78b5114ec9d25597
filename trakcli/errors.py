"""Exceptions of trakcli: every error a user can cause is a :class:`TrakError` whose message says what happened,
the offending value, and how to fix it; the CLI prints it as one line and exits with its ``exit_code``.

A fix that differs by front end (the CLI's ``--overwrite``, the Python API's ``overwrite=True``) is data, a
:class:`Fix`: ``str(error)`` words it for the CLI, :meth:`TrakError.for_front` for the Python API; a
:class:`Note` (a line a job reports) carries its fix the same way.
"""

from __future__ import annotations

import sysconfig
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator

#: The front ends that word a :class:`Fix`: ``"cli"`` (the ``trak`` commands), ``"api"`` (:class:`trakcli.Attributor`).
FRONTS = ("cli", "api")

#: Per kind of :class:`Fix`, its wording per front end (``{store}``, ``{experiment_key}``: the fix's fields).
FIX_WORDS: dict[str, dict[str, str]] = {
    "start_over": {"cli": "rerun with --overwrite to start over",
                   "api": "give Attributor another store path, or delete {store} to start over"},
    "start_over_or_new_path": {"cli": "rerun with --overwrite to start over, or choose another store path",
                               "api": "give Attributor another store path, or delete {store} to start over"},
    "recompute_experiment": {"cli": "rerun with --overwrite to recompute them, or set {experiment_key} to a new name",
                             "api": "pass overwrite=True to recompute them, or another experiment="},
    "recompute_scores": {"cli": "rerun with --overwrite to recompute the scores, or set {experiment_key} to a new name",
                         "api": "pass overwrite=True to recompute the scores, or another experiment="},
    "rescore": {"cli": "rescore with `trak score CONFIG --overwrite`",
                "api": "rescore with overwrite=True"},
    "rescore_call": {"cli": "`trak score CONFIG --overwrite`",
                     "api": "overwrite=True"},
}


@dataclass(frozen=True)
class Fix:
    """How to fix an error, said by no front end: each front end words it (:meth:`words`).

    ``kind`` is one of :data:`FIX_WORDS`; ``store`` the store it concerns as the user named it; ``experiment_key`` the
    config key naming the experiment, for the CLI's wording. An unknown ``kind`` raises ``ValueError``.
    """

    kind: str
    store: str = ""
    experiment_key: str = "score.experiment"

    def __post_init__(self) -> None:
        if self.kind not in FIX_WORDS:
            raise ValueError(f"Fix kind {self.kind!r} is not one of {sorted(FIX_WORDS)}")

    def words(self, front: str = "cli") -> str:
        """The fix as ``front`` (one of :data:`FRONTS`, else ``ValueError``) says it."""
        if front not in FRONTS:
            raise ValueError(f"front {front!r} is not one of {list(FRONTS)}")
        return FIX_WORDS[self.kind][front].format(store=self.store, experiment_key=self.experiment_key)


class TrakError(Exception):
    """Base class of every user-facing trakcli error (the CLI exits with ``exit_code``).

    ``TrakError(message)``: the message says the fix. ``TrakError(head, fix=Fix(...), after=tail)``: the message is
    ``head``, the fix worded for the CLI, then ``tail``; :meth:`for_front` words it for another front end.
    """

    exit_code: int = 1
    fix: Fix | None = None

    def __init__(self, *args: Any, fix: Fix | None = None, after: str = "") -> None:
        if fix is not None:
            self.fix, self._around = fix, (str(args[0]) if args else "", after)
            args = (self.worded("cli"), *args[1:])
        super().__init__(*args)

    def worded(self, front: str) -> str:
        """The message with its fix worded for ``front`` (one of :data:`FRONTS`); ``str(self)`` without a fix."""
        if self.fix is None:
            return str(self)
        head, after = self._around
        return head + self.fix.words(front) + after

    def for_front(self, front: str) -> "TrakError":
        """This error as ``front`` words it: of the same class, with the same :attr:`fix`; itself without a fix."""
        return self if self.fix is None else self._copy(self.fix, front)

    def with_fix(self, fix: Fix) -> "TrakError":
        """This error (of the same class, the same message around the fix) with ``fix`` instead of its own
        (``ValueError``: it has none)."""
        if self.fix is None:
            raise ValueError(f"{type(self).__name__} has no fix to replace: {self}")
        return self._copy(fix, "cli")

    def _copy(self, fix: Fix, front: str) -> "TrakError":
        other = type(self).__new__(type(self))
        other.__dict__.update(self.__dict__)
        other.fix = fix
        other.args = (other.worded(front),)
        return other


class Note(str):
    """A line a job reports (``Store.notes``), ``head + fix.words("cli") + after``; :meth:`worded` says it for
    another front end."""

    fix: Fix

    def __new__(cls, head: str, fix: Fix, after: str = "") -> "Note":
        note = super().__new__(cls, head + fix.words("cli") + after)
        note.fix, note._around = fix, (head, after)
        return note

    def __reduce__(self) -> tuple[Any, ...]:
        return (Note, (self._around[0], self.fix, self._around[1]))

    def worded(self, front: str) -> str:
        """The note with its fix worded for ``front`` (one of :data:`FRONTS`)."""
        head, after = self._around
        return head + self.fix.words(front) + after


def worded(text: str | Note, front: str) -> str:
    """``text`` as ``front`` words it: a :class:`Note`'s fix worded for ``front``, any other string as it is."""
    return text.worded(front) if isinstance(text, Note) else str(text)


class ConfigError(TrakError):
    """The YAML config or a ``key=value`` override is invalid (``problems``: one line per problem, each starting
    with the dotted config key it concerns)."""

    def __init__(self, problems: list[str] | str, source: str | None = None):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        where = f" in {source}" if source else ""
        n = len(self.problems)
        if n == 1:
            super().__init__(f"config{where}: {self.problems[0]}")
        else:
            head = f"{n} problems with the config{where}:"
            super().__init__(head + "\n" + "\n".join(f"  - {p}" for p in self.problems))


class UsageError(TrakError):
    """A command-line flag has a bad value (exit code 2, like a click usage error); library code raises
    :class:`ArgumentError` instead."""

    exit_code = 2


class ArgumentError(UsageError):
    """A library function was given an argument it cannot use (a path it cannot write, a count below 1, no rows),
    named as the caller named it; a command passing a flag through reports it as that bad flag (exit code 2)."""


class DataError(TrakError):
    """The training or target data cannot be loaded or does not fit the model."""


class ModelError(TrakError):
    """The model cannot be built, or a checkpoint does not fit it."""


class CheckpointError(ModelError):
    """A checkpoint file is missing, unreadable or does not match the model."""


class ProjectorError(TrakError):
    """A projector was asked for with invalid options, or is not available here."""


class StoreError(TrakError):
    """The Zarr store cannot be written, or holds data made with other settings."""


class MissingModuleError(TrakError):
    """An optional ``module`` a feature imports is not installed; the message names it and the install command."""

    def __init__(self, message: str, module: str = ""):
        super().__init__(message)
        self.module = module


class StoreMismatchError(StoreError):
    """The store was made with a different config; ``--overwrite`` starts over."""


class GradientError(TrakError):
    """Per-example gradients could not be computed or are not finite."""


class TrainingError(TrakError):
    """Training diverged: a non-finite loss, a loss far above the first step's, or non-finite weights."""


class OptimizerError(TrakError):
    """A projected optimizer was built or loaded with invalid settings or state."""


class UserCodeError(TrakError):
    """The user's own code raised (a ``model.entrypoint`` function, the forward pass, a training function); the
    message names the code, the exception and the user's file and line, the original is the ``__cause__``."""


_PACKAGE_DIR = Path(__file__).resolve().parent
_LIBRARY_DIRS = tuple(
    Path(p).resolve() for key in ("stdlib", "platstdlib", "purelib", "platlib") if (p := sysconfig.get_paths().get(key))
)


@lru_cache(maxsize=4096)
def in_library(filename: str) -> bool:
    """Whether ``filename`` is a file of the Python standard library (``<frozen ...>`` too) or of an installed
    package other than trakcli: a third party's code."""
    if filename.startswith("<"):
        return filename.startswith("<frozen")
    path = Path(filename).resolve()
    return not path.is_relative_to(_PACKAGE_DIR) and any(path.is_relative_to(folder) for folder in _LIBRARY_DIRS)


def _shown_path(path: Path) -> str:
    """``path`` relative to the working directory when inside it, a library file from its package folder, else as is."""
    for folder in (Path.cwd().resolve(), *_LIBRARY_DIRS):
        if path.is_relative_to(folder):
            return str(path.relative_to(folder))
    return str(path)


def user_frame(exc: BaseException) -> tuple[str, int] | None:
    """Where in the user's code ``exc`` was raised: ``(file, line)`` of its deepest frame outside trakcli and
    libraries (else outside trakcli; None if every frame is trakcli's)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<")]
    ours = [(f, Path(f.filename).resolve()) for f in frames]
    outside = [(f, p) for f, p in ours if not p.is_relative_to(_PACKAGE_DIR)]
    user = [(f, p) for f, p in outside if not any(p.is_relative_to(d) for d in _LIBRARY_DIRS)]
    chosen = (user or outside or [None])[-1]
    if chosen is None:
        return None
    frame, path = chosen
    return _shown_path(path), int(frame.lineno or 0)


#: Longer exception messages are cut to their first sentence by :func:`describe_exception`.
MESSAGE_CHARS = 200


def exception_text(exc: BaseException) -> str:
    """``"RuntimeError: boom"``: the type and the first line of the message, of a line over
    :data:`MESSAGE_CHARS` characters its first sentence (``TRAK_DEBUG=1`` shows all of it)."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if len(first) > MESSAGE_CHARS:
        end = first.find(". ", 0, 2 * MESSAGE_CHARS)
        first = first[: end + 1] if end > 0 else first[:MESSAGE_CHARS] + "..."
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def describe_exception(exc: BaseException) -> str:
    """``"RuntimeError: boom (my_model.py, line 4)"``: :func:`exception_text` and :func:`user_frame` (a
    ``SyntaxError``: the file and line of the bad code)."""
    text = exception_text(exc)
    where = user_frame(exc)
    if isinstance(exc, SyntaxError) and exc.filename and exc.lineno:  # the frames are the importer's
        where = (_shown_path(Path(exc.filename).resolve()), exc.lineno)
        text = f"{type(exc).__name__}: {exc.msg}"
    return f"{text} ({where[0]}, line {where[1]})" if where else text


@contextmanager
def user_code(
    what: str | Callable[[], str], *, hint: str = "", error: type[TrakError] = UserCodeError
) -> Iterator[None]:
    """Run the user's code and report any exception it raises as one :class:`TrakError` line.

    ``with user_code("model.entrypoint my_model.py:make_model"): ...`` turns a ``RuntimeError("boom")`` at line 4
    of ``my_model.py`` into ``UserCodeError("model.entrypoint my_model.py:make_model raised RuntimeError: boom
    (my_model.py, line 4)")``, chained to it. A :class:`TrakError`, ``KeyboardInterrupt`` and ``SystemExit`` pass.

    Args:
        what: the code that ran, as the user wrote it; or a function returning it (called only on an exception).
        hint: appended after ``"; "``: how to fix it.
        error: the :class:`TrakError` class raised.
    """
    try:
        yield
    except TrakError:
        raise
    except Exception as e:  # noqa: BLE001 - any exception of the user's code is reported the same way
        name = what() if callable(what) else what
        raise error(f"{name} raised {describe_exception(e)}" + (f"; {hint}" if hint else "")) from e
