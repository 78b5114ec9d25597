"""Run identity: the one flattening, JSON normalisation and key-by-key diff of settings.

Every identity check of trakcli (the store's root, an experiment's targets and
scores, the ``eval/`` group, score's check of the train features, and
`trak optimize`'s comparison with an earlier manifest) compares plain dicts
through these functions, so a mismatch is reported the same way everywhere:
one line per differing leaf, ``key: store has X, this run has Y``.

Imports neither zarr nor torch.
"""

from __future__ import annotations

import json
from typing import Any

from trakcli.errors import StoreMismatchError


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one flat dict with dotted keys.

    Args:
        d: a value; dicts are walked recursively, anything else (lists
            included) is a leaf.
        prefix: the dotted key of ``d`` itself ("" at the top).

    Returns:
        ``{"a.b.c": leaf, ...}``; a non-dict ``d`` gives ``{prefix: d}``.

    Example:
        ``flatten({"projector": {"proj_dim": 16}, "task": "classification"})``
        is ``{"projector.proj_dim": 16, "task": "classification"}``.
    """
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: d}


def jsonable(d: Any) -> Any:
    """``d`` round-tripped through JSON (what zarr attributes hold)."""
    return json.loads(json.dumps(d, default=str))


_UNSET = object()


def diff_keys(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Human-readable lines ``key: store has X, this run has Y`` for differing leaves."""
    a, b = flatten(jsonable(old)), flatten(jsonable(new))
    show = lambda v: "<unset>" if v is _UNSET else repr(v)  # noqa: E731
    return [
        f"{k}: store has {show(a.get(k, _UNSET))}, this run has {show(b.get(k, _UNSET))}"
        for k in sorted(set(a) | set(b))
        if a.get(k, _UNSET) != b.get(k, _UNSET)
    ]


def settings_mismatch(what: str, old: dict[str, Any] | None, new: dict[str, Any], fix: str) -> StoreMismatchError:
    """The error for stored data made with other settings: ``what`` differs, key by key, and ``fix``."""
    lines = diff_keys(old or {}, new) or ["(identity differs)"]
    return StoreMismatchError(f"{what} were made with different settings:\n  " + "\n  ".join(lines) + f"\n{fix}")

