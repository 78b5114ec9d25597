"""The s3 extra installs what an s3:// store imports, and a missing module is one error naming the install command.

Each module of the S3 path is hidden in turn (``sys.modules[name] = None`` makes its import fail); the CLI then
refuses the s3:// store.path with one red line naming the module and ``trakcli-attribution[s3]``, before any
object store is asked (no S3 service runs in these tests).
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions

import pytest

from projects import ROOT, make_project, msg, run
from trakcli.errors import MissingModuleError
from trakcli.store.location import S3_INSTALL, S3_MODULES, store_location

URL = "s3://trak-extras/a.zarr"


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _extra(name: str) -> set[str]:
    """The distributions the extra ``name`` of pyproject.toml installs (names only, canonical)."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return {_canonical(re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0]) for req in extras[name]}


def _imported_modules(path) -> set[str]:
    """The top-level modules ``path`` imports, anywhere in it (functions included)."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_the_s3_extra_installs_every_module_the_s3_path_imports():
    assert _extra("s3") >= {_canonical(dist) for _, dist in S3_MODULES}
    # every third-party module location.py imports is one of S3_MODULES, or zarr (a dependency of trakcli itself)
    imported = _imported_modules(ROOT / "trakcli" / "store" / "location.py")
    third_party = {m for m in imported if m not in sys.stdlib_module_names and m not in ("trakcli", "__future__")}
    assert third_party - {"zarr"} <= {module for module, _ in S3_MODULES}, third_party
    assert {"fsspec", "upath"} <= third_party  # the scan sees the imports inside functions
    # each module is installed by the distribution the message names (upath by universal-pathlib)
    installed = packages_distributions()
    for module, dist in S3_MODULES:
        assert _canonical(dist) in {_canonical(d) for d in installed[module]}, (module, installed[module])


def test_messages_name_the_published_distribution():
    assert "pip install 'trakcli-attribution[s3]'" in S3_INSTALL and "pip install -e '.[s3]'" in S3_INSTALL
    source = (ROOT / "trakcli" / "store" / "location.py").read_text()
    assert "trakcli[" not in source  # `trakcli` on the package index is an unrelated time tracker


@pytest.mark.parametrize("module", [m for m, _ in S3_MODULES])
def test_a_missing_module_of_the_s3_path_is_one_error_naming_the_extra(tmp_path, monkeypatch, module):
    root = make_project(tmp_path / "p", n_models=1)
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):  # no S3 service: it must not be asked
        monkeypatch.delenv(name, raising=False)
    res = run(root, "featurize", "run.yaml", f"store.path={URL}")
    assert res.returncode == 1, res.stderr
    dist = dict(S3_MODULES)[module]
    one = msg(res)
    assert "Traceback" not in res.stderr and "ModuleNotFoundError" not in res.stderr, res.stderr
    assert one.startswith("error: "), one
    assert f"store.path '{URL}' needs {dist}" in one and "which is not installed" in one, one
    if dist != module:
        assert f"(module {module})" in one, one
    assert "pip install 'trakcli-attribution[s3]'" in one and "pip install -e '.[s3]'" in one, one
    assert not (root / "s3:").exists()
    with pytest.raises(MissingModuleError) as e:  # the library raises the same error, naming the module
        store_location(URL)
    assert e.value.module == module


def test_a_module_missing_below_s3fs_is_named(tmp_path, monkeypatch):
    """s3fs installed but a module it imports (aiobotocore) missing: the message names both."""
    monkeypatch.setitem(sys.modules, "aiobotocore", None)
    for name in [n for n in sys.modules if n == "s3fs" or n.startswith("s3fs.")]:
        monkeypatch.delitem(sys.modules, name)  # imported again (and fails); monkeypatch restores them
    root = make_project(tmp_path / "p", n_models=1)
    res = run(root, "featurize", "run.yaml", f"store.path={URL}")
    assert res.returncode == 1, res.stderr
    one = msg(res)
    assert "needs s3fs, which cannot be imported: the module aiobotocore it imports is not installed" in one, one
    assert "trakcli-attribution[s3]" in one and "Traceback" not in res.stderr


def test_a_url_missing_a_slash_is_read_without_fsspec(tmp_path, monkeypatch):
    root = make_project(tmp_path / "p", n_models=1)
    monkeypatch.setitem(sys.modules, "fsspec", None)
    monkeypatch.delitem(sys.modules, "fsspec.registry", raising=False)
    res = run(root, "featurize", "run.yaml", "store.path=s3:/trak-extras/a.zarr")
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert "reads as a s3:// URL missing a slash; write s3://trak-extras/a.zarr" in msg(res)
