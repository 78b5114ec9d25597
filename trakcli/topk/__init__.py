"""The streamed top-k of `trak score` (``score.top_k``): per target, the K highest and K lowest scores.

The train rows are cut into segments of whole chunks (:func:`segments`), the unit of resume and of work between
``torchrun`` ranks. One pass per segment scores every target against a block of train rows at a time, keeps a
running top-k and writes the segment's proponents and opponents to ``scores/<experiment>/top_k_parts``; when
every segment is done, rank 0 merges them into ``scores/<experiment>/top_k`` (best first, equal scores by train
index) and drops the parts. Over a store with codes (``store.dtype`` int8 or binary) the top-k is two-stage: the
codes pick K' candidates per target and side, which are scored exactly from the float copy, and the recall of a
few sampled targets is measured (:meth:`StoredTopK.compute_scan`; docs/guides/store.md, "Compressed features and
two-stage top-k"). Memory is O(n_target · (K + block)) + O(block · proj_dim), whatever n_train.
"""

from trakcli.topk.plan import DEFAULT_RESCORE_MULTIPLIER, TOP_K_ARRAYS, TwoStage, segments
from trakcli.topk.stored import StoredTopK, top_k_arrays, top_k_parts

__all__ = ["DEFAULT_RESCORE_MULTIPLIER", "TOP_K_ARRAYS", "StoredTopK", "TwoStage", "segments", "top_k_arrays",
           "top_k_parts"]
