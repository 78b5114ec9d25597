"""The answer of an experiment: per target, its top proponents and opponents with scores, texts and tokens.

One record per target, the same for ``trak score --out answers.jsonl``, ``trak report`` and the Python API::

    {"target": 0, "text": "...",                       # text data: a short rendering of the target
     "proponents": [{"train": 17, "score": 3.2, "text": "...",
                     "target_tokens": [["▁Paris", 0.8], ["!", -0.01], ...],   # with score.per_token
                     "document_tokens": [["The", null], ["▁capital", 0.4], ...]}, ...],
     "opponents": [...]}

``target_tokens`` lists every token of the target and ``document_tokens`` every token of the train document, as
``[token text, contribution]``; the contribution is the share of the document's score that the token's next-token term
carries (:mod:`trakcli.jobs.per_token`), ``null`` for a token that is not a target of the loss (a prompt, a user turn).
Over the target tokens the contributions sum to the document's score.

Proponents are documents of positive score and opponents of negative score: the stored top-k's
lowest K of a small training set may include positive scores, which are not listed as opponents.

What a score means, in which units and why its size varies, depends on the method: :func:`score_meaning` says it for an
experiment (``trak score`` and ``trak report`` print it), and :func:`ridge_meaning` says what TRAK's ridge λ is.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

#: ``(target, side, rank, train row) -> {"target_tokens": ..., "document_tokens": ...}`` of one top document, or None.
TokenFields = Callable[[int, str, int, int], dict[str, Any] | None]


def answer_records(res: Any, k: int, target_texts: Any = None, train_texts: Any = None, block: int = 1024,
                   tokens: TokenFields | None = None) -> Iterator[dict[str, Any]]:
    """Yield one record per target (module docstring) of a :class:`~trakcli.jobs.score.ScoreResult`, ``block``
    targets read at a time: ``k`` documents a side from a full matrix (all K of a top-k), with the rows' texts
    (indexable renderings, or None) and a top document's per-token fields (``tokens``, or None)."""
    from trakcli.plots import top_indices

    for lo in range(0, res.n_target, block):
        hi = min(lo + block, res.n_target)
        if res.top_k:
            top = res.top(lo, hi)
            sides = [(top["proponents"][r], top["proponent_scores"][r], top["opponents"][r],
                      top["opponent_scores"][r]) for r in range(hi - lo)]
        else:
            sides = []
            for row in res.rows(lo, hi):
                pro, opp = top_indices(row, k)
                sides.append((pro, row[pro], opp, row[opp]))
        for r, (pro, pro_s, opp, opp_s) in enumerate(sides):
            t = lo + r
            line: dict[str, Any] = {"target": t}
            if target_texts is not None:
                line["text"] = target_texts[t]
            for side, idx, vals in (("proponents", pro, pro_s), ("opponents", opp, opp_s)):
                line[side] = []
                for rank, (i, v) in enumerate(zip(idx, vals)):
                    if not (v > 0 if side == "proponents" else v < 0):  # the stored K lowest may be positive
                        continue
                    entry = answer_entry(i, v, train_texts)
                    extra = tokens(t, side, rank, int(i)) if tokens is not None else None
                    if extra:
                        entry.update(extra)
                    line[side].append(entry)
            yield line


def answer_entry(i: Any, score: Any, texts: Any) -> dict[str, Any]:
    """One proponent or opponent: its train index, score and (text data) text."""
    entry: dict[str, Any] = {"train": int(i), "score": float(score)}
    if texts is not None:
        entry["text"] = texts[int(i)]
    return entry


def token_fields(res: Any, target: Any, train: Any, block: int = 64) -> TokenFields:
    """The per-token fields of the answers (``score.per_token``): ``(target, side, rank, train row) -> {...}``,
    the stored per-token scores of ``res`` read ``block`` targets at a time, each sequence's tokens rendered with
    its dataset's (``target``, ``train``) tokenizer."""
    cache: dict[str, Any] = {"lo": -1, "hi": -1}

    @lru_cache(maxsize=4096)
    def tokens_of(which: int, i: int) -> list[str]:
        return token_texts((target, train)[which], i)

    def fields(t: int, side: str, rank: int, doc: int) -> dict[str, Any]:
        if not cache["lo"] <= t < cache["hi"]:
            cache["lo"], cache["hi"] = t, min(t + block, res.n_target)
            cache.update(res.tokens(cache["lo"], cache["hi"]))
        r, s = t - cache["lo"], SIDES.index(side)
        return {"target_tokens": _pairs(tokens_of(0, t), cache["target_tokens"][r, s, rank]),
                "document_tokens": _pairs(tokens_of(1, doc), cache["document_tokens"][r, s, rank])}

    return fields


#: The sides of an answer, in the order of the per-token arrays' second axis.
SIDES = ("proponents", "opponents")


def _pairs(tokens: list[str], values: np.ndarray) -> list[list[Any]]:
    """``[[token text, contribution or None], ...]`` of one sequence (NaN: not a target of the loss)."""
    return [[tok, None if i >= len(values) or not np.isfinite(values[i]) else float(values[i])]
            for i, tok in enumerate(tokens)]


def token_texts(ds: Any, i: int) -> list[str]:
    """The text of each token of row ``i`` of a token dataset (padding left out): what it adds to the decoded
    prefix, so a character split over several tokens shows whole at the token that completes it (the others
    ``""``); the token ids without a tokenizer."""
    _, x, _ = next(iter(ds.batches_of([i], 1)))
    ids = x["input_ids"][0]
    mask = x.get("attention_mask")
    if mask is not None:
        ids = ids[: int(mask[0].sum())]
    tok = getattr(ds, "tokenizer", None)
    if tok is None:
        return [str(int(v)) for v in ids]
    ids = [int(v) for v in ids]
    # a prefix ending inside a character decodes to U+FFFD there: it is left to the token that completes it
    prefixes = [p.rstrip("\ufffd") for p in tok.batch_decode([ids[:i] for i in range(len(ids) + 1)])]
    return [b[len(a):] if b.startswith(a) else tok.decode([ids[i]]) for i, (a, b) in
            enumerate(zip(prefixes, prefixes[1:]))]


def score_meaning(identity: Mapping[str, Any], settings: Mapping[str, Any] | None = None, *,
                  per_token: bool = False) -> str:
    """What one score of an experiment is, in a few sentences: the quantity, its units, and why its size varies,
    from the store's ``identity``, the experiment's ``settings`` (the attributes of ``scores/<experiment>``) and
    whether it has per-token scores."""
    settings = settings or {}
    lm = identity.get("task") == "language_modeling"
    curvature = identity.get("curvature") or {}
    kind = curvature.get("kind")
    output = curvature.get("output", "margin") if kind else "margin"
    if output == "loss":
        quantity = "log-likelihood (minus its cross-entropy loss, in nats)"
    elif identity.get("task") in ("classification", "language_modeling"):
        quantity = "margin (log-odds of the right answer against the rest, in nats)"
    else:
        quantity = "output (the task's output function, in its units)"
    if lm:
        quantity = quantity.replace("log-likelihood", "log-likelihood of its target tokens").replace(
            "margin (", "margin summed over its target tokens (")
    if settings.get("method") == "unroll":
        text = ("A score is a metagradient (MAGIC, Ilyas & Engstrom 2025): minus the derivative of the target's loss "
                "after training with respect to the weight of the train example's loss in every step of the recorded "
                "training run, averaged over the checkpoints, in nats of the target's loss per unit weight: raising "
                "the example's weight from 1 to 1 + e in every step it appears in moves the target's loss by about "
                "-e x score. Positive: up-weighting the example lowers the target's loss. No ridge or damping: "
                "the derivative is exact for the recorded run. Compare scores within one experiment.")
    elif settings.get("normalize") == "unit":
        text = ("A score is a cosine: the target's and the train example's features compared by direction only "
                "(each between -1 and 1 per checkpoint), for ranking; it has no units.")
    elif kind:
        exact = settings.get("curvature_exact") or {}
        damping = exact.get("damping", curvature.get("feature_damping"))
        how = "exactly" if exact else "from the stored projected features"
        bound = (f"the damping ({damping:g} x each layer's mean eigenvalue)" if isinstance(damping, (int, float))
                 else "the damping")
        text = (f"A score is an influence (Koh & Liang 2017), computed {how}: how fast the target's {quantity} rises "
                "per unit of extra weight on the train example's loss in the mean training loss; one more copy of "
                "the example (weight 1/n_train) moves it by about score / n_train. Positive: training on the "
                "example helps the target. Sizes can reach 1e3 to 1e6: the Kronecker-factored curvature "
                f"(Fisher) of the mean loss has small eigenvalues, which only {bound} bounds")
        text += ", and a language model's gradients sum over many tokens." if lm else "."
        text += " Compare scores within one experiment."
    else:
        text = (f"A score is TRAK's estimate (Park et al. 2023) of how much training on the train example raised the "
                f"target's {quantity}: the target's output with the example minus without it, in the output's "
                "units; positive: the example helps the target. It is an estimate for ranking, not a calibrated "
                "difference: its size also depends on the ridge lambda (a larger one, smaller scores) and on "
                "TRAK's out-to-loss term (1 - p of the train example). Compare scores within one experiment.")
    if per_token:
        text += (" A token's value is its share of the document's score, in the same units: a document's values sum "
                 "to its score.")
    return text


def ridge_meaning(lambdas: Sequence[float], lambda_rel: float | None = 1.0, lambda_reg: float | None = None) -> str:
    """What TRAK's ridge ``lambdas`` (λ_m per checkpoint) are, in one sentence, from ``score.lambda_rel`` and
    ``score.lambda_reg``."""
    lam = ", ".join(f"{v:.3g}" for v in lambdas)
    if lambda_reg is not None:
        source = "score.lambda_reg, as given"
    else:
        rel = 1.0 if lambda_rel is None else lambda_rel
        source = f"lambda_rel {rel:g} x the mean squared norm of a train feature"
    return (f"lambda_reg per checkpoint: {lam} ({source}; the ridge is in the squared units of the gradients, so "
            "large gradients, as a language model's summed over many tokens or LoRA's, make it large, and "
            "scaling every gradient by c scales it by c^2 and leaves the scores as they are)")
