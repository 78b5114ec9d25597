"""The streamed top-k of `trak score` (``score.top_k``): per target, the K highest and K lowest scores.

The train rows are cut into *segments* (runs of whole ``chunk_rows`` chunks,
:func:`segments`). One pass per segment reads its train features a block at a
time, scores every target against the block (the same ensembled score as the
full matrix: :mod:`trakcli.scoring`) and keeps a running top-k
(:func:`trakcli.scoring.merge_top_k`); the segment's K proponents and opponents
are then written to ``scores/<experiment>/top_k_parts`` with its done flag. When
every segment is done, the candidates of all segments are merged per chunk of
targets into ``scores/<experiment>/top_k`` (best first, equal scores by train
index: :func:`trakcli.scoring.order_top_k`) and the parts are dropped.

**Two-stage top-k** (``store.dtype`` int8 or binary, :mod:`trakcli.store.quantize`). With
``score.rerank`` ``scan`` (:meth:`StoredTopK.compute_scan`), one pass reads each block's codes and float
copy together and scores every candidate exactly as its block passes; the merge then keeps, per target
and side, the K' best approximate scores and among them the K best exact ones. With ``rows``, three steps:

1. per segment, a pass over the compressed codes scores every target against every row
   approximately (:meth:`TwoStageScores.approx`) and keeps the K' = ``rescore_multiplier · K``
   highest and lowest per target (``scores/<experiment>/top_k_candidates``, done per segment;
   :class:`RunningTopK`: only the scores that beat the current K'-th best are merged);
2. the segments' candidates are merged into K' candidates per target and side (every rank
   computes the same merge from the stored parts), their (target, row) pairs sorted by row;
3. per segment, the float copy (bfloat16) of the segment's candidate rows is read, row by row
   (:meth:`TwoStageScores.gather`; :mod:`trakcli.store.rowread`: ``proj_dim · 2`` bytes a row, not
   the segment's chunks), and the candidate pairs are re-scored exactly
   (:meth:`TwoStageScores.pairs`: gathered dot products, not a product over the rows;
   ``top_k_parts``, done per segment). In the segments of :meth:`StoredTopK.recall_segments`
   (at least :data:`RECALL_ROWS` rows, evenly spaced; all of them for a smaller store) a few
   evenly spaced targets (``score.recall_queries``) are also scored exactly against every row.

Two-stage segments hold :data:`TWO_STAGE_SEGMENT_ROWS` rows. The candidate pass computes the
next block's product, and the re-ranking reads the next segment's rows, in a background thread
while the current one is merged (:func:`_ahead`).

The merge keeps the K best exact scores among each target's candidates: the exact top-k
whenever the true top-K rows are among the candidates (always when K' >= n_train). The
sampled targets' exact scores measure the recall of the result on every run (exactly when
every row was measured, else an estimate: :meth:`StoredTopK.recall`); it is recorded
in the attributes of ``top_k/proponents`` (``two_stage``) and reported. Exact re-ranking costs
O(n_target · K' · proj_dim) in reads and products, whatever n_train.

Memory is O(n_target · (K + block)) + O(block · proj_dim), whatever n_train
(two-stage: K' for K, two blocks at once, plus the merge of step 2,
O(n_segments · n_target · K'), and the mean Q of every row, 4 bytes a row);
the store grows by O(n_segments · n_target · K) (two-stage: K') while the pass runs
and keeps O(n_target · K). A killed run resumes at its first segment not done. Under
``torchrun`` rank r computes the segments ≡ r (mod world_size) and rank 0
merges, so the arrays are the same as a single process writes.
"""

from trakcli.topk.plan import DEFAULT_RESCORE_MULTIPLIER, TwoStage, segments
from trakcli.topk.stored import StoredTopK

__all__ = ["DEFAULT_RESCORE_MULTIPLIER", "StoredTopK", "TwoStage", "segments"]
