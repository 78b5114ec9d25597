"""Atomic writes of every file trakcli makes outside the store.

Exports, ``--out``, plots, JSON reports, manifests and checkpoints alike:
a file is written to a temporary file in the same directory, flushed to disk
(``fsync``) and renamed onto its path (``os.replace``, atomic on POSIX and
Windows). A write that fails (disk full, permissions, an exception, Ctrl-C)
removes the temporary file and leaves the previous file exactly as it was;
readers never see a half-written file. A process killed with ``kill -9``
mid-write may leave a hidden ``.<stem>-<token>.tmp<suffix>`` file beside the
path, never a damaged target.

Imports nothing from trakcli (every part may use it).
"""

from __future__ import annotations

import os
import secrets
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; renamed onto ``path`` when the block succeeds.

    The temporary name keeps the suffix of ``path`` (``.npy``, ``.png``, ...),
    so writers that read the format from the name work unchanged; a writer
    that records the name in the file (``torch.save`` to a path names its zip
    archive after it) must write to :func:`atomic_open`'s file object instead,
    or the bytes would change with the random name. On success
    the file is fsynced, renamed onto ``path``, and the directory fsynced; on
    any exception (also ``KeyboardInterrupt``) the temporary file is removed
    and the exception propagates.

    Example::

        with atomic_path(out) as tmp:
            fig.savefig(tmp, format="png")

    Raises:
        OSError: the temporary file cannot be written, synced or renamed
            (``path`` is then unchanged).
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
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    _sync_dir(path.parent)


@contextmanager
def atomic_open(path: str | Path, mode: str = "w", **kwargs: Any) -> Iterator[IO[Any]]:
    """``open(path, mode)`` through :func:`atomic_path`: the file appears complete or not at all.

    Args:
        path: the file to (re)write.
        mode: ``"w"`` or ``"wb"`` (the temporary file is new; it is created exclusively).
        kwargs: passed to :func:`open` (``encoding``, ``newline``).

    Raises:
        OSError: as :func:`atomic_path`.
    """
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
    """``torch.save(obj)`` to ``path`` through :func:`atomic_open`: the file appears complete or not at all.

    Written to the file object, not to the temporary path: torch names the
    archive inside after a path, and a random name would change the bytes.

    Raises:
        OSError: the file cannot be written (``path`` is then unchanged). torch's
            writer reports a failed write (a full disk, a file size limit) as a
            ``RuntimeError``; it is raised as an ``OSError`` naming that cause.
    """
    import torch

    with atomic_open(path, "wb") as f:
        try:
            torch.save(obj, f)
        except RuntimeError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise OSError(f"the write failed ({first}); is the disk full?") from None


def save_training_file(obj: Any, path: str | Path, head: str, fix: str) -> None:
    """:func:`atomic_torch_save` of a file `trak optimize` writes (a checkpoint, an optimizer or training state, a
    replay record), its folder made first.

    Raises:
        TrainingError: the file cannot be written: ``"{head} {path}: {the cause}; {fix}"``.
    """
    from trakcli.errors import TrainingError

    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_torch_save(obj, path)
    except OSError as e:
        raise TrainingError(f"{head} {path}: {e}; {fix}") from None


def write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically.

    Raises:
        OSError: as :func:`atomic_path` (``path`` is then unchanged).
    """
    with atomic_open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _sync_dir(directory: Path) -> None:
    """fsync a directory so that a rename in it survives a power loss (best effort: not every OS allows it)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def event(message: str) -> None:
    """Append a line to the file named by ``$TRAK_EVENT_LOG``, if set (how the kill-and-resume tests count work).

    Jobs write ``start <what> <model_id> <chunk>`` before and ``done ...`` after
    each unit of work; without the variable this does nothing.
    """
    path = os.environ.get("TRAK_EVENT_LOG")
    if path:
        with open(path, "a") as f:
            f.write(message + "\n")
