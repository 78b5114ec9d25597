"""`trak report CONFIG --out report.html` and Attributor.report: the stored answers, read without recomputing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from projects import msg, run
from trakcli.plots import top_indices


def embedded(path: Path) -> dict:
    m = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', path.read_text(), re.S)
    assert m is not None
    return json.loads(m.group(1))


def files_of(folder: Path) -> dict[str, int]:
    """Every file below ``folder`` with its modification time (ns)."""
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


def test_report_of_the_full_score_matrix_reads_the_store_and_changes_nothing(project):
    store = project / "out" / "attrib.zarr"
    before = files_of(store)
    res = run(project, "report", "run.yaml", "--out", "report.html")
    assert res.returncode == 0, res.stderr
    assert msg(res) == "report of 90 targets -> report.html"
    assert files_of(store) == before  # nothing computed, nothing written to the store
    data = embedded(project / "report.html")
    scores = np.asarray(zarr.open_group(str(store), mode="r")["scores/default/scores"][:])
    labels = torch.load(project / "ckpts" / "data.pt")
    assert [q["t"] for q in data["queries"]] == list(range(90)) and data["k"] == 5
    for q in data["queries"]:
        pro, opp = top_indices(scores[q["t"]], 5)
        assert [e["d"] for e in q["p"]] == pro.tolist() and [e["d"] for e in q["o"]] == opp.tolist()
        np.testing.assert_allclose([e["s"] for e in q["p"]], scores[q["t"], pro], rtol=1e-3)
        assert q["label"] == int(labels["y_target"][q["t"]])
    assert all(d["label"] == int(labels["y_train"][int(i)]) for i, d in data["docs"].items())
    assert data["image"] is None and "90 targets, 600 train rows" in data["about"]
    assert data["title"] == "run: experiment 'default'"


def test_report_of_a_top_k_experiment_shows_score_show_top_of_its_k(project):
    res = run(project, "score", "run.yaml", "-q", "score.top_k=4", "score.experiment=tk")
    assert res.returncode == 0, res.stderr
    res = run(project, "report", "run.yaml", "--experiment", "tk", "score.show_top=2", "-q", "--out", "tk.html")
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""  # --quiet
    top = zarr.open_group(str(project / "out" / "attrib.zarr"), mode="r")["scores/tk/top_k"]
    data = embedded(project / "tk.html")
    assert len(data["queries"]) == 90 and data["k"] == 2
    for q in data["queries"]:
        assert [e["d"] for e in q["p"]] == top["proponents"][q["t"], :2].tolist()
        assert [e["d"] for e in q["o"]] == top["opponents"][q["t"], :2].tolist()
    assert "(top 4 kept)" in data["about"]


@pytest.mark.parametrize("args,code,message", [
    (["--out", "r.txt"], 2, "--out r.txt: unknown format '.txt'; use a .html or .htm path"),
    (["--out", "nowhere/r.html"], 2, "directory nowhere does not exist"),
    (["--out", "r.html", "--experiment", "nope"], 1,
     "holds no scores of experiment 'nope' (score.experiment); it holds 'default'; run `trak score CONFIG` first"),
    (["--out", "r.html", "data.target=null"], 1,
     "config: data.target: unset, so there are no targets to show; give data.target (or --targets FILE)"),
    (["--out", "r.html", "store.path=out/none.zarr"], 1,
     "store out/none.zarr does not exist; run `trak featurize CONFIG` and `trak score CONFIG` first"),
])
def test_what_it_cannot_show_is_one_clear_error_and_the_old_file_stays(project, args, code, message):
    (project / "r.html").write_text("old")
    res = run(project, "report", "run.yaml", *args)
    assert res.returncode == code and message in msg(res), res.stderr
    assert (project / "r.html").read_text() == "old"


def test_an_unfinished_experiment_names_the_command_that_finishes_it(project):
    done = zarr.open_array(str(project / "out" / "attrib.zarr" / "scores" / "default" / "done"), mode="r+")
    flags = done[:]
    flags[0] = 0
    done[:] = flags
    res = run(project, "report", "run.yaml", "--out", "r.html")
    assert res.returncode == 1
    assert "are unfinished" in msg(res) and "run `trak score CONFIG` to finish them" in msg(res), res.stderr
    assert not (project / "r.html").exists()


def test_scores_of_other_data_are_refused(project):
    data = torch.load(project / "ckpts" / "data.pt")
    data["x_target"] = data["x_target"] + 1
    torch.save(data, project / "ckpts" / "other.pt")
    res = run(project, "report", "run.yaml", "data.target.path=ckpts/other.pt", "--out", "r.html")
    assert res.returncode == 1 and "data.target differs from the targets of experiment 'default'" in msg(res)


def test_attributor_report_shows_its_last_experiment(user_project):
    import trakcli
    from torch.utils.data import DataLoader
    from torch.utils.data import TensorDataset as TorchTensorDataset

    from trakcli.errors import ArgumentError, ConfigError, DataError, StoreError
    from trakcli.models import build_model

    data = torch.load("ckpts/data.pt")  # user_project is the working directory
    train = DataLoader(TorchTensorDataset(data["x_train"], data["y_train"]), batch_size=8)
    target = DataLoader(TorchTensorDataset(data["x_target"], data["y_target"]), batch_size=8)
    att = trakcli.Attributor(build_model("my_model.py:make_model"), store="out/api.zarr",
                             projector={"kind": "rademacher", "proj_dim": 16, "seed": 0})
    with pytest.raises(ArgumentError, match="experiment=None, and this Attributor has scored nothing yet; call score"):
        att.report("r.html")
    ckpts = sorted(Path("ckpts").glob("model_*.pt"))
    for m, ck in enumerate(ckpts):
        att.featurize(train, checkpoint=ck, model_id=m)
    top = att.top_k(target, 3, checkpoints=ckpts, experiment="top")
    texts = [f"train row {i}" for i in range(40)]
    pictures = data["x_target"][:, :4].reshape(7, 2, 2)
    assert att.report("r.html", k=2, train=texts) == Path("r.html")
    page = embedded(Path("r.html"))
    assert [[e["d"] for e in q["p"]] for q in page["queries"]] == top.proponents[:, :2].tolist()
    assert page["docs"][str(top.proponents[0, 0])]["text"] == f"train row {top.proponents[0, 0]}"
    assert "Attributor" not in page["about"] and page["title"] == "Experiment 'top': proponents and opponents"
    att.report("pictures.html", train=data["x_train"][:, :4].reshape(40, 2, 2), target=pictures)
    shown = embedded(Path("pictures.html"))
    assert shown["image"] == {"shape": [1, 2, 2]} and all("img" in q for q in shown["queries"])
    with pytest.raises(DataError, match="3 train rows given, but experiment 'top' has 40 train rows"):
        att.report("r.html", train=texts[:3])
    with pytest.raises(DataError, match="cannot show rows"):
        att.report("r.html", target=pictures.reshape(7, 4))
    with pytest.raises(StoreError, match="no scores of experiment 'x'.*run Attributor.score or Attributor.top_k first"):
        att.report("r.html", experiment="x")
    att.score(target, checkpoints=ckpts, experiment="full")
    att.report("full.html", k=40, title="All of them")
    full = embedded(Path("full.html"))
    n_positive = int((att.score(target, checkpoints=ckpts, experiment="full").scores[0] > 0).sum())
    assert 0 < n_positive < 40  # k: at most n_train, and proponents are the positive scores
    assert full["title"] == "All of them" and len(full["queries"][0]["p"]) == n_positive
    with pytest.raises(ConfigError, match="k=0: give a positive int"):
        att.report("r.html", k=0)


def test_the_page_says_what_a_score_is_and_the_ridge_of_each_checkpoint(project):
    res = run(project, "report", "run.yaml", "--out", "report.html")
    assert res.returncode == 0, res.stderr
    page = (project / "report.html").read_text()
    m = re.search(r'<p class="about scale">(.*?)</p>', page, re.S)
    assert m is not None
    scale = m.group(1)
    assert scale.startswith("A score is TRAK&#x27;s estimate") and "(log-odds of the right answer" in scale
    g = zarr.open_group(str(project / "out" / "attrib.zarr"), mode="r")
    lambdas = [g[f"train/{m}/kernel"].attrs["lambda_reg"] for m in range(2)]
    assert f"lambda_reg per checkpoint: {lambdas[0]:.3g}, {lambdas[1]:.3g} (lambda_rel 1 x the mean squared" in scale
    res = run(project, "score", "run.yaml", "-q", "score.normalize=unit", "score.experiment=cos", "score.top_k=3")
    assert res.returncode == 0, res.stderr
    res = run(project, "report", "run.yaml", "--experiment", "cos", "--out", "cos.html", "-q")
    assert res.returncode == 0, res.stderr
    cos = re.search(r'<p class="about scale">(.*?)</p>', (project / "cos.html").read_text(), re.S).group(1)
    assert "A score is a cosine" in cos and "lambda_reg" not in cos
