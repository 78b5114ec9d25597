"""Checkpoint sha256s remembered by (path, size, mtime_ns) beside the store."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest
import yaml
import zarr
from typer.testing import CliRunner

import trakcli.jobs.setup as setup
import trakcli.store.manifest as manifest
from trakcli.cli.main import app
from trakcli.store import hashes
from trakcli.store.hashes import HashCache, hashes_path
from projects import trak

HOUR_AGO = time.time() - 3600


def age(*paths: Path, when: float = HOUR_AGO) -> None:
    """Give files an old mtime (a file modified within the last 2 s is never remembered)."""
    for p in paths:
        os.utime(p, (when, when))


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class Counting:
    """A hash function that counts the files it reads."""

    def __init__(self):
        self.read: list[str] = []

    def __call__(self, path: Path) -> str:
        self.read.append(path.name)
        return sha(path)


def test_remembered_until_size_or_mtime_changes(tmp_path):
    f = tmp_path / "model.pt"
    f.write_bytes(b"weights" * 100)
    age(f)
    count, cache_file = Counting(), tmp_path / "s.zarr.hashes.json"
    cache = HashCache(cache_file)
    assert cache.sha256(f, count) == sha(f) and count.read == ["model.pt"]
    assert cache.sha256(f, count) == sha(f) and count.read == ["model.pt"]
    cache.save()
    data = json.loads(cache_file.read_text())
    assert data["format"] == "trakcli.checkpoint_hashes"
    assert data["files"][str(f.resolve())] == {"signature": [700, f.stat().st_mtime_ns], "sha256": sha(f)}

    again = HashCache(cache_file)  # a new process
    assert again.sha256(f, count) == sha(f) and count.read == ["model.pt"]  # not read
    age(f, when=HOUR_AGO + 1)  # touched: same bytes, another mtime
    assert again.sha256(f, count) == sha(f) and count.read == ["model.pt"] * 2
    f.write_bytes(b"other" * 100)
    age(f)
    assert again.sha256(f, count) == sha(f) and count.read == ["model.pt"] * 3


def test_a_just_written_file_is_not_remembered(tmp_path):
    f = tmp_path / "model.pt"
    f.write_bytes(b"x")  # mtime now: a second write in the same tick could keep size and mtime
    count = Counting()
    cache = HashCache(tmp_path / "h.json")
    cache.sha256(f, count)
    cache.sha256(f, count)
    assert count.read == ["model.pt", "model.pt"]
    cache.save()
    assert not (tmp_path / "h.json").exists()


def test_a_model_directory_is_keyed_by_every_file_in_it(tmp_path):
    d = tmp_path / "hf_model"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"w" * 10)
    (d / "config.json").write_text("{}")
    age(*d.iterdir())
    calls = []
    cache = HashCache(None)
    compute = lambda p: calls.append(p) or "h"  # noqa: E731
    cache.sha256(d, compute)
    cache.sha256(d, compute)
    assert len(calls) == 1
    (d / "config.json").write_text('{"a": 1}')
    age(d / "config.json", when=HOUR_AGO + 5)
    cache.sha256(d, compute)
    assert len(calls) == 2


@pytest.mark.parametrize("content", ["not json", '{"format": "other"}', '{"format": "trakcli.checkpoint_hashes", '
                                     '"format_version": 1, "files": {"x": 3}}'])
def test_an_unreadable_or_foreign_cache_file_means_hashing_again(tmp_path, content):
    f = tmp_path / "m.pt"
    f.write_bytes(b"abc")
    age(f)
    (tmp_path / "h.json").write_text(content)
    count = Counting()
    cache = HashCache(tmp_path / "h.json")
    assert cache.sha256(f, count) == sha(f) and count.read == ["m.pt"]
    cache.save()
    assert HashCache(tmp_path / "h.json").entries[str(f.resolve())]["sha256"] == sha(f)


def new_process(monkeypatch) -> Counting:
    """Forget this process's caches (as a new `trak` process would) and count checkpoint reads."""
    monkeypatch.setattr(hashes, "_OPEN", {})
    count = Counting()
    monkeypatch.setattr(setup, "file_sha256", count)
    monkeypatch.setattr(manifest, "checkpoint_sha256", count)
    return count


def test_commands_read_each_checkpoint_once_then_not_until_it_changes(user_project, monkeypatch):
    ckpts = sorted(Path("ckpts").glob("model_*.pt"))
    age(*ckpts)
    count = new_process(monkeypatch)
    trak("featurize", "run.yaml", "-q")
    assert count.read == ["model_0.pt", "model_1.pt"]
    assert hashes_path("out/attrib.zarr") == Path("out/attrib.zarr.hashes.json")
    assert Path("out/attrib.zarr.hashes.json").is_file()
    count = new_process(monkeypatch)
    trak("score", "run.yaml", "-q")
    trak("featurize", "run.yaml", "-q")
    assert count.read == []
    # the store still records the full sha256 (the provenance)
    assert zarr.open_group("out/attrib.zarr", mode="r")["train/1"].attrs["sha256"] == sha(ckpts[1])

    age(ckpts[1], when=HOUR_AGO + 10)  # touched
    count = new_process(monkeypatch)
    trak("score", "run.yaml", "-q")
    assert count.read == ["model_1.pt"]


def test_a_manifest_is_checked_from_the_cache_too(user_project, monkeypatch):
    cfg = yaml.safe_load(Path("run.yaml").read_text())
    cfg["optimize"] = {"n_models": 2, "epochs": 1, "batch_size": 16, "lr": 0.1, "out_dir": "trained"}
    cfg["checkpoints"] = "trained/manifest.json"
    Path("opt.yaml").write_text(yaml.safe_dump(cfg))
    trak("optimize", "opt.yaml", "-q")
    age(*Path("trained").glob("model_*.pt"))
    count = new_process(monkeypatch)
    trak("featurize", "opt.yaml", "-q")  # the manifest check and the store's record: one read per file
    assert sorted(count.read) == ["model_000.pt", "model_001.pt"]
    count = new_process(monkeypatch)
    trak("score", "opt.yaml", "-q")
    assert count.read == []
    # a checkpoint replaced since the manifest was written is still refused
    Path("trained/model_001.pt").write_bytes(Path("trained/model_000.pt").read_bytes())
    age(Path("trained/model_001.pt"), when=HOUR_AGO + 20)
    new_process(monkeypatch)
    res = CliRunner().invoke(app, ["score", "opt.yaml", "-q"])
    assert res.exit_code == 1 and "changed since trak optimize wrote the manifest" in res.stderr
