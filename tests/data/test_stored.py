"""`trak score` of a store whose train data file is gone: the store's features and recorded fingerprint suffice."""

from __future__ import annotations

import numpy as np
import torch
import yaml
from projects import arrays, run


def _split_data(root):
    """The project's train and target rows in files of their own, so the train file can go alone."""
    d = torch.load(root / "ckpts" / "data.pt")
    torch.save({"x": d["x_train"], "y": d["y_train"]}, root / "train.pt")
    torch.save({"x": d["x_target"], "y": d["y_target"]}, root / "target.pt")
    cfg = yaml.safe_load((root / "run.yaml").read_text())
    cfg["data"]["train"] = {"path": "train.pt", "inputs": "x", "labels": "y"}
    cfg["data"]["target"] = {"path": "target.pt", "inputs": "x", "labels": "y"}
    (root / "run.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))


def test_score_reads_the_train_rows_from_the_store_when_their_file_is_gone(user_project):
    root = user_project
    _split_data(root)
    assert run(root, "featurize", "run.yaml", "-q").returncode == 0
    res = run(root, "score", "run.yaml", "score.experiment=a", "score.top_k=5")
    assert res.returncode == 0, res.stderr
    (root / "train.pt").unlink()
    res = run(root, "score", "run.yaml", "score.experiment=b", "score.top_k=5")
    assert res.returncode == 0, res.stderr
    assert "data.train's file train.pt is missing" in res.stderr and "unavailable" in res.stderr
    assert "(label)" not in res.stderr  # the table shows no train labels: they are not stored
    got = arrays(root / "out" / "attrib.zarr")
    a = {k.removeprefix("scores/a/"): v for k, v in got.items() if k.startswith("scores/a/")}
    b = {k.removeprefix("scores/b/"): v for k, v in got.items() if k.startswith("scores/b/")}
    assert a.keys() == b.keys() and a
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)

    # what needs the rows says which file is missing; the scores it follows are kept
    res = run(root, "score", "run.yaml", "score.experiment=b", "score.top_k=5", "--plot", "top.png")
    assert res.returncode == 1
    assert "--plot top.png" in res.stderr and "train.pt is missing" in res.stderr and "restore the file" in res.stderr
    assert not (root / "top.png").exists()
    assert any(k.startswith("scores/b/") for k in arrays(root / "out" / "attrib.zarr"))


def test_a_missing_train_file_without_a_store_is_the_usual_missing_file_error(user_project):
    root = user_project
    _split_data(root)
    (root / "train.pt").unlink()
    for cmd in ("featurize", "score"):
        res = run(root, cmd, "run.yaml")
        assert res.returncode == 1
        assert "data.train.path" in res.stderr and "train.pt" in res.stderr, res.stderr
