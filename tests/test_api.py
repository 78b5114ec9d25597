"""trakcli.Attributor over DataLoaders against the CLI, and custom model output functions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from torch.utils.data import DataLoader
from torch.utils.data import TensorDataset as TorchTensorDataset

import trakcli
from trakcli.config.schema import BUILTIN_TASKS
from trakcli.errors import ConfigError, DataError, StoreMismatchError
from trakcli.tasks import TASKS, classification_margin
from trakcli.models import build_model

from projects import invoke as trak
from projects import assert_same_store, tiny_model

N_MODELS = 10

MARGIN_FILE = '''
import torch

def margin(logits, batch):
    """The classification margin, written as a user would (masks, no logits[range(n), labels])."""
    labels = batch["labels"]
    mask = torch.arange(logits.shape[-1]) == labels.unsqueeze(-1)  # [n, C]; one_hot is not vmap-safe
    logit_y = (logits * mask).sum(-1)
    m = logit_y - torch.logsumexp(logits.masked_fill(mask, float("-inf")), dim=-1)
    return m, torch.sigmoid(-m)

def summed(logits, batch):
    m, q = margin(logits, batch)
    return m.sum(), q

def not_finite(logits, batch):
    m, q = margin(logits, batch)
    return m / 0.0, q
'''


@pytest.fixture
def project(user_project: Path) -> Path:
    """user_project (2 checkpoints) with a user file of output functions."""
    (user_project / "outputs.py").write_text(MARGIN_FILE)
    return user_project


@pytest.fixture
def project10(project: Path) -> Path:
    """The project with 10 checkpoints: the API and the CLI agree over many models."""
    for i in range(2, N_MODELS):
        torch.save(tiny_model(seed=i).state_dict(), project / "ckpts" / f"model_{i}.pt")
    return project


def loaders(batch_size: int = 8) -> tuple[DataLoader, DataLoader]:
    data = torch.load("ckpts/data.pt")
    train = DataLoader(TorchTensorDataset(data["x_train"], data["y_train"]), batch_size=batch_size, shuffle=False)
    target = DataLoader(TorchTensorDataset(data["x_target"], data["y_target"]), batch_size=batch_size)
    return train, target


def cli_scores(*overrides: str) -> np.ndarray:
    for cmd in ("featurize", "score"):
        r = trak(cmd, "run.yaml", *overrides)
        assert r.exit_code == 0, r.output
    return np.asarray(zarr.open_group("out/attrib.zarr", mode="r")["scores/default/scores"][:])


def api_scores(task, store: str, checkpoints=None, projector=None, **kwargs) -> np.ndarray:
    model = build_model("my_model.py:make_model")
    att = trakcli.Attributor(
        model, store={"path": store, "chunk_rows": 16}, task=task,
        projector=projector or {"kind": "rademacher", "proj_dim": 16, "seed": 0}, **kwargs,
    )
    train, target = loaders()
    ckpts = checkpoints or sorted(Path("ckpts").glob("model_*.pt"))
    for m, ck in enumerate(ckpts):
        assert att.featurize(train, checkpoint=ck, model_id=m) > 0
    assert att.featurize(train, checkpoint=ckpts[0], model_id=0) == 0  # resumed: nothing left to do
    return att.score(target, checkpoints=ckpts).scores


def assert_close(a: np.ndarray, b: np.ndarray) -> None:
    assert a.shape == b.shape == (7, 40)
    rel = np.abs(a - b).max() / np.abs(b).max()
    assert rel < 1e-4, rel


def test_attributor_over_a_dataloader_gives_the_cli_scores(project10):
    expected = cli_scores()
    got = api_scores("classification", "out/api.zarr")
    assert_close(got, expected)
    np.testing.assert_array_equal(got, expected)  # same batches, same jobs: bit for bit


def test_attributor_with_ekfac_gives_the_cli_scores(project):
    expected = cli_scores("curvature.kind=ekfac", "curvature.feature_damping=0.2", "curvature.exact=false")
    got = api_scores("classification", "out/api.zarr", curvature={"kind": "ekfac", "feature_damping": 0.2})
    np.testing.assert_array_equal(got, expected)  # same batches, same fit, same features
    gram = api_scores("classification", "out/gram.zarr")
    assert not np.allclose(got, gram, rtol=1e-2)
    with pytest.raises(ConfigError, match="curvature.exact"):
        trakcli.Attributor(build_model("my_model.py:make_model"), store="out/x.zarr",
                           curvature={"kind": "ekfac", "exact": True})
    with pytest.raises(ConfigError, match="curvature.refine"):
        trakcli.Attributor(build_model("my_model.py:make_model"), store="out/x.zarr",
                           curvature={"kind": "ekfac", "refine": {"iterations": 2}})
    with pytest.raises(ConfigError, match="curvature.kind"):
        trakcli.Attributor(build_model("my_model.py:make_model"), store="out/x.zarr", curvature="shampoo")


def test_attributor_with_ekfac_alone_picks_the_kronecker_projector_and_the_loss_as_the_cli(project):
    expected = cli_scores("curvature.kind=ekfac", "curvature.exact=false", "projector.kind=kronecker")
    got = api_scores("classification", "out/api.zarr", projector={"proj_dim": 16, "seed": 0},
                     curvature={"kind": "ekfac"})
    np.testing.assert_array_equal(got, expected)
    margin = api_scores("classification", "out/margin.zarr", projector={"proj_dim": 16, "seed": 0},
                        curvature={"kind": "ekfac", "output": "margin"})
    assert not np.allclose(got, margin, rtol=1e-2)


def test_custom_task_function_and_state_dicts_give_the_same_scores(project10):
    sys.path.insert(0, str(project10))
    try:
        from outputs import margin  # noqa: PLC0415
    finally:
        sys.path.remove(str(project10))
    expected = cli_scores()
    state_dicts = [torch.load(p) for p in sorted(Path("ckpts").glob("model_*.pt"))]
    got = api_scores(margin, "out/custom.zarr", checkpoints=state_dicts)
    assert_close(got, expected)
    ident = zarr.open_group("out/custom.zarr", mode="r").attrs["identity"]
    assert ident["task"] == "outputs:margin"
    assert ident["output_function"]["file"].endswith("outputs.py") and len(ident["output_function"]["sha256"]) == 64


def test_yaml_custom_task_matches_the_builtin_and_a_changed_function_is_refused(project):
    builtin = cli_scores()
    custom = cli_scores("task=outputs.py:margin", "store.path=out/yaml.zarr")
    assert_close(custom, builtin)
    Path("outputs.py").write_text(MARGIN_FILE + "\n# edited\n")
    r = trak("featurize", "run.yaml", "task=outputs.py:margin", "store.path=out/yaml.zarr")
    assert r.exit_code == 1
    assert "output_function.sha256" in r.output and "Traceback" not in r.output


@pytest.mark.parametrize(
    ("fn", "message"),
    [("summed", "must return (f, Q), two tensors of shape [n]"), ("not_finite", "returned non-finite f")],
)
def test_a_bad_custom_task_is_one_clear_error(project, fn, message):
    r = trak("featurize", "run.yaml", f"task=outputs.py:{fn}")
    assert r.exit_code == 1, r.output
    assert message in r.output and "Traceback" not in r.output


def test_unknown_task_names_the_choices(project):
    r = trak("featurize", "run.yaml", "task=clasification")
    assert r.exit_code == 1
    assert "did you mean 'classification'" in r.output and "file.py:fn" in r.output


def test_custom_task_errors_through_the_api(project):
    model = build_model("my_model.py:make_model")
    att = trakcli.Attributor(model, store="out/bad.zarr", task=lambda logits, batch: (logits, logits[:, 0]))
    train, _ = loaders()
    with pytest.raises(DataError, match=r"for logits \[1, 3\] and a batch of inputs \[1, 6\], labels \[1\] it returned \[\[1, 3\], \[1\]\]"):
        att.featurize(train, checkpoint="ckpts/model_0.pt", model_id=0)


def test_other_train_batches_are_refused(project):
    model = build_model("my_model.py:make_model")
    att = trakcli.Attributor(model, store="out/api.zarr", projector={"proj_dim": 16})
    train, _ = loaders()
    att.featurize(train, checkpoint="ckpts/model_0.pt", model_id=0)
    shuffled = DataLoader(train.dataset, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1))
    with pytest.raises(StoreMismatchError, match="train_data") as e:
        att.featurize(shuffled, checkpoint="ckpts/model_0.pt", model_id=0)
    # the fix is one the API can do: Attributor.featurize takes no --overwrite
    assert "give Attributor another store path, or delete out/api.zarr to start over" in str(e.value)
    assert "--overwrite" not in str(e.value)


def test_builtin_task_names_agree_and_the_margin_is_the_documented_one():
    assert TASKS == BUILTIN_TASKS
    logits, labels = torch.tensor([[2.0, 0.0, 1.0]]), torch.tensor([0])
    m, q = classification_margin(logits, labels)
    assert torch.allclose(m, 2.0 - torch.logsumexp(torch.tensor([0.0, 1.0]), 0))
    assert torch.allclose(q, 1 - torch.softmax(logits, -1)[:, 0])


def test_import_trakcli_stays_cheap():
    code = "import sys, trakcli; assert 'torch' not in sys.modules; trakcli.Attributor; assert 'torch' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_custom_task_under_the_kronecker_featurizer(project):
    kron = ("projector.kind=kronecker",)
    builtin = cli_scores(*kron)
    custom = cli_scores(*kron, "task=outputs.py:margin", "store.path=out/kron.zarr")
    assert_close(custom, builtin)


def test_dict_batches_are_the_same_data_as_pairs(project):
    from trakcli.api import collect_batches  # noqa: PLC0415

    train, _ = loaders(batch_size=16)
    pairs, first = collect_batches(train, "train batches")
    dicts, _ = collect_batches(({"inputs": x, "labels": y} for x, y in train), "train batches")
    assert first == 16 and len(pairs) == 40
    assert pairs.fingerprint() == dicts.fingerprint()
    with pytest.raises(DataError, match="without 'labels'"):
        collect_batches([{"x": torch.zeros(2, 6)}], "train batches")


def test_a_task_function_vmap_refuses_is_named(project):
    Path("outputs.py").write_text(MARGIN_FILE.replace(
        "torch.arange(logits.shape[-1]) == labels.unsqueeze(-1)", "torch.nn.functional.one_hot(labels, 3).bool()"))
    r = trak("featurize", "run.yaml", "task=outputs.py:margin", "gradient_method=vmap")
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert "and task outputs.py:margin raised" in r.output and "(outputs.py, line 7)" in r.output
    assert trak("featurize", "run.yaml", "task=outputs.py:margin").exit_code == 0  # layer hooks need no vmap


def test_attributor_settings_are_checked_like_a_config(tmp_path):
    from trakcli.errors import ConfigError

    model = torch.nn.Linear(3, 2)
    with pytest.raises(ConfigError, match=r"projector\.proj_dims: unknown key; did you mean projector\.proj_dim\?"):
        trakcli.Attributor(model, store=tmp_path / "s.zarr", projector={"kind": "rademacher", "proj_dims": 8})


def featurized_attributor(store: str):
    """An Attributor over the project's model with both checkpoints featurized; it, the target loader, the checkpoints."""
    model = build_model("my_model.py:make_model")
    att = trakcli.Attributor(model, store={"path": store, "chunk_rows": 16},
                             projector={"kind": "rademacher", "proj_dim": 16, "seed": 0})
    train, target = loaders()
    ckpts = sorted(Path("ckpts").glob("model_*.pt"))
    for m, ck in enumerate(ckpts):
        att.featurize(train, checkpoint=ck, model_id=m)
    return att, target, ckpts


def test_top_k_through_the_api_is_the_top_of_the_scores(project):
    att, target, ckpts = featurized_attributor("out/top.zarr")
    top = att.top_k(target, 4, checkpoints=ckpts, experiment="top")
    scores = att.score(target, checkpoints=ckpts).scores
    assert top.proponents.shape == top.opponents.shape == (scores.shape[0], 4)
    np.testing.assert_array_equal(top.proponents, np.argsort(-scores, 1, kind="stable")[:, :4])
    np.testing.assert_array_equal(top.opponents, np.argsort(scores, 1, kind="stable")[:, :4])
    np.testing.assert_allclose(top.proponent_scores, np.take_along_axis(scores, top.proponents, 1), rtol=1e-6)
    assert "scores" not in zarr.open_group("out/top.zarr", mode="r")["scores/top"]  # no dense matrix
    unit = att.top_k(target, 4, checkpoints=ckpts, experiment="cos", normalize="unit")
    assert np.abs(unit.proponent_scores).max() <= 1 + 1e-6
    with pytest.raises(ConfigError, match="k=0"):
        att.top_k(target, 0, checkpoints=ckpts)
    with pytest.raises(ConfigError, match="normalize='cosine'"):
        att.top_k(target, 3, checkpoints=ckpts, normalize="cosine")


def test_progress_goes_to_a_terminal_by_default(project, monkeypatch):
    import io

    from trakcli.progress import NULL_REPORTER, StderrReporter

    model = build_model("my_model.py:make_model")
    logged = trakcli.Attributor(model, store="out/p.zarr").reporter  # stderr is not a terminal here
    assert isinstance(logged, StderrReporter) and logged.lines  # plain lines, rate-limited
    assert trakcli.Attributor(model, store="out/p.zarr", reporter=NULL_REPORTER).reporter is NULL_REPORTER

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    term = Terminal()
    monkeypatch.setattr("sys.stderr", term)
    att = trakcli.Attributor(model, store="out/p.zarr", projector={"proj_dim": 16})
    assert isinstance(att.reporter, StderrReporter)
    train, _ = loaders()
    att.featurize(train, checkpoint="ckpts/model_0.pt", model_id=0)
    lines = term.getvalue().replace("\r", "\n").splitlines()
    assert lines[-1] == "featurize model 0: 40/40", lines


def test_progress_goes_to_a_log_as_plain_lines(project, monkeypatch):
    import io

    log = io.StringIO()  # no isatty: a log file, a batch job's output
    monkeypatch.setattr("sys.stderr", log)
    model = build_model("my_model.py:make_model")
    att = trakcli.Attributor(model, store="out/p.zarr", projector={"proj_dim": 16})
    train, _ = loaders()
    att.featurize(train, checkpoint="ckpts/model_0.pt", model_id=0)
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert lines[0] == "featurize model 0: 0/40 (0%)" and lines[-1] == "featurize model 0: 40/40 (100%)", lines


def test_attributor_appends_rows_and_rescores_as_featurized_at_once(project):
    """Batches of the store's rows and more after them grow the store; the stale experiment is rescored."""
    from trakcli.store import StoreStaleError

    data = torch.load("ckpts/data.pt")
    x, y = data["x_train"], data["y_train"]  # 40 rows: 32 featurized first, then 8 appended
    _, target = loaders()
    ckpts = sorted(Path("ckpts").glob("model_*.pt"))

    def run(store: str, n: int) -> trakcli.Attributor:
        att = trakcli.Attributor(build_model("my_model.py:make_model"), store={"path": store, "chunk_rows": 12},
                                 projector={"kind": "rademacher", "proj_dim": 16, "seed": 0})
        train = DataLoader(TorchTensorDataset(x[:n], y[:n]), batch_size=8, shuffle=False)
        for m, ck in enumerate(ckpts):
            att.featurize(train, checkpoint=ck, model_id=m)
        return att

    once = run("out/once.zarr", 40).score(target, checkpoints=ckpts).scores
    run("out/grow.zarr", 32).score(target, checkpoints=ckpts)
    att = run("out/grow.zarr", 40)
    with pytest.raises(StoreStaleError, match=r"computed over 32 train rows.*rescore with overwrite=True"):
        att.score(target, checkpoints=ckpts)
    np.testing.assert_allclose(att.score(target, checkpoints=ckpts, overwrite=True).scores, once, rtol=1e-5, atol=1e-6)


def test_each_refusal_says_its_fix_as_the_api_takes_it_and_the_cli_as_its_flags(project):
    """The errors that carry a Fix word it per front end: the API's arguments here, the CLI's flags and keys in str()
    of the same error as the CLI raises it (test_the_cli_says_the_same_refusals_with_its_flags)."""
    from trakcli.progress import Reporter
    from trakcli.store import StoreStaleError

    class Lines(Reporter):
        def __init__(self):
            self.lines: list[str] = []

        def info(self, message: str) -> None:
            self.lines.append(message)

    data = torch.load("ckpts/data.pt")
    ckpts = sorted(Path("ckpts").glob("model_*.pt"))
    train, target = loaders()
    other_target = DataLoader(TorchTensorDataset(data["x_train"][:5], data["y_train"][:5]), batch_size=8)
    reporter = Lines()
    att = trakcli.Attributor(build_model("my_model.py:make_model"), store="out/fix.zarr", reporter=reporter,
                             projector={"kind": "rademacher", "proj_dim": 16, "seed": 0})

    def refused(error: type, call) -> StoreMismatchError:
        with pytest.raises(error) as e:
            call()
        assert "--overwrite" not in str(e.value) and "score.experiment" not in str(e.value), str(e.value)
        assert e.value.fix is not None and e.value.fix.store == "out/fix.zarr"
        return e.value

    for m, ck in enumerate(ckpts):
        att.featurize(train, checkpoint=ck, model_id=m)
    e = refused(StoreMismatchError, lambda: att.featurize(train, checkpoint=ckpts[1], model_id=0))
    assert e.fix.kind == "start_over"
    assert str(e).endswith("; give Attributor another store path, or delete out/fix.zarr to start over")
    assert e.worded("cli").endswith("; rerun with --overwrite to start over")

    att.score(target, checkpoints=ckpts)
    e = refused(StoreMismatchError, lambda: att.score(other_target, checkpoints=ckpts))
    assert e.fix.kind == "recompute_experiment" and "target_data" in str(e)
    assert str(e).endswith("\npass overwrite=True to recompute them, or another experiment=")
    assert e.worded("cli").endswith("\nrerun with --overwrite to recompute them, or set score.experiment to a new name")

    att.top_k(target, 3, checkpoints=ckpts, experiment="top")
    e = refused(StoreMismatchError, lambda: att.top_k(target, 4, checkpoints=ckpts, experiment="top"))
    assert e.fix.kind == "recompute_scores"
    assert str(e).endswith("\npass overwrite=True to recompute the scores, or another experiment=")
    assert att.top_k(target, 4, checkpoints=ckpts, experiment="top", overwrite=True).proponents.shape == (7, 4)

    att.select(target, checkpoints=ckpts, count=4)
    e = refused(StoreMismatchError, lambda: att.select(other_target, checkpoints=ckpts, count=4))
    assert e.fix.kind == "recompute_experiment" and e.fix.experiment_key == "select.experiment"
    assert str(e).endswith("\npass overwrite=True to recompute them, or another experiment=")
    assert e.worded("cli").endswith("or set select.experiment to a new name")

    more = DataLoader(TorchTensorDataset(torch.cat([data["x_train"], data["x_target"]]),
                                         torch.cat([data["y_train"], data["y_target"]])), batch_size=8)
    for m, ck in enumerate(ckpts):
        att.featurize(more, checkpoint=ck, model_id=m)
    appended = [line for line in reporter.lines if line.startswith("appending 7 train rows")]
    assert len(appended) == 1 and appended[0].endswith("scored experiments are stale until rescored (overwrite=True)")
    e = refused(StoreStaleError, lambda: att.score(target, checkpoints=ckpts))
    assert e.fix.kind == "rescore"
    assert str(e).endswith("rows were appended); rescore with overwrite=True (the target features are kept)")
    assert e.worded("cli").endswith("rescore with `trak score CONFIG --overwrite` (the target features are kept)")
    e = refused(StoreStaleError, lambda: att.report("out/page.html", experiment="default"))
    assert "rescore with overwrite=True" in str(e)


def test_the_cli_says_the_same_refusals_with_its_flags(project):
    """The CLI's words of the fixes that the API words its own way (the test above)."""
    def done(*args: str) -> None:
        res = trak(*args)
        assert res.exit_code == 0, res.output

    def refused(*args: str) -> str:
        res = trak(*args)
        assert res.exit_code == 1, res.output
        return " ".join(res.stderr.split())

    other_target = ("data.target.inputs=x_train", "data.target.labels=y_train")
    done("featurize", "run.yaml")
    done("score", "run.yaml")
    assert refused("score", "run.yaml", *other_target).endswith(
        "rerun with --overwrite to recompute them, or set score.experiment to a new name")
    done("score", "run.yaml", "score.top_k=3", "score.experiment=top")
    assert refused("score", "run.yaml", "score.top_k=4", "score.experiment=top").endswith(
        "rerun with --overwrite to recompute the scores, or set score.experiment to a new name")
    done("select", "run.yaml", "select.count=4", "select.out=out/sel.pt")
    assert refused("select", "run.yaml", "select.count=4", "select.out=out/sel.pt", *other_target).endswith(
        "rerun with --overwrite to recompute them, or set select.experiment to a new name")


def test_attributor_score_returns_the_lazy_result_of_trak_score(project):
    from trakcli.jobs.score import ScoreResult

    att, target, ckpts = featurized_attributor("out/lazy.zarr")
    res = att.score(target, checkpoints=ckpts)
    cfg = trakcli.load_config("run.yaml")
    trakcli.featurize(cfg)
    cfg_res = trakcli.score(cfg)
    assert type(res) is type(cfg_res) is ScoreResult
    assert (res.n_target, res.n_train, res.full, res.top_k) == (7, 40, True, None) and len(res.lambdas) == len(ckpts)
    np.testing.assert_array_equal(res.rows(2, 5), res.scores[2:5])
    assert res.train_labels is None and res.target_labels.shape == (7,)
    with pytest.raises(DataError, match="needs the train rows"):
        res.train_data.batches(0, 1, 1)


def test_config_objects_a_generator_and_a_dataset_give_the_dataloaders_store(project):
    from trakcli.config import ProjectorConfig
    from trakcli.data.tensors import TensorDataset

    model = build_model("my_model.py:make_model")
    train, _ = loaders()
    ref = trakcli.Attributor(model, store="out/loader.zarr", projector={"proj_dim": 16, "seed": 3})
    ref.featurize(train, checkpoint="ckpts/model_0.pt", model_id=0)
    data = torch.load("ckpts/data.pt")
    rows = TensorDataset(data["x_train"], data["y_train"], name="train")
    for store, batches, projector in [
        ("out/gen.zarr", (b for b in train), ProjectorConfig(proj_dim=16, seed=3)),
        ("out/rows.zarr", rows, {"proj_dim": 16, "seed": 3}),
    ]:
        att = trakcli.Attributor(model, store=store, projector=projector, batch_size=8)
        assert att.featurize(batches, checkpoint="ckpts/model_0.pt", model_id=0) > 0
        assert_same_store(Path("out/loader.zarr"), Path(store))
