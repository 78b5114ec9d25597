"""Atomic writes of every file trakcli makes outside the store (exports, ``--out``, plots, manifests, checkpoints).

A file is written to a temporary file beside it, fsynced and renamed onto its path (``os.replace``): a
failed write (disk full, an exception, Ctrl-C) removes the temporary file and leaves the previous file as
it was; ``kill -9`` may leave a hidden ``.<stem>-<token>.tmp<suffix>`` file, never a damaged target.
Imports nothing from trakcli at load time (every part may use it).
"""

from __future__ import annotations

import os
import secrets
import signal
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any, Iterator


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to (``with atomic_path(out) as tmp: fig.savefig(tmp)``); renamed
    onto ``path`` when the block succeeds, removed on any exception.

    The temporary name keeps the suffix of ``path``; a writer that records the name in the file
    (``torch.save`` to a path) must write to :func:`atomic_open`'s file object instead.

    Raises:
        OSError: the temporary file cannot be written, synced or renamed (``path`` is then unchanged).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.stem}-{secrets.token_hex(4)}.tmp{path.suffix}")
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            tmp.unlink()
        raise
    _sync_dir(path.parent)


@contextmanager
def atomic_open(path: str | Path, mode: str = "w", **kwargs: Any) -> Iterator[IO[Any]]:
    """``open(path, mode)`` (``"w"`` or ``"wb"``, ``kwargs`` to :func:`open`) through :func:`atomic_path`."""
    if not mode.startswith("w"):
        raise ValueError(f"atomic_open writes a new file: mode {mode!r} must start with 'w'")
    with atomic_path(path) as tmp:
        with open(tmp, mode.replace("w", "x", 1), **kwargs) as f:
            yield f
            f.flush()


def file_problem(path: str | Path) -> str | None:
    """Why ``path`` cannot be read as a file: ``"does not exist"``, ``"is a directory, not a file"``, ...; None if it can."""
    path = Path(path)
    if path.is_file():
        return None
    if path.is_dir():
        return "is a directory, not a file"
    if path.exists():
        return "is not a regular file"
    return "does not exist"


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    """``torch.save(obj)`` to ``path`` through :func:`atomic_open`.

    Raises:
        OSError: the file cannot be written (also torch's ``RuntimeError`` of a failed write, a full disk).
    """
    import torch

    with atomic_open(path, "wb") as f:
        try:
            torch.save(obj, f)
        except RuntimeError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise OSError(f"the write failed ({first}); is the disk full?") from None


def save_training_file(obj: Any, path: str | Path, head: str, fix: str) -> None:
    """:func:`atomic_torch_save` of a file `trak optimize` writes, its folder made first (else
    :class:`TrainingError` ``"{head} {path}: {the cause}; {fix}"``)."""
    from trakcli.errors import TrainingError

    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_torch_save(obj, path)
    except OSError as e:
        raise TrainingError(f"{head} {path}: {e}; {fix}") from None


def write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (:class:`OSError` as :func:`atomic_path`)."""
    with atomic_open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _sync_dir(directory: Path) -> None:
    """fsync a directory so that a rename in it survives a power loss (best effort: not every OS allows it)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        with suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def event(message: str) -> None:
    """Append a line (``start <what> <model_id> <chunk>``, ``done ...``) to the file named by ``$TRAK_EVENT_LOG``,
    if set: how the kill-and-resume tests count work.

    The tests' kill points: with ``$TRAK_EVENT_KILL_AT=n`` the process SIGKILLs itself once the log holds n
    ``start`` lines, with ``$TRAK_EVENT_KILL_ON=text`` once the log holds ``text`` (an exact point, where a
    watcher polling the log could miss it on a loaded machine).
    """
    path = os.environ.get("TRAK_EVENT_LOG")
    if not path:
        return
    with open(path, "a") as f:
        f.write(message + "\n")
    at, on = os.environ.get("TRAK_EVENT_KILL_AT"), os.environ.get("TRAK_EVENT_KILL_ON")
    if at or on:
        text = Path(path).read_text()
        if (at and text.count("start") >= int(at)) or (on and on in text):
            os.kill(os.getpid(), signal.SIGKILL)
