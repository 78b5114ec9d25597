"""`trak optimize` with optimize.replay, then `trak score` with score.method: unroll, through the store:
the scores equal the Unroller's, the top-k ranks the matrix, a kill -9 resumes to the same store, and
checkpoints without a record are refused naming the command."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from projects import assert_same_store, kill_at_line
from projects import invoke as trak
from trakcli.config import load_config
from trakcli.errors import StoreMismatchError
from trakcli.tasks import resolve_task
from trakcli.train import TensorRows
from trakcli.unroll import ReplayRecord, Unroller, replay


def project(**score) -> dict:
    """user_project (40 train rows, 7 targets) trained by trak optimize with replay; targets 3 per replay."""
    cfg = yaml.safe_load(Path("run.yaml").read_text())
    cfg["checkpoints"] = "trained/manifest.json"
    cfg["num_threads"] = 1
    cfg["data"]["batch_size"] = 3
    cfg["optimize"] = {"optimizer": "adamw", "lr": 0.02, "weight_decay": 0.01, "schedule": "cosine", "n_models": 2,
                       "epochs": 2, "batch_size": 8, "seed": 5, "out_dir": "trained", "replay": True,
                       "subset_fraction": 0.75}
    cfg["score"] = {"method": "unroll", "experiment": "unrolled", **score}
    Path("opt.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return cfg


def test_unrolled_scores_through_the_store(user_project):
    project(top_k=4, full=True)
    res = trak("optimize", "opt.yaml")
    assert res.exit_code == 0, res.stderr
    entries = json.loads(Path("trained/manifest.json").read_text())["models"]
    assert [e["replay"] for e in entries] == ["replay/model_000", "replay/model_001"]
    res = trak("score", "opt.yaml")
    assert res.exit_code == 0, res.stderr
    from trakcli.store import Store

    store = Store.open_existing("out/attrib.zarr", mode="r")
    scores, attrs = store.read_scores("unrolled")
    assert scores.shape == (7, 40) and attrs["method"] == "unroll"
    # the matrix: minus the mean over both models of each one's metagradients, on its subset's columns
    cfg = load_config("opt.yaml")
    data = torch.load("ckpts/data.pt")
    x, y = data["x_train"], data["y_train"]
    from trakcli.models.build import build_model

    want = torch.zeros(7, 40, dtype=torch.float64)
    for e in entries:
        sub = torch.tensor(e["subset_indices"])
        torch.manual_seed(0)
        u = Unroller(build_model(cfg.model.entrypoint, **cfg.model.kwargs), TensorRows(x[sub], y[sub]),
                     ReplayRecord(Path("trained") / e["replay"]), resolve_task("classification"))
        want[:, sub] -= u.metagradients(data["x_target"], data["y_target"]).double() / 2
    np.testing.assert_allclose(scores, want.numpy(), rtol=1e-5, atol=1e-7 * float(want.abs().max()))
    assert (scores == 0).sum() > 0  # rows outside both subsets
    top = store.read("scores/unrolled/top_k/proponents")
    np.testing.assert_array_equal(top[:, 0], scores.argmax(1))
    assert "unroll_rows" not in store.root["scores/unrolled"]  # the chunks are dropped once written
    # the record replays model 0's training to its checkpoint bit for bit
    sub = torch.tensor(entries[0]["subset_indices"])
    torch.manual_seed(0)
    again = replay(build_model(cfg.model.entrypoint, **cfg.model.kwargs), TensorRows(x[sub], y[sub]),
                   ReplayRecord(Path("trained/replay/model_000")), resolve_task("classification"))
    saved = torch.load("trained/model_000.pt")
    assert all(torch.equal(saved[k], v) for k, v in again.state_dict().items())


def test_kill_9_resumes_to_the_same_store(user_project, monkeypatch):
    project()
    assert trak("optimize", "opt.yaml").exit_code == 0
    res = trak("score", "opt.yaml")
    assert res.exit_code == 0, res.stderr
    shutil.move("out/attrib.zarr", "whole.zarr")
    kill_at_line(Path.cwd(), ["score", "opt.yaml"], Path("events.log"), "done unroll 1")
    assert "done unroll 1" in Path("events.log").read_text()
    assert Path("out/attrib.zarr/scores/unrolled/unroll_rows").is_dir()  # killed before the matrix
    Path("events.log").unlink()
    monkeypatch.setenv("TRAK_EVENT_LOG", str(Path("events.log").resolve()))
    res = trak("score", "opt.yaml")
    assert res.exit_code == 0, res.stderr
    log = Path("events.log").read_text()
    assert "start unroll 0" not in log and "start unroll 1" not in log and "start unroll 2" in log
    assert_same_store(Path("whole.zarr"), Path("out/attrib.zarr"))


def test_a_finished_top_k_is_not_recomputed_by_a_rerun(user_project, monkeypatch):
    project(top_k=4, full=False)
    assert trak("optimize", "opt.yaml").exit_code == 0
    res = trak("score", "opt.yaml")
    assert res.exit_code == 0, res.stderr
    shutil.copytree("out/attrib.zarr", "first.zarr")
    monkeypatch.setenv("TRAK_EVENT_LOG", str(Path("events.log").resolve()))
    res = trak("score", "opt.yaml")
    assert res.exit_code == 0, res.stderr
    assert "start unroll" not in (Path("events.log").read_text() if Path("events.log").exists() else "")
    assert_same_store(Path("first.zarr"), Path("out/attrib.zarr"))


def test_checkpoints_without_a_record_are_refused_with_the_command(user_project):
    cfg = project()
    cfg["checkpoints"] = "ckpts/model_*.pt"
    Path("glob.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    res = trak("score", "glob.yaml")
    assert res.exit_code == 1
    assert "optimize.replay=true" in res.stderr and "manifest.json" in res.stderr
    cfg["checkpoints"] = "trained/manifest.json"
    cfg["optimize"]["replay"] = False
    Path("plain.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert trak("optimize", "plain.yaml").exit_code == 0
    res = trak("score", "plain.yaml")
    assert res.exit_code == 1 and "model 0" in res.stderr and "optimize.replay=true" in res.stderr
    cfg["optimize"].update(replay=True, projection={"mode": "global", "proj_dim": 8})
    Path("proj.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    res = trak("optimize", "proj.yaml")
    assert res.exit_code == 1 and "optimize.projection" in res.stderr


def test_torchrun_two_ranks_score_as_one_process(user_project, tmp_path_factory):
    """Under torchrun each rank scores its chunks of targets (c ≡ rank mod 2), each once; the store is bit-identical
    to one process's."""
    import os
    import subprocess
    import sys

    from projects import free_port

    project(top_k=4, full=True)
    assert trak("optimize", "opt.yaml").exit_code == 0
    two = tmp_path_factory.mktemp("two")
    shutil.copytree(Path.cwd(), two, dirs_exist_ok=True)
    res = trak("score", "opt.yaml", "-q")
    assert res.exit_code == 0, res.stderr
    log = two / "events.log"
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
         "-m", "trakcli.cli.main", "score", "opt.yaml", "-q"],
        cwd=two, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TRAK_EVENT_LOG": str(log)},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    starts = sorted(line for line in log.read_text().splitlines() if line.startswith("start unroll"))
    assert starts == ["start unroll 0", "start unroll 1", "start unroll 2"]  # 7 targets, 3 a chunk: each chunk once
    assert_same_store(Path("out/attrib.zarr"), two / "out" / "attrib.zarr")


def test_report_answers_and_lds_read_unrolled_scores(user_project):
    """Everything scores go through: `trak score --out answers.jsonl`, `trak report` and `trak eval lds` (both
    retrain seeds) on an unrolled experiment."""
    cfg = project(top_k=4, full=True)
    cfg["eval"] = {"n_subsets": 4, "bootstrap": 50}
    Path("opt.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert trak("optimize", "opt.yaml").exit_code == 0
    res = trak("score", "opt.yaml", "--out", "answers.jsonl")
    assert res.exit_code == 0, res.stderr
    from trakcli.store import Store

    scores, _ = Store.open_existing("out/attrib.zarr", mode="r").read_scores("unrolled")
    answers = [json.loads(line) for line in Path("answers.jsonl").read_text().splitlines()]
    assert len(answers) == 7
    for t, answer in enumerate(answers):  # each target's first proponent: its highest unrolled score
        top = answer["proponents"][0]
        assert top["train"] == int(scores[t].argmax()) and top["score"] == pytest.approx(float(scores[t].max()))
    res = trak("report", "opt.yaml", "--out", "report.html")
    assert res.exit_code == 0, res.stderr
    assert Path("report.html").stat().st_size > 1000
    for seed in ("other", "same"):
        res = trak("eval", "lds", "opt.yaml", f"eval.retrain_seed={seed}", "--json", "--overwrite")
        assert res.exit_code == 0, res.stderr
        out = json.loads(res.stdout)
        assert out["n_subsets"] == 4 and -1 <= out["lds"] <= 1 and out["retrain_seed"] == seed, out


def test_eval_retrain_seed_replay_reruns_the_recorded_trainings_reweighted(user_project):
    """eval.retrain_seed: replay: row k is checkpoint k mod 2's recorded training rerun with the rows outside subset k
    weighted 0 (each model on its own optimize subset); refused without replay records."""
    cfg = project(full=True)
    cfg["eval"] = {"n_subsets": 3, "bootstrap": 50, "retrain_seed": "replay"}
    Path("opt.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert trak("optimize", "opt.yaml").exit_code == 0
    assert trak("score", "opt.yaml").exit_code == 0
    from trakcli.evaluation.retrain import model_outputs, retrain
    from trakcli.models.build import build_model

    data = torch.load("ckpts/data.pt")
    from trakcli.data import TensorDataset

    target = TensorDataset(data["x_target"], data["y_target"], "t")

    def check(res, overrides=()):
        entries = json.loads(Path("trained/manifest.json").read_text())["models"]
        c = load_config("opt.yaml", list(overrides))
        for k in range(3):
            e = entries[k % 2]
            sub = torch.tensor(e["subset_indices"])
            torch.manual_seed(0)
            u = Unroller(build_model(c.model.entrypoint, **c.model.kwargs), TensorRows(
                data["x_train"][sub], data["y_train"][sub]), ReplayRecord(Path("trained") / e["replay"]),
                resolve_task("classification"))
            w = torch.from_numpy(res.masks[k]).float()[sub]
            assert 0 < w.sum() < len(sub)  # some of the model's rows are dropped, some kept
            u.model.load_state_dict({**u.model.state_dict(), **u.reweighted_params(w)})
            want = model_outputs(u.model, target, "classification", batch_size=c.data.batch_size)
            np.testing.assert_array_equal(res.outputs[k], want)

    first = retrain(load_config("opt.yaml"))
    check(first)
    # retrained checkpoints: new reruns in the same process (of the new records), and the store refuses the old rows
    assert trak("optimize", "opt.yaml", "optimize.lr=0.03", "--overwrite").exit_code == 0
    with pytest.raises(StoreMismatchError, match="replay_of"):
        retrain(load_config("opt.yaml", ["optimize.lr=0.03"]))
    again = retrain(load_config("opt.yaml", ["optimize.lr=0.03"]), overwrite=True)
    check(again, ["optimize.lr=0.03"])
    assert not np.array_equal(again.outputs, first.outputs)
    assert trak("optimize", "opt.yaml", "--overwrite").exit_code == 0
    out = trak("eval", "lds", "opt.yaml", "--json", "--overwrite")
    assert out.exit_code == 0, out.stderr
    assert json.loads(out.stdout)["retrain_seed"] == "replay"
    res = trak("eval", "lds", "opt.yaml", "checkpoints=ckpts/model_*.pt", "store.path=out/other.zarr")
    assert res.exit_code == 1 and "optimize.replay=true" in res.stderr and "eval.retrain_seed: replay" in res.stderr
