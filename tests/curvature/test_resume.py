"""Kill -9 and resume of the curvature passes: the EK-FAC fit (covariances, then eigenvalues), the features, and the
exact scores each keep their progress every ``store.save_every_s`` of work (0 here: after every batch), so a rerun
redoes at most the batch that was running when the process died, and ends with the store (and scores) of an
uninterrupted run, bit for bit: the resumed sums are the saved float32/float64 values, added to in the same
batches and order, with the label sampler restored to its saved state.

Events (``$TRAK_EVENT_LOG``): ``batch curvature-<pass> <m> <lo> <hi>`` per fitting batch, ``partial ...`` after each
save, ``resume ...`` when a pass starts after saved rows; ``batch exact <m> <lo> <hi>``, ``partial exact <block> <m>
<rows>``, ``resume exact <block> <m> <rows>`` for the exact scores; ``batch featurize ...`` for the features.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np
import pytest
import zarr

from projects import (
    assert_same_store, kill_at_line, make_project, run, run_subprocess, tiny_lm_project, token_rows, write_config,
)

N_DOCS, BATCH = 48, 4  # the LM corpus; rows per batch: the most a rerun may redo (one batch, save_every_s 0)
ARGS = ["-q"]


def _lm_project(root: Path) -> Path:
    """A tiny GPT-2 (one checkpoint) with an EK-FAC curvature (the true Fisher: sampled labels) on 48 pre-tokenized
    documents of 3 to 12 tokens, one store chunk, batches of 4 rows, every save after each batch."""
    rows = token_rows(N_DOCS, 3, 12, seed=5)
    return tiny_lm_project(root, rows, rows[:3], max_length=12, batch_size=BATCH,
                           projector={"proj_dim": 32, "seed": 0}, curvature={"kind": "ekfac"}, score={"top_k": 5},
                           store={"path": "s.zarr", "chunk_rows": N_DOCS, "save_every_s": 0})


def _events(log: Path, word: str, what: str) -> list[list[int]]:
    """The integers of the events ``<word> <what> ...`` in order."""
    out = []
    for line in log.read_text().splitlines():
        parts = line.split()
        if parts[:2] == [word, what]:
            out.append([int(v) for v in parts[2:]])
    return out


def _redone(killed: Path, resumed: Path, what: str, saved: int, model_id: int = 0) -> int:
    """Rows the resumed run computed again: those the killed run had computed past its last save (checked: the
    resumed run starts at the saved row and computes each later row once)."""
    before = [hi for m, lo, hi in _events(killed, "batch", what) if m == model_id]
    after = [(lo, hi) for m, lo, hi in _events(resumed, "batch", what) if m == model_id]
    assert after and after[0][0] == saved, (after[:1], saved)  # the rerun starts at the first row not saved
    assert [lo for lo, _ in after[1:]] == [hi for _, hi in after[:-1]]  # and goes on batch after batch
    return max(before) - saved


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The LM project featurized and scored without interruption."""
    root = _lm_project(tmp_path_factory.mktemp("ref") / "p")
    assert run(root, "featurize", "run.yaml", *ARGS).returncode == 0
    res = run(root, "score", "run.yaml", *ARGS)
    assert res.returncode == 0, res.stderr
    return root


def _partial_rows(root: Path) -> tuple[str, int]:
    attrs = dict(zarr.open_group(str(root / "s.zarr"), mode="r")["train/0/curvature/partial"].attrs)
    return attrs["pass"], attrs["rows"]


@pytest.mark.subprocess
def test_killed_ekfac_fit_resumes_each_pass_after_its_saved_rows(tmp_path, reference):
    root = _lm_project(tmp_path / "p")
    log = tmp_path / "events.log"
    kill_at_line(root, ["featurize", "run.yaml", *ARGS], log, "partial curvature-covariances 0 20")
    assert "start curvature-eigenvalues" not in log.read_text()
    stage, saved = _partial_rows(root)
    assert stage == "covariances" and 20 <= saved < N_DOCS and saved % BATCH == 0

    first, log2 = log, tmp_path / "events2.log"  # the rerun resumes pass 1, and is killed in pass 2
    kill_at_line(root, ["featurize", "run.yaml", *ARGS], log2, "partial curvature-eigenvalues 0 20")
    assert _events(log2, "resume", "curvature-covariances") == [[0, saved]]
    assert _redone(first, log2, "curvature-covariances", saved) <= BATCH
    assert "batch featurize" not in log2.read_text()  # killed before the features
    stage, saved2 = _partial_rows(root)
    assert stage == "eigenvalues" and 20 <= saved2 < N_DOCS

    log3 = tmp_path / "events3.log"
    res = run_subprocess(root, "featurize", "run.yaml", *ARGS, env={"TRAK_EVENT_LOG": str(log3)})
    assert res.returncode == 0, res.stderr
    assert _events(log3, "resume", "curvature-eigenvalues") == [[0, saved2]]
    assert _redone(log2, log3, "curvature-eigenvalues", saved2) <= BATCH
    assert "curvature-covariances" not in log3.read_text()  # pass 1 was stored whole
    assert not (root / "s.zarr" / "train" / "0" / "curvature" / "partial").exists()  # dropped once done
    _same_train(root, reference)


@pytest.mark.subprocess
def test_killed_ekfac_features_resume_after_the_saved_rows(tmp_path, reference):
    root = _lm_project(tmp_path / "p")
    log = tmp_path / "events.log"
    kill_at_line(root, ["featurize", "run.yaml", *ARGS], log, "partial featurize 0 0 20")
    saved = int(np.asarray(zarr.open_group(str(root / "s.zarr"), mode="r")["train/0/rows_done"][0]))
    assert 20 <= saved < N_DOCS
    log2 = tmp_path / "events2.log"
    res = run_subprocess(root, "featurize", "run.yaml", *ARGS, env={"TRAK_EVENT_LOG": str(log2)})
    assert res.returncode == 0, res.stderr
    assert "curvature-" not in log2.read_text()  # the finished fit is read, not repeated
    assert _events(log2, "resume", "featurize") == [[0, 0, saved]]
    before = [hi for m, c, lo, hi in _events(log, "batch", "featurize")]
    after = [lo for m, c, lo, hi in _events(log2, "batch", "featurize")]
    assert min(after) == saved and max(before) - saved <= BATCH
    _same_train(root, reference)


@pytest.mark.subprocess
def test_killed_exact_scores_resume_after_the_saved_rows(tmp_path, reference):
    root = _lm_project(tmp_path / "p")
    assert run(root, "featurize", "run.yaml", *ARGS).returncode == 0
    log = tmp_path / "events.log"
    kill_at_line(root, ["score", "run.yaml", *ARGS], log, "partial exact 0 0 20")
    assert "done top-k segment 0" not in log.read_text()  # all 48 rows are one segment: killed inside it
    log2 = tmp_path / "events2.log"
    res = run_subprocess(root, "score", "run.yaml", *ARGS, env={"TRAK_EVENT_LOG": str(log2)})
    assert res.returncode == 0, res.stderr
    (_, _, saved), = _events(log2, "resume", "exact")
    assert 20 <= saved < N_DOCS
    assert _redone(log, log2, "exact", saved) <= BATCH
    got = zarr.open_group(str(root / "s.zarr"), mode="r")["scores/default"]
    want = zarr.open_group(str(reference / "s.zarr"), mode="r")["scores/default"]
    assert "exact_rows" not in got  # the saved progress is dropped once the scores are done
    for name in ("proponents", "proponent_scores", "opponents", "opponent_scores"):
        np.testing.assert_array_equal(got[f"top_k/{name}"][:], want[f"top_k/{name}"][:], err_msg=name)


def _same_train(root: Path, reference: Path) -> None:
    """The train side of two stores (features, out-to-loss, curvature) are equal, bit for bit."""
    a, b = root / "s.zarr", reference / "s.zarr"
    from projects import arrays

    xa = {k: v for k, v in arrays(a).items() if k.startswith("train/")}
    xb = {k: v for k, v in arrays(b).items() if k.startswith("train/")}
    assert sorted(xa) == sorted(xb)
    for name in xa:
        np.testing.assert_array_equal(xa[name], xb[name], err_msg=name)


# --- in one process: two checkpoints, the full score matrix, Ctrl-C after a save -----------------------------------

def _interrupt_after(monkeypatch, module: str, line: str) -> None:
    """Raise KeyboardInterrupt (Ctrl-C) right after the event ``line`` of ``module`` is written."""
    mod = importlib.import_module(module)
    real = mod.event

    def event(message: str) -> None:
        real(message)
        if message == line:
            raise KeyboardInterrupt

    monkeypatch.setattr(mod, "event", event)


def test_interrupted_exact_matrix_of_two_checkpoints_resumes_to_the_same_scores(tmp_path, monkeypatch):
    """The full matrix (one score chunk of 40 train rows a call, batches of 16): stopped at the end of checkpoint 0's
    rows of the first chunk (the rerun starts checkpoint 1), then inside checkpoint 1's (the saved sums hold
    checkpoint 1 for the first 32 rows and checkpoint 0 for the others); the third run ends with the scores of an
    uninterrupted one."""
    import yaml

    once, root = (make_project(tmp_path / name, n_models=2) for name in ("once", "p"))
    for r in (once, root):
        cfg = yaml.safe_load((r / "run.yaml").read_text())
        cfg["projector"] = {"proj_dim": 32, "seed": 0}
        cfg["curvature"] = {"kind": "ekfac", "fit_rows": 64}
        cfg["store"]["save_every_s"] = 0
        write_config(r / "run.yaml", cfg)
        assert run(r, "featurize", "run.yaml", *ARGS).returncode == 0
    assert run(once, "score", "run.yaml", *ARGS).returncode == 0
    log = tmp_path / "events.log"
    for stop, resumed in (("partial exact 0 0 40", None), ("partial exact 0 1 32", [0, 1, 0]), (None, [0, 1, 32])):
        monkeypatch.setenv("TRAK_EVENT_LOG", str(log))
        if stop is not None:
            _interrupt_after(monkeypatch, "trakcli.jobs.exact", stop)
        assert run(root, "score", "run.yaml", *ARGS).returncode == (130 if stop else 0)
        monkeypatch.undo()
        assert _events(log, "resume", "exact") == ([resumed] if resumed else [])
        if resumed:  # the rows of the saved sums are not scored again
            batches = _events(log, "batch", "exact")
            assert batches[0][:2] == resumed[1:]
            assert not any(m < resumed[1] and lo < 40 or m == resumed[1] and lo < resumed[2] for m, lo, _ in batches)
        log.unlink()
    assert_same_store(root / "out" / "attrib.zarr", once / "out" / "attrib.zarr")


class _Recorder:
    """A reporter that keeps every task's description, total and the steps it advanced."""

    def __init__(self):
        self.tasks: list[list] = []

    def task(self, description: str, total: int):
        import contextlib

        from trakcli.progress import Task

        entry = [description, total, 0]
        self.tasks.append(entry)

        class Counting(Task):
            def advance(self, n: int = 1) -> None:
                entry[2] += n

        return contextlib.nullcontext(Counting())

    def info(self, message: str) -> None:
        pass


def test_each_fitting_pass_and_each_exact_block_counts_its_rows(tmp_path, monkeypatch):
    import yaml

    from trakcli.config.load import load_config
    from trakcli.data.load import load_dataset
    from trakcli.jobs.exact import ExactInfluence
    from trakcli.jobs.setup import prepare
    from trakcli.store import Store
    from trakcli.tasks import resolve_task

    root = make_project(tmp_path / "p", n_models=2)
    cfg = yaml.safe_load((root / "run.yaml").read_text())
    cfg["projector"] = {"proj_dim": 32, "seed": 0}
    cfg["curvature"] = {"kind": "ekfac", "fit_rows": 100}
    write_config(root / "run.yaml", cfg)
    assert run(root, "featurize", "run.yaml", *ARGS).returncode == 0
    monkeypatch.chdir(root)
    conf = load_config(cfg)
    s = prepare(conf, need_target=True)
    rec = _Recorder()
    s.fit_curvature(1, None, rec)  # in memory: both passes run
    assert rec.tasks == [["model 1: ekfac covariances", 100, 100], ["model 1: ekfac eigenvalues", 100, 100]]
    target = load_dataset(conf.data.target, key="data.target", task=resolve_task(conf.task))
    store = Store.open_existing(Path(conf.store.path), mode="r")
    exact = ExactInfluence(s, store, target, 0.1, reporter=rec)
    rec.tasks.clear()
    assert exact(40, 80).shape == (len(target), 40)
    assert rec.tasks == [["exact influence, train rows 40-80", 80, 80]]  # 40 rows of each of 2 checkpoints
