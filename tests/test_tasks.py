"""Tasks as users write them: a :class:`trakcli.tasks.Task` subclass's identity follows its source, and
regression and multiple-choice tasks featurize, score and evaluate with no edit of trakcli."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml
import zarr

from trakcli.tasks import BUILTIN, Task, resolve_task, source_sha256
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
