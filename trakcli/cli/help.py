"""Help labels in the form click and most CLIs print: ``trak score [OPTIONS] CONFIG [OVERRIDES]...``, ``--out PATH``.

typer >= 0.26 labels every parameter with its Python type (``<bool>`` on flags, ``<list[str]>``, ``{config}`` in the
usage line). :class:`TrakCommand` and :class:`TrakGroup` relabel their parameters when help is drawn: arguments by
their upper-case name (optional ones in brackets, ``...`` when repeated), options by an upper-case type (``PATH``,
``INTEGER``, ``[a|b]`` for a choice), flags by nothing.

An unknown flag that names a config key (``--proj-dim 512``) gets the override
to write instead (``projector.proj_dim=512``) added to click's usage error (exit 2).
"""

from __future__ import annotations

import typing
from functools import lru_cache
from typing import Any

import typer.core

#: typer's type names -> the labels click prints
TYPE_LABELS = {"int": "INTEGER", "str": "TEXT", "float": "FLOAT", "path": "PATH", "file": "FILE",
               "directory": "DIRECTORY", "bool": "BOOLEAN"}


def option_label(param: Any, ctx: Any) -> str | None:
    """The value label of an option: ``None`` for a flag, else its metavar or an upper-case type."""
    if getattr(param, "is_flag", False) or getattr(param, "count", False):
        return None
    if param.metavar:
        return param.metavar
    raw = param.display_type(ctx).strip("<>")
    if raw.startswith("list[") and raw.endswith("]"):
        raw = raw[5:-1]
    if "|" in raw:
        return f"[{raw}]"
    label = " ".join(TYPE_LABELS.get(w, w.upper()) for w in raw.lower().split())  # "int range" -> "INTEGER RANGE"
    return label + ("..." if param.nargs != 1 else "")


def relabel(param: Any) -> None:
    """Give one parameter (in place, once) the labels described in the module docstring."""
    if getattr(param, "trak_relabelled", False):
        return
    param.trak_relabelled = True
    if param.param_type_name == "argument":
        name = (param.metavar or param.name or "").upper()
        repeated = "..." if param.nargs != 1 else ""
        piece = (name if param.required else f"[{name}]") + repeated
        param.metavar = name + repeated
        param.get_usage_pieces = lambda ctx: [piece]
        param.display_type_rich = lambda ctx: None
    else:
        param.display_type_rich = lambda ctx: option_label(param, ctx)


@lru_cache(maxsize=1)
def config_keys() -> tuple[str, ...]:
    """Every dotted config key (``projector.proj_dim``, ``data.train.path``, ...) from the config schema."""
    import pydantic

    from trakcli.config import Config

    def walk(model: type, prefix: str) -> typing.Iterator[str]:
        for name, field in model.model_fields.items():
            args = typing.get_args(field.annotation) or (field.annotation,)
            sub = [a for a in args if isinstance(a, type) and issubclass(a, pydantic.BaseModel)]
            if sub:
                yield from walk(sub[0], f"{prefix}{name}.")
            else:
                yield prefix + name

    return tuple(walk(Config, ""))


def override_hint(option: str, args: list[str]) -> str | None:
    """The ``key=value`` override(s) an unknown ``--flag`` probably meant, or None.

    ``--proj-dim 512`` -> ``"projector.proj_dim=512"``: the flag, with dashes as underscores, is matched against the
    last part of every config key; the shallowest keys win (``projector.proj_dim`` before
    ``optimize.projection.proj_dim``). The value is the flag's ``=VALUE`` or the argument after it, else ``VALUE``.
    """
    name, _, value = option.lstrip("-").partition("=")
    name = name.replace("-", "_")
    matches = [k for k in config_keys() if k.split(".")[-1] == name or k == name.replace("__", ".")]
    if not matches:
        return None
    depth = min(k.count(".") for k in matches)
    matches = [k for k in matches if k.count(".") == depth]
    if not value:
        at = next((i for i, a in enumerate(args) if a == option or a.startswith(option + "=")), None)
        if at is not None and "=" in args[at]:
            value = args[at].partition("=")[2]
        else:
            nxt = args[at + 1] if at is not None and at + 1 < len(args) else None
            value = nxt if nxt is not None and not nxt.startswith("-") else "VALUE"
    return " or ".join(f"{k}={value}" for k in matches)


class _Relabelled:
    """Relabels the parameters when help is drawn (see module docstring)."""

    def get_params(self, ctx: Any) -> list[Any]:
        params = super().get_params(ctx)  # type: ignore[misc]
        for p in params:
            relabel(p)
        return params


class TrakCommand(_Relabelled, typer.core.TyperCommand):
    """A typer command whose help reads ``CONFIG [OVERRIDES]...`` and ``--out PATH`` (see module docstring).

    An unknown flag that names a config key gets the override to use instead (:func:`override_hint`), added to
    click's ``NoSuchOption`` (caught by class name: typer ships its own click).
    """

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        original = list(args)
        try:
            return super().parse_args(ctx, args)
        except Exception as e:
            hint = (override_hint(getattr(e, "option_name", ""), original)
                    if any(c.__name__ == "NoSuchOption" for c in type(e).__mro__) else None)
            if hint:
                e.message = f"{e.message}; config keys are set as overrides after the config: {hint}"
            raise


class TrakGroup(_Relabelled, typer.core.TyperGroup):
    """The command group counterpart of :class:`TrakCommand`."""
