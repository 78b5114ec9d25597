from pathlib import Path

import pytest

from trakcli.config.load import load_config, parse_overrides
from trakcli.jobs.inputs import check_files, resolve_checkpoints
from trakcli.errors import ConfigError

from projects import ROOT


BASE = {
    "checkpoints": "ckpts/*.pt",
    "data": {"train": {"builtin": "digits", "split": "train"}},
    "store": "out/s.zarr",
}


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    cfg = load_config(path)
    assert cfg.store.path.suffix == ".zarr"


def test_overrides_are_parsed_as_yaml_and_nested():
    extra, problems = parse_overrides(["projector.proj_dim=512", "grad_wrt=[a, b]", "score.lambda_reg=3e-4"])
    assert problems == []
    assert extra == {"projector": {"proj_dim": 512}, "grad_wrt": ["a", "b"], "score": {"lambda_reg": "3e-4"}}


def test_override_applies_and_scientific_string_is_coerced():
    cfg = load_config(BASE, ["projector.proj_dim=512", "score.lambda_reg=3e-4", "store.chunk_rows=64"])
    assert cfg.projector.proj_dim == 512
    assert cfg.score.lambda_reg == pytest.approx(3e-4)
    assert cfg.store.path == Path("out/s.zarr") and cfg.store.chunk_rows == 64


def test_all_problems_reported_at_once_with_dotted_keys_and_did_you_mean():
    with pytest.raises(ConfigError) as e:
        load_config(BASE, ["projectr.proj_dim=3", "data.batch_size=many", "score.lambda_rell=1", "badoverride"])
    msg = str(e.value)
    assert "override 'badoverride': expected key=value" in msg
    assert "projectr: unknown key; did you mean projector?" in msg
    assert "data.batch_size:" in msg and "integer" in msg
    assert "score.lambda_rell: unknown key; did you mean score.lambda_rel?" in msg
    assert len(e.value.problems) == 4


def test_missing_required_keys_and_bad_dataset():
    with pytest.raises(ConfigError) as e:
        load_config({"data": {"train": {"builtin": "digits"}}})
    msg = str(e.value)
    assert "checkpoints: required key is missing" in msg
    assert "store: required key is missing" in msg
    assert "split" in msg


def test_proj_dim_must_be_positive_integer():
    for bad in ("0", "-3", "2.5", "abc"):
        with pytest.raises(ConfigError, match="projector.proj_dim"):
            load_config(BASE, [f"projector.proj_dim={bad}"])


def test_yaml_boolean_trap_is_a_type_error():
    # PyYAML reads `no` as False: a string key must not silently accept it
    with pytest.raises(ConfigError, match="score.experiment"):
        load_config(BASE, ["score.experiment=no"])


def test_missing_files_all_reported(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(
        {
            "model": {"entrypoint": "nope.py:make"},
            "checkpoints": "ckpts/*.pt",
            "data": {"train": {"path": "d.pt", "inputs": "x", "labels": "y"}},
            "store": "s.zarr",
        }
    )
    with pytest.raises(ConfigError) as e:
        check_files(cfg, need_target=True)
    msg = str(e.value)
    assert "checkpoints: no file matches 'ckpts/*.pt'" in msg
    assert "data.train.path: file 'd.pt' does not exist" in msg
    assert "data.target: required to score" in msg
    assert "model.entrypoint: file 'nope.py' does not exist" in msg


def test_checkpoint_glob_sorted_and_list_keeps_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for n in ("b.pt", "a.pt", "c.pt"):
        (tmp_path / n).write_bytes(b"x")
    cfg = load_config({**BASE, "checkpoints": "*.pt"})
    assert [p.name for p in resolve_checkpoints(cfg)] == ["a.pt", "b.pt", "c.pt"]
    cfg = load_config({**BASE, "checkpoints": ["c.pt", "a.pt"]})
    assert [p.name for p in resolve_checkpoints(cfg)] == ["c.pt", "a.pt"]


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must be a YAML mapping"):
        load_config(lst)


def test_the_recipe_is_the_optimize_section_and_round_trips():
    """cfg.recipe is ``optimize:``; --print-config output loads back to the same config."""
    from trakcli.config.recipe import RUN_ONLY_KEYS, recipe_identity
    from trakcli.config.schema import Config

    base = {"checkpoints": "c/*.pt", "data": {"train": {"builtin": "digits", "split": "train"}}, "store": "s.zarr"}
    cfg = load_config({**base, "optimize": {"out_dir": "o", "optimizer": "adamw", "lr": 1e-3, "n_models": 2}})
    assert cfg.recipe == cfg.optimize and cfg.recipe.optimizer == "adamw"
    assert Config.model_validate(cfg.resolved()).resolved() == cfg.resolved()
    # n_models is run-only: more models of the same recipe train the same models
    more = load_config({**base, "optimize": {"out_dir": "o", "optimizer": "adamw", "lr": 1e-3, "n_models": 3}})
    assert recipe_identity(more.recipe) == recipe_identity(cfg.recipe) == recipe_identity(cfg.resolved()["optimize"])
    assert "n_models" in RUN_ONLY_KEYS and "n_models" not in recipe_identity(cfg.recipe)
    slower = load_config({**base, "optimize": {"out_dir": "o", "optimizer": "adamw", "lr": 1e-4}})
    assert recipe_identity(slower.recipe) != recipe_identity(cfg.recipe)
    assert load_config(base).recipe is None
    # out_dir is for trak optimize's checkpoints; trak eval's retraining writes nothing there
    assert load_config({**base, "optimize": {"entrypoint": "train.py:fn"}}).optimize.out_dir is None


@pytest.mark.parametrize("section, fix", [
    ({"training": {"out_dir": "o", "epochs": 3}}, "training: is not a config section; the training recipe is the "
                                                   "optimize: section: write training.KEY as optimize.KEY"),
    ({"optimizer": {"name": "adamw"}}, "optimizer: is not a config section; the optimizer is set in the optimize: "
                                       "section: write optimizer.name as optimize.optimizer"),
])
def test_training_and_optimizer_sections_are_refused_naming_optimize(section, fix):
    base = {"checkpoints": "c/*.pt", "data": {"train": {"builtin": "digits", "split": "train"}}, "store": "s.zarr"}
    with pytest.raises(ConfigError) as e:
        load_config({**base, **section})
    assert fix in str(e.value) and len(str(e.value).splitlines()) <= 2, str(e.value)


def test_data_validation_is_a_dataset_checked_only_for_optimize(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config({**BASE, "data": {**BASE["data"], "validation": {"builtin": "digits", "split": "target"}}})
    assert (cfg.data.validation.builtin, cfg.data.validation.split) == ("digits", "target")
    with pytest.raises(ConfigError) as e:
        load_config({**BASE, "data": {**BASE["data"], "validation": {"path": "v.pt"}, "target": {"builtin": "x"}}})
    msg = str(e.value)
    assert "data.validation: a file dataset needs inputs, labels" in msg and "data.target.builtin" in msg
    validation = {"path": "v.pt", "inputs": "x", "labels": "y"}
    raw = {**BASE, "checkpoints": ["c.pt"], "data": {**BASE["data"], "validation": validation}}
    (tmp_path / "c.pt").write_bytes(b"x")
    check_files(load_config(raw))  # featurize and score ignore it
    with pytest.raises(ConfigError, match="data.validation.path: file 'v.pt' does not exist"):
        check_files(load_config(raw), need_checkpoints=False, need_validation=True)


def test_checkpoints_from_a_manifest_in_model_id_order_relative_to_it(tmp_path, monkeypatch):
    import json

    from trakcli.models.checkpoints import file_sha256

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "a"
    run.mkdir(parents=True)
    for name, body in (("m0.pt", b"zero"), ("m1.pt", b"one")):
        (run / name).write_bytes(body)
    entry = lambda i, name: {"model_id": i, "checkpoint": name, "sha256": file_sha256(run / name)}  # noqa: E731
    manifest = {
        "format": "trakcli.optimize.manifest", "format_version": 1, "n_models": 2, "complete": True,
        "models": [entry(1, "m1.pt"), entry(0, "m0.pt")],
    }
    (run / "manifest.json").write_text(json.dumps(manifest))
    cfg = load_config({**BASE, "checkpoints": "runs/a/manifest.json"})
    assert resolve_checkpoints(cfg) == [Path("runs/a/m0.pt"), Path("runs/a/m1.pt")]
    (run / "manifest.json").write_text(json.dumps({**manifest, "complete": False, "n_models": 3}))
    with pytest.raises(ConfigError, match=r"lists 2 of the 3 models of its run: `trak optimize` did not finish"):
        resolve_checkpoints(cfg)
    (run / "manifest.json").write_text(json.dumps(manifest))
    (run / "m0.pt").write_bytes(b"changed")
    (run / "m1.pt").unlink()
    with pytest.raises(ConfigError) as e:
        check_files(cfg)
    msg = str(e.value)
    assert "checkpoint 'runs/a/m0.pt' (model 0) changed since trak optimize wrote the manifest" in msg
    assert "checkpoint 'runs/a/m1.pt' (model 1) of the manifest 'runs/a/manifest.json' does not exist" in msg


@pytest.mark.parametrize("key", ["optimize.init_checkpoint", "optimize.out_dir", "optimize.metrics", "select.out",
                                 "eval.sweep.dir"])
def test_a_url_where_a_local_path_goes_is_refused_as_typed(key):
    with pytest.raises(ConfigError) as e:
        load_config(BASE, [f"{key}=hf://datasets/foo/bar"])
    msg = str(e.value)
    assert f"{key}: this key takes a local file or folder path, not a URL" in msg and "'hf://datasets/foo/bar'" in msg
    assert "hf:/datasets" not in msg
    assert load_config(BASE, [f"{key}=runs/x"]) is not None  # a local path is taken
