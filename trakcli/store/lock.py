"""The store's lock file ``<store>.lock``: one run uses a store at a time (created exclusively:
:func:`trakcli.store.location.create_exclusive`). Imports neither zarr nor torch.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

from trakcli.errors import StoreError
from trakcli.store.location import Location, create_exclusive, is_remote


@dataclass
class StoreLock:
    """An exclusive lock file ``<store>.lock`` naming the host and pid of the run.

    A lock left by a killed run on this host (its pid no longer alive), or by
    an earlier attempt of the same torchrun job (``--rdzv-id``, restarted after a
    node failed), is stale and taken over. A lock held by a live process, or by
    another host, refuses the second run.
    """

    path: Location
    held: bool = False

    @staticmethod
    def for_store(store_path: Location) -> "StoreLock":
        return StoreLock(store_path.with_name(store_path.name + ".lock"))

    def acquire(self) -> str | None:
        """Take the lock; returns a message if a stale lock was taken over.

        Raises:
            StoreError: another live run holds the lock (names its host and pid); the lock path
                is a directory or cannot be created or removed.
        """
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        job = _torchrun_job()
        if job is not None:
            me["torchrun_job"] = job
        note = None
        store = self.path.with_name(self.path.name[: -len(".lock")])
        if not is_remote(self.path) and self.path.exists() and not self.path.is_file():
            raise StoreError(
                f"the lock path {self.path} of store {store} is a directory, not a lock file; "
                "remove it (or choose another store.path)"
            )
        for _ in range(3):
            try:
                created = create_exclusive(self.path, json.dumps(me).encode())
            except OSError as e:
                raise StoreError(
                    f"cannot create the lock file {self.path}: {e}; choose a writable store path") from None
            if created:
                self.held = True
                return note
            other = self._read()
            if other is None:  # being written right now, or empty: retry shortly
                time.sleep(0.05)
                other = self._read()
            if other is not None and not self._is_stale(other):
                raise StoreError(
                    f"store {store} is in use by another run (host {other.get('host')}, "
                    f"pid {other.get('pid')}); wait for it to finish, or if that run is gone delete {self.path}"
                )
            note = (
                f"took over a stale lock of a run that is gone (host {other.get('host') if other else '?'}, "
                f"pid {other.get('pid') if other else '?'})"
            )
            if other is not None and other.get("host") != socket.gethostname():
                note = (f"took over the lock of an earlier attempt of this torchrun job (rdzv id {job}) on host "
                        f"{other.get('host')}, pid {other.get('pid')}")
            try:
                self.path.unlink(missing_ok=True)
            except OSError as e:
                raise StoreError(f"cannot take over the stale lock {self.path}: {e}; remove it by hand") from None
        raise StoreError(f"could not take the lock {self.path}; another run keeps taking it")

    def _read(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    @staticmethod
    def _is_stale(other: dict[str, Any]) -> bool:
        job = _torchrun_job()
        if job is not None and other.get("torchrun_job") == job:
            return True  # an earlier attempt of this elastic job (torchrun restarts every rank together)
        if other.get("host") != socket.gethostname():
            return False  # cannot tell whether a process on another host lives
        pid = other.get("pid")
        if not isinstance(pid, int):
            return True
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False


def _torchrun_job() -> str | None:
    """The rendezvous id (``--rdzv-id``, ``TORCHELASTIC_RUN_ID``; its default ``none`` names no job) of the torchrun
    job of this process, or None: after a node fails, rank 0 may run on another host, and the lock its earlier
    attempt left is this job's own."""
    job = os.environ.get("TORCHELASTIC_RUN_ID")
    return job if job and job != "none" else None
