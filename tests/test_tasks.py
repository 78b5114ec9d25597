"""Tasks as users write them: a :class:`trakcli.tasks.Task` subclass's identity follows its source, and
regression and multiple-choice tasks featurize, score and evaluate with no edit of trakcli."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
import zarr

from trakcli.data.load import checked_dataset
from trakcli.errors import DataError
from trakcli.tasks import BUILTIN, Task, check_outputs, resolve_task, source_sha256
from projects import MODEL_FILE, invoke

MARGIN_TASK_FILE = '''
import torch
from trakcli.tasks import Task, classification_margin

class Margin(Task):
    formula = "margin of the class logits"

    def __call__(self, logits, batch):
        return classification_margin(logits, batch["labels"])
'''


def test_a_task_class_is_identified_by_its_source():
    class Plain(Task):
        def __call__(self, logits, batch):
            return logits[:, 0], logits[:, 0]

    ident = Plain().identity()
    assert ident["task"] == Plain.__qualname__
    assert ident["output_function"] == {"class": Plain.__qualname__, "formula": "", "sha256": source_sha256(Plain)}
    assert len(source_sha256(Plain)) == 64
    # a built-in task is identified by its formula, so stores do not depend on how trakcli's source is written
    builtin = BUILTIN["classification"]
    assert builtin.identity() == {"task": "classification", "output_function": builtin.formula}

    class Sub(Plain):  # the base's source counts: Sub alone says nothing about what it computes
        pass

    class Other(Task):
        pass

    assert source_sha256(Sub) != source_sha256(Plain) != source_sha256(Other)


def test_an_edited_task_class_is_refused_by_its_store(user_project):
    Path("my_task.py").write_text(MARGIN_TASK_FILE)
    assert invoke("featurize", "run.yaml", "task=my_task.py:Margin").exit_code == 0
    ident = zarr.open_group("out/attrib.zarr", mode="r").attrs["identity"]
    assert ident["task"] == "my_task.py:Margin" and ident["output_function"]["class"] == "Margin"
    assert invoke("score", "run.yaml", "task=my_task.py:Margin").exit_code == 0

    Path("my_task.py").write_text(MARGIN_TASK_FILE.replace("logits, batch[\"labels\"])", "2 * logits, batch[\"labels\"])"))
    assert resolve_task("my_task.py:Margin").identity()["output_function"]["sha256"] != ident["output_function"]["sha256"]
    for command in ("featurize", "score"):
        r = invoke(command, "run.yaml", "task=my_task.py:Margin")
        assert r.exit_code == 1, r.output
        assert "output_function.sha256: store has" in r.output and "Traceback" not in r.output


# --- tasks of one's own, with no edit of trakcli: regression and multiple choice ----------------------------------

REGRESSION_FILE = '''
import torch
from trakcli.errors import DataError
from trakcli.tasks import Task

class Regression(Task):
    """Squared error of one output per example: f is the output, Q = dloss/df / (2 (f - y)) = 1 (TRAK, App. E)."""

    formula = "f = output; Q = 1 (squared error)"

    def __call__(self, logits, batch):
        out = logits[:, 0]
        return out, torch.ones_like(out)

    def loss(self, logits, batch, reduction="mean"):
        return torch.nn.functional.mse_loss(logits[:, 0], batch["labels"], reduction=reduction)

    def check(self, logits, batch, row_offset=0):
        super().check(logits, batch, row_offset)
        if logits.ndim != 2 or logits.shape[1] != 1:
            raise DataError(f"task {self.name} needs one output per example, [n, 1]; got {list(logits.shape)}")
        if not batch["labels"].is_floating_point():
            raise DataError(f"task {self.name} needs float targets; got {batch['labels'].dtype}")
'''

CHOICE_FILE = '''
import torch
from torch import nn
from trakcli.errors import DataError
from trakcli.tasks import Task, classification_margin

class Scorer(nn.Module):
    """One score per choice: inputs [n, choices, d] -> [n, choices]."""

    def __init__(self, d=6, hidden=8):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.body(x).squeeze(-1)

class MultipleChoice(Task):
    """The margin of the right choice's score over the others' (labels: the right choice's index)."""

    formula = "margin of the right choice's score"
    has_accuracy = True

    def __call__(self, logits, batch):
        return classification_margin(logits, batch["labels"])

    def check(self, logits, batch, row_offset=0):
        super().check(logits, batch, row_offset)
        choices = batch["inputs"].shape[1]
        if tuple(logits.shape[1:]) != (choices,):
            raise DataError(f"task {self.name} needs one score per choice, [n, {choices}]; got {list(logits.shape)}")
'''


def _project(root: Path, data: dict, model: dict, task: str) -> None:
    torch.save(data, root / "data.pt")
    cfg = {
        "model": model,
        "task": task,
        "checkpoints": "trained/manifest.json",
        "data": {"train": {"path": "data.pt", "inputs": "x_train", "labels": "y_train"},
                 "target": {"path": "data.pt", "inputs": "x_target", "labels": "y_target"}, "batch_size": 8},
        "projector": {"kind": "rademacher", "proj_dim": 16, "seed": 0},
        "store": {"path": "out/attrib.zarr", "chunk_rows": 16},
        "optimize": {"n_models": 2, "epochs": 3, "batch_size": 8, "lr": 0.1, "out_dir": "trained"},
        "eval": {"n_subsets": 4, "bootstrap": 50},
        "num_threads": 1,
    }
    (root / "run.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))


def _featurize_score_eval() -> dict:
    """`trak optimize`, `featurize`, `score`, `eval lds --json` in the cwd: each succeeds; the LDS result."""
    for args in (["optimize", "run.yaml", "-q"], ["featurize", "run.yaml", "-q"], ["score", "run.yaml", "-q"]):
        r = invoke(*args)
        assert r.exit_code == 0, r.output
    r = invoke("eval", "lds", "run.yaml", "--json", "-q")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_a_regression_task_featurizes_scores_and_evaluates(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_model.py").write_text(MODEL_FILE)
    (tmp_path / "reg.py").write_text(REGRESSION_FILE)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, generator=g)
    x_train, x_target = torch.randn(40, 6, generator=g), torch.randn(7, 6, generator=g)
    data = {"x_train": x_train, "y_train": x_train @ w + 0.1 * torch.randn(40, generator=g),
            "x_target": x_target, "y_target": x_target @ w}
    _project(tmp_path, data, {"entrypoint": "my_model.py:make_model", "kwargs": {"num_classes": 1}},
             "reg.py:Regression")
    result = _featurize_score_eval()
    assert result["n_subsets"] == 4 and result["n_target"] == 7 and np.isfinite(result["lds"])
    # the float targets reach the task as they are: the retrained models' outputs are the regression's f
    outputs = np.asarray(zarr.open_group("out/attrib.zarr/eval", mode="r")["outputs"][:])
    assert outputs.shape == (4, 7) and np.isfinite(outputs).all()
    assert np.asarray(zarr.open_group("out/attrib.zarr", mode="r")["scores/default/scores"][:]).shape == (7, 40)
    # training minimized the task's own loss (mean squared error; no accuracy for a regression)
    metrics = json.loads(Path("trained/manifest.json").read_text())["models"][0]
    assert "train_accuracy" not in metrics["metrics"] and np.isfinite(metrics["metrics"]["final_loss"]), metrics
    # integer targets are refused by the task's own check, naming it
    torch.save({**data, "y_train": data["y_train"].round().long()}, "data.pt")
    r = invoke("featurize", "run.yaml", "store.path=out/int.zarr")
    assert r.exit_code == 1 and "task reg.py:Regression needs float targets; got torch.int64" in r.output


def test_a_multiple_choice_task_featurizes_scores_and_evaluates(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "choice.py").write_text(CHOICE_FILE)
    g = torch.Generator().manual_seed(0)
    data = {"x_train": torch.randn(40, 4, 6, generator=g), "y_train": torch.randint(0, 4, (40,), generator=g),
            "x_target": torch.randn(7, 4, 6, generator=g), "y_target": torch.randint(0, 4, (7,), generator=g)}
    _project(tmp_path, data, {"entrypoint": "choice.py:Scorer"}, "choice.py:MultipleChoice")
    result = _featurize_score_eval()
    assert result["n_subsets"] == 4 and result["n_target"] == 7 and np.isfinite(result["lds"])
    ident = zarr.open_group("out/attrib.zarr", mode="r").attrs["identity"]
    assert ident["task"] == "choice.py:MultipleChoice" and ident["train_data"]["input_shape"] == [4, 6]
    # the task's accuracy (the right choice scored highest) is what training reports
    metrics = json.loads(Path("trained/manifest.json").read_text())["models"][0]
    assert 0.0 <= metrics["metrics"]["train_accuracy"] <= 1.0, metrics


# --- labels: the task reads and checks them --------------------------------------------------------------------------


class _Own(Task):
    def __call__(self, logits, batch):
        return logits[:, 0], logits[:, 0]


def test_labels_of_any_shape_pass_to_a_task_of_ones_own():
    x = torch.randn(5, 3)
    y = torch.randn(5, 2, dtype=torch.float64)
    ds = checked_dataset(x, y, key="data.train", name="t", task=_Own())
    assert ds.labels.dtype == torch.float32 and ds.labels.shape == (5, 2)
    torch.testing.assert_close(ds.labels, y.float())
    ints = checked_dataset(x, torch.arange(5, dtype=torch.int32).reshape(5, 1), key="k", name="t", task=_Own())
    assert ints.labels.dtype == torch.int64 and ints.labels.shape == (5, 1)
    with pytest.raises(DataError, match=r"data.train: labels must have one row per example, \[n, ...\] with n = 5, "
                                        r"got shape \[\]"):
        checked_dataset(x, torch.tensor(1.0), key="data.train", name="t", task=_Own())
    with pytest.raises(DataError, match="data.train: labels must be numbers, got strings"):
        checked_dataset(x, ["a"] * 5, key="data.train", name="t", task=_Own())


def test_the_builtin_tasks_keep_class_indices():
    x = torch.randn(5, 3)
    with pytest.raises(DataError, match="data.train: labels must be integer class indices, got non-integer floats"):
        checked_dataset(x, torch.rand(5) + 0.1, key="data.train", name="t", task=BUILTIN["classification"])
    with pytest.raises(DataError, match=r"labels must be 1-D class indices with one per row \(5\), got shape \[5, 2\]"):
        checked_dataset(x, torch.zeros(5, 2, dtype=torch.long), key="data.train", name="t")
    one_column = checked_dataset(x, torch.tensor([[0], [1], [2], [1], [0]]), key="k", name="t")
    assert one_column.labels.tolist() == [0, 1, 2, 1, 0]  # [n, 1] class indices are [n]
    with pytest.raises(DataError, match="task classification needs integer class labels"):
        BUILTIN["classification"].check(torch.zeros(2, 3), {"inputs": x[:2], "labels": torch.zeros(2)})


def test_every_task_has_its_outputs_checked():
    batch = {"inputs": torch.zeros(3, 2), "labels": torch.zeros(3)}
    logits = torch.zeros(3, 1)
    with pytest.raises(DataError, match=r"task _Own must return \(f, Q\), two tensors of shape \[n\]"):
        check_outputs(_Own(), (torch.zeros(3, 1), torch.zeros(3)), logits, batch)
    with pytest.raises(DataError, match=r"task _Own returned non-finite Q for examples \[12\]"):
        check_outputs(_Own(), (torch.zeros(3), torch.tensor([0.0, 0.0, float("inf")])), logits, batch, row_offset=10)
    with pytest.raises(DataError, match="task classification must return"):
        check_outputs(BUILTIN["classification"], (torch.zeros(3),), logits, batch)


def test_the_config_knows_the_builtin_tasks_labels_as_the_tasks_do():
    from trakcli.config.schema import BUILTIN_TASK_LABELS

    assert set(BUILTIN_TASK_LABELS) == set(BUILTIN)
    for name, task in BUILTIN.items():
        assert BUILTIN_TASK_LABELS[name] == ("tokens" if task.token_level else "classes"), name
    # the built-in losses are methods of their classes: a language model's is the next-token cross-entropy
    logits, ids = torch.randn(2, 4, 5), torch.tensor([[1, 2, 3, -100], [4, 0, 2, 1]])
    lm = BUILTIN["language_modeling"]
    batch = {"input_ids": ids.clamp(min=0), "labels": ids}
    want = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 5), ids[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(lm.loss(logits, batch), want)
    assert lm.loss_count(batch) == 5 and BUILTIN["classification"].loss_count({"labels": torch.zeros(3)}) == 3


def test_the_built_in_tasks_are_the_configs_names():
    from trakcli.config.schema import BUILTIN_TASKS
    from trakcli.tasks import BUILTIN

    assert tuple(BUILTIN) == BUILTIN_TASKS
