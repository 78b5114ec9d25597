"""Checkpoint sha256s remembered by (path, size, mtime_ns) in ``<store>.hashes.json``.

Every command records and compares each checkpoint's full sha256; the sha256 of a file (of every file under
a model directory) is kept beside the store with its resolved path, size and ``mtime_ns``, and read again
only when one changes. As in git's index, a file modified within :data:`RACY_NS` of being hashed is not
remembered; ``--verify`` hashes every file again (:meth:`HashCache.forget`). A missing, unreadable or
foreign cache means hashing again, a failed write is ignored; within a process the entries stay in memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

from trakcli.files import write_text
from trakcli.store.location import is_url

FORMAT = "trakcli.checkpoint_hashes"
FORMAT_VERSION = 1
RACY_NS = 2_000_000_000  # 2 s: coarser than the mtime resolution of common filesystems

_OPEN: dict[str, "HashCache"] = {}


def hashes_path(store_path: Any) -> Path:
    """The cache file of a store: ``<store>.hashes.json`` beside it; for a store on an object store (a URL), on this
    machine: ``$XDG_CACHE_HOME/trakcli/hashes/<sha256 of the URL>.json`` (``~/.cache`` when unset)."""
    text = str(store_path)
    if is_url(text):
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trakcli" / "hashes"
        return cache / (hashlib.sha256(text.encode()).hexdigest()[:32] + ".json")
    store_path = Path(store_path)
    return store_path.with_name(store_path.name + ".hashes.json")


def file_signature(path: Path) -> list[Any]:
    """What must not change for a remembered sha256 to hold: ``[size, mtime_ns]`` of a file; for a directory,
    ``[[relative name, size, mtime_ns], ...]`` of every file under it, sorted by name."""
    if not path.is_dir():
        st = path.stat()
        return [st.st_size, st.st_mtime_ns]
    out = []
    for root, _, names in os.walk(path):
        for name in names:
            f = Path(root) / name
            st = f.stat()
            out.append([f.relative_to(path).as_posix(), st.st_size, st.st_mtime_ns])
    return sorted(out)


class HashCache:
    """sha256 of checkpoint files, remembered by their signature (:func:`file_signature`).

    Use :meth:`for_store` (one instance per cache file and process), then
    :meth:`sha256` for each file and :meth:`save` once (rank 0).

    Attributes:
        path: the JSON file (None: in memory only).
        computed: files hashed by this instance (read in full), in order.
    """

    def __init__(self, path: Path | None = None):
        self.path = path
        self.entries: dict[str, dict[str, Any]] = self._load(path)
        self.computed: list[Path] = []
        self._dirty = False

    @classmethod
    def for_store(cls, store_path: Any) -> "HashCache":
        """The cache of the store at ``store_path``, shared by every caller in this process."""
        path = hashes_path(store_path)
        key = str(path.resolve())
        if key not in _OPEN:
            _OPEN[key] = cls(path)
            if is_url(str(store_path)):  # the per-user cache folder, made now: save() writes only into a folder
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                except OSError:
                    pass
        return _OPEN[key]

    def forget(self) -> None:
        """Drop every remembered sha256: each file is hashed again (``--verify``, which trusts no signature)."""
        self.entries.clear()
        self._dirty = True

    @staticmethod
    def _load(path: Path | None) -> dict[str, dict[str, Any]]:
        if path is None or not path.is_file():
            return {}
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("format_version") != FORMAT_VERSION:
            return {}
        files = data.get("files")
        return {
            k: v for k, v in files.items()
            if isinstance(v, dict) and isinstance(v.get("sha256"), str) and isinstance(v.get("signature"), list)
        } if isinstance(files, dict) else {}

    def sha256(self, path: str | Path, compute: Callable[[Path], str]) -> str:
        """The hex sha256 of ``path`` (a checkpoint file or model directory): remembered if its signature is
        unchanged, else ``compute(path)`` (:func:`trakcli.models.file_sha256`); OSError if it cannot be read."""
        path = Path(path)
        key = str(path.resolve())
        signature = file_signature(path)
        entry = self.entries.get(key)
        if entry is not None and entry["signature"] == signature:
            return entry["sha256"]
        sha = compute(path)
        self.computed.append(path)
        newest = max([signature[1]] if not path.is_dir() else [e[2] for e in signature] or [0])
        if file_signature(path) == signature and time.time_ns() - newest > RACY_NS:
            self.entries[key] = {"signature": signature, "sha256": sha}
            self._dirty = True
        return sha

    def save(self) -> None:
        """Write the entries of files that still exist (atomically), if any changed; failures are ignored."""
        if self.path is None or not self._dirty or not self.path.parent.is_dir():
            return
        files = {k: v for k, v in sorted(self.entries.items()) if os.path.exists(k)}
        try:
            write_text(self.path, json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION, "files": files},
                                             indent=1) + "\n")
        except OSError:
            return
        self._dirty = False
