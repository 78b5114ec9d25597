"""The scores of every target against blocks of stored train rows, from the stored features
(:class:`FeatureScores`): TRAK's ensembled scores, cosines, a curvature's whitened inner products, and, over a
store with codes, the approximate and exact scores of a two-stage top-k.

Formula: :mod:`trakcli.scoring` (Park et al. 2023, Eq. 17).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from trakcli.scoring import (cosine_term, dual_target_sq_norms, ensemble_block, kernel_sq_norms, score_block,
                             target_weights)
from trakcli.store import ChunkedRows
from trakcli.store.quantize import signs


def _as_tensor(arr: np.ndarray) -> torch.Tensor:
    """A stored feature array as a torch tensor: bfloat16 bits (uint16) viewed as ``torch.bfloat16`` (no copy),
    anything else as float32."""
    if arr.dtype == np.uint16:
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr.astype(np.float32, copy=False))


class FeatureScores:
    """The ensembled scores of every target against a block of train rows, ``(lo, hi) -> [n_target, hi - lo]``.

    TRAK's (:func:`~trakcli.scoring.score_block`: float32 products ``W_m Φ_m[block]ᵀ`` of float64
    solves, times the mean Q), or with ``unit`` the mean over checkpoints of the cosines in each
    kernel's space (:func:`~trakcli.scoring.cosine_term`). A dual checkpoint's term ``Φ_m(targets) X_mᵀ``
    is one float32 product for all columns (summed over checkpoints in float64, ``[n_target, n_train]``).
    """

    def __init__(self, train_rows: list[ChunkedRows], unit: bool):
        self.train_rows, self.unit = train_rows, unit
        self.weights: list[torch.Tensor] = []  # per primal checkpoint: W_m [n_target, proj_dim] float32
        self.primal: list[tuple[ChunkedRows, torch.Tensor, torch.Tensor]] = []  # rows, factor, target norms²
        self.dual_total: torch.Tensor | None = None
        # two-stage top-k: per primal checkpoint the int8 target weights and their scales (made on first use)
        self._qweights: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._local = threading.local()  # per thread: the int32 product and a term of :meth:`scan_product`
        self._ring: list[torch.Tensor | None] = [None] * self.SCAN_SLOTS  # :meth:`scan_product`'s outputs

    def add(self, model_id: int, kernel: torch.Tensor | None, lam: float, phi_t: torch.Tensor) -> None:
        """Add checkpoint ``model_id``: its kernel (primal factor, dual X, or None: no kernel), ridge and target features."""
        rows = self.train_rows[model_id]
        # None: the features' own inner products (curvature kfac / ekfac); PRIMAL ([proj_dim, proj_dim]; the dual's
        # X has n_train < proj_dim rows): Cholesky of ΦᵀΦ + λI
        if kernel is None or kernel.shape[0] == kernel.shape[1]:
            w = phi_t if kernel is None else target_weights(kernel, phi_t, dtype=torch.float32)
            self.weights.append(w)
            t_sq = (w.double() * phi_t.double()).sum(1) if self.unit else torch.empty(0)
            self.primal.append((rows, kernel, t_sq))
            return
        # DUAL: X_m = (Φ_mΦ_mᵀ + λI)⁻¹Φ_m [n_train, proj_dim], n_train < proj_dim; the term Φ_t X_mᵀ
        term = phi_t @ kernel.T  # float32, as the primal products
        if self.unit:
            phi = torch.from_numpy(rows.read("features", 0, rows.n_rows).astype(np.float32, copy=False))
            z_sq = (phi.double() * kernel.double()).sum(1)  # φᵀAφ = φ · X_i
            term = cosine_term(term.double(), dual_target_sq_norms(phi_t, term, phi, lam), z_sq)
        self.dual_total = term.double() if self.dual_total is None else self.dual_total.add_(term)

    # -- two-stage top-k over int8 / binary codes ---------------------------------------------------------------

    def _mean_q(self, lo: int, hi: int, slot: int) -> torch.Tensor:
        """``[hi - lo]`` float32 mean out-to-loss over checkpoints (averaged in float64, as :func:`ensemble_block`),
        read with each block (a read of every row up front would add to the run)."""
        rows = self.train_rows
        q = sum(r.read_direct("out_to_loss", lo, hi, slot=slot).astype(np.float64) for r in rows) / len(rows)
        return torch.from_numpy(np.asarray(q, dtype=np.float32))

    def _quantized_weights(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per primal checkpoint ``(ŵ [n_target, proj_dim] int8, s_t [n_target] float32)``: the target weights
        ``W_m`` rounded with a per-target scale ``s_t = max|W_m[t]| / 127`` (made on first use)."""
        if self._qweights is None:  # threads may race here: each makes the same list, one is kept
            made = []
            for w in self.weights:  # [n_target, proj_dim] float32
                s_t = w.abs().amax(1) / 127
                safe = torch.where(s_t > 0, s_t, torch.ones_like(s_t))
                wq = torch.round(w / safe[:, None]).clamp_(-127, 127).to(torch.int8)  # [n_target, proj_dim]
                made.append((wq, s_t))
            self._qweights = made
        return self._qweights

    #: Buffers of each array that :meth:`scan_read` reads in turn (the ``i``-th read of a pass uses buffer
    #: ``i mod SCAN_SLOTS``): more than the blocks held at once by the reads ahead, the products and the caller
    #: (:func:`trakcli.topk.stream._pipeline`: its ``depth + workers + 1``, 7).
    SCAN_SLOTS = 8

    def scan_read(self, lo: int, hi: int, slot: int) -> tuple[tuple[list[np.ndarray], list[np.ndarray],
                                                                     torch.Tensor, int], Any]:
        """Everything a one-pass two-stage top-k needs of train rows ``lo .. hi`` (whole chunks), read only (a
        thread reads the next blocks while the product of this one is computed), for the ``slot``-th read of the
        pass (:meth:`~trakcli.store.rows.ChunkedRows.read_direct`'s reused buffers).

        Returns:
            ``((codes, scales, q, slot), (features, q))``: per primal checkpoint the codes ``[rows, proj_dim]``
            int8 (±1 for binary) and the row scales ``[rows]`` float32, the ``[rows]`` mean Q, and the float copy
            of the rows (bfloat16 kept as stored; :meth:`pairs` and :meth:`rows` convert what they use).
        """
        slot %= self.SCAN_SLOTS
        proj_dim = self.weights[0].shape[1]
        codes = [signs(rows.code_dtype, rows.read_direct("codes", lo, hi, slot=slot), proj_dim)
                 for rows, _, _ in self.primal]
        scales = [rows.read_direct("scale", lo, hi, slot=slot).astype(np.float32, copy=False)
                  for rows, _, _ in self.primal]
        q = self._mean_q(lo, hi, slot)
        feats = [_as_tensor(rows.read_direct("features", lo, hi, raw=True, slot=slot)) for rows, _, _ in self.primal]
        return (codes, scales, q, slot), (feats, q)

    def scan_product(self, read: tuple[tuple[list[np.ndarray], list[np.ndarray], torch.Tensor, int], Any]
                     ) -> tuple[torch.Tensor, Any]:
        """``(approximate scores [rows, n_target] float32, the float copy)`` of a :meth:`scan_read`.

        Per checkpoint, ``W_m φ_i ≈ s_t s_i · (ŵ_t · c_i)``: the target weights rounded to int8
        (:meth:`_quantized_weights`), the row's codes ``c_i`` and scale ``s_i``; the int8 product is exact in int32
        (``torch._int_mm``, the codes as stored on the left: faster on AVX-512 VNNI). Summed over checkpoints,
        times the mean Q of the row, as :func:`~trakcli.scoring.score_block`. With one checkpoint the scores are
        left divided by ``s_t``: a positive factor per target, which orders each target's rows as the scores do
        (the candidates, their thresholds and their merge all stay in these units). The scores are the slot's
        reused buffer: valid until the read ``SCAN_SLOTS`` later.
        """
        (codes, scales, q, slot), floats = read
        qweights = self._quantized_weights()
        n, n_target = len(q), qweights[0][0].shape[0]
        if self._ring[slot] is None or self._ring[slot].shape[0] < n:
            self._ring[slot] = torch.empty(n, n_target)
        own = self._local.__dict__.get("product")  # the int32 product and a term, the thread's own
        if own is None or own[0].shape[0] < n:
            own = self._local.product = (torch.empty(n, n_target, dtype=torch.int32), torch.empty(n, n_target))
        acc, prod, tmp = self._ring[slot][:n], own[0][:n], own[1][:n]
        for m, ((wq, s_t), c, scale) in enumerate(zip(qweights, codes, scales)):
            torch._int_mm(torch.from_numpy(c), wq.T, out=prod)  # [rows, n_target] int32
            term = acc if m == 0 else tmp
            torch.mul(prod, (torch.from_numpy(scale) * q)[:, None], out=term)  # float32
            if len(qweights) > 1:
                term.mul_(s_t[None, :])
            if m:
                acc.add_(term)
        return acc, floats

    #: Pairs scored at once by :meth:`pairs` (their gathered rows: ``PAIR_GROUP · proj_dim`` float32).
    PAIR_GROUP = 8192

    def pairs(self, block: tuple[list[torch.Tensor], torch.Tensor], targets: torch.Tensor,
              rows: torch.Tensor) -> torch.Tensor:
        """Exact scores ``[p]`` float32 of target ``targets[j]`` against row ``rows[j]`` of ``block``, pair by pair.

        ``[(1/M) Σ_m W_m[t] · Φ_m[i]] · Q̄_i``, the formula of :func:`~trakcli.scoring.score_block` for one pair,
        from gathered rows and target weights (float32), :data:`PAIR_GROUP` pairs at a time.

        Args:
            block: :meth:`scan_product`'s float copy of rows (float32 or bfloat16, converted to
                float32 as they are gathered).
            targets: ``[p]`` int64 target indices.
            rows: ``[p]`` int64 row indices within the block.
        """
        feats, q = block
        out = torch.empty(len(rows), dtype=torch.float32)
        for g in range(0, len(rows), self.PAIR_GROUP):
            r, t = rows[g : g + self.PAIR_GROUP], targets[g : g + self.PAIR_GROUP]
            acc = None
            for w, f in zip(self.weights, feats):
                term = f.index_select(0, r).float().mul_(w.index_select(0, t)).sum(1)  # [group]
                acc = term if acc is None else acc.add_(term)
            out[g : g + self.PAIR_GROUP] = acc.div_(len(feats)).mul_(q[r])
        return out

    def rows(self, block: tuple[list[torch.Tensor], torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        """Exact scores ``[len(targets), rows]`` float32 of the targets ``targets`` against the whole block."""
        feats, q = block
        return score_block([w[targets] for w in self.weights], feats, [q] * len(feats))

    def __call__(self, lo: int, hi: int) -> torch.Tensor:
        return self.score_read(self.read_block(lo, hi), lo, hi)

    def read_block(self, lo: int, hi: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The stored rows ``lo .. hi`` that :meth:`score_read` needs (only reads: a background thread reads the
        next block while this one is scored): per primal checkpoint its features ``[hi - lo, proj_dim]`` float32,
        and per checkpoint its out-to-loss ``[hi - lo]`` (none with ``unit``)."""
        feats = [torch.from_numpy(r.read("features", lo, hi).astype(np.float32, copy=False)) for r, _, _ in self.primal]
        qs = [] if self.unit else [torch.from_numpy(r.read("out_to_loss", lo, hi)) for r in self.train_rows]
        return feats, qs

    def score_read(self, read: tuple[list[torch.Tensor], list[torch.Tensor]], lo: int, hi: int) -> torch.Tensor:
        """The scores ``[n_target, hi - lo]`` of rows ``lo .. hi`` from their :meth:`read_block`."""
        feats, qs = read
        if self.unit:
            total = torch.zeros(0) if self.dual_total is None else self.dual_total[:, lo:hi].clone()
            for w, f, (_, factor, t_sq) in zip(self.weights, feats, self.primal):
                z_sq = f.double().square().sum(1) if factor is None else kernel_sq_norms(factor, f)
                term = cosine_term(w @ f.T, t_sq, z_sq).double()
                total = term if total.numel() == 0 else total.add_(term)
            return (total / len(self.train_rows)).to(torch.float32)
        if self.dual_total is None:  # every checkpoint is of one form (kernel_form of n_train and proj_dim)
            return score_block(self.weights, feats, qs)
        return ensemble_block(self.dual_total[:, lo:hi], qs)
