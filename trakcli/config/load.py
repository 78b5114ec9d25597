"""Loading a config: YAML, ``key=value`` overrides, and one error listing every problem."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from trakcli.config.schema import UNKNOWN_KEYS, Config
from trakcli.errors import ConfigError
from trakcli.files import file_problem


def parse_overrides(overrides: list[str] | tuple[str, ...]) -> tuple[dict[str, Any], list[str]]:
    """Turn ``["a.b=1", "c=[x, y]"]`` into a nested dict; values are parsed as YAML.

    Returns:
        (nested dict, list of problems).
    """
    out: dict[str, Any] = {}
    problems: list[str] = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            problems.append(f"override {item!r}: expected key=value, e.g. projector.proj_dim=512")
            continue
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as e:
            problems.append(f"{key}: cannot parse value {raw!r} as YAML ({e.__class__.__name__})")
            continue
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                nxt = node[p] = {}
            node = nxt
        node[parts[-1]] = value
    return out, problems


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(merged.get(k), dict):
            merged[k] = _merge(merged[k], v)
        elif isinstance(v, dict) and isinstance(merged.get(k), (str, Path)) and k == "store":
            merged[k] = _merge({"path": merged[k]}, v)
        else:
            merged[k] = v
    return merged


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model class that owns the field at ``loc`` (for did-you-mean)."""
    model: Any = Config
    for part in loc:
        field = model.model_fields.get(str(part)) if model is not None else None
        if field is None:
            return None
        ann = field.annotation
        members = getattr(ann, "__args__", None) or (ann,)
        model = next((a for a in members if isinstance(a, type) and issubclass(a, BaseModel)), None)
    return model


def _unknown_key(parent: tuple[Any, ...], name: str, choices: list[str] | None) -> str:
    """``"a.b.nme: unknown key; did you mean a.b.name?"`` (or the known keys when none is close)."""
    prefix = "".join(f"{p}." for p in parent)
    if not choices:
        return f"{prefix}{name}: unknown key"
    close = difflib.get_close_matches(name, choices, n=1)
    hint = f"did you mean {prefix}{close[0]}?" if close else f"known keys: {', '.join(choices)}"
    return f"{prefix}{name}: unknown key; {hint}"


_NOT_KEYS = ("function-after", "str", "int", "float")


def _format_errors(err: ValidationError, prefix: tuple[str, ...] = ()) -> list[str]:
    problems = []
    for e in err.errors():
        # pydantic adds validator and union branch names ("str", "list[str]") to the location: drop them
        loc = prefix + tuple(p for p in e["loc"] if not (isinstance(p, str) and ("[" in p or p in _NOT_KEYS)))
        key = ".".join(str(p) for p in loc) or "(top level)"
        if e["type"] == "extra_forbidden":
            owner = _model_at(loc[:-1])
            problems.append(_unknown_key(loc[:-1], str(loc[-1]), list(owner.model_fields) if owner else None))
        elif e["type"] == UNKNOWN_KEYS:
            problems += [_unknown_key(loc, str(k), list(e["ctx"]["choices"])) for k in e["ctx"]["keys"]]
        elif e["type"] == "missing":
            problems.append(f"{key}: required key is missing")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            got = f" (got {e.get('input')!r})" if loc else ""  # a whole-config check: the input is the config
            problems.append(f"{key}: {msg}{got}")
    # a union failure is reported once per branch: keep each line once
    return list(dict.fromkeys(problems))


def validate_section(model: type[BaseModel], raw: Any, key: str) -> Any:
    """One config section (``model`` its pydantic class, ``raw`` a mapping) validated on its own, messages naming
    ``key.field``.

    Raises:
        ConfigError: every problem at once, worded as for a YAML config (did-you-mean for unknown keys).
    """
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, (key,))) from None


def load_config(source: str | Path | dict[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read, override and validate a config.

    Args:
        source: path of a YAML file, or an already-parsed mapping.
        overrides: ``key=value`` strings applied on top (values parsed as YAML).

    Returns:
        The validated :class:`Config`.

    Raises:
        ConfigError: listing every problem found, each with its dotted key.
    """
    label = None
    if isinstance(source, dict):
        raw: Any = source
    else:
        path = Path(source)
        label = str(source)
        problem = file_problem(path)
        if problem is not None:
            raise ConfigError(f"config file {str(path)!r} {problem}; pass the path of a YAML file such as "
                              "configs/digits.yaml")
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            line = e.object[: e.start].count(b"\n") + 1
            raise ConfigError(f"{path} is not UTF-8 text: byte {e.object[e.start]:#04x} on line {line} cannot be "
                              "decoded; save the config as UTF-8", source=label) from None
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror or e}; check its permissions") from None
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path} is not valid YAML: {e}", source=label) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"the config must be a YAML mapping, got {type(raw).__name__}", source=label)
    extra, problems = parse_overrides(list(overrides))
    try:
        cfg = Config.model_validate(_merge(raw, extra))
    except ValidationError as e:
        raise ConfigError(problems + _format_errors(e), source=label) from None
    if problems:
        raise ConfigError(problems, source=label)
    return cfg
