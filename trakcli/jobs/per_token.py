"""Per-token attribution (``score.per_token``): which tokens of a target, and of each top document, carry its score.

A language model's output function is a sum over its target tokens, ``f = Σ_t f_t`` (``f_t`` the next-token
margin of token ``t``, :func:`trakcli.tasks.language_modeling_margin`), and every map between a gradient and a
score is linear in it. So the score of a target ``x`` and a train document ``z`` of :mod:`trakcli.scoring`
(TRAK, Park et al. 2023, Eq. 17),

    τ(x, z) = [(1/M) Σ_m a_m(x) · b_m(z)] · Q̄(z),

splits exactly over the tokens of either side:

* **target side**, ``τ_t(x, z) = [(1/M) Σ_m a_m(x_t) · b_m(z)] · Q̄(z)`` with ``a_m(x_t)`` the same map applied
  to the gradient of ``f_t(x)`` alone: the featurizer's gradient of a copy of the target whose labels keep token
  ``t`` only; or, when the target has many more tokens than top documents (:attr:`PerTokenScores.jvp_cost`), one
  Jacobian-vector product of its per-token margins along ``Tᵀ A b_m(z)`` per document (the same numbers);
* **train side**, ``τ_s(x, z) = [(1/M) Σ_m ⟨∇_θ f_s(z), v_m(x)⟩] · Q̄(z)``, with ``v_m(x) = Tᵀ a_m(x)`` the
  adjoint of the train features' linear map ``T`` (projection ``Pᵀ`` by the projector's ``unproject``,
  whitening by its vector-Jacobian product, the diagonal second-moment scaling) applied to the target's
  weights: one forward-mode Jacobian-vector product of the document's per-token margins along ``v_m(x)``
  gives every ``s`` at once (:func:`torch.func.jvp` in :func:`forward_mode`), for the top-k documents only.

``a`` and ``b`` per curvature: TRAK's kernel ``a_m(x) = (Φ_mᵀΦ_m + λ_m I)⁻¹ φ_m(x)`` (primal: the stored
Cholesky factor; dual: Woodbury from the stored ``X_m``, ``a = (φ − Φ_mᵀ X_m φ) / λ_m``) and ``b_m(z) = φ_m(z)``
the stored features; ``curvature.kind`` kfac / ekfac from stored features: ``a = φ(x)``, ``b = φ(z)`` (already
whitened); with ``curvature.exact``: ``a`` the target's whitened gradient and ``b`` the document's, recomputed
(:mod:`trakcli.jobs.exact`). Both sides sum to the document's score: ``Σ_t τ_t = Σ_s τ_s = τ``.

Stored under ``scores/<experiment>/per_token`` (:func:`per_token_arrays`): ``target_tokens`` and
``document_tokens`` ``[n_target, 2, K, width]`` float32 (side 0 the proponents, 1 the opponents, in top-k
order; position ``t`` of the sequence, NaN where a token is not a target of the loss or past the sequence's
end), computed and resumed by chunks of targets.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from types import TracebackType
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, jvp
from torch.nn.attention import SDPBackend, sdpa_kernel

from trakcli.data.tensors import inputs_to
from trakcli.data.load import load_dataset, sequence_width
from trakcli.errors import ConfigError, GradientError, StoreError, exception_text
from trakcli.jobs.runtime import event
from trakcli.jobs.kernels import ridge_settings
from trakcli.jobs.setup import JobSetup, prepare, rows_of
from trakcli.models.build import model_name
from trakcli.models.forward import logits_of, model_kwargs
from trakcli.progress import NULL_REPORTER, Reporter
from trakcli.scoring import target_weights
from trakcli.store import ChunkedRows, Store
from trakcli.store.kernel import read_kernel
from trakcli.tasks import (IGNORE_INDEX, LanguageModeling, LossOutput, classification_margin, resolve_task,
                           token_labels, token_losses)

def check_per_token(s: JobSetup, *, normalize: str | None) -> None:
    """Refuse settings per-token scores cannot be computed with, naming the fix (``score.top_k`` is the config's).

    Raises:
        ConfigError: a task other than ``language_modeling``; ``score.normalize: unit``; ``curvature.refine``;
            a curvature or ``second_moment`` with the kronecker projector.
    """
    task = _task(s.featurizer)
    base = task.task if isinstance(task, LossOutput) else task  # curvature.output loss: its token losses split
    if not isinstance(base, LanguageModeling):
        raise ConfigError(f"score.per_token: true needs task: language_modeling (a sum over tokens); this config's "
                          f"task is {getattr(base, 'name', base)!r}")
    if s.curvature is not None and not hasattr(s.featurizer, "grads"):
        raise ConfigError(f"score.per_token: true with curvature.kind {s.curvature.kind} splits whole per-example "
                          "gradients over tokens, which projector.kind kronecker never forms: set projector.kind: sjlt "
                          "for this experiment's store")
    if normalize == "unit":
        raise ConfigError("score.per_token: true splits TRAK's and the curvature's scores; cosines "
                          "(score.normalize: unit) do not split over tokens: set score.normalize: null")
    if s.refine is not None and s.refine.iterations:
        raise ConfigError("score.per_token: true needs scores linear in the target's gradient; conjugate-gradient "
                          "refinement is not: set curvature.refine.iterations: 0")
    if s.featurizer.second_moment is not None and not hasattr(s.featurizer, "grads"):
        raise ConfigError("score.per_token: true with second_moment needs projector.kind rademacher, normal or "
                          "sjlt (the kronecker projection folds the correction into its factors)")


def _task(featurizer: Any) -> Any:
    """The task of a featurizer (a Kronecker featurizer's own, or its per-example gradients')."""
    return getattr(featurizer, "task", None) or getattr(getattr(featurizer, "grads", None), "task", None)


def token_outputs(task: Any, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each target token's term of the task's output function ``[n, L]``: its next-token margin
    (:func:`token_margins`), or for :class:`~trakcli.tasks.LossOutput` minus its next-token cross-entropy; the
    sum over ``t`` is the task's ``f``."""
    if not isinstance(task, LossOutput):
        return token_margins(logits, labels)
    return torch.nn.functional.pad(-token_losses(logits, labels), (1, 0))


def token_margins(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each target token's next-token margin at its own position, ``[n, L]``, of a causal LM's ``[n, L, V]``
    ``logits`` and ``[n, L]`` int64 unshifted ``labels`` (``-100``: not a target): position ``t ≥ 1`` holds
    ``logit_{t−1}(x_t) − logsumexp_{j≠x_t} logit_{t−1}(j)`` where ``labels[t]`` is a target, else 0; the sum over
    ``t`` is :func:`~trakcli.tasks.language_modeling_margin`'s ``f``."""
    nxt = labels[:, 1:]
    valid = nxt != IGNORE_INDEX
    margins, _ = classification_margin(logits[:, :-1, :], torch.where(valid, nxt, 0))
    return torch.nn.functional.pad(margins * valid.to(margins.dtype), (1, 0))


def split_by_token(inputs: dict[str, torch.Tensor], labels: torch.Tensor) -> tuple[dict, torch.Tensor, list, list]:
    """One copy of each row per target token, whose labels keep that token only: ``(inputs, labels, rows,
    positions)``, the copies (``[N, L]`` each) and the row and position of each."""
    at = torch.nonzero(labels[:, 1:] != IGNORE_INDEX)  # (row, position - 1) of every target token, row by row
    rows, positions = at[:, 0].tolist(), (at[:, 1] + 1).tolist()
    idx = torch.tensor(rows, dtype=torch.long)
    out = torch.full((len(rows), labels.shape[1]), IGNORE_INDEX, dtype=labels.dtype)
    if rows:
        out[torch.arange(len(rows)), torch.tensor(positions)] = labels[idx, torch.tensor(positions)]
    return {k: v[idx] for k, v in inputs.items()}, out, rows, positions


class PerTokenScores:
    """Computes the per-token arrays of one experiment's top-k (module docstring).

    Args:
        s, store: the setup `trak score` ran with; the open store (kernels, curvature).
        train_rows: per model_id, the complete train features (``features``, ``out_to_loss``).
        target, k: the targets; the top-k's K.
        width: the arrays' last axis (the longest sequence of the train and target data).
        lambda_key: the ridge settings of the stored kernels (:func:`trakcli.jobs.kernels.ridge_settings`).
        exact_damping: with ``curvature.exact``, its damping; else None.
    """

    #: The target side takes one forward-mode pass of the target per top document instead of one copy of the
    #: target per target token when ``2K · jvp_cost < T``: a JVP costs about two forward + backward passes of
    #: the same tokens (SmolLM2-135M on 2 CPU cores, ``benchmarks/bench_per_token.py``).
    jvp_cost = 2.0

    def __init__(self, s: JobSetup, store: Store, train_rows: list[ChunkedRows], target: Any, k: int, width: int,
                 lambda_key: dict[str, Any], exact_damping: float | None):
        self.s, self.store, self.train_rows, self.target, self.k, self.width = s, store, train_rows, target, k, width
        self._views: dict[int, Any] = {}
        self._kernels: dict[int, Any] = {}
        self.lambda_key, self.exact_damping = lambda_key, exact_damping
        self.names = list(s.featurizer.param_names)
        self.rows_per_batch = max(1, s.batch_rows)

    def compute(self, lo: int, hi: int, top: dict[str, np.ndarray], reporter: Reporter = NULL_REPORTER) -> dict:
        """The per-token arrays of targets ``[lo, hi)`` given their top-k rows ``top`` (``[hi - lo, K]`` arrays).

        Returns:
            ``{"target_tokens", "document_tokens"}``: ``[hi - lo, 2, K, width]`` float32.
        """
        n_models = len(self.s.checkpoints)
        docs = np.stack([top["proponents"], top["opponents"]], axis=1)  # [r, 2, K]
        k = docs.shape[2]
        t_acc = np.zeros((hi - lo, 2, k, self.width))
        d_acc = np.zeros((hi - lo, 2, k, self.width))
        t_mask = np.zeros((hi - lo, self.width), dtype=bool)
        d_mask = np.zeros((hi - lo, 2, k, self.width), dtype=bool)
        unique = sorted(set(docs.ravel().tolist()))
        where = {d: i for i, d in enumerate(unique)}
        q_bar = np.zeros(len(unique))
        for model_id in range(n_models):
            event(f"start per-token {model_id} {lo}")
            self._load(model_id)
            # stored features of every document of the chunk at once; exact gradients ([2K, grad_dim]) per target
            b_all = self._documents(model_id, unique) if self.exact_damping is None else None
            q_bar += self._out_to_loss(model_id, unique)
            with reporter.task(f"per-token scores model {model_id}", hi - lo) as task:
                for r, t in enumerate(range(lo, hi)):
                    x, y = rows_of(self.target, [t], 1)[0]
                    mine = docs[r].ravel().tolist()
                    b = b_all[[where[d] for d in mine]] if b_all is not None else self._documents(model_id, mine)
                    positions = (torch.nonzero(token_labels({**x, "labels": y})[0, 1:] != IGNORE_INDEX).flatten()
                                 + 1).tolist()
                    if len(mine) * self.jvp_cost < len(positions):  # one JVP of the target per document
                        a_q = self.weights_of(model_id, x, y, t)
                        flat = t_acc[r].reshape(2 * k, self.width)  # a view
                        for j in range(len(mine)):
                            w = self._adjoint(model_id, self._weights(model_id, torch.from_numpy(b[j:j + 1])))
                            got, _ = self._token_jvp(self.target, [t], w)
                            flat[j, :got.shape[1]] += got[0]
                    else:  # one copy of the target per target token
                        a_tok, positions = self._target_tokens(model_id, x, y, t)  # [T, p] float64
                        terms = (a_tok @ b.T).reshape(len(positions), 2, k)  # [T, 2, K]
                        t_acc[r][:, :, positions] += terms.transpose(1, 2, 0)
                        a_q = torch.from_numpy(a_tok.sum(0, keepdims=True))
                    t_mask[r, positions] = True
                    v = self._adjoint(model_id, a_q)
                    got, valid = self._token_jvp(self.s.train, mine, v)  # [2K, L]
                    L = got.shape[1]
                    d_acc[r, :, :, :L] += got.reshape(2, k, L)
                    d_mask[r, :, :, :L] |= valid.reshape(2, k, L)
                    task.advance()
            event(f"done per-token {model_id} {lo}")
        q = (q_bar / n_models)[[[[where[d] for d in side] for side in row] for row in docs.tolist()]]  # [r, 2, K]
        t_out = t_acc / n_models * q[..., None]
        d_out = d_acc / n_models * q[..., None]
        t_out[~np.broadcast_to(t_mask[:, None, None, :], t_out.shape)] = np.nan
        d_out[~d_mask] = np.nan
        return {"target_tokens": t_out.astype(np.float32), "document_tokens": d_out.astype(np.float32)}

    def _load(self, model_id: int) -> None:
        """Load checkpoint ``model_id`` (and the curvature that whitened its stored features)."""
        self.s.load(model_id)
        if self.s.curvature is not None and self.exact_damping is None:
            self.s.curvature.read(self.store, model_id)

    def _out_to_loss(self, model_id: int, docs: list[int]) -> np.ndarray:
        return self.train_rows[model_id].take("out_to_loss", docs).astype(np.float64)

    def _documents(self, model_id: int, docs: list[int]) -> np.ndarray:
        """``b_m(z)`` of the documents ``[n_docs, p]`` float64: stored features, or (exact) whitened gradients."""
        if self.exact_damping is not None:
            batches = rows_of(self.s.train, docs, self.rows_per_batch, self.s.batch_tokens)
            return torch.cat([self._exact(model_id, x, y, 0) for x, y in batches]).numpy()
        return self.train_rows[model_id].take("features", docs).astype(np.float64)

    def _exact(self, model_id: int, x: Any, y: torch.Tensor, row: int) -> torch.Tensor:
        """The whitened gradients of rows ``(x, y)`` with the exact scores' damping: ``[r, grad_dim]`` float64."""
        g, _ = self.s.featurizer.transformed(inputs_to(x, self.s.device), y.to(self.s.device), model_id, row,
                                             curvature=self._view(model_id))
        return self.s.featurizer.grads.flatten(g).double().cpu()

    def _view(self, model_id: int) -> Any:
        """Checkpoint ``model_id``'s curvature with the exact scores' damping (read once)."""
        if model_id not in self._views:
            self.s.curvature.read(self.store, model_id)
            self._views[model_id] = self.s.curvature.with_damping(self.exact_damping)
        return self._views[model_id]

    def _target_tokens(self, model_id: int, x: Any, y: torch.Tensor, row: int) -> tuple[np.ndarray, list[int]]:
        """``a_m(x_t)`` of each target token of one target ``[T, p]`` float64, and the tokens' positions."""
        xs, ys, _, positions = split_by_token(x, token_labels({**x, "labels": y}))
        return self.weights_of(model_id, xs, ys, row).numpy(), positions

    def weights_of(self, model_id: int, x: Any, y: torch.Tensor, row: int) -> torch.Tensor:
        """``a_m`` of rows ``(x, y)`` (targets, or copies of one): ``[r, p]`` float64 (``p`` grad_dim when exact)."""
        parts, exact = [], self.exact_damping is not None
        for b in range(0, y.shape[0], self.rows_per_batch):
            xb = {k_: v[b:b + self.rows_per_batch] for k_, v in x.items()}
            yb = y[b:b + self.rows_per_batch]
            parts.append(self._exact(model_id, xb, yb, row) if exact else
                         self.s.features(xb, yb, model_id, row)[0].double().cpu())
        width = self.s.grad_dim if exact else self.s.proj_dim
        phi = torch.cat(parts) if parts else torch.zeros(0, width, dtype=torch.float64)  # a target without targets
        return self._weights(model_id, phi)

    def train_tokens(self, queries: list[int], reporter: Reporter = NULL_REPORTER) -> np.ndarray:
        """The train-side per-token scores of every train document for each query (per-token QLD):
        ``[n_queries, n_train, width]`` float32, ``τ_s(x, z)`` at document ``z``'s position ``s`` (NaN where ``s`` is
        not a target of the loss)."""
        n_models, n = len(self.s.checkpoints), len(self.s.train)
        docs = list(range(n))
        acc = np.zeros((len(queries), n, self.width))
        mask = np.zeros((n, self.width), dtype=bool)
        q_bar = np.zeros(n)
        for model_id in range(n_models):
            self._load(model_id)
            q_bar += self._out_to_loss(model_id, docs)
            with reporter.task(f"per-token train scores model {model_id}", len(queries)) as task:
                for i, t in enumerate(queries):
                    x, y = rows_of(self.target, [t], 1)[0]
                    v = self._adjoint(model_id, self.weights_of(model_id, x, y, t))
                    got, valid = self._token_jvp(self.s.train, docs, v)
                    acc[i, :, :got.shape[1]] += got
                    mask[:, :valid.shape[1]] |= valid
                    task.advance()
        out = acc / n_models * (q_bar / n_models)[None, :, None]
        out[:, ~mask] = np.nan
        return out.astype(np.float32)

    def _weights(self, model_id: int, phi: torch.Tensor) -> torch.Tensor:
        """``a_m`` of features ``[r, p]`` float64: the kernel's solve (TRAK), or the features themselves."""
        if self.s.curvature is not None:  # whitened already (stored features or exact gradients)
            return phi
        kernel, lam, big_phi = self._kernel(model_id)
        if big_phi is None:  # PRIMAL: Cholesky factor of ΦᵀΦ + λI
            return target_weights(kernel, phi, dtype=torch.float64)
        # DUAL: X = (ΦΦᵀ + λI)⁻¹Φ; (ΦᵀΦ + λI)⁻¹φ = (φ − Φᵀ X φ) / λ (Woodbury)
        return (phi - (phi @ kernel.T) @ big_phi) / lam

    def _kernel(self, model_id: int) -> tuple[torch.Tensor, float, torch.Tensor | None]:
        """Checkpoint ``model_id``'s stored kernel, read once: ``(factor, λ, None)`` (primal) or ``(X, λ, Φ)`` with
        the train features ``Φ`` ``[n_train, p]`` (dual), float64."""
        if model_id not in self._kernels:
            stored = read_kernel(self.store, model_id, self.lambda_key)
            if stored is None:
                raise StoreError(f"the kernel of model_id {model_id} with this config's score.lambda_reg / "
                                 f"lambda_rel is not in {self.store.path}; run `trak score CONFIG` first")
            kernel, lam = torch.from_numpy(stored[0]).double(), stored[1]
            big_phi = None
            if kernel.shape[0] != kernel.shape[1]:  # DUAL: X [n_train, p]
                rows = self.train_rows[model_id]
                big_phi = torch.from_numpy(rows.read("features", 0, rows.n_rows).astype(np.float64))
            self._kernels[model_id] = (kernel, lam, big_phi)
        return self._kernels[model_id]

    def _adjoint(self, model_id: int, a: torch.Tensor) -> dict[str, torch.Tensor]:
        """``v_m = Tᵀ a`` of one target's weights ``[1, p]``: per selected parameter ``[*shape]`` float32."""
        feat, params = self.s.featurizer, dict(self.s.model.named_parameters())
        if self.exact_damping is not None:
            g = _split(a.float(), self.names, params)
            curvature = self._view(model_id)
        else:
            z = a.to(torch.float32).to(self.s.device)
            if hasattr(feat.projector, "unproject_params"):
                g = {n: t.float() for n, t in feat.projector.unproject_params(z, model_id).items()}
            else:
                g = _split(feat.projector.unproject(z, model_id).float(), self.names, params)
            curvature = getattr(feat, "curvature", None)
        g = {n: t.to(self.s.device) for n, t in g.items()}
        if curvature is not None:  # Wᵀ: the vector-Jacobian product of the (linear) whitening
            x = {n: torch.zeros_like(t, requires_grad=True) for n, t in g.items()}
            with torch.enable_grad():
                y = curvature.whiten(x, model_id)
                grads = torch.autograd.grad([y[n] for n in self.names], [x[n] for n in self.names],
                                            [g[n] for n in self.names], allow_unused=True)
            g = {n: (t if t is not None else torch.zeros_like(x[n])).detach() for n, t in zip(self.names, grads)}
        if feat.second_moment is not None:  # a diagonal scaling: its own adjoint
            g = feat.second_moment.scale_gradients(g, model_id)
        return {n: t[0].to(params[n].dtype) for n, t in g.items()}

    def _token_jvp(self, data: Any, docs: list[int], v: dict[str, torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
        """``⟨∇_θ f_s(z), v⟩`` of every token ``s`` of each row ``z`` of ``data`` ``[n_rows, L]`` float64 (one
        forward-mode pass), and the targets' mask."""
        model, task = self.s.model, _task(self.s.featurizer)
        primal = {n: p.detach() for n, p in model.named_parameters() if n in v}
        outs, masks = [], []
        for x, y in rows_of(data, docs, self.rows_per_batch, self.s.batch_tokens):
            x = inputs_to(x, self.s.device)
            labels = token_labels({**x, "labels": y.to(self.s.device)})

            def margins(p: dict[str, torch.Tensor]) -> torch.Tensor:
                out = functional_call(model, p, args=(), kwargs=model_kwargs(model, x))
                return token_outputs(task, logits_of(out), labels)

            # forward mode only: no backward graph of the parameters left out of v
            with torch.no_grad(), forward_mode(model):
                _, tangent = jvp(margins, (primal,), (v,))
            outs.append(tangent.detach().double().cpu().numpy())
            masks.append(torch.nn.functional.pad(labels[:, 1:] != IGNORE_INDEX, (1, 0)).cpu().numpy())
        width = max(o.shape[1] for o in outs)  # batches padded to their own longest row: zeros past it
        return (np.concatenate([np.pad(o, ((0, 0), (0, width - o.shape[1]))) for o in outs]),
                np.concatenate([np.pad(m, ((0, 0), (0, width - m.shape[1]))) for m in masks]))


#: The messages of torch's operations without a forward-mode derivative: a built-in operator (its name in
#: group 1), a custom ``torch.autograd.Function`` without a ``jvp`` staticmethod.
_NO_FORWARD_AD = (re.compile(r"forward AD with (\S+) that does not support it"),
                  re.compile(r"implement the jvp function for custom autograd\.Function"))


@contextmanager
def forward_mode(model: nn.Module) -> Iterator[None]:
    """Run a forward-mode pass (:func:`torch.func.jvp`) of ``model`` inside this context.

    Scaled dot-product attention (transformers' default ``attn_implementation="sdpa"``) runs on its math kernel:
    the fused kernels have no forward-mode derivative, while the math kernel computes the eager attention's
    formula, ``softmax(q kᵀ / √d + mask) v``, from operations that have one. Nothing of the model is changed.

    Raises:
        GradientError: an operation of the forward pass has no forward-mode derivative (naming it, the model's
            module that ran it and the fix; chained to torch's exception).
    """
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    except (NotImplementedError, RuntimeError) as e:
        found = [m for m in (p.search(str(e)) for p in _NO_FORWARD_AD) if m]
        if not found:
            raise
        raise _no_forward_ad(model, e, found[0]) from e


def _no_forward_ad(model: nn.Module, exc: BaseException, match: re.Match) -> GradientError:
    """The :class:`GradientError` of :func:`forward_mode` for ``exc``, torch's error of an operation without a
    forward-mode derivative."""
    module, function = _where(model, exc.__traceback__)
    if match.groups():  # a built-in operator
        what = f"the operation {match.group(1)}"
        fix = "replace it in the model by operations with a forward-mode derivative"
        impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
        if isinstance(impl, str) and impl not in ("eager", "sdpa"):  # flash_attention_2, flex_attention, ...
            fix = f"build the model with attn_implementation=\"eager\" (it has {impl!r})"
    else:
        what = f"the custom autograd.Function {function or ''}".rstrip()
        fix = ("give it a jvp staticmethod (https://pytorch.org/docs/stable/notes/extending.func.html) or replace "
               "it in the model")
    where = f" in module {module[0]!r} ({type(module[1]).__name__})" if module else ""
    return GradientError(
        f"score.per_token: true takes forward-mode derivatives (torch.func.jvp) of the per-token outputs of "
        f"{model_name(model)}, and {what}{where} has none ({exception_text(exc)}): {fix}, or set "
        f"score.per_token: false")


def _where(model: nn.Module, tb: TracebackType | None) -> tuple[tuple[str, nn.Module] | None, str | None]:
    """The innermost module of ``model`` whose ``forward`` ran at the traceback's end, as ``(name, module)``
    (the model itself named ``"model"``), and the innermost custom ``autograd.Function``'s name; None where none."""
    names = {id(m): n or "model" for n, m in model.named_modules()}
    module, function = None, None
    while tb is not None:
        local = tb.tb_frame.f_locals
        me = local.get("self")
        if isinstance(me, nn.Module) and id(me) in names:
            module = (names[id(me)], me)
        cls = local.get("cls")
        if isinstance(cls, type) and issubclass(cls, torch.autograd.Function):
            function = cls.__name__
        tb = tb.tb_next
    return module, function


def _split(flat: torch.Tensor, names: list[str], params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``[r, grad_dim]`` -> per parameter ``[r, *shape]``, in ``names`` order."""
    out, at = {}, 0
    for n in names:
        size = params[n].numel()
        out[n] = flat[:, at:at + size].reshape(flat.shape[0], *params[n].shape)
        at += size
    return out


def per_token_width(s: JobSetup, target: Any) -> int:
    """The per-token arrays' last axis: the most tokens a train or target row has (:func:`sequence_width`)."""
    return max(sequence_width(d) for d in (s.train, target)) or 1


def query_token_scores(cfg: Any, queries: list[int], reporter: Reporter = NULL_REPORTER) -> np.ndarray:
    """Per-token scores of every train document's tokens for the target rows ``queries`` (`trak eval qld` with
    ``eval.qld.per_token``) from the config's featurized store: ``[n_queries, n_train, width]`` float32
    (:meth:`PerTokenScores.train_tokens`).

    Raises:
        StoreError: no or incomplete train features, or no kernel (run `trak featurize` / `trak score`).
        ConfigError: settings per-token scores cannot split (:func:`check_per_token`).
    """
    from trakcli.jobs.score import check_train_complete  # score imports this module

    s = prepare(cfg, need_target=True, reporter=reporter)
    check_per_token(s, normalize=cfg.score.normalize)
    target = load_dataset(cfg.data.target, key="data.target", task=resolve_task(cfg.task))
    store = Store.open_existing(cfg.store.location, mode="r")
    train_rows = check_train_complete(s, store)
    exact = s.exact_damping if s.curvature is not None else None
    scorer = PerTokenScores(s, store, train_rows, target, 0, per_token_width(s, target),
                            ridge_settings(cfg.score.lambda_reg, cfg.score.lambda_rel), exact)
    return scorer.train_tokens(queries, reporter)


def per_token_arrays(store: Store, experiment: str, n_target: int, k: int, width: int, create: bool = True,
                     repair: bool = False) -> ChunkedRows:
    """The per-token scores of an experiment's top-k, ``scores/<experiment>/per_token``: ``target_tokens`` and
    ``document_tokens`` ``[n_target, 2, k, width]`` float32 (module docstring), a done flag per chunk of about
    4 MB of target rows.

    Raises:
        StoreMismatchError: the stored arrays have another ``k`` or ``width`` (names ``--overwrite``).
    """
    t_rows = min(n_target, max(1, (4 << 20) // (16 * k * width)))
    arrays = {a: ((n_target, 2, k, width), "float32", (t_rows, 2, k, width), ("target", "side", "rank", "position"))
              for a in ("target_tokens", "document_tokens")}
    return store.sized_rows(f"scores/{experiment}/per_token", {"k": k, "width": width}, arrays, n_target, t_rows,
                            create, repair)
