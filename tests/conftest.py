"""Shared fixtures: a user's project of the tiny seeded model (its data, checkpoints and config), and a finished
project. The helpers they are built from are in projects.py."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from projects import MODEL_FILE, make_project, run, tiny_model, write_config

# the tests never ask the Hugging Face Hub: a Hub name resolves from a cache the test populates, or fails at once
os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: Words whose presence in a test module means its tests start child processes (`trak` in a subprocess, kill -9,
#: torchrun, retraining workers, a server): the module's tests get the ``subprocess`` marker, so
#: ``pytest -m "not subprocess"`` is the quick in-process loop.
CHILD_PROCESS_WORDS = ("subprocess", "run_subprocess", "kill_at_line", "torchrun", "Popen")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test of a module that starts child processes with ``subprocess`` (see :data:`CHILD_PROCESS_WORDS`)."""
    starts: dict[Path, bool] = {}
    for item in items:
        path = Path(str(item.fspath))
        if path not in starts:
            text = path.read_text(encoding="utf-8") if path.suffix == ".py" else ""
            starts[path] = any(word in text for word in CHILD_PROCESS_WORDS)
        if starts[path]:
            item.add_marker(pytest.mark.subprocess)


@pytest.fixture
def user_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user's own project in a fresh working directory: model file, 2 checkpoints, data, config.

    Layout (relative to the cwd, as a user lays out a project)::

        my_model.py                     make_model(in_dim=6, hidden=8, num_classes=3)
        ckpts/model_0.pt, model_1.pt    state dicts of two seeded models
        ckpts/data.pt                   x_train [40, 6], y_train [40], x_target [7, 6], y_target [7]
        run.yaml
    """
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_model.py").write_text(MODEL_FILE)
    (tmp_path / "ckpts").mkdir()
    for i in range(2):
        torch.save(tiny_model(seed=i).state_dict(), tmp_path / "ckpts" / f"model_{i}.pt")
    g = torch.Generator().manual_seed(0)
    data = {
        "x_train": torch.randn(40, 6, generator=g),
        "y_train": torch.randint(0, 3, (40,), generator=g),
        "x_target": torch.randn(7, 6, generator=g),
        "y_target": torch.randint(0, 3, (7,), generator=g),
    }
    torch.save(data, tmp_path / "ckpts" / "data.pt")
    write_config(
        tmp_path / "run.yaml",
        {
            "model": {"entrypoint": "my_model.py:make_model"},
            "checkpoints": "ckpts/model_*.pt",
            "data": {
                "train": {"path": "ckpts/data.pt", "inputs": "x_train", "labels": "y_train"},
                "target": {"path": "ckpts/data.pt", "inputs": "x_target", "labels": "y_target"},
                "batch_size": 8,
            },
            "projector": {"kind": "rademacher", "proj_dim": 16, "seed": 0},
            "store": {"path": "out/attrib.zarr", "chunk_rows": 16},
        },
    )
    return tmp_path


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A project whose store was featurized and scored without a fault (2 checkpoints, 15 chunks each)."""
    root = make_project(tmp_path_factory.mktemp("finished"), n_models=2)
    for cmd in (["featurize", "run.yaml", "-q"], ["score", "run.yaml", "-q"]):
        res = run(root, *cmd)
        assert res.returncode == 0, res.stderr
    return root


@pytest.fixture
def project(tmp_path, finished) -> Path:
    """A private copy of the finished project, to damage."""
    root = tmp_path / "p"
    shutil.copytree(finished, root)
    return root


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    """A SeaweedFS S3 service on the loopback address for the session (skipped where `weed` is not installed)."""
    from projects import SeaweedS3

    try:
        service = SeaweedS3(tmp_path_factory.mktemp("seaweedfs"))
    except FileNotFoundError as e:
        pytest.skip(f"needs {e}")
    yield service
    service.stop()


@pytest.fixture
def s3(seaweed, monkeypatch):
    """The S3 service with its AWS_* variables set in this process's environment (subprocesses inherit them)."""
    for k, v in seaweed.env.items():
        monkeypatch.setenv(k, v)
    return seaweed
