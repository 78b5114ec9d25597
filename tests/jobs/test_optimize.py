"""`trak optimize`'s manifest (written per finished model, read by featurize), validation history, live progress."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from rich.console import Console

from projects import arrays, tiny_model
from projects import invoke as trak
from trakcli.config import load_config
from trakcli.jobs.inputs import resolve_checkpoints
from trakcli.errors import ConfigError
from trakcli.models import file_sha256
from trakcli.progress import Reporter, Task


def project(name: str = "opt.yaml", *, validation: bool = False, **recipe) -> dict:
    """The user_project config with a small training recipe writing to trained/ (checkpoints: its manifest)."""
    cfg = yaml.safe_load(Path("run.yaml").read_text())
    cfg["checkpoints"] = "trained/manifest.json"
    cfg["num_threads"] = 1
    train = {"n_models": 2, "epochs": 3, "batch_size": 8, "seed": 5, "out_dir": "trained", **recipe}
    cfg["optimize"] = {"optimizer": "sgd", "lr": 0.1, **train}
    if validation:
        cfg["data"]["validation"] = {"path": "ckpts/data.pt", "inputs": "x_target", "labels": "y_target"}
    Path(name).write_text(yaml.safe_dump(cfg, sort_keys=False))
    return cfg


def manifest(out_dir: str = "trained") -> dict:
    return json.loads((Path(out_dir) / "manifest.json").read_text())


# ----------------------------------------------------------------------------
# the manifest


def test_manifest_records_the_run_and_featurize_reads_it_like_the_glob(user_project):
    project(subset_fraction=0.5, metrics="metrics.json")
    res = trak("optimize", "opt.yaml")
    assert res.exit_code == 0, res.stderr
    assert "manifest -> trained/manifest.json" in res.stderr
    m = manifest()
    assert m["format"] == "trakcli.optimize.manifest" and m["n_models"] == 2 and m["complete"] is True
    assert m["model"] == {"entrypoint": "my_model.py:make_model", "kwargs": {}}
    # the recipe: the optimize: section
    assert set(m["recipe"]) == {"optimize"} and m["recipe"]["optimize"]["lr"] == 0.1
    assert m["recipe"]["optimize"]["optimizer"] == "sgd" and m["recipe"]["optimize"]["subset_fraction"] == 0.5
    models = m["models"]
    assert [e["model_id"] for e in models] == [0, 1] and [e["seed"] for e in models] == [5, 6]
    for e in models:
        assert e["checkpoint"] == f"model_{e['model_id']:03d}.pt"  # relative to the manifest's directory
        assert e["sha256"] == file_sha256(Path("trained") / e["checkpoint"])
        sub = e["subset_indices"]
        assert len(sub) == 20 and sub == sorted(set(sub)) and 0 <= sub[0] and sub[-1] < 40
        met = e["metrics"]
        assert [h["epoch"] for h in met["history"]] == [1, 2, 3]
        assert met["history"][-1]["loss"] == met["final_loss"] > 0
        assert 0 <= met["train_accuracy"] <= 1 and 0 <= met["target_accuracy"] <= 1
        assert met["optimizer_state_numel"] == 8 * 6 + 8 + 3 * 8 + 3  # SGD momentum: one float per parameter
    assert models[0]["subset_indices"] != models[1]["subset_indices"]
    # the metrics JSON: the same recipe sections and per-model metrics, flat
    metrics = json.loads(Path("metrics.json").read_text())
    assert {k: metrics[k] for k in m["recipe"]} == m["recipe"] and "optimize" in metrics
    assert [r["history"] for r in metrics["models"]] == [e["metrics"]["history"] for e in models]
    assert [r["subset_indices"] for r in metrics["models"]] == [e["subset_indices"] for e in models]
    # the manifest resolves to the checkpoints of the glob, in model_id order, from any working directory
    loaded = load_config("opt.yaml")
    assert resolve_checkpoints(loaded) == sorted(Path("trained").glob("model_*.pt"))
    # featurize through the manifest == featurize through the glob
    assert trak("featurize", "opt.yaml", "-q", "store.path=out/m.zarr").exit_code == 0
    res = trak("featurize", "opt.yaml", "-q", "store.path=out/g.zarr", "checkpoints=trained/model_*.pt")
    assert res.exit_code == 0, res.stderr
    a, b = arrays("out/m.zarr"), arrays("out/g.zarr")
    assert sorted(a) == sorted(b) and any(k.endswith("features") for k in a)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_manifest_errors_name_the_problem_and_the_fix(user_project):
    project()
    res = trak("featurize", "opt.yaml")
    assert res.exit_code == 1
    assert "manifest 'trained/manifest.json' does not exist; run `trak optimize CONFIG`" in res.stderr
    assert trak("optimize", "opt.yaml", "-q").exit_code == 0
    cfg = load_config("opt.yaml")
    resolve_checkpoints(cfg)  # fine as written

    # a checkpoint changed since trak optimize wrote the manifest
    good = Path("trained/model_001.pt").read_bytes()
    torch.save(tiny_model(seed=9).state_dict(), "trained/model_001.pt")
    res = trak("featurize", "opt.yaml")
    assert res.exit_code == 1
    assert "checkpoint 'trained/model_001.pt' (model 1) changed since trak optimize wrote the manifest" in res.stderr
    assert "rerun `trak optimize CONFIG`" in res.stderr
    # a missing one
    Path("trained/model_001.pt").unlink()
    with pytest.raises(ConfigError, match=r"checkpoint 'trained/model_001.pt' \(model 1\) .* does not exist"):
        resolve_checkpoints(cfg)
    Path("trained/model_001.pt").write_bytes(good)
    resolve_checkpoints(cfg)

    # the config asks for more models than the manifest lists
    with pytest.raises(ConfigError, match="lists 2 models but optimize.n_models is 3; run `trak optimize CONFIG`"):
        resolve_checkpoints(load_config("opt.yaml", ["optimize.n_models=3"]))
    # ... which only matters for the manifest of the config's own out_dir
    assert len(resolve_checkpoints(load_config("opt.yaml", ["optimize.n_models=3", "optimize.out_dir=other"]))) == 2

    # not a manifest, damaged, unreadable
    text = Path("trained/manifest.json").read_text()
    Path("trained/manifest.json").write_text(json.dumps({"models": []}))
    with pytest.raises(ConfigError, match="is not a manifest of `trak optimize`"):
        resolve_checkpoints(cfg)
    Path("trained/manifest.json").write_text(text.replace('"model_id": 1', '"model_id": 7'))
    with pytest.raises(ConfigError, match="is damaged"):
        resolve_checkpoints(cfg)
    Path("trained/manifest.json").write_text(text[:50])
    with pytest.raises(ConfigError, match="cannot read the manifest"):
        resolve_checkpoints(cfg)
    Path("trained/manifest.json").write_text(text)

    # rerunning optimize keeps its models, and records a replaced file as it is now
    torch.save(tiny_model(seed=9).state_dict(), "trained/model_001.pt")
    res = trak("optimize", "opt.yaml")
    assert res.exit_code == 0, res.stderr
    assert "trained/model_000.pt exists, kept" in res.stderr
    assert "trained/model_001.pt exists (changed since the manifest was written): kept and recorded" in res.stderr
    m = manifest()
    assert m["complete"] and m["models"][0]["origin"] == "trained" and "history" in m["models"][0]["metrics"]
    assert m["models"][1]["origin"] == "found" and "history" not in m["models"][1]["metrics"]
    assert m["models"][1]["sha256"] == file_sha256("trained/model_001.pt")
    assert resolve_checkpoints(cfg)[1] == Path("trained/model_001.pt")


def test_rerun_with_another_recipe_is_refused_and_more_models_extend_the_run(user_project):
    project()
    assert trak("optimize", "opt.yaml", "-q").exit_code == 0
    first = manifest()
    res = trak("optimize", "opt.yaml", "optimize.lr=0.2", "optimize.seed=1")
    assert res.exit_code == 1
    msg = "'trained' holds models that trak optimize trained differently (its manifest differs in: lr, seed)"
    assert msg in res.stderr
    assert "--overwrite" in res.stderr
    assert manifest() == first  # untouched
    # the same recipe with a run-only key changed (metrics) trained the same models: kept
    project("same.yaml", metrics="same.json")
    res = trak("optimize", "same.yaml")
    assert res.exit_code == 0, res.stderr
    assert res.stderr.count("exists, kept") == 2
    assert manifest()["models"] == first["models"] and manifest()["recipe"]["optimize"]["metrics"] == "same.json"
    # more models: the finished ones are kept with their records, the new one is trained
    res = trak("optimize", "opt.yaml", "optimize.n_models=3", "optimize.checkpoint_every=2")
    assert res.exit_code == 0, res.stderr
    m = manifest()
    assert m["n_models"] == 3 and m["complete"] and m["models"][:2] == first["models"]
    assert m["models"][2]["seed"] == 7 and m["models"][2]["origin"] == "trained"
    # --overwrite retrains with the new recipe
    res = trak("optimize", "opt.yaml", "optimize.lr=0.2", "--overwrite", "-q")
    assert res.exit_code == 0, res.stderr
    m = manifest()
    assert m["recipe"]["optimize"]["lr"] == 0.2 and m["models"][0]["sha256"] != first["models"][0]["sha256"]


def _kill_after_model(cwd: Path, args: list[str], log: Path, finished: int, state: Path) -> None:
    """Run `trak ARGS`; SIGKILL it once `finished` models are in the manifest and the next one saved a state."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "trakcli.cli.main", *args], cwd=cwd,
        env={**os.environ, "TRAK_EVENT_LOG": str(log)}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    try:
        while proc.poll() is None and time.time() < deadline:
            if log.exists() and f"manifest {finished - 1}\n" in log.read_text() and state.exists():
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.002)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"not killed (exit {proc.returncode})"


def test_killed_optimize_leaves_a_manifest_of_its_finished_models(user_project, tmp_path):
    recipe = {"n_models": 3, "epochs": 150, "checkpoint_every": 7}
    project(validation=True, **recipe)
    _kill_after_model(
        user_project, ["optimize", "opt.yaml", "-q"], tmp_path / "events.log", 1,
        user_project / "trained" / ".resume" / "model_001.pt",
    )
    m = manifest()
    assert [e["model_id"] for e in m["models"]] == [0] and m["complete"] is False and m["n_models"] == 3
    assert m["models"][0]["sha256"] == file_sha256("trained/model_000.pt")
    assert Path("trained/.resume/model_001.pt").exists()
    res = trak("featurize", "opt.yaml")
    assert res.exit_code == 1
    assert "lists 1 of the 3 models of its run: `trak optimize` did not finish" in res.stderr
    assert "rerun `trak optimize CONFIG`" in res.stderr
    # the rerun resumes model 1 from its training state and finishes the run
    res = trak("optimize", "opt.yaml")
    assert res.exit_code == 0, res.stderr
    assert "model 1: resuming from" in res.stderr
    resumed = manifest()
    assert resumed["complete"] and resumed["models"][0] == m["models"][0]
    # everything, checkpoints and per-epoch histories, as an uninterrupted run has it
    project("ref.yaml", validation=True, **recipe, out_dir="ref")
    assert trak("optimize", "ref.yaml", "-q").exit_code == 0
    ref = manifest("ref")
    assert [e["sha256"] for e in resumed["models"]] == [e["sha256"] for e in ref["models"]]
    assert [e["metrics"] for e in resumed["models"]] == [e["metrics"] for e in ref["models"]]
    assert len(ref["models"][1]["metrics"]["history"]) == 150
    assert trak("featurize", "opt.yaml", "-q").exit_code == 0


# ----------------------------------------------------------------------------
# validation data


def test_validation_history_per_epoch_and_training_unchanged(user_project):
    project(validation=True, metrics="metrics.json")
    res = trak("optimize", "opt.yaml")
    assert res.exit_code == 0, res.stderr
    assert "validation accuracy" in res.stderr
    with_val = manifest()
    x, y = (torch.load("ckpts/data.pt")[k] for k in ("x_target", "y_target"))
    for e in with_val["models"]:
        met = e["metrics"]
        assert [set(h) for h in met["history"]] == [{"epoch", "loss", "accuracy", "val_loss", "val_accuracy"}] * 3
        # the last epoch's validation numbers are the saved model's on data.validation
        model = tiny_model()
        model.load_state_dict(torch.load(Path("trained") / e["checkpoint"], weights_only=True))
        with torch.no_grad():
            logits = model(x)
        assert met["history"][-1]["val_accuracy"] == pytest.approx((logits.argmax(1) == y).float().mean().item())
        assert met["history"][-1]["val_loss"] == pytest.approx(torch.nn.functional.cross_entropy(logits, y).item())
        assert met["validation_accuracy"] == met["history"][-1]["val_accuracy"]
    assert with_val["validation_data"]["n"] == 7
    rows = json.loads(Path("metrics.json").read_text())
    assert rows["optimize"]["lr"] == 0.1 and rows["models"][0]["history"] == with_val["models"][0]["metrics"]["history"]
    # without data.validation: no validation numbers, and the same checkpoints
    project(out_dir="plain")
    assert trak("optimize", "opt.yaml", "-q").exit_code == 0
    plain = manifest("plain")
    assert plain["validation_data"] is None
    assert [set(h) for h in plain["models"][0]["metrics"]["history"]] == [{"epoch", "loss", "accuracy"}] * 3
    assert [e["sha256"] for e in plain["models"]] == [e["sha256"] for e in with_val["models"]]
    # featurize ignores data.validation (its file need not even exist)
    project("val.yaml", validation=True, out_dir="plain")
    res = trak("featurize", "val.yaml", "-q", "data.validation.path=nope.pt")
    assert res.exit_code == 0, res.stderr
    res = trak("optimize", "val.yaml", "data.validation.path=nope.pt")
    assert res.exit_code == 1 and "data.validation.path: file 'nope.pt' does not exist" in res.stderr


# ----------------------------------------------------------------------------
# live progress fields


class RecordingTask(Task):
    def __init__(self, log: list):
        self.log = log

    def update(self, **fields) -> None:
        self.log.append(fields)


class RecordingReporter(Reporter):
    def __init__(self):
        self.updates: dict[str, list] = {}

    @contextmanager
    def task(self, description, total):
        yield RecordingTask(self.updates.setdefault(description, []))


def test_training_shows_running_loss_and_accuracy_and_validation():
    from trakcli.train import Recipe, TensorRows, Trainer

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(30, 6, generator=g), torch.randint(0, 3, (30,), generator=g)
    xv, yv = torch.randn(9, 6, generator=g), torch.randint(0, 3, (9,), generator=g)
    rep = RecordingReporter()
    trainer = Trainer(tiny_model(), TensorRows(x, y), Recipe(epochs=2, batch_size=8, lr=0.1), validation=(xv, yv))
    trainer.fit(reporter=rep, description="m")
    stats = trainer.metrics()
    log = rep.updates["m"]
    steps = [u for u in log if "loss" in u]
    assert len(steps) == 2 * 4  # one per minibatch: 4 per epoch
    assert all(set(u) == {"loss", "acc"} for u in steps)
    assert steps[-1]["loss"] == pytest.approx(stats["final_loss"])  # the epoch's running mean, at its end
    assert steps[-1]["acc"] == stats["history"][-1]["accuracy"] and steps[3]["acc"] == stats["history"][0]["accuracy"]
    vals = [u for u in log if "val_acc" in u]
    assert [v["val_acc"] for v in vals] == [h["val_accuracy"] for h in stats["history"]]
    assert [v["val_loss"] for v in vals] == [h["val_loss"] for h in stats["history"]]


def test_rich_reporter_renders_task_fields(monkeypatch, user_project):
    import trakcli.cli.common as common

    buf = io.StringIO()
    monkeypatch.setattr(common, "err_console", Console(file=buf, force_terminal=True, width=160))
    with common.RichReporter().task("train model 0", 3) as task:
        task.update(loss=0.123456, acc=0.5)
        task.update(val_acc=0.75, note="[x]")
        task.update(loss=0.25)
        task.advance()
    out = buf.getvalue()
    assert "loss 0.25  acc 0.5  val_acc 0.75  note [x]" in out
    # the whole command, drawing to a terminal under CliRunner
    monkeypatch.setattr(common, "err_console", Console(stderr=True, force_terminal=True, width=200))
    project(validation=True)
    res = trak("optimize", "opt.yaml")
    assert res.exit_code == 0, res.stderr
    assert "model 1: loss" in res.stderr and "manifest -> trained/manifest.json" in res.stderr


class StepRecorder(Reporter):
    """Keeps each task's total, its steps advanced and its updates."""

    def __init__(self):
        self.totals: dict[str, int] = {}
        self.done: dict[str, int] = {}
        self.updates: list[dict] = []

    @contextmanager
    def task(self, description, total):
        self.totals[description], self.done[description] = total, 0
        rec = self

        class Steps(Task):
            def advance(self, n=1):
                rec.done[description] += n

            def update(self, **fields):
                rec.updates.append(fields)

        yield Steps()


def test_training_progress_counts_optimizer_steps_and_shows_the_epoch():
    from trakcli.train import Recipe, TensorRows, Trainer

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(30, 6, generator=g), torch.randint(0, 3, (30,), generator=g)
    rep = StepRecorder()
    Trainer(tiny_model(), TensorRows(x, y), Recipe(epochs=3, batch_size=8, lr=0.1)).fit(reporter=rep, description="m")
    assert rep.totals == {"m": 3 * 4} and rep.done == {"m": 3 * 4}  # 4 minibatches an epoch, not 3 epochs
    assert [u["epoch"] for u in rep.updates if "epoch" in u] == ["1/3", "2/3", "3/3"]


def test_a_resumed_training_counts_the_steps_it_had_done(tmp_path):
    from trakcli.train import Recipe, TensorRows, Trainer

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(30, 6, generator=g), torch.randint(0, 3, (30,), generator=g)
    state = tmp_path / "state.pt"
    recipe = Recipe(epochs=2, batch_size=8, lr=0.1)

    def killed(epoch, model, opt):
        if epoch == 2:
            raise KeyboardInterrupt  # after epoch 1's state was saved

    with pytest.raises(KeyboardInterrupt):
        Trainer(tiny_model(), TensorRows(x, y), recipe).fit(resume_path=state, epoch_end=killed)
    rep = StepRecorder()
    Trainer(tiny_model(), TensorRows(x, y), recipe).fit(reporter=rep, description="m", resume_path=state)
    assert rep.totals == {"m": 8} and rep.done == {"m": 8}  # epoch 1's 4 steps at once, then epoch 2's
    assert [u["epoch"] for u in rep.updates if "epoch" in u] == ["2/2"]


def test_trak_optimize_logs_steps_with_the_epoch(user_project, monkeypatch):
    from trakcli.cli import common

    monkeypatch.setattr(common, "LOG_FIRST", 0.0)  # a task of any length logs at once, then at its end
    project(n_models=1)
    res = trak("optimize", "opt.yaml")
    assert res.exit_code == 0, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("train model 0:")]
    # 40 rows in batches of 8: 5 steps an epoch, 3 epochs
    assert lines and lines[-1].startswith("train model 0: 15/15 (100%)") and "epoch 3/3" in lines[-1], res.stderr
