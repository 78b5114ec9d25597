"""Hugging Face Hub names: model and dataset repositories resolved to folders of the local Hugging Face cache.

Two spellings, following the Hub's own URIs (``huggingface_hub.parse_hf_uri``):

* ``hf:ORG/NAME[@REVISION][/PATH]`` for ``model.entrypoint``, entries of ``checkpoints:`` and ``data.*.tokenizer``
  (there also without ``hf:``): a model repository, at a branch, tag or commit (default ``main``), or a file or folder
  inside it (``hf:ORG/NAME/model-Q4_K_M.gguf``, ``hf:ORG/NAME/checkpoint-500``).
* ``hf://datasets/ORG/NAME[@REVISION][/PATH]`` for data paths: a dataset
  repository, or a file, folder or glob inside it.

A local directory or an installed package of that name always comes first (:func:`trakcli.models.hf.resolve_hf_path`). A
Hub name resolves as transformers does: ``huggingface_hub.snapshot_download`` into the Hugging Face cache
(:func:`hub_cache_dir`), of only the files needed (:func:`model_files`, :func:`dataset_files`); with
``HF_HUB_OFFLINE=1`` (or ``TRANSFORMERS_OFFLINE=1``, read when a name is resolved), or when the Hub cannot be reached,
the snapshot already in the cache is used, and without one an error names the repository, the cache folder and the
fixes. ``huggingface_hub`` is imported only when a Hub name is resolved.
"""

from __future__ import annotations

import fnmatch
import functools
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from trakcli.errors import DataError, ModelError, TrakError

logger = logging.getLogger("trakcli.models")

#: The prefix of a Hub data path (``hf://datasets/ORG/NAME...``).
HUB_URL_PREFIX = "hf://"
_TRUE = {"1", "ON", "YES", "TRUE"}  # what huggingface_hub takes as set

#: Files of a model folder downloaded besides the weights: config, tokenizer, chat templates, generation config.
MODEL_SMALL_SUFFIXES = (".json", ".txt", ".model", ".tiktoken", ".jinja")
#: Files that make a folder a tokenizer (:data:`trakcli.models.hf.TOKENIZER_FILES` and the vocabularies).
TOKENIZER_NAMES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model",
                   "spiece.model", "sentencepiece.bpe.model")
#: Weight files of a model folder, in the order they are taken: safetensors, else PyTorch pickles.
WEIGHT_GLOBS = (("*.safetensors",), ("pytorch_model*.bin", "adapter_model.bin"))
#: Data files a dataset repository is searched for (what :mod:`trakcli.data.text` reads).
DATA_SUFFIXES = (".jsonl", ".csv", ".parquet", ".arrow")
#: Data files that are read together when several are picked (columnar shards of one table).
SHARD_SUFFIXES = (".parquet", ".arrow")
_SHOWN = 12  # files listed in a message


def hub_cache_dir() -> Path:
    """The Hugging Face cache folder as huggingface_hub finds it, read from the environment now: ``$HF_HUB_CACHE``
    (or ``$HUGGINGFACE_HUB_CACHE``), else ``$HF_HOME/hub``, else ``${XDG_CACHE_HOME:-~/.cache}/huggingface/hub``."""
    env = os.environ
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if not cache:
        home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"),
                                                  "huggingface")
        cache = os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(cache)))


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set to 1 / ON / YES / TRUE now."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in _TRUE


def is_hub_url(path: object) -> bool:
    """Whether a data path is a Hub URL (a string starting with ``hf://``), not a local path."""
    return isinstance(path, str) and path.startswith(HUB_URL_PREFIX)


@dataclass(frozen=True)
class HubName:
    """A parsed Hub name: ``repo_type`` (``"model"`` or ``"dataset"``), ``repo_id`` (``"ORG/NAME"``), ``revision``
    (the branch, tag or commit after ``@``; None: ``main``) and ``path`` (the file, folder or glob inside the
    repository; ``""``: all of it)."""

    repo_type: str
    repo_id: str
    revision: str | None = None
    path: str = ""

    def uri(self, path: str | None = None) -> str:
        """``ORG/NAME[@REVISION][/PATH]`` (``hf://datasets/...`` for datasets), with ``path`` instead of
        :attr:`path` if given."""
        rest = self.path if path is None else path
        text = self.repo_id + (f"@{self.revision}" if self.revision else "") + (f"/{rest}" if rest else "")
        return f"{HUB_URL_PREFIX}datasets/{text}" if self.repo_type == "dataset" else text

    def download_command(self) -> str:
        """The ``hf download`` command (huggingface_hub's CLI) that puts the repository into the cache."""
        return ("hf download " + self.repo_id + (" --repo-type dataset" if self.repo_type == "dataset" else "")
                + (f" --revision {self.revision}" if self.revision else ""))


def parse_model_name(spec: str) -> HubName | None:
    """The Hub model name ``spec`` spells (``"hf:"`` prefix optional), or ``None`` if it spells none.

    ``ORG/NAME``, ``ORG/NAME@REVISION`` and either followed by ``/PATH`` (a file or folder inside the repository) are
    Hub names; absolute or relative paths (``/x``, ``./x``, ``~/x``), single names and anything else the Hub's
    repository-id rules refuse are not. ``None`` as well when huggingface_hub is not installed.
    """
    spec = spec.removeprefix("hf:")
    if not re.match(r"[A-Za-z0-9]", spec) or "\\" in spec or "//" in spec or Path(spec).is_absolute():
        return None
    try:
        from huggingface_hub import parse_hf_uri
        from huggingface_hub.errors import HfUriError
    except ImportError:
        return None
    try:
        uri = parse_hf_uri(HUB_URL_PREFIX + spec)
    except HfUriError:
        return None
    if uri.type != "model" or not spec.startswith(uri.id):  # "models/ORG/NAME" is a path, not a name
        return None
    return HubName("model", uri.id, uri.revision, uri.path_in_repo.strip("/"))


def parse_dataset_url(url: str, *, key: str = "data.train") -> HubName:
    """The dataset repository (and path in it) of ``hf://datasets/ORG/NAME[@REVISION][/PATH]``.

    Raises:
        DataError: a malformed URL, one of a repository that is no dataset, or huggingface_hub missing.
    """
    form = "hf://datasets/ORG/NAME[@REVISION][/PATH]"
    try:
        from huggingface_hub import parse_hf_uri
        from huggingface_hub.errors import HfUriError
    except ImportError:
        raise DataError(f"{key}.path {url!r}: Hub datasets need the huggingface_hub package; install it with "
                        "pip install 'trakcli-attribution[hf]' (keep torch==2.13.0 on the same pip line)") from None
    try:
        uri = parse_hf_uri(url)
    except HfUriError as e:
        raise DataError(f"{key}.path {url!r} is no Hub dataset URL ({e}); write {form}") from None
    if uri.type != "dataset":
        raise DataError(f"{key}.path {url!r} names a {uri.type} repository; data paths name dataset repositories: "
                        f"{form}")
    return HubName("dataset", uri.id, uri.revision, uri.path_in_repo.strip("/"))


# --- which files to take ----------------------------------------------------------------------------


def _missing(error: TrakError) -> TrakError:
    """``error`` marked as saying that files are missing (a cached snapshot's fix is then to download them)."""
    error.hub_missing = True  # type: ignore[attr-defined]
    return error


def _listing(files: list[str], limit: int = _SHOWN) -> str:
    shown = ", ".join(files[:limit])
    return shown + (f", ... ({len(files) - limit} more)" if len(files) > limit else "") if files else "no files"


def _weights(names: list[str]) -> list[str]:
    for globs in WEIGHT_GLOBS:
        found = [n for n in names if any(fnmatch.fnmatchcase(n, g) for g in globs)]
        if found:
            return found
    return []


def model_files(files: list[str], name: HubName, need: str) -> list[str]:
    """The files of a model repository to download for ``name`` (its :attr:`~HubName.path`) and ``need``.

    A path naming a file: that file. Otherwise the folder (the root, or the path's folder): its config and tokenizer
    files (``*.json``, ``*.txt``, ``*.model``, ``*.tiktoken``, ``*.jinja``, ``additional_chat_templates/``) and, unless
    ``need`` is ``"tokenizer"`` and the folder has tokenizer files, its weights: the ``*.safetensors`` files, else the
    ``pytorch_model*.bin`` / ``adapter_model.bin`` files, else, without ``config.json``, its only ``.gguf`` file. Other
    formats (TensorFlow, Flax, ONNX) and subfolders are left out. ``files`` and the paths returned (sorted) are relative
    to the repository's root, ``/``-separated.

    Raises:
        ModelError: no such file or folder, a model folder without weights, or several ``.gguf``
            files and no ``config.json`` (names them and how to pick one).
    """
    sub = name.path
    if sub in files:
        return [sub]
    prefix = f"{sub}/" if sub else ""
    inside = [f[len(prefix):] for f in files if f.startswith(prefix)]
    where = f"{name.repo_id}" + (f" has no file or folder {sub!r}" if sub else " holds no files")
    if not inside:
        tops = sorted({f.split("/")[0] for f in files})
        raise _missing(ModelError(f"{where}; it holds {_listing(tops)}"))
    top = [f for f in inside if "/" not in f]
    small = [f for f in top if f.lower().endswith(MODEL_SMALL_SUFFIXES)]
    small += [f for f in inside if f.startswith("additional_chat_templates/")]
    if need == "tokenizer" and any(f in TOKENIZER_NAMES for f in top):
        return sorted(prefix + f for f in small)
    weights = _weights(top)
    if not weights and "config.json" not in top:
        ggufs = [f for f in top if f.lower().endswith(".gguf")]
        if len(ggufs) == 1:
            weights = ggufs
        elif ggufs:
            raise ModelError(f"{name.uri()} has no config.json and {len(ggufs)} .gguf files ({_listing(ggufs)}); name "
                             f"one, e.g. hf:{name.uri(prefix + ggufs[0])}")
    if not weights and need != "tokenizer":
        raise _missing(ModelError(f"{name.uri()} holds no PyTorch weights (*.safetensors, pytorch_model*.bin or one "
                                  f".gguf); its files are {_listing(top)}"))
    return sorted(prefix + f for f in small + weights)


def _is_train(path: str) -> bool:
    """Whether a data file belongs to the ``train`` split by its name (``train.jsonl``,
    ``data/train-00000-of-00002.parquet``, ``train/part.arrow``)."""
    stem = str(PurePosixPath(path).with_suffix(""))
    return "train" in re.split(r"[-_./]", stem.lower())


def dataset_files(files: list[str], name: HubName) -> tuple[list[str], list[str]]:
    """Which files of a dataset repository to download, and which to read, for ``name``.

    The rule, on the repository (or the folder :attr:`~HubName.path` names):

    1. a path naming a file: that file; a glob (``data/test-*.parquet``): the files it matches;
    2. a Hugging Face datasets ``save_to_disk`` folder (``state.json``): the folder; one of a
       ``DatasetDict`` (``dataset_dict.json``): its ``train`` split;
    3. otherwise its data files (``.jsonl``, ``.csv``, ``.parquet``, ``.arrow``, in
       subfolders too): the only one, else those of the ``train`` split (``train`` as a
       word of the path: ``train.jsonl``, ``data/train-00000-of-00002.parquet``).

    Several files are read as one table, in sorted order, so they must be ``.parquet`` or
    ``.arrow`` shards. Returns ``(download, read)``: repository paths (relative to its root,
    ``/``-separated, as ``files``) to download, and the files (or the one folder) to read.

    Raises:
        DataError: nothing matches, no data files, several without a ``train`` split, or several
            that are not columnar shards of one format (each names the files and how to name one).
    """
    sub = name.path
    url = name.uri()
    how = f"name one in the URL, e.g. {name.uri('FILE')}, or a glob such as {name.uri('data/train-*.parquet')}"
    if sub in files:
        return [sub], [sub]
    if any(c in sub for c in "*?["):
        picked = sorted(f for f in files if fnmatch.fnmatchcase(f, sub))
        if not picked:
            raise _missing(DataError(f"no file of {name.repo_id} matches {sub!r}; its files are "
                                     f"{_listing(sorted(files))}"))
    else:
        prefix = f"{sub}/" if sub else ""
        inside = sorted(f for f in files if f.startswith(prefix))
        if not inside:
            raise _missing(DataError(f"{name.repo_id} has no file or folder {sub!r}; its files are "
                                     f"{_listing(sorted(files))}"))
        if f"{prefix}dataset_dict.json" in files and f"{prefix}train/state.json" in files:
            prefix += "train/"
        if f"{prefix}state.json" in files:  # a save_to_disk folder
            folder = prefix.rstrip("/")
            return [f for f in inside if f.startswith(prefix)], [folder]
        data = [f for f in inside if f.lower().endswith(DATA_SUFFIXES)]
        if not data:
            raise _missing(DataError(f"{name.repo_id} has no data files ({', '.join(DATA_SUFFIXES)})"
                                     f"{' in ' + repr(sub) if sub else ''}; its files are {_listing(inside)}"))
        train = [f for f in data if _is_train(f[len(prefix):])]
        if len(data) > 1 and not train:
            raise DataError(f"{url} holds {len(data)} data files and none of a train split ({_listing(data)}); {how}")
        picked = data if len(data) == 1 else train
    suffixes = {PurePosixPath(f).suffix.lower() for f in picked}
    if len(picked) > 1 and (len(suffixes) > 1 or not suffixes <= set(SHARD_SUFFIXES)):
        raise DataError(f"{len(picked)} files of {url} ({_listing(picked)}) are read together only as .parquet or "
                        f".arrow shards of one format; {how}")
    return picked, picked


# --- the cache and the Hub --------------------------------------------------------------------------


def hub_timeout() -> float:
    """Seconds to wait for the Hub's answer about a repository: ``$HF_HUB_ETAG_TIMEOUT`` (as transformers), else 10."""
    try:
        return float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or 10)
    except ValueError:
        return 10.0


@functools.cache
def _repo_files(repo_type: str, repo_id: str, revision: str | None, cache: Path) -> list[str] | Exception:
    """The files of a repository at its revision, asked once per process and cache (one request, no retries:
    an unreachable Hub is known after one failed connection or :func:`hub_timeout` seconds), or the exception."""
    import huggingface_hub

    try:
        info = huggingface_hub.HfApi().repo_info(repo_id, revision=revision, repo_type=repo_type,
                                                 timeout=hub_timeout())
        return [s.rfilename for s in (info.siblings or [])]
    except Exception as e:  # noqa: BLE001 - kept, and told apart by the caller
        return e


def _local_files(folder: Path) -> list[str]:
    """Every file under ``folder`` (links followed), as ``/``-separated paths relative to it, sorted."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def _select(name: HubName, what: str, files: list[str]) -> tuple[list[str], list[str]]:
    """The repository's files to download and to read: :func:`dataset_files`, or for a model (``what``: the
    ``need``) :func:`model_files` and the path in it."""
    if name.repo_type == "dataset":
        return dataset_files(files, name)
    return model_files(files, name, what), [name.path]


@functools.cache
def _snapshot(name: HubName, what: str, cache: Path, offline: bool) -> tuple[Path, list[str]]:
    """The snapshot folder of ``name`` in ``cache`` (downloading the files :func:`_select` picks, unless
    ``offline``) and the repository paths to read, kept for the process.

    Raises:
        DataError (a dataset) or ModelError: no such repository or revision on the Hub (or private, gated),
            a failed download, no snapshot in the cache when the Hub cannot be used, or files that do not
            hold what is needed; the callers lead the message with what the name was given as.
    """
    import huggingface_hub
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    kind = "dataset" if name.repo_type == "dataset" else "model"
    error = DataError if kind == "dataset" else ModelError
    revision = name.revision or "main"
    files = None if offline else _repo_files(name.repo_type, name.repo_id, name.revision, cache)
    if isinstance(files, RevisionNotFoundError):
        raise error(f"the Hugging Face Hub {kind} {name.repo_id} has no revision {revision!r}; "
                    "give a branch, tag or commit it has after @")
    if isinstance(files, RepositoryNotFoundError):
        raise error(f"the Hugging Face Hub has no {kind} repository {name.repo_id} (or it is private or gated: log in "
                    "with `hf auth login` or set HF_TOKEN, and accept its terms on its page); check the name")
    where = dict(repo_id=name.repo_id, repo_type=name.repo_type, revision=name.revision, cache_dir=str(cache))
    if isinstance(files, list):
        download, read = _select(name, what, files)
        logger.info("downloading %s (%d files) into %s", name.uri(), len(download), cache)
        try:
            folder = huggingface_hub.snapshot_download(**where, allow_patterns=[_literal(f) for f in download])
        except Exception as e:  # noqa: BLE001 - any failure of the download (disk, network, auth)
            raise error(f"downloading {name.uri()} from the Hugging Face Hub into {cache} failed: "
                        f"{e.__class__.__name__}: {e}") from None
        return Path(folder), read
    try:  # offline, or the Hub unreachable (no network, a proxy, the Hub down): the cache, as transformers does
        folder = Path(huggingface_hub.snapshot_download(**where, local_files_only=True))
    except Exception:  # noqa: BLE001 - LocalEntryNotFoundError, an incomplete snapshot: not usable from the cache
        why = ("HF_HUB_OFFLINE is set" if offline else
               f"the Hub cannot be reached: {files.__class__.__name__}: {(str(files).strip().splitlines() or [''])[0]}")
        also = ("unset HF_HUB_OFFLINE to download it here" if offline else
                "with HF_HUB_OFFLINE=1 the Hub is not tried")
        raise error(f"the Hugging Face Hub {kind} {name.repo_id} (revision {revision}) is not in the Hugging Face "
                    f"cache {cache} ({why}); download it on a machine with internet with "
                    f"`{name.download_command()}` and copy its cache folder here (or point HF_HUB_CACHE / HF_HOME at "
                    f"one that holds it; {also}), or give a local {'file' if kind == 'dataset' else 'directory'}"
                    ) from None
    try:
        return folder, _select(name, what, _local_files(folder))[1]
    except TrakError as e:
        fix = f"; download them with `{name.download_command()}` on a machine with internet"
        raise error(f"in the cached snapshot {folder}: {e}{fix if getattr(e, 'hub_missing', False) else ''}") from None


def _literal(path: str) -> str:
    """``path`` as an fnmatch pattern matching only itself (``[`` ``*`` ``?`` escaped)."""
    return re.sub(r"([\[\]*?])", r"[\1]", path)


def resolve_hub_model(name: HubName, *, need: str = "model", label: str, lead: str = "") -> Path:
    """``<cache>/models--ORG--NAME/snapshots/<commit>[/PATH]``: the snapshot folder of a Hub model name
    (:func:`parse_model_name`), or the file or folder :attr:`~HubName.path` names inside it, downloaded
    (online; which files: :func:`model_files` for ``need``) or from the cache.

    Raises:
        ModelError: as :func:`_snapshot`, messages starting with ``label`` and ``lead``.
    """
    try:
        folder, _ = _snapshot(name, need, hub_cache_dir(), hub_offline())
    except TrakError as e:
        raise ModelError(f"{label}: {lead}{e}") from None
    return folder / name.path if name.path else folder


def resolve_hub_dataset(url: str, *, key: str = "data.train") -> list[Path]:
    """The local files (or the one ``save_to_disk`` folder) of a Hub dataset URL
    ``hf://datasets/ORG/NAME[@REVISION][/PATH]`` (which: :func:`dataset_files`), downloaded (online) or from
    the cache: paths under ``<cache>/datasets--ORG--NAME/snapshots/<commit>/``, in reading order.

    Raises:
        DataError: a malformed URL (:func:`parse_dataset_url`), or as :func:`_snapshot`.
    """
    name = parse_dataset_url(url, key=key)
    try:
        folder, read = _snapshot(name, "data", hub_cache_dir(), hub_offline())
    except TrakError as e:
        raise DataError(f"{key}.path {url!r}: {e}") from None
    return [folder / r for r in read]
