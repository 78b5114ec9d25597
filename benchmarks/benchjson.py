"""Provenance and atomic writing of the benchmarks' JSON results.

Every ``benchmarks/bench_*.py`` (and ``probe_sketch.py``) writes its result with
:func:`write_result`, which adds :func:`provenance` (date, commit, trakcli version,
machine) at the top level of the JSON. The benchmarks page prints ``date``, ``commit``
and ``version`` of each committed result, and ``tests/test_docs.py`` checks that every
committed ``bench_results/*.json`` has them. :func:`render_table` prints a result's
table as that page shows it.

The benchmarks import it as a module of the ``benchmarks`` package::

    from benchmarks.benchjson import write_result
"""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

#: The keys :func:`provenance` returns (and :func:`write_result` adds to every result).
PROVENANCE_KEYS = ("date", "commit", "dirty", "version", "python", "torch", "platform", "cpus")


def _git(*args: str) -> str | None:
    """``git ARGS`` in the repository: its stripped stdout, or None where git or the checkout is missing."""
    try:
        proc = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def _trakcli_version() -> str | None:
    """The version of the trakcli in this checkout (``trakcli.__version__``), else the installed one."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    try:
        from trakcli import __version__

        return __version__
    except ImportError:
        try:
            return importlib.metadata.version("trakcli")
        except importlib.metadata.PackageNotFoundError:
            return None


def _package_version(name: str) -> str | None:
    """The version of ``name``: the imported module's ``__version__`` if imported, else the installed one."""
    module = sys.modules.get(name)
    if module is not None and getattr(module, "__version__", None):
        return str(module.__version__)
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def provenance() -> dict[str, Any]:
    """What produced a result, at the time of the call.

    Returns:
        A dict with ``date`` (UTC, ISO 8601 to the second, str), ``commit`` (``git rev-parse
        HEAD``, 40 hex digits; None outside a git checkout), ``dirty`` (bool: tracked files
        differ from the commit; None outside a git checkout), ``version`` (trakcli's
        version), ``python``, ``torch`` (None if torch is not installed), ``platform``
        (``platform.platform()``) and ``cpus`` (``os.cpu_count()``, int). Raises nothing.
    """
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _git("rev-parse", "HEAD"),
        "dirty": None if status is None else bool(status),
        "version": _trakcli_version(),
        "python": platform.python_version(),
        "torch": _package_version("torch"),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }


def with_provenance(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` with :func:`provenance` added: ``benchmark`` first, then the provenance keys, then the rest.

    A key ``result`` sets itself (e.g. a ``date`` of the run's start) keeps the result's value.

    Raises:
        TypeError: ``result`` is not a dict.
    """
    if not isinstance(result, dict):
        raise TypeError(f"a benchmark result must be a dict (JSON object), got {type(result).__name__}")
    out: dict[str, Any] = {}
    if "benchmark" in result:
        out["benchmark"] = result["benchmark"]
    out.update(provenance())
    out.update(result)
    return out


def write_result(path: str | Path, result: dict[str, Any], indent: int = 2) -> dict[str, Any]:
    """Write ``result`` with its provenance as JSON to ``path``, atomically.

    The JSON goes to a temporary file beside ``path`` that then replaces ``path``
    (``os.replace``): a killed run leaves the previous result whole. Missing parent
    folders are made.

    Returns:
        The dict written (``result`` with :func:`provenance`, see :func:`with_provenance`).

    Raises:
        TypeError: ``result`` is not a dict or holds a value JSON cannot encode.
        OSError: ``path`` cannot be written (``path`` is then unchanged).
    """
    out = with_provenance(result)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(out, indent=indent) + "\n"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return out


@functools.cache
def _gen_docs() -> Any:
    """``docs/gen_docs.py`` (the docs site's generator, no package) loaded by its path, as ``docs/hooks.py`` does."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))  # trakcli from this checkout
    spec = importlib.util.spec_from_file_location("gen_docs", REPO / "docs" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def render_table(result: dict[str, Any]) -> str:
    """``result``'s main table (Markdown), as the benchmarks page shows it (``render_table`` of docs/gen_docs.py).

    Raises:
        ValueError: docs/gen_docs.py has no renderer for ``result``.
    """
    return _gen_docs().render_table(result)


def relative_paths(value, roots: dict):
    """``value`` (a result: dicts, lists, strings) with every string's machine paths ``roots`` (path -> the name
    written instead, e.g. ``{"/tmp/work": "<work>", REPO: "."}``) replaced, so a committed result names none."""
    if isinstance(value, str):
        for root, name in roots.items():
            value = value.replace(root, name)
        return value
    if isinstance(value, dict):
        return {k: relative_paths(v, roots) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [relative_paths(v, roots) for v in value]
    return value
