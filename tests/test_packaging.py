"""Packaging: the distribution's metadata, and the example configs shipped as package data."""

from __future__ import annotations

from projects import ROOT


def test_repository_configs_are_the_package_data():
    shipped = sorted(p.name for p in (ROOT / "trakcli" / "configs").glob("*.yaml"))
    assert shipped and sorted(p.name for p in (ROOT / "configs").glob("*.yaml")) == shipped


def test_package_metadata_name_torch_range_and_package_data():
    import tomllib

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["name"] == "trakcli-attribution"  # "trakcli" on the index is another project
    assert meta["project"]["scripts"] == {"trak": "trakcli.cli.main:main"}
    torch_req = next(d for d in meta["project"]["dependencies"] if d.startswith("torch"))
    assert "==" not in torch_req and "<3" in torch_req
    assert "configs/*.yaml" in meta["tool"]["setuptools"]["package-data"]["trakcli"]


def test_the_benchmarks_and_examples_are_no_part_of_the_installed_package():
    import tomllib

    from setuptools import find_packages

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    found = find_packages(where=str(ROOT), **meta["tool"]["setuptools"]["packages"]["find"])
    assert "trakcli" in found and "trakcli.store" in found
    assert (ROOT / "benchmarks" / "__init__.py").is_file() and (ROOT / "examples" / "__init__.py").is_file()
    assert sorted({p.split(".")[0] for p in found}) == ["trakcli"]
