"""Where a store lives: a local directory, or a URL of an object store (``s3://bucket/prefix``).

``store.path`` is a local path (a :class:`pathlib.Path`) or a URL that fsspec opens (a :class:`upath.UPath`, with the
same methods over the object store): ``s3://`` (the ``s3`` extra installs :data:`S3_MODULES`), ``gs://``, ``az://``,
``memory://``... What a path cannot do on an object store is here (:func:`zarr_store`, :func:`replace`, :func:`rmtree`,
:func:`create_exclusive`, :func:`check_reachable`, :func:`disk_usage`), and the store's lock file ``<store>.lock``
(:class:`StoreLock`: one run uses a store at a time). ``s3://`` takes its credentials and endpoint as the AWS tools do
(``AWS_*`` variables, profiles, roles), ``store.storage_options`` over them (docs/guides/store.md).

Imports neither zarr nor torch; fsspec and universal_pathlib only for a URL. A module a URL needs that is not
installed is one :class:`~trakcli.errors.MissingModuleError` naming it and how to install it, never an ``ImportError``.
"""

from __future__ import annotations

import errno
import importlib
import json
import os
import re
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

from trakcli.errors import MissingModuleError, StoreError

if TYPE_CHECKING:
    from upath import UPath

#: A store's place: a local :class:`~pathlib.Path` or a :class:`upath.UPath` of an object store.
Location = Union[Path, "UPath"]

#: A URL's scheme: ``s3`` of ``s3://bucket/key``.
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")

#: The package that opens a scheme, for the message when it is missing (fsspec's own table names most).
_PACKAGE = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
            "abfss": "adlfs", "adl": "adlfs"}

#: Schemes that name this machine's own file system.
_LOCAL = {"file", "local"}

#: What an ``s3://`` store imports (here, and zarr's ``FsspecStore``): (module, the distribution that installs it).
#: The ``s3`` extra of pyproject.toml installs each (tests/store/test_extras.py checks both lists agree).
S3_MODULES = (("fsspec", "fsspec"), ("upath", "universal-pathlib"), ("s3fs", "s3fs"))

#: How to install :data:`S3_MODULES`: the distribution is trakcli-attribution (``trakcli`` on the package
#: index is an unrelated time tracker).
S3_INSTALL = "pip install 'trakcli-attribution[s3]' (from a checkout: pip install -e '.[s3]')"

#: What any other URL imports besides its scheme's own package.
URL_MODULES = (("fsspec", "fsspec"), ("upath", "universal-pathlib"))

#: Schemes fsspec knows, for :func:`broken_url` when fsspec itself is not installed.
_KNOWN_WITHOUT_FSSPEC = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "memory", "http", "https", "hf",
                         "ftp", "sftp", "ssh", "hdfs", "webhdfs", "oci", "oss", "r2"}


def require_modules(modules: tuple[tuple[str, str], ...], needed_by: str, install: str) -> None:
    """Import each of the (module, distribution) pairs ``modules``; the first that cannot be imported (or a module
    it imports) is one MissingModuleError naming it, what ``needed_by`` it, and ``install``."""
    for module, distribution in modules:
        try:
            importlib.import_module(module)
        except ImportError as e:
            missing = _missing_module(e) or module
            named = distribution if distribution == module else f"{distribution} (module {module})"
            what = (f"needs {named}, which is not installed" if missing == module else
                    f"needs {named}, which cannot be imported: the module {missing} it imports is not installed")
            raise MissingModuleError(f"{needed_by} {what}; install it with {install}", module=missing) from None


def scheme(path: Any) -> str | None:
    """The URL scheme of ``path`` (``"s3"``), or None for a local path (a :class:`~pathlib.Path` or plain text)."""
    if isinstance(path, Path) and not is_remote(path):
        return None
    m = _SCHEME.match(str(path))
    return m.group(1).lower() if m else None


def is_url(text: str | Path) -> bool:
    """Whether ``text`` is a URL (``scheme://...``) rather than a local path."""
    return not isinstance(text, Path) and _SCHEME.match(str(text)) is not None


#: ``s3:/bucket/key`` or ``s3:bucket/key``: a URL that lost a slash (a local folder ``s3:`` would be made of it).
_BROKEN_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/?(?!/)")


def broken_url(text: str) -> str | None:
    """The scheme of ``text`` if it reads as a URL of a known file system missing a slash (``s3:/b/k``), else None;
    single letters (``C:``, a Windows drive) never count."""
    m = _BROKEN_URL.match(text)
    if m is None or is_url(text):
        return None
    name = m.group(1).lower()
    try:
        from fsspec.registry import known_implementations
    except ImportError:  # the message still reads the URL; opening it names what to install
        known_implementations = _KNOWN_WITHOUT_FSSPEC
    return name if name in known_implementations and name not in _LOCAL else None


def is_remote(path: Any) -> bool:
    """Whether ``path`` is on an object store (a :class:`upath.UPath` of a non-local scheme)."""
    return type(path).__module__.startswith("upath") and getattr(path, "protocol", "") not in ("", *_LOCAL)


def s3_options(storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``s3fs.S3FileSystem`` keyword arguments of a store: the AWS environment variables (``AWS_REGION`` honoured
    too), then ``storage_options`` (the config's ``store.storage_options``) over them. Listings are not cached: other
    processes write the same store. ``max_concurrency: 1``: with more, s3fs sends a HEAD before every GET
    (``benchmarks/bench_object_store.py``). botocore checks a response's CRC32 only where S3 requires it: every chunk
    carries the store's own CRC32C."""
    given = dict(storage_options or {})
    client: dict[str, Any] = {}
    for key, names in (("endpoint_url", ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")),
                       ("region_name", ("AWS_REGION", "AWS_DEFAULT_REGION"))):
        env = os.environ.get(names[0]) or os.environ.get(names[1])
        if key in given or env:  # s3fs takes the given ones at the top level too; keep one place
            client[key] = given.pop(key) if key in given else env
    client.update(given.pop("client_kwargs", None) or {})
    opts: dict[str, Any] = {"use_listings_cache": False, "max_concurrency": 1}
    if client:
        opts["client_kwargs"] = client
    opts["config_kwargs"] = {"response_checksum_validation": "when_required",
                             **(given.pop("config_kwargs", None) or {})}
    return {**opts, **given}


def store_location(path: str | Location, storage_options: dict[str, Any] | None = None) -> Location:
    """The store at ``path`` (a local path, ``file://`` or another URL, or an opened location, returned as is): a
    :class:`~pathlib.Path`, or a :class:`upath.UPath` of a URL opened with ``storage_options`` (of its fsspec file
    system).

    Raises:
        MissingModuleError: a module the URL needs is not installed (named with :data:`S3_INSTALL` for ``s3://``).
        StoreError: the URL's scheme is unknown, it names no store below the bucket, or its object store does not
            answer or has no such bucket (:func:`check_reachable`); never taken as a local path.
    """
    if is_remote(path) or (isinstance(path, Path) and not storage_options):
        return path
    text = str(path)
    found = scheme(text)
    if found is None:
        return Path(text)
    if found in _LOCAL:
        return Path(re.sub(r"^[A-Za-z]+://", "", text))
    s3 = found in ("s3", "s3a")
    require_modules(S3_MODULES if s3 else URL_MODULES, f"store.path {text!r}",
                    S3_INSTALL if s3 else "pip install fsspec universal-pathlib")
    import fsspec
    from fsspec.registry import known_implementations

    if found not in known_implementations and found not in fsspec.available_protocols():
        raise StoreError(f"store.path {text!r} has the scheme {found!r}, which no file system opens; give a local "
                         f"directory, s3://BUCKET/PREFIX/NAME.zarr ({S3_INSTALL}), or another fsspec URL (gs://, "
                         "az://, memory://)")
    try:
        fsspec.get_filesystem_class(found)
    except ImportError as e:
        package = _PACKAGE.get(found) or _missing_module(e) or "its fsspec file system"
        raise MissingModuleError(f"store.path {text!r} needs {package}, which is not installed: pip install {package}",
                                 module=_missing_module(e) or package) from None
    rest = text.split("://", 1)[1]
    url = f"{found}://{rest.rstrip('/')}"  # the scheme in lower case, as fsspec registers it; no trailing "/"
    parts = rest.strip("/").split("/")
    if found not in ("memory",) and (rest.startswith("/") or not parts[0]):
        raise StoreError(f"store.path {text!r} names no bucket; give {found}://BUCKET/PREFIX/NAME.zarr")
    if found not in ("memory",) and len(parts) < 2:
        raise StoreError(f"store.path {text!r} names a bucket, not a store in it; give the store's own prefix, e.g. "
                         f"{found}://{parts[0]}/attrib.zarr (its lock and caches go beside it)")
    if any(p in ("", ".", "..") for p in parts):
        raise StoreError(f"store.path {text!r} has an empty, '.' or '..' part; object stores take keys as written: "
                         f"give the store's own prefix without them, e.g. {found}://{parts[0]}/attrib.zarr")
    options = s3_options(storage_options) if s3 else dict(storage_options or {})
    from upath import UPath

    location = UPath(url, **options)
    check_reachable(location)
    return location


#: How to give S3 credentials, in the messages of :func:`check_reachable`.
_CREDENTIALS = "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or store.storage_options: {key: ..., secret: ...})"
#: (endpoint, bucket, options, key id) this process found reachable (:func:`check_reachable` asks once).
_REACHED: set[tuple[str, str, str, str | None]] = set()


def _missing_module(e: ImportError) -> str | None:
    name = getattr(e, "name", None)
    return name.split(".")[0] if name else None


def endpoint(path: Location) -> str:
    """Where the object store of ``path`` answers (for messages): the endpoint URL, or the scheme's default."""
    opts = getattr(path, "storage_options", {}) or {}
    url = (opts.get("client_kwargs") or {}).get("endpoint_url") or opts.get("endpoint_url")
    return str(url) if url else f"the default endpoint of {scheme(path)}://"


def zarr_store(path: Location, read_only: bool = False) -> Any:
    """What ``zarr.open_group(store=...)`` takes for ``path``: the path's text, or an fsspec store of the URL."""
    if not is_remote(path):
        return str(path)
    from zarr.storage import FsspecStore

    return FsspecStore.from_url(str(path), storage_options=dict(path.storage_options), read_only=read_only)


def replace(src: Location, dst: Location) -> None:
    """Move ``src`` to ``dst`` (which must not exist): atomic ``os.replace`` locally; a copy then a delete on an
    object store, which has no rename. OSError if it fails."""
    if not is_remote(src):
        os.replace(src, dst)
        return
    src.fs.mv(src.path, dst.path, recursive=True)


def rmtree(path: Location, ignore_errors: bool = False) -> None:
    """Delete ``path`` and everything under it (nothing if it is absent); OSError if it fails (unless
    ``ignore_errors``)."""
    try:
        if not is_remote(path):
            shutil.rmtree(path)
        elif path.fs.exists(path.path):
            path.fs.rm(path.path, recursive=True)
    except FileNotFoundError:
        pass
    except OSError:
        if not ignore_errors:
            raise


def create_exclusive(path: Location, data: bytes) -> bool:
    """Write ``data`` to a new file ``path`` (``O_CREAT | O_EXCL``; on S3 a PUT with ``If-None-Match: *``); False if
    ``path`` already exists (nothing is written then).

    Raises:
        StoreError: the object store does not do conditional writes (a second
            conditional PUT of an existing key succeeded), or cannot be written.
        OSError: a local file could not be created.
    """
    if not is_remote(path):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return True
    fs, key = path.fs, path.path
    if not _put_if_absent(fs, key, data, path):
        return False
    # a store that ignores If-None-Match accepts a second conditional PUT: then nothing excludes two runs
    if _put_if_absent(fs, key, data, path):
        try:
            fs.rm(key)
        except OSError:
            pass
        raise StoreError(f"the object store at {endpoint(path)} ignores conditional writes (a PUT with If-None-Match: "
                         f"* of an existing key {path} succeeded), so it cannot lock the store against a second run; "
                         "use a service that has them (AWS S3, MinIO, SeaweedFS, Cloudflare R2) or a local store.path")
    return True


def _put_if_absent(fs: Any, key: str, data: bytes, path: Location) -> bool:
    """One conditional write of ``key``; False when it exists."""
    try:
        fs.pipe_file(key, data, mode="create")
        return True
    except FileExistsError:
        return False
    except (NotImplementedError, TypeError, ValueError) as e:
        raise StoreError(f"the file system of {path} cannot create a file only if it is absent ({e}), so it "
                         "cannot lock the store; use s3:// or a local store.path") from None
    except OSError as e:
        if e.errno in (errno.EEXIST,) or "pre-condition" in str(e).lower() or "precondition" in str(e).lower():
            return False
        raise StoreError(f"cannot write {path} at {endpoint(path)}: {e}") from None


def check_reachable(path: Location) -> None:
    """Check that the object store of ``path`` answers and its bucket exists (nothing for a local path); StoreError if
    the endpoint does not answer, the credentials are refused, or the bucket does not exist (names the endpoint and the
    fix)."""
    if not is_remote(path):
        return
    bucket = path.path.split("/", 1)[0]
    where = endpoint(path)
    asked = (where, bucket, repr(sorted(path.storage_options.items())), os.environ.get("AWS_ACCESS_KEY_ID"))
    if asked in _REACHED:
        return
    try:
        if hasattr(path.fs, "call_s3"):  # s3fs: its exists() reads a refused connection as a missing bucket
            try:
                path.fs.call_s3("head_bucket", Bucket=bucket)
                ok = True
            except FileNotFoundError:
                ok = False
        else:
            ok = path.fs.exists(bucket)
    except PermissionError as e:
        raise StoreError(f"the object store at {where} refused access to bucket {bucket!r} of store.path {path} ({e}); "
                         f"set {_CREDENTIALS}") from None
    except Exception as e:  # noqa: BLE001 - botocore/aiohttp raise their own connection errors
        if e.__class__.__name__ == "ParamValidationError":
            raise StoreError(f"store.path {path}: {bucket!r} is not a valid bucket name "
                             f"({' '.join(str(e).split())[:200]}); bucket names are lower-case letters, "
                             "digits, '.' and '-'") from None
        if "Credentials" in e.__class__.__name__:
            raise StoreError(f"the credentials for store.path {path} at {where} are incomplete ({e}); set both "
                             f"{_CREDENTIALS}") from None
        raise StoreError(f"cannot reach the object store of store.path {path} at {where} ({e.__class__.__name__}: "
                         f"{e}); set AWS_ENDPOINT_URL (or store.storage_options: {{endpoint_url: ...}}) to a running "
                         "S3 service") from None
    if not ok:
        raise StoreError(f"bucket {bucket!r} of store.path {path} does not exist at {where}; create it (e.g. "
                         f"`aws s3 mb s3://{bucket}`) or choose another store.path")
    _REACHED.add(asked)


def holds_objects(path: Location) -> bool:
    """Whether any object (file) is stored below the prefix ``path`` of an object store (an empty "folder" a
    service shows after a delete holds nothing); for a local path, whether it is a file or a folder with entries."""
    if not is_remote(path):
        return path.exists() and (not path.is_dir() or any(path.iterdir()))
    fs, key = path.fs, path.path.rstrip("/")
    if hasattr(fs, "call_s3"):
        bucket, _, prefix = key.partition("/")
        page: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix + "/"}
        while True:  # "folder" keys (ending in "/") sort before the objects below them: read on past them
            listed = fs.call_s3("list_objects_v2", **page)
            if any(not o["Key"].endswith("/") for o in listed.get("Contents", [])):
                return True
            if not listed.get("IsTruncated"):
                return False
            page["ContinuationToken"] = listed["NextContinuationToken"]
    return bool(fs.find(key, withdirs=False))


def entries(path: Location) -> list[str]:
    """The names of what ``path`` holds: its files, and its folders that hold a file somewhere below (an empty
    "folder" an object store lists is not one of them); OSError if ``path`` cannot be listed."""
    if not is_remote(path):
        return [p.name for p in path.iterdir()]
    listed = path.fs.ls(path.path, detail=True)
    return [info["name"].rstrip("/").rsplit("/", 1)[-1] for info in listed
            if info.get("type") != "directory" or holds_objects(path / info["name"].rstrip("/").rsplit("/", 1)[-1])]


def disk_usage(path: Location) -> int:
    """Bytes stored under ``path`` (0 if it is missing); files that vanish meanwhile count 0."""
    if is_remote(path):
        try:
            return int(path.fs.du(path.path, total=True))
        except (OSError, ValueError):
            return 0
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, f))
            except OSError:
                pass
    return total


@dataclass
class StoreLock:
    """An exclusive lock file ``<store>.lock`` naming the host and pid of the run. A lock left by a killed run on this
    host (its pid no longer alive), or by an earlier attempt of the same torchrun job (``--rdzv-id``, restarted after a
    node failed), is stale and taken over. A lock held by a live process, or by another host, refuses the second run."""

    path: Location
    held: bool = False

    @staticmethod
    def for_store(store_path: Location) -> "StoreLock":
        return StoreLock(store_path.with_name(store_path.name + ".lock"))

    def acquire(self) -> str | None:
        """Take the lock; returns a message if a stale lock was taken over. StoreError if another live run holds the
        lock (names its host and pid), or the lock path is a directory or cannot be created or removed."""
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        job = _torchrun_job()
        if job is not None:
            me["torchrun_job"] = job
        note = None
        store = self.path.with_name(self.path.name[: -len(".lock")])
        if not is_remote(self.path) and self.path.exists() and not self.path.is_file():
            raise StoreError(f"the lock path {self.path} of store {store} is a directory, not a lock file; "
                             "remove it (or choose another store.path)")
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
                raise StoreError(f"store {store} is in use by another run (host {other.get('host')}, pid "
                                 f"{other.get('pid')}); wait for it to finish, or if that run is gone delete "
                                 f"{self.path}")
            note = (f"took over a stale lock of a run that is gone (host {other.get('host') if other else '?'}, "
                    f"pid {other.get('pid') if other else '?'})")
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
