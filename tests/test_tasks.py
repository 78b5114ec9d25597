"""Tasks as users write them: a :class:`trakcli.tasks.Task` subclass's identity follows its source, and
regression and multiple-choice tasks featurize, score and evaluate with no edit of trakcli."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import zarr

from trakcli.data.load import checked_dataset
from trakcli.errors import DataError
from trakcli.tasks import BUILTIN, Task, check_outputs, resolve_task, source_sha256
from projects import invoke

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
    assert BUILTIN["classification"].identity()["output_function"]["sha256"] == source_sha256(type(BUILTIN["classification"]))

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
        checked_dataset(x, torch.rand(5) + 0.1, key="data.train", name="t", task="classification")
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
