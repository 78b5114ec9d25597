"""CLI conveniences: completion and help labels, the override hint of an unknown flag, `--json`, the scores
table of a language model, `trak init`."""

from __future__ import annotations

from pathlib import Path

import pytest

from projects import invoke as trak


# --- CLI: completion, help labels, --json, unknown flags ----------------------------------------------


def test_help_offers_completion_and_standard_labels():
    res = trak("--help")
    assert res.exit_code == 0 and "--install-completion" in res.output
    for command in (["score"], ["featurize"], ["eval", "lds"], ["eval", "sweep"], ["optimize"], ["export"]):
        res = trak(*command, "--help")
        assert res.exit_code == 0, res.output
        for typer_label in ("<bool>", "<path>", "<list[str]>", "{config}", "<int>"):
            assert typer_label not in res.output, (command, typer_label)
    res = trak("score", "--help")
    assert "trak score [OPTIONS] CONFIG [OVERRIDES]..." in res.output
    assert "PATH" in res.output and "n_target x n_train" in res.output


@pytest.mark.parametrize(
    "flag, hint",
    [
        (["--proj-dim", "512"], "projector.proj_dim=512"),
        (["--lambda-rel=0.5"], "score.lambda_rel=0.5"),
        (["--chunk-rows"], "store.chunk_rows=VALUE"),
    ],
)
def test_an_unknown_flag_naming_a_config_key_suggests_the_override(flag, hint):
    res = trak("score", "run.yaml", *flag)
    assert res.exit_code == 2
    assert "No such option" in res.output and hint in res.output


def test_an_unknown_flag_without_a_config_key_has_no_hint():
    res = trak("score", "run.yaml", "--bogus")
    assert res.exit_code == 2 and "No such option: --bogus" in res.output and "overrides" not in res.output


def test_score_json_prints_data_on_stdout_and_text_on_stderr(user_project):
    import json

    assert trak("featurize", "run.yaml", "-q").exit_code == 0
    res = trak("score", "run.yaml", "--json", "score.show_targets=2", "score.show_top=3")
    assert res.exit_code == 0, res.stderr
    data = json.loads(res.stdout)
    assert (data["n_target"], data["n_train"], data["experiment"]) == (7, 40, "default")
    assert len(data["lambda_reg"]) == 2 and len(data["top"]) == 2
    assert len(data["top"][0]["proponents"]) == 3 and set(data["top"][0]["proponents"][0]) == {"train", "score"}
    assert "proponents" in res.stderr  # the table stays on stderr
    quiet = trak("score", "run.yaml", "--json", "-q")
    assert quiet.exit_code == 0 and quiet.stderr == "" and json.loads(quiet.stdout)["n_train"] == 40


def test_language_model_table_shows_texts_not_labels():
    import numpy as np
    from rich.console import Console

    from trakcli.cli.score import scores_table

    class Res:
        experiment, train_labels, target_labels = "default", np.zeros(5, int), np.zeros(2, int)

    scores = np.arange(10, dtype=np.float32).reshape(2, 5)
    table = scores_table(Res(), scores, 2, ["the cat sat on the mat", "a dog barked"], labels=False)
    console = Console(width=200, record=True)
    console.print(table)
    shown = console.export_text()
    assert "the cat sat on the mat" in shown and "a dog barked" in shown
    assert "label" not in shown and "(0)" not in shown


def test_the_table_shows_no_positive_score_as_an_opponent():
    import numpy as np
    from rich.console import Console

    from trakcli.cli.score import scores_table

    class Res:
        experiment, train_labels, target_labels = "default", np.arange(4), np.zeros(2, int)

    # target 0: every score positive (a small training set); target 1: one negative score among positive ones
    scores = np.array([[0.5, 0.25, 0.125, 2.0], [0.5, -0.75, 0.125, 2.0]], dtype=np.float32)
    console = Console(width=200, record=True)
    console.print(scores_table(Res(), scores, 3, labels=True))
    rows = [line for line in console.export_text().splitlines() if "│" in line]
    opponents = [line.split("│")[4].strip() for line in rows if line.split("│")[4].strip()]
    assert opponents == ["none: no train example has a negative score", "1 (1) -0.75"]  # +0.125 is no opponent


# --- trak init ---------------------------------------------------------------------------------------


def test_init_writes_a_commented_config_that_validates(tmp_path, monkeypatch):
    from trakcli.config import load_config

    monkeypatch.chdir(tmp_path)
    res = trak("init", "--list")
    assert res.exit_code == 0 and "digits" in res.stdout and "minilm_text" in res.stdout
    res = trak("init", "digits")
    assert res.exit_code == 0, res.output
    text = Path("digits.yaml").read_text()
    assert text.startswith("#") and "trak featurize" in text  # the comments come along
    assert load_config("digits.yaml").projector.proj_dim > 0
    Path("sub").mkdir()
    assert trak("init", "digits_projected", "sub").exit_code == 0 and Path("sub/digits_projected.yaml").is_file()
    assert trak("init", "digits", "run.yaml").exit_code == 0
    copy = Path("run.yaml").read_text()
    assert "trak featurize run.yaml" in copy and "configs/digits.yaml" not in copy  # the header names the copy
    assert copy.replace("run.yaml", "digits.yaml") == text


def test_init_refuses_to_overwrite_without_force(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("run.yaml").write_text("mine\n")
    res = trak("init", "digits", "run.yaml")
    assert res.exit_code == 2 and "already exists" in res.stderr and "--force" in res.stderr
    assert Path("run.yaml").read_text() == "mine\n"
    res = trak("init", "digits", "run.yaml", "--force")
    assert res.exit_code == 0 and Path("run.yaml").read_text().startswith("#")
    assert list(tmp_path.iterdir()) == [tmp_path / "run.yaml"]  # no temporary file left behind


@pytest.mark.parametrize(
    "args, message, fix",
    [
        (["init", "nope"], "no example config named 'nope'", "digits, digits_projected, facts, facts_smollm2, minilm_text"),
        (["init"], "name an example config", "digits"),
        (["init", "digits", "missing/run.yaml"], "directory missing does not exist", "create it"),
    ],
)
def test_init_errors(tmp_path, monkeypatch, args, message, fix):
    monkeypatch.chdir(tmp_path)
    res = trak(*args)
    assert res.exit_code == 2 and message in res.stderr and fix in res.stderr
    assert list(tmp_path.iterdir()) == []




def test_progress_goes_to_a_log_as_lines_when_stderr_is_no_terminal(user_project, monkeypatch):
    from trakcli.cli import common

    monkeypatch.setattr(common, "LOG_FIRST", 0.0)  # a task of any length logs at once, then at its end
    res = trak("featurize", "run.yaml")
    assert res.exit_code == 0, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if " elapsed" in ln]
    assert lines and any("(100%)" in ln for ln in lines), res.stderr
    assert all("\r" not in ln and "━" not in ln for ln in lines)  # plain lines, no bar redrawn in place
    monkeypatch.setattr(common, "LOG_FIRST", 3600.0)  # a task shorter than the first interval logs nothing
    res = trak("featurize", "run.yaml", "--overwrite")
    assert res.exit_code == 0 and "featurized" in res.stderr, res.stderr
    assert not [ln for ln in res.stderr.splitlines() if " elapsed" in ln]
