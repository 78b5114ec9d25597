"""The layering rules of the package (docs/development.md, "Architecture"), read from the source with ``ast``.

Every import counts, module-level or inside a function: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "trakcli"


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package."""
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(imported module, imported names) of every import statement in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, [a.name for a in node.names]))
    return out


def _part(module: str) -> str | None:
    """The top-level part of a trakcli module (``trakcli.store.rows`` -> ``store``); None outside trakcli."""
    bits = module.split(".")
    if bits[0] != "trakcli":
        return None
    return bits[1] if len(bits) > 1 else ""


MODULES = _modules()


@pytest.mark.parametrize(
    ("library", "allowed"),
    [("typer", "cli"), ("rich", "cli"), ("click", None), ("zarr", "store")],
)
def test_third_party_libraries_stay_in_their_part(library, allowed):
    offenders = sorted(
        name
        for name, path in MODULES.items()
        if _part(name) != allowed and any(mod.split(".")[0] == library for mod, _ in _imports(path))
    )
    assert offenders == []


def test_optim_imports_neither_config_nor_store():
    offenders = sorted(
        f"{name} imports {mod}"
        for name, path in MODULES.items()
        if _part(name) == "optim"
        for mod, _ in _imports(path)
        if _part(mod) in ("config", "store", "jobs", "cli")
    )
    assert offenders == []


def test_no_private_name_crosses_parts():
    offenders = []
    for name, path in MODULES.items():
        for mod, names in _imports(path):
            other = _part(mod)
            if other is None or other == _part(name):
                continue
            offenders += [f"{name}: from {mod} import {n}" for n in names if n.startswith("_") and n != "__version__"]
            if any(b.startswith("_") for b in mod.split(".")[1:]):
                offenders.append(f"{name}: import {mod}")
    assert offenders == []


def test_no_import_cycle_between_parts():
    edges: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        src = _part(name)
        for mod, _ in _imports(path):
            dst = _part(mod)
            if dst is not None and src and dst and dst != src:
                edges.setdefault(src, set()).add(dst)

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in edges.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    cycles = sorted(p for p in edges if p in reach(p))
    assert cycles == [], {p: sorted(edges[p]) for p in cycles}


def test_library_code_never_prints():
    offenders = sorted(
        name
        for name, path in MODULES.items()
        if _part(name) != "cli"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"
    )
    assert offenders == []


# --- the tests' layout ----------------------------------------------------------------------------------------------

TESTS = PKG.parent / "tests"


def test_the_tests_mirror_the_package_with_one_helper_module():
    """tests/<part>/test_*.py for a part of trakcli, top-level modules' tests in tests/; no __init__.py, so every
    test module's basename is unique; the one helper module is projects.py, the fixtures are conftest.py's."""
    parts = {p.name for p in PKG.iterdir() if (p / "__init__.py").is_file()}
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and p.name not in ("fixtures", "__pycache__")}
    assert folders <= parts, f"test folders that are no part of trakcli: {sorted(folders - parts)}"
    modules = [p for p in TESTS.rglob("*.py") if "fixtures" not in p.relative_to(TESTS).parts]
    assert not [p for p in modules if p.name == "__init__.py"]
    tests = [p for p in modules if p.name.startswith("test_")]
    names = [p.name for p in tests]
    assert sorted({n for n in names if names.count(n) > 1}) == []
    others = sorted(str(p.relative_to(TESTS)) for p in modules if not p.name.startswith("test_"))
    assert others == ["conftest.py", "projects.py"]
    importing_tests = sorted(
        str(p.relative_to(TESTS))
        for p in modules
        for mod, _ in _imports(p)
        if mod.split(".")[0].startswith(("test_", "conftest"))
    )
    assert importing_tests == [], "a test module imports another test module or conftest: share through projects.py"


def _map_entries() -> dict[str, set[str]]:
    """The architecture map of docs/development.md: folder (``""`` for the top level) -> the module files it names."""
    text = (PKG.parent / "docs" / "development.md").read_text()
    block = text[text.index("```\ntrakcli/\n") + len("```\ntrakcli/\n"):]
    block = block[: block.index("```")]
    entries: dict[str, set[str]] = {"": set()}
    current = ""
    for line in block.splitlines():
        folder = re.match(r"^  (\w+)/(\s|$)", line)
        top = re.match(r"^  (\w+\.py)\b", line)
        if folder:
            current = folder.group(1)
            entries.setdefault(current, set())
        elif top:
            current = ""
            entries[""].add(top.group(1))
        if not top:  # a folder's lines name its modules
            entries[current].update(re.findall(r"\b(\w+\.py)\b", line))
    return entries


def test_the_map_in_development_md_names_every_module():
    entries = _map_entries()
    missing = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        folder = rel.parent.as_posix() if rel.parent != Path(".") else ""
        if "__pycache__" in rel.parts or (folder and rel.name == "__init__.py" and folder in entries):
            continue  # a package's __init__ is named by its folder's line
        if rel.name not in entries.get(folder, set()):
            missing.append(rel.as_posix())
    assert missing == [], f"docs/development.md's map does not name {missing}"
    named_folders = {f for f in entries if f}
    assert named_folders == {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
