"""Warnings of other libraries (torch, numpy, peft) go to the debug log during a command, not to stderr.

The user's own ``warnings.warn`` still reaches stderr, and ``TRAK_DEBUG=1`` shows every warning. The stderr checks
run `trak` in a fresh process: pytest records warnings itself, and Python shows a warning once per place.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from projects import MODEL_FILE, make_project, run, run_subprocess, write_config, write_jsonl

#: make_model as a user writes it, calling code of torch and numpy that warns, and warning itself.
WARNING_MODEL_FILE = MODEL_FILE.replace("def make_model(in_dim=6, hidden=8, num_classes=3):\n", '''
import warnings

import numpy as np


def make_model(in_dim=6, hidden=8, num_classes=3):
    torch.nn.functional.softmax(torch.zeros(2, 3))  # torch: "Implicit dimension choice", pointed at this line
    np.mean(np.zeros(0))  # numpy: "Mean of empty slice"
    warnings.warn("the user's own note from make_model")
''')

LIBRARY_WORDS = ("Implicit dimension choice for softmax", "Mean of empty slice")


def _project(root: Path) -> Path:
    make_project(root, n_models=1)
    (root / "my_model.py").write_text(WARNING_MODEL_FILE)
    return root


def test_library_warnings_stay_off_stderr_and_the_users_own_reach_it(tmp_path):
    root = _project(tmp_path / "p")
    res = run_subprocess(root, "featurize", "run.yaml", "-q")
    assert res.returncode == 0, res.stderr
    for words in LIBRARY_WORDS:
        assert words not in res.stderr, res.stderr
    assert "UserWarning: the user's own note from make_model" in res.stderr
    # TRAK_DEBUG=1: every warning, as Python shows them
    res = run_subprocess(root, "featurize", "run.yaml", "-q", "--overwrite", env={"TRAK_DEBUG": "1"})
    assert res.returncode == 0, res.stderr
    for words in (*LIBRARY_WORDS, "the user's own note"):
        assert words in res.stderr, (words, res.stderr)


@pytest.mark.filterwarnings("ignore:the user's own note:UserWarning")  # pytest's summary would show it
@pytest.mark.filterwarnings("always")
def test_library_warnings_go_to_the_debug_log(tmp_path, caplog):
    root = _project(tmp_path / "p")
    with caplog.at_level(logging.DEBUG, logger="trakcli.warnings"):
        res = run(root, "featurize", "run.yaml", "-q")
    assert res.returncode == 0, res.stderr
    logged = [r for r in caplog.records if r.name == "trakcli.warnings"]
    assert all(r.levelno == logging.DEBUG for r in logged)
    text = "\n".join(r.getMessage() for r in logged)
    assert "UserWarning: Implicit dimension choice for softmax" in text and "my_model.py" in text, text
    assert "RuntimeWarning: Mean of empty slice" in text, text
    assert "the user's own note" not in text


def test_peft_fan_in_fan_out_warning_of_lora_on_gpt2_stays_off_stderr(tmp_path):
    """The issue's case: `trak optimize` adds LoRA adapters to GPT-2's Conv1D attention, which peft warns about."""
    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    from projects import TOKEN_VOCAB, tiny_gpt2, word_tokenizer

    tiny_gpt2().save_pretrained(str(tmp_path / "base"))
    word_tokenizer(tmp_path / "base", ["a", "b"])
    g = torch.Generator().manual_seed(0)
    rows = [{"ids": torch.randint(3, TOKEN_VOCAB, (8,), generator=g).tolist()} for _ in range(6)]
    for row in rows:
        row["labels"] = row["ids"]
    write_jsonl(tmp_path / "rows.jsonl", rows)
    data = {"path": "rows.jsonl", "input_ids": "ids", "labels": "labels", "max_length": 8}
    write_config(tmp_path / "run.yaml", {
        "model": {"entrypoint": "hf:base", "kwargs": {"model_class": "causal_lm"}}, "task": "language_modeling",
        "checkpoints": "out/manifest.json", "data": {"train": data, "target": data, "batch_size": 3},
        "optimize": {"n_models": 1, "out_dir": "out", "epochs": 1, "batch_size": 3, "optimizer": "adamw",
                     "lr": 0.01, "lora": {"r": 2, "target_modules": ["c_attn"]}},
        "projector": {"kind": "noop"}, "store": {"path": "s.zarr", "chunk_rows": 3}, "num_threads": 1,
    })
    res = run_subprocess(tmp_path, "optimize", "run.yaml", "-q")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "out" / "model_000" / "adapter_config.json").is_file()
    assert "fan_in_fan_out" not in res.stderr and "Warning" not in res.stderr, res.stderr


def test_library_warnings_of_eval_worker_processes_stay_off_stderr(tmp_path):
    """`trak eval lds --workers 2`: each worker builds the model (torch and numpy warn) as the main process does."""
    import yaml

    root = _project(tmp_path / "p")
    cfg = yaml.safe_load((root / "run.yaml").read_text())
    cfg["optimize"] = {"epochs": 1, "batch_size": 64, "lr": 0.1, "optimizer": "sgd"}
    cfg["eval"] = {"n_subsets": 2, "bootstrap": 20}
    write_config(root / "run.yaml", cfg)
    res = run_subprocess(root, "eval", "lds", "run.yaml", "--workers", "2", "-q")
    # no scores in this store: the models are retrained, then the LDS is refused
    assert res.returncode == 1 and "retrained models are kept" in res.stderr, res.stderr
    assert (root / "out" / "attrib.zarr" / "eval").is_dir()
    for words in LIBRARY_WORDS:
        assert words not in res.stderr, res.stderr
    # the workers' own warnings from make_model still reach stderr: the check can fail
    assert res.stderr.count("UserWarning: the user's own note from make_model") >= 2, res.stderr
