"""Per-token scores (``score.per_token``, trakcli.jobs.per_token): sums, vmap references, answers, errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import zarr
import pytest
import torch
import yaml
from torch.func import functional_call, grad, vmap

from projects import LM_VOCAB, TINY_LMS_FILE, masked_batch, run, word_tokenizer, write_config, write_jsonl
from trakcli.jobs.per_token import split_by_token, token_margins
from trakcli.models.forward import logits_of, model_kwargs
from trakcli.tasks import IGNORE_INDEX, language_modeling_margin

def test_token_margins_sum_to_the_sequence_margin_and_split_keeps_one_target_per_copy():
    inputs, labels = masked_batch("chat", n=4, length=9)
    logits = torch.randn(4, 9, LM_VOCAB, generator=torch.Generator().manual_seed(0))
    per = token_margins(logits, labels)
    f, _ = language_modeling_margin(logits, labels)
    torch.testing.assert_close(per.sum(1), f)
    assert (per[:, 0] == 0).all() and (per[labels == IGNORE_INDEX] == 0).all()
    xs, ys, rows, positions = split_by_token(inputs, labels)
    assert len(rows) == int((labels[:, 1:] != IGNORE_INDEX).sum())
    assert ((ys != IGNORE_INDEX).sum(1) == 1).all()
    for j, (r, t) in enumerate(zip(rows, positions)):
        assert ys[j, t] == labels[r, t] and torch.equal(xs["input_ids"][j], inputs["input_ids"][r])


def _rows(kind: str, n: int, seed: int) -> list[dict]:
    inputs, labels = masked_batch(kind, n=n, length=10, seed=seed)
    out = []
    for ids, am, lab in zip(inputs["input_ids"], inputs["attention_mask"], labels):
        real = int(am.sum())
        out.append({"ids": ids[:real].tolist(), "labels": lab[:real].tolist()})
    return out


def _project(root: Path, arch: str, kind: str, extra: dict | None = None) -> None:
    """A tiny causal LM (random init, one checkpoint), pre-tokenized train (24 rows) and target (3 rows) data."""
    (root / "lm_model.py").write_text(TINY_LMS_FILE)
    import importlib.util

    spec = importlib.util.spec_from_file_location("lm_model_for_ckpt", root / "lm_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.save(getattr(mod, arch)().state_dict(), root / "ck0.pt")
    write_jsonl(root / "train.jsonl", _rows(kind, 24, 1))
    write_jsonl(root / "target.jsonl", _rows(kind, 3, 2))
    data = {"input_ids": "ids", "labels": "labels", "max_length": 10}
    cfg = {
        "model": {"entrypoint": f"lm_model.py:{arch}"},
        "task": "language_modeling",
        "checkpoints": ["ck0.pt"],
        "data": {"train": {"path": "train.jsonl", **data}, "target": {"path": "target.jsonl", **data},
                 "batch_size": 8},
        "projector": {"kind": "noop"},
        "store": {"path": "s.zarr", "chunk_rows": 8, "dtype": "float32"},
        "score": {"top_k": 4, "per_token": True},
        "num_threads": 1,
    }
    for key, value in (extra or {}).items():
        section, _, name = key.partition(".")
        if section == "top":
            cfg[name] = value
        elif "." in name:
            sub, _, leaf = name.partition(".")
            cfg.setdefault(section, {}).setdefault(sub, {})[leaf] = value
        else:
            cfg.setdefault(section, {})[name] = value
    write_config(root / "run.yaml", cfg)


def _reference(root: Path, arch: str, kind: str, lam: float | None, damping: float | None = None,
               output: str = "margin"):
    """Per-token scores from per-token gradients of vmap (torch.func), written independently of trakcli:
    TRAK's kernel on whole gradients (noop projector) or, with ``damping``, the exact EK-FAC curvature
    from the store; ``output`` ``loss``: each token's term is minus its next-token cross-entropy, Q = 1."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("lm_model_ref", root / "lm_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model = getattr(mod, arch)().eval()
    model.load_state_dict(torch.load(root / "ck0.pt"))
    params = {n: p.detach() for n, p in model.named_parameters()}
    names = list(params)

    def batch(rows):
        L = 10
        ids = torch.zeros(len(rows), L, dtype=torch.long)
        am = torch.zeros(len(rows), L, dtype=torch.long)
        lab = torch.full((len(rows), L), IGNORE_INDEX)
        for i, r in enumerate(rows):
            ids[i, :len(r["ids"])] = torch.tensor(r["ids"])
            am[i, :len(r["ids"])] = 1
            lab[i, :len(r["labels"])] = torch.tensor(r["labels"])
        return ids, am, lab

    def f_of(p, ids, am, lab):  # one row, every token of `lab` a target
        x = {"input_ids": ids[None], "attention_mask": am[None]}
        logits = logits_of(functional_call(model, p, args=(), kwargs=model_kwargs(model, x)))
        if output == "loss":
            nxt = lab[1:]
            logp = torch.log_softmax(logits[0, :-1], dim=-1)
            picked = logp.gather(-1, torch.where(nxt != IGNORE_INDEX, nxt, 0)[:, None])[:, 0]
            return (picked * (nxt != IGNORE_INDEX)).sum()
        return token_margins(logits, lab[None]).sum()

    def q_of(ids, am, lab):
        if output == "loss":
            return 1.0
        with torch.no_grad():
            logits = logits_of(model(**model_kwargs(model, {"input_ids": ids[None], "attention_mask": am[None]})))
        return float(language_modeling_margin(logits, lab[None])[1])

    def flat(g):
        return torch.cat([g[n].reshape(g[n].shape[0], -1) for n in names], 1).double()

    def per_token_grads(ids, am, lab):
        """[L, grad_dim]: row t the gradient of f_t (0 where t is not a target)."""
        L = lab.shape[0]
        eye = torch.where(torch.eye(L, dtype=torch.bool), lab[None, :].expand(L, L), IGNORE_INDEX)
        g = vmap(grad(f_of), in_dims=(None, None, None, 0))(params, ids, am, eye)
        return flat(g)

    train = [json.loads(line) for line in (root / "train.jsonl").read_text().splitlines()]
    target = [json.loads(line) for line in (root / "target.jsonl").read_text().splitlines()]
    t_ids, t_am, t_lab = batch(train)
    phi = torch.stack([per_token_grads(t_ids[i], t_am[i], t_lab[i]).sum(0) for i in range(len(train))])
    q = np.array([q_of(t_ids[i], t_am[i], t_lab[i]) for i in range(len(train))])
    if damping is None:
        inv = torch.linalg.inv(phi.T @ phi + lam * torch.eye(phi.shape[1], dtype=torch.float64))
        apply = lambda g: g @ inv  # noqa: E731
    else:
        apply = _ekfac_inverse(root, names, params, damping)
    x_ids, x_am, x_lab = batch(target)
    out = []
    for i in range(len(target)):
        g_tok = per_token_grads(x_ids[i], x_am[i], x_lab[i])  # [L, d]
        w_tok = apply(g_tok)  # [L, d]: each token's (F + λ)⁻¹ ∇f_t
        out.append({"target_tokens": (w_tok @ phi.T).numpy() * q[None, :],  # [L, n_train]
                    "train_grads": w_tok.sum(0)})
    doc_tokens = lambda i, d: (per_token_grads(t_ids[d], t_am[d], t_lab[d]) @ out[i]["train_grads"]).numpy() * q[d]  # noqa: E731
    return out, doc_tokens


def _ekfac_inverse(root: Path, names, params, damping: float):
    """g ↦ Wᵀ W g with the stored EK-FAC whitening W at ``damping`` (trakcli.curvature), as a map on flat rows."""
    import yaml

    from trakcli.config.load import load_config
    from trakcli.jobs.setup import prepare
    from trakcli.store import Store

    cfg = load_config(yaml.safe_load((root / "run.yaml").read_text()))
    s = prepare(cfg)
    s.curvature.read(Store.open_existing(Path(cfg.store.path), mode="r"), 0)
    view = s.curvature.with_damping(damping)
    sel = s.featurizer.param_names

    def apply(g_flat: torch.Tensor) -> torch.Tensor:
        parts, at = {}, 0
        for n in names:
            size = params[n].numel()
            parts[n] = g_flat[:, at:at + size].reshape(-1, *params[n].shape).float()
            at += size
        w = view.whiten({n: parts[n] for n in sel}, 0)
        x = {n: torch.zeros_like(w[n], requires_grad=True) for n in sel}
        y = view.whiten(x, 0)
        back = torch.autograd.grad([y[n] for n in sel], [x[n] for n in sel], [w[n] for n in sel])
        full = {n: torch.zeros_like(parts[n]) for n in names}
        full.update(dict(zip(sel, back)))
        return torch.cat([full[n].reshape(full[n].shape[0], -1) for n in names], 1).double()

    return apply


@pytest.mark.parametrize("arch,kind", [("gpt2", "completion"), ("llama", "chat")])
def test_per_token_scores_sum_to_the_document_scores_and_match_vmap_references(tmp_path, monkeypatch, arch, kind):
    monkeypatch.chdir(tmp_path)
    _project(tmp_path, arch, kind)
    for cmd in ("featurize", "score"):
        res = run(tmp_path, cmd, "run.yaml", "-q")
        assert res.returncode == 0, res.stderr
    _check_against_reference(tmp_path, arch, kind, damping=None)
    res = run(tmp_path, "score", "run.yaml", "-q", "--out", "answers.jsonl")  # the stored scores, with tokens
    assert res.returncode == 0, res.stderr
    answers = [json.loads(line) for line in Path("answers.jsonl").read_text().splitlines()]
    target = [json.loads(line) for line in Path("target.jsonl").read_text().splitlines()]
    train = [json.loads(line) for line in Path("train.jsonl").read_text().splitlines()]
    for a, row in zip(answers, target):
        for side in ("proponents", "opponents"):
            for e in a[side]:
                assert [t for t, _ in e["target_tokens"]] == [str(i) for i in row["ids"]]
                assert [t for t, _ in e["document_tokens"]] == [str(i) for i in train[e["train"]]["ids"]]
                scored = [i for i, lab in enumerate(row["labels"]) if lab != IGNORE_INDEX and i > 0]
                assert [i for i, (_, c) in enumerate(e["target_tokens"]) if c is not None] == scored
                for key in ("target_tokens", "document_tokens"):
                    total = sum(c for _, c in e[key] if c is not None)
                    assert total == pytest.approx(e["score"], rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("output", ["loss", "margin"])
def test_per_token_scores_of_exact_ekfac_match_the_vmap_reference(tmp_path, monkeypatch, output):
    monkeypatch.chdir(tmp_path)
    _project(tmp_path, "gpt2", "completion", {"curvature.kind": "ekfac", "curvature.damping": 0.01,
                                             "curvature.output": output,
                                             "curvature.fisher": "empirical", "projector.kind": "sjlt",
                                             "projector.proj_dim": 64,
                                             "top.grad_wrt": ["transformer.h.0.attn.*", "transformer.h.0.mlp.*"]})
    for cmd in ("featurize", "score"):
        res = run(tmp_path, cmd, "run.yaml", "-q")
        assert res.returncode == 0, res.stderr
    _check_against_reference(tmp_path, "gpt2", "completion", damping=0.01, output=output)


def _check_against_reference(root: Path, arch: str, kind: str, damping: float | None, output: str = "margin") -> None:
    import zarr

    g = zarr.open_group(str(root / "s.zarr"), mode="r")
    top = {name: g[f"scores/default/top_k/{name}"][:] for name in ("proponents", "proponent_scores",
                                                                    "opponents", "opponent_scores")}
    tok = {name: g[f"scores/default/per_token/{name}"][:] for name in ("target_tokens", "document_tokens")}
    lam = g["train/0/kernel"].attrs.get("lambda_reg") if damping is None else None
    ref, doc_tokens = _reference(root, arch, kind, lam, damping, output)
    docs = np.stack([top["proponents"], top["opponents"]], 1)  # [n_target, 2, K]
    scores = np.stack([top["proponent_scores"], top["opponent_scores"]], 1)
    scale = np.abs(scores).max()
    for name in ("target_tokens", "document_tokens"):  # each side sums to the document's score
        sums = np.nansum(tok[name], axis=-1)
        np.testing.assert_allclose(sums, scores, rtol=1e-5, atol=1e-5 * scale)
    for i in range(docs.shape[0]):
        for side in range(2):
            for r, d in enumerate(docs[i, side]):
                want_t = ref[i]["target_tokens"][:, d]
                got_t = tok["target_tokens"][i, side, r]
                np.testing.assert_allclose(np.nan_to_num(got_t), want_t, rtol=1e-4, atol=1e-4 * scale)
                assert np.isnan(got_t[want_t == 0]).all() or (want_t[np.isnan(got_t)] == 0).all()
                want_d = doc_tokens(i, d)
                got_d = tok["document_tokens"][i, side, r]
                np.testing.assert_allclose(np.nan_to_num(got_d), want_d, rtol=1e-4, atol=1e-4 * scale)


@pytest.mark.parametrize("extra", [
    {"projector.kind": "kronecker", "projector.proj_dim": 32},  # n_train 24 < proj_dim: the dual kernel
    {"projector.kind": "sjlt", "projector.proj_dim": 16},  # the primal kernel
    {"projector.kind": "sjlt", "projector.proj_dim": 48, "curvature.kind": "ekfac", "curvature.exact": False,
     "top.grad_wrt": ["transformer.h.0.attn.*", "transformer.h.0.mlp.*"]},
], ids=["kronecker-gram", "sjlt-gram-primal", "sjlt-ekfac-stored"])
def test_both_sides_sum_to_the_ensembled_scores_of_two_checkpoints(tmp_path, monkeypatch, extra):
    monkeypatch.chdir(tmp_path)
    _project(tmp_path, "gpt2", "completion", extra)
    state = torch.load(tmp_path / "ck0.pt")
    torch.save({k: v + 0.05 * torch.randn_like(v) if v.is_floating_point() else v for k, v in state.items()},
               tmp_path / "ck1.pt")
    cfg = yaml.safe_load((tmp_path / "run.yaml").read_text())
    cfg["checkpoints"] = ["ck0.pt", "ck1.pt"]
    write_config(tmp_path / "run.yaml", cfg)
    for cmd in ("featurize", "score"):
        res = run(tmp_path, cmd, "run.yaml", "-q")
        assert res.returncode == 0, res.stderr
    import zarr

    g = zarr.open_group(str(tmp_path / "s.zarr"), mode="r")
    scores = np.stack([g["scores/default/top_k/proponent_scores"][:], g["scores/default/top_k/opponent_scores"][:]], 1)
    for name in ("target_tokens", "document_tokens"):
        got = g[f"scores/default/per_token/{name}"][:]
        assert np.isfinite(got).any(axis=-1).all()  # every top document has target tokens on both sides
        np.testing.assert_allclose(np.nansum(got, -1), scores, rtol=1e-5, atol=1e-5 * np.abs(scores).max())
    res = run(tmp_path, "inspect", "s.zarr", "--json", "--verify")
    assert res.returncode == 0, res.stderr
    shown = json.loads(res.stdout)["scores"]["default"]["per_token"]
    assert shown == {"shape": [3, 2, 4, 10], "chunks_done": 1, "chunks_total": 1}


@pytest.mark.parametrize("args,message", [
    (["score.per_token=true"], "score.top_k is unset"),
    (["score.per_token=true", "score.top_k=3"], "task: language_modeling"),
])
def test_per_token_settings_it_cannot_split_are_one_clear_error(user_project, args, message):
    res = run(user_project, "score", "run.yaml", "-q", *args)
    assert res.returncode != 0 and message in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_cosines_refinement_and_document_scores_for_token_qld_are_one_clear_error_each(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _project(tmp_path, "gpt2", "completion")
    assert run(tmp_path, "featurize", "run.yaml", "-q").returncode == 0
    res = run(tmp_path, "score", "run.yaml", "-q", "score.normalize=unit")
    assert res.returncode == 1 and "score.normalize: null" in res.stderr, res.stderr
    np.save(tmp_path / "x.npy", np.zeros((3, 24), dtype=np.float32))
    res = run(tmp_path, "eval", "qld", "run.yaml", "-q", "eval.qld.per_token=true", "--scores", "x.npy")
    assert res.returncode != 0 and "leave out --scores" in res.stderr, res.stderr
    ekfac = ["curvature.kind=ekfac", "curvature.fisher=empirical", "projector.kind=sjlt", "projector.proj_dim=16",
             "grad_wrt=[transformer.h.0.mlp.*]", "store.path=e.zarr"]
    assert run(tmp_path, "featurize", "run.yaml", "-q", *ekfac).returncode == 0
    res = run(tmp_path, "score", "run.yaml", "-q", *ekfac, "curvature.refine.iterations=2")
    assert res.returncode == 1 and "curvature.refine.iterations: 0" in res.stderr, res.stderr


# -- per-token QLD ---------------------------------------------------------------------------------


def test_the_token_plan_masks_each_querys_top_tokens_and_as_many_random_ones(tmp_path, monkeypatch):
    from trakcli.config import load_config
    from trakcli.evaluation.qld import plan_tokens

    monkeypatch.chdir(tmp_path)
    _project(tmp_path, "gpt2", "completion", {"eval.qld": {"queries": 2, "fraction": 0.05, "seeds": 2}})
    cfg = load_config(tmp_path / "run.yaml")
    rng = np.random.default_rng(0)
    scores = rng.normal(size=(2, 24, 10)).astype(np.float32)
    scores[:, :, :3] = np.nan  # not targets
    p = plan_tokens(cfg, [0, 2], scores)
    m = round(0.05 * 24 * 7)  # 8 tokens
    assert len(p.masked) == 2 * (1 + 2 * 2) and all(d.size == 0 for d in p.drop)
    for (kind, s, qi), masked in zip(p.kinds, p.masked):
        cells = {(r, t) for r, ts in masked.items() for t in ts}
        if kind == "all":
            assert not cells
            continue
        assert len(cells) == m and all(t >= 3 for _, t in cells)
        if kind == "top":
            best = np.argsort(-np.nan_to_num(scores[qi], nan=-np.inf).ravel(), kind="stable")[:m]
            assert cells == {(int(c) // 10, int(c) % 10) for c in best}


def test_masked_tokens_are_left_out_of_the_training_labels(tmp_path, monkeypatch):
    from trakcli.config import load_config
    from trakcli.data.load import load_dataset
    from trakcli.train import DatasetRows

    monkeypatch.chdir(tmp_path)
    _project(tmp_path, "gpt2", "completion")
    train = load_dataset(load_config(tmp_path / "run.yaml").data.train, key="data.train")
    rows = DatasetRows(train, [1, 5, 6], masked={5: [4, 6], 1: [5]})
    plain = DatasetRows(train, [1, 5, 6])
    order = torch.tensor([2, 1, 0])
    (_, _, y), = list(rows.batches(order, 0, 8))
    (_, _, y0), = list(plain.batches(order, 0, 8))
    changed = {(int(i), int(t)) for i, t in torch.nonzero(y != y0)}
    want = {(1, t) for t in (4, 6) if y0[1, t] != IGNORE_INDEX} | ({(2, 5)} if y0[2, 5] != IGNORE_INDEX else set())
    assert changed == want and want and (y[y != y0] == IGNORE_INDEX).all()


def test_per_token_qld_end_to_end_and_its_token_scores_are_the_stored_ones(tmp_path, monkeypatch):
    from trakcli.config import load_config
    from trakcli.jobs.per_token import query_token_scores

    monkeypatch.chdir(tmp_path)
    _project(tmp_path, "gpt2", "completion", {
        "eval.qld": {"queries": 2, "fraction": 0.05}, "eval.bootstrap": 100,
        "optimize.epochs": 2, "optimize.batch_size": 8, "optimize.lr": 0.01, "optimize.optimizer": "adamw",
        "optimize.n_models": 1, "optimize.out_dir": "ckpts"})
    for cmd in ("featurize", "score"):
        assert run(tmp_path, cmd, "run.yaml", "-q").returncode == 0
    import zarr

    g = zarr.open_group(str(tmp_path / "s.zarr"), mode="r")
    stored = g["scores/default/per_token/document_tokens"][:]  # [3, 2, K, 10]
    docs = g["scores/default/top_k/proponents"][:]
    got = query_token_scores(load_config(tmp_path / "run.yaml"), [0, 2])  # [2, 24, 10]
    for qi, t in enumerate([0, 2]):
        np.testing.assert_allclose(got[qi][docs[t]], stored[t, 0], rtol=1e-5, atol=1e-6)
    res = run(tmp_path, "eval", "qld", "run.yaml", "eval.qld.per_token=true", "--out", "qld.json")
    assert res.returncode == 0, res.stderr
    table = " ".join(res.stderr.split())
    assert "proponent tokens left out" in table and "random tokens left out" in table
    assert "the query's own tokens left out" in table
    out = json.loads(Path("qld.json").read_text())
    n_tokens = int(np.isfinite(got[0]).sum())
    assert out["unit"] == "tokens" and out["n_dropped"] == round(0.05 * n_tokens) and out["n_queries"] == 2
    assert np.isfinite(out["qld_top"]["mean"]) and np.isfinite(out["qld_random"]["mean"])
    assert np.isfinite(out["baselines"]["token_overlap"]["mean"])  # the lexical row, on the same queries


def test_token_overlap_scores_the_querys_own_tokens_by_rarity(tmp_path, monkeypatch):
    from trakcli.config import load_config
    from trakcli.data.load import load_dataset
    from trakcli.evaluation.bm25 import token_overlap_scores

    monkeypatch.chdir(tmp_path)
    _project(tmp_path, "gpt2", "completion")
    cfg = load_config(tmp_path / "run.yaml")
    train, target = (load_dataset(d, key=k) for d, k in ((cfg.data.train, "data.train"), (cfg.data.target, "t")))
    got = token_overlap_scores(train, target, [1], 10, seed=0)[0]  # [24, 10]
    rows = [json.loads(line) for line in Path("train.jsonl").read_text().splitlines()]
    query = json.loads(Path("target.jsonl").read_text().splitlines()[1])
    mine = {v for i, v in enumerate(query["labels"]) if i > 0 and v != IGNORE_INDEX}
    df = {}
    for r in rows:
        for v in {v for i, v in enumerate(r["labels"]) if i > 0 and v != IGNORE_INDEX}:
            df[v] = df.get(v, 0) + 1
    for d, r in enumerate(rows):
        for t in range(10):
            v = r["labels"][t] if t < len(r["labels"]) else IGNORE_INDEX
            if t == 0 or v == IGNORE_INDEX:
                assert np.isnan(got[d, t])
            elif v in mine:
                assert got[d, t] == pytest.approx(np.log(25 / (df[v] + 0.5)), abs=1e-5)
            else:
                assert 0 <= got[d, t] < 1e-6


def test_token_texts_are_what_each_token_adds_to_the_decoded_row(tmp_path):
    from trakcli.answers import token_texts
    from trakcli.data.text import TextDataset

    word_tokenizer(tmp_path / "tok", ["the", "capital", "of", "france", "is", "paris"])
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": "the capital of france is", "completion": "paris"},
                                       {"prompt": "paris is", "completion": "the capital"}])
    ds = TextDataset(tmp_path / "d.jsonl", prompt="prompt", completion="completion", tokenizer=str(tmp_path / "tok"))
    # what each token adds to the decoded text (the word-level decoder joins words with spaces)
    assert token_texts(ds, 0) == ["the", " capital", " of", " france", " is", " paris", " [EOS]"]
    assert token_texts(ds, 1) == ["paris", " is", " the", " capital", " [EOS]"]  # padding left out


def test_a_character_split_over_byte_level_tokens_shows_whole_at_the_token_that_completes_it():
    from trakcli.answers import token_texts

    class Bytes:  # a byte-level tokenizer: one token per UTF-8 byte
        def batch_decode(self, seqs):
            return [bytes(s).decode("utf-8", errors="replace") for s in seqs]

        def decode(self, ids):
            return self.batch_decode([ids])[0]

    class Data:
        tokenizer = Bytes()

        def batches_of(self, rows, n):
            ids = torch.tensor([list("£5 ok".encode())])
            yield 1, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, ids

    got = token_texts(Data(), 0)
    assert "".join(got) == "£5 ok" and got[:2] == ["", "£"] and "\ufffd" not in "".join(got)


def test_a_target_without_target_tokens_has_no_target_tokens_and_zero_document_tokens(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _project(tmp_path, "gpt2", "completion", {"curvature.kind": "ekfac", "curvature.fisher": "empirical",
                                             "projector.kind": "sjlt", "projector.proj_dim": 32,
                                             "top.grad_wrt": ["transformer.h.0.mlp.*"]})
    rows = [json.loads(line) for line in Path("target.jsonl").read_text().splitlines()]
    rows[1]["labels"] = [IGNORE_INDEX] * len(rows[1]["labels"])  # a prompt alone: nothing to explain
    write_jsonl(tmp_path / "target.jsonl", rows)
    for cmd in ("featurize", "score"):
        res = run(tmp_path, cmd, "run.yaml", "-q")
        assert res.returncode == 0, res.stderr
    import zarr

    g = zarr.open_group(str(tmp_path / "s.zarr"), mode="r")
    t_tok, d_tok = (g[f"scores/default/per_token/{n}"][:] for n in ("target_tokens", "document_tokens"))
    assert np.isnan(t_tok[1]).all() and np.isfinite(t_tok[0]).any()
    assert (np.nan_to_num(d_tok[1]) == 0).all() and np.isfinite(d_tok[1]).any()


@pytest.mark.parametrize("extra", [
    {},
    {"curvature.kind": "ekfac", "curvature.fisher": "empirical", "projector.kind": "sjlt", "projector.proj_dim": 32,
     "top.grad_wrt": ["transformer.h.0.mlp.*"]},
], ids=["gram", "exact-ekfac"])
def test_the_target_side_by_one_jvp_per_document_equals_one_copy_per_token(tmp_path, monkeypatch, extra):
    from trakcli.config import load_config
    from trakcli.data.load import load_dataset
    from trakcli.jobs.kernels import ridge_settings
    from trakcli.jobs.per_token import PerTokenScores, per_token_width
    from trakcli.jobs.score import check_train_complete
    from trakcli.jobs.setup import prepare
    from trakcli.store import Store

    monkeypatch.chdir(tmp_path)
    _project(tmp_path, "gpt2", "completion", extra)
    for cmd in ("featurize", "score"):  # 8 top documents, at most 8 target tokens: one copy per token
        assert run(tmp_path, cmd, "run.yaml", "-q").returncode == 0
    import zarr

    g = zarr.open_group(str(tmp_path / "s.zarr"), mode="r")
    stored = {n: g[f"scores/default/per_token/{n}"][:] for n in ("target_tokens", "document_tokens")}
    top = {n: g[f"scores/default/top_k/{n}"][:] for n in ("proponents", "opponents")}
    cfg = load_config(tmp_path / "run.yaml")
    s = prepare(cfg, need_target=True)
    target = load_dataset(cfg.data.target, key="data.target")
    store = Store.open_existing(Path(cfg.store.path), mode="r")
    scorer = PerTokenScores(s, store, check_train_complete(s, store), target, 4, per_token_width(s, target),
                            ridge_settings(None, 1.0), s.exact_damping if s.curvature is not None else None)
    scorer.jvp_cost = 0.0  # always one JVP of the target per document
    got = scorer.compute(0, 3, top)
    scale = np.nanmax(np.abs(stored["target_tokens"]))
    for name in ("target_tokens", "document_tokens"):
        np.testing.assert_array_equal(np.isnan(got[name]), np.isnan(stored[name]))
        np.testing.assert_allclose(np.nan_to_num(got[name]), np.nan_to_num(stored[name]), rtol=1e-4,
                                   atol=1e-5 * scale)


def test_killed_while_splitting_over_tokens_resumes_to_the_store_of_an_uninterrupted_run(tmp_path):
    import shutil
    import signal
    import subprocess
    import time

    from projects import assert_same_store, trak_cmd

    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    _project(one, "gpt2", "completion")
    shutil.copytree(one, two)
    for root in (one, two):
        assert run(root, "featurize", "run.yaml", "-q").returncode == 0
    assert run(one, "score", "run.yaml", "-q").returncode == 0
    log = tmp_path / "events.log"
    proc = subprocess.Popen(trak_cmd("score", "run.yaml", "-q"), cwd=two, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "TRAK_EVENT_LOG": str(log)})
    deadline = time.time() + 120
    while proc.poll() is None and time.time() < deadline:
        if log.exists() and "start per-token 0 0" in log.read_text():
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.001)
    proc.wait()
    assert "start per-token 0 0" in log.read_text() and "done per-token 0 0" not in log.read_text()
    log.unlink()
    res = subprocess.run(trak_cmd("score", "run.yaml", "-q"), cwd=two, capture_output=True, text=True,
                         env={**os.environ, "TRAK_EVENT_LOG": str(log)})
    assert res.returncode == 0, res.stderr
    rerun = log.read_text()
    assert "done per-token 0 0" in rerun and "top-k segment" not in rerun  # the finished top-k is kept
    assert_same_store(one / "s.zarr", two / "s.zarr")


def test_another_train_max_length_is_refused_and_targets_score_at_their_own(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _project(tmp_path, "gpt2", "completion")
    assert run(tmp_path, "featurize", "run.yaml", "-q").returncode == 0
    res = run(tmp_path, "score", "run.yaml", "-q", "data.train.max_length=12", "data.target.max_length=12")
    msg = " ".join(res.stderr.split())
    assert res.returncode == 1 and "train_data.input_shape.input_ids: store has [10], this run has [12] (set by " \
        "data.train.max_length for text data" in msg, msg
    res = run(tmp_path, "score", "run.yaml", "-q", "data.target.max_length=12")  # targets need not be the train's length
    assert res.returncode == 0, res.stderr


def test_featurize_with_another_max_length_is_refused_naming_the_config_key(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _project(tmp_path, "gpt2", "completion")
    assert run(tmp_path, "featurize", "run.yaml", "-q").returncode == 0
    res = run(tmp_path, "featurize", "run.yaml", "-q", "data.train.max_length=12")
    msg = " ".join(res.stderr.split())
    assert res.returncode == 1 and "train_data.input_shape.input_ids: store has [10], this run has [12] (set by " \
        "data.train.max_length" in msg, msg


# -- forward mode under every attention implementation -----------------------------------------------

#: The tiny LMs of TINY_LMS_FILE (the same weights) as a user's entrypoint builds them: transformers' default
#: attention (``sdpa``: fused kernels without a forward-mode derivative), no ``attn_implementation``.
SDPA_LMS_FILE = '''
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM


def gpt2(vocab_size=29):
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=vocab_size, n_embd=16, n_layer=1, n_head=2, n_positions=32,
                     bos_token_id=1, eos_token_id=1)
    return GPT2LMHeadModel(cfg)


def llama(vocab_size=29):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg)
'''


@pytest.mark.parametrize("arch,kind", [("gpt2", "completion"), ("llama", "chat")])
def test_per_token_scores_of_a_default_sdpa_attention_model_match_the_references(tmp_path, monkeypatch, arch, kind):
    import importlib.util

    monkeypatch.chdir(tmp_path)
    # top_k 1: 2 top documents, so a target of more than 4 target tokens (gpt2's third) takes its target side by JVP
    _project(tmp_path, arch, kind, {"score.top_k": 1})
    (tmp_path / "lm_model.py").write_text(SDPA_LMS_FILE)
    spec = importlib.util.spec_from_file_location("lm_model_sdpa", tmp_path / "lm_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model = getattr(mod, arch)()
    assert model.config._attn_implementation == "sdpa"  # the default the issue met
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), torch.load("ck0.pt").values()))
    for cmd in ("featurize", "score"):
        res = run(tmp_path, cmd, "run.yaml", "-q")
        assert res.returncode == 0, res.stderr
    _check_against_reference(tmp_path, arch, kind, damping=None)  # the vmap reference of the same sdpa model
    (tmp_path / "lm_model.py").write_text(TINY_LMS_FILE)  # and of the eager model (float32 rounding apart)
    _check_against_reference(tmp_path, arch, kind, damping=None)


def test_forward_mode_restores_the_sdpa_kernels_and_equals_eager_attention():
    from torch.func import jvp

    from trakcli.jobs.per_token import forward_mode

    ns: dict = {}
    exec(SDPA_LMS_FILE, ns)
    eager_ns: dict = {}
    exec(TINY_LMS_FILE, eager_ns)
    inputs, labels = masked_batch("chat", n=3, length=9)
    for arch in ("gpt2", "llama"):
        sdpa, eager = ns[arch]().eval(), eager_ns[arch]().eval()
        primal = {n: p.detach() for n, p in sdpa.named_parameters()}
        v = {n: torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) for n, p in primal.items()}

        def f(model):
            return lambda p: token_margins(logits_of(functional_call(model, p, args=(),
                                                                     kwargs=model_kwargs(model, inputs))), labels)

        before = (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
                  torch.backends.cuda.math_sdp_enabled())
        with torch.no_grad(), forward_mode(sdpa):
            got = jvp(f(sdpa), (primal,), (v,))
        assert (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
                torch.backends.cuda.math_sdp_enabled()) == before
        with torch.no_grad():
            want = jvp(f(eager), (primal,), (v,))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * float(w.abs().max()))


#: The tiny GPT-2 with its MLP's activation a custom autograd.Function that has a backward (and a vmap rule: the
#: featurizer's per-example gradients work) but no jvp: forward mode cannot go through it.
NO_JVP_FILE = TINY_LMS_FILE + '''

class NoJvpTanh(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return torch.tanh(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * (1 - y * y)


class Act(torch.nn.Module):
    def forward(self, x):
        return NoJvpTanh.apply(x)


def no_jvp(vocab_size=29):
    model = gpt2(vocab_size)
    model.transformer.h[0].mlp.act = Act()
    return model
'''


def test_an_operation_without_forward_ad_is_one_clear_error_naming_it_and_its_module(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _project(tmp_path, "gpt2", "completion")
    (tmp_path / "lm_model.py").write_text(NO_JVP_FILE)
    cfg = yaml.safe_load((tmp_path / "run.yaml").read_text())
    cfg["model"]["entrypoint"] = "lm_model.py:no_jvp"
    write_config(tmp_path / "run.yaml", cfg)
    res = run(tmp_path, "featurize", "run.yaml", "-q")
    assert res.returncode == 0, res.stderr  # per-example gradients (reverse mode) go through it
    res = run(tmp_path, "score", "run.yaml", "-q")
    msg = " ".join(res.stderr.split())
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr
    assert "NoJvpTanh" in msg and "'transformer.h.0.mlp.act' (Act)" in msg, msg
    assert "lm_model.py:no_jvp" in msg and "give it a jvp staticmethod" in msg and "score.per_token: false" in msg, msg


def test_per_token_with_a_curvature_on_the_kronecker_projector_is_one_error_naming_sjlt(tmp_path, monkeypatch):
    """The curvature's default projector (kronecker) forms no whole per-example gradient to split: refused with the
    fix before anything is scored, and the stored features stay."""
    monkeypatch.chdir(tmp_path)
    _project(tmp_path, "gpt2", "completion", {"curvature.kind": "ekfac", "projector.kind": "kronecker",
                                             "projector.proj_dim": 32})
    assert run(tmp_path, "featurize", "run.yaml", "-q").returncode == 0
    before = zarr.open_group(str(tmp_path / "s.zarr"), mode="r")["train/0/features"][:]
    res = run(tmp_path, "score", "run.yaml")
    assert res.returncode == 1, res.stderr
    assert "score.per_token: true with curvature.kind ekfac" in res.stderr and "projector.kind: sjlt" in res.stderr
    after = zarr.open_group(str(tmp_path / "s.zarr"), mode="r")["train/0/features"][:]
    np.testing.assert_array_equal(before, after)
