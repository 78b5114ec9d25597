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

**Two-stage top-k** (``store.dtype`` int8 or binary, :mod:`trakcli.store.quantize`). One pass
(:meth:`StoredTopK.compute_scan`) reads each block's codes and float copy together: the codes give every
target's approximate scores of the block's rows (:meth:`TwoStageScores.scan_product`), a running top-K'
(K' = ``rescore_multiplier · K``) per target and side keeps the candidates (:class:`RunningTopK`: only the
scores that beat the current K'-th best are merged), and every candidate it takes in is scored exactly at once
from the block's float copy (:meth:`TwoStageScores.pairs`: gathered dot products, not a product over the
rows). The merge then keeps, per target and side, the K' best approximate scores over the segments and among
them the K best exact ones. Where the store is large enough, each side starts from a floor sampled from a
fraction of the rows (:meth:`StoredTopK._seed_floors`), so that few pairs are scored exactly; a smaller store
(fewer than about 3 · K' chunks) has no floor and scores about K' · ln(blocks) pairs per target and side.
In the segments of :meth:`StoredTopK.recall_segments` (at least :data:`RECALL_ROWS` rows, evenly spaced;
all of them for a smaller store) a few evenly spaced targets (``score.recall_queries``) are also scored
exactly against every row.

Two-stage segments hold :data:`TWO_STAGE_SEGMENT_ROWS` rows. Background threads read the next blocks and
compute their products while the current one is filtered (:func:`_pipeline`).

The merge keeps the K best exact scores among each target's candidates: the exact top-k
whenever the true top-K rows are among the candidates (always when K' >= n_train). The
sampled targets' exact scores measure the recall of the result on every run (exactly when
every row was measured, else an estimate: :meth:`StoredTopK.recall`); it is recorded
in the attributes of ``top_k/proponents`` (``two_stage``) and reported. "Exact" here is the
score from the float copy, which is bfloat16: the scores of a float32 or bfloat16 store's plain pass.

Memory is O(n_target · (K + block)) + O(block · proj_dim), whatever n_train
(two-stage: K' for K, two blocks at once, plus the merge of step 2,
O(n_segments · n_target · K'), and the mean Q of every row, 4 bytes a row);
the store grows by O(n_segments · n_target · K) (two-stage: K') while the pass runs
and keeps O(n_target · K). A killed run resumes at its first segment not done. Under
``torchrun`` rank r computes the segments ≡ r (mod world_size) and rank 0
merges, so the arrays are the same as a single process writes.
"""

from trakcli.topk.plan import DEFAULT_RESCORE_MULTIPLIER, TOP_K_ARRAYS, TwoStage, segments
from trakcli.topk.stored import StoredTopK, top_k_arrays, top_k_parts

__all__ = ["DEFAULT_RESCORE_MULTIPLIER", "TOP_K_ARRAYS", "StoredTopK", "TwoStage", "segments", "top_k_arrays",
           "top_k_parts"]
