"""Two-stage top-k over int8 / binary codes (trakcli.topk): the store's layout, exactness when the
candidates cover every row, the recall each run measures and records, kill and resume, torchrun, bad config;
the filtered running top-k and the candidate pairs of the re-ranking against their plain equivalents."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import zarr

from trakcli.topk import StoredTopK

from projects import N_TRAIN, assert_same_store, free_port, kill_at, make_project, run
from trakcli.store.quantize import decode

K = 7


def _dtype(dtype):
    return [f"store.dtype={dtype}", f"store.path=out/{dtype}.zarr"]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = make_project(tmp_path_factory.mktemp("two_stage") / "p")
    for dtype in ("int8", "binary"):
        res = run(root, "featurize", "run.yaml", "-q", *_dtype(dtype))
        assert res.returncode == 0, res.stderr
        # the full matrix of the same store (from its bfloat16 copy): the exact scores the top-k is checked against
        res = run(root, "score", "run.yaml", "-q", *_dtype(dtype), "score.experiment=full")
        assert res.returncode == 0, res.stderr
    return root


def _top(root, dtype, exp):
    g = zarr.open_group(str(root / "out" / f"{dtype}.zarr"), mode="r")[f"scores/{exp}"]
    names = ("proponents", "proponent_scores", "opponents", "opponent_scores")
    top = {n: np.asarray(g[f"top_k/{n}"][:]) for n in names}
    return top, dict(g["top_k/proponents"].attrs).get("two_stage")


def _full(root, dtype):
    return np.asarray(zarr.open_group(str(root / "out" / f"{dtype}.zarr"), mode="r")["scores/full/scores"][:])


@pytest.mark.parametrize("dtype", ["int8", "binary"])
def test_store_keeps_codes_beside_a_bfloat16_copy_in_the_same_chunks(project, dtype):
    g = zarr.open_group(str(project / "out" / f"{dtype}.zarr"), mode="r")
    feats = g["train/0/features"]
    assert feats.dtype == np.uint16 and feats.attrs["logical_dtype"] == "bfloat16"
    codes, scale = np.asarray(g["train/0/codes"][:]), np.asarray(g["train/0/scale"][:])
    assert codes.shape[0] == scale.shape[0] == N_TRAIN and g["train/0/codes"].chunks[0] == feats.chunks[0]
    assert g["targets/full/0/features"].dtype == np.uint16  # the targets: bfloat16, no codes
    phi = (np.asarray(feats[:]).astype(np.uint32) << 16).view(np.float32)
    back = decode(dtype, codes, scale, phi.shape[1])
    if dtype == "int8":  # codes of the float32 features, within half a step (+ the bfloat16 rounding of the copy)
        assert (np.abs(back - phi).max(1) <= np.abs(phi).max(1) * (1 / 254 + 2**-8)).all()
    else:
        assert (np.sign(back) == np.where(phi > 0, 1, -1)).all()


@pytest.mark.parametrize("dtype", ["int8", "binary"])
def test_candidates_covering_every_row_give_the_exact_top_k(project, dtype):
    m = -(-N_TRAIN // K)  # K' = m · K >= n_train: every row is a candidate
    exp = "cover"
    res = run(project, "score", "run.yaml", *_dtype(dtype), f"score.top_k={K}", "score.rerank=scan", f"score.rescore_multiplier={m}",
              f"score.experiment={exp}", "score.show_targets=0")
    assert res.returncode == 0, res.stderr
    top, rec = _top(project, dtype, exp)
    full = _full(project, dtype)
    for side, sign in (("proponent", -1), ("opponent", 1)):
        order = np.argsort(sign * full, axis=1, kind="stable")[:, :K]
        np.testing.assert_array_equal(top[f"{side}s"], order)
        np.testing.assert_allclose(top[f"{side}_scores"], np.take_along_axis(full, order, 1), rtol=1e-5, atol=1e-7)
    assert rec["recall"] == {"proponents": 1.0, "opponents": 1.0} and rec["rescore_multiplier"] == m
    assert rec["rerank"] == "scan" and f"rescore_multiplier {m}, rerank scan)" in res.stderr
    assert (f"recall@{K} against the exact top-{K} (the bfloat16 copy's scores) of 16 targets: proponents 1.0000, "
            "opponents 1.0000") in res.stderr


def test_recall_is_measured_on_the_sampled_targets_recorded_and_reported(project):
    # binary codes with K' = K: some true top-k rows are missed
    res = run(project, "score", "run.yaml", *_dtype("binary"), f"score.top_k={K}", "score.rerank=scan", "score.rescore_multiplier=1",
              "score.recall_queries=30", "score.experiment=tight", "score.show_targets=0", "--json")
    assert res.returncode == 0, res.stderr
    top, rec = _top(project, "binary", "tight")
    full = _full(project, "binary")
    sample = np.array(rec["recall_queries"])
    assert len(sample) == rec["n_queries"] == 30 and sample[0] == 0 and sample[-1] == full.shape[0] - 1
    want = {}
    for side, sign in (("proponent", -1), ("opponent", 1)):
        exact = np.argsort(sign * full[sample], axis=1, kind="stable")[:, :K]
        want[f"{side}s"] = float(np.mean([len(set(a) & set(b)) / K for a, b in zip(top[f"{side}s"][sample], exact)]))
        # every kept score is the exact score of its row (re-ranked from the float copy)
        np.testing.assert_allclose(top[f"{side}_scores"], np.take_along_axis(full, top[f"{side}s"], 1),
                                   rtol=1e-5, atol=1e-7)
    assert rec["recall"] == pytest.approx(want, abs=1e-12)
    assert min(want.values()) < 1  # the test can see a miss
    r = rec["recall"]
    assert f"proponents {r['proponents']:.4f}, opponents {r['opponents']:.4f}" in res.stderr
    assert "below 0.99: raise score.rescore_multiplier" in res.stderr
    import json

    assert json.loads(res.stdout)["two_stage"]["recall"] == r


def test_kill_during_two_stage_then_rerun_gives_identical_arrays(tmp_path):
    one = make_project(tmp_path / "one")
    args = ["run.yaml", "-q", *_dtype("int8")]
    assert run(one, "featurize", *args).returncode == 0
    shutil.copytree(one, tmp_path / "two")
    top = [f"score.top_k={K}", "score.rerank=scan"]
    assert run(one, "score", *args, *top).returncode == 0
    two, log = tmp_path / "two", tmp_path / "events.log"
    # 9 target chunks, 8 one-pass segments: killed in segment 3, then in segment 5
    for n in (13, 16):
        assert kill_at(two, ["score", *args, *top], log, n)
    text = log.read_text()
    assert "done top-k segment 2" in text and "done top-k segment 5" not in text
    assert "done top-k segment 7" not in text
    res = run(two, "score", *args, *top)
    assert res.returncode == 0, res.stderr
    assert_same_store(one / "out" / "int8.zarr", two / "out" / "int8.zarr")
    _, rec = _top(two, "int8", "default")
    assert set(rec["recall"]) == {"proponents", "opponents"} and rec["rerank"] == "scan"


def test_torchrun_two_ranks_write_the_two_stage_top_k_of_one_process(tmp_path):
    one = make_project(tmp_path / "one")
    args = ["run.yaml", "-q", *_dtype("binary"), f"score.top_k={K}", "score.rerank=scan"]
    assert run(one, "featurize", *args).returncode == 0
    shutil.copytree(one, tmp_path / "two")
    assert run(one, "score", *args).returncode == 0
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "trakcli.cli.main", "score", *args],
        cwd=tmp_path / "two", capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert_same_store(one / "out" / "binary.zarr", tmp_path / "two" / "out" / "binary.zarr")


def test_bad_two_stage_settings_are_refused(project):
    cases = [
        (["score.top_k=5", "score.rescore_multiplier=4"],
         "score.rescore_multiplier (4) sets the candidates of the two-stage top-k, which finds them from int8 or "
         "binary codes, but store.dtype is float32; set store.dtype: int8"),
        ([*_dtype("int8"), "score.rescore_multiplier=4"], "but score.top_k is unset; set score.top_k"),
        ([*_dtype("int8"), "score.top_k=5", "score.rescore_multiplier=0"], "score.rescore_multiplier"),
        ([*_dtype("int8"), "score.top_k=5", "score.recall_queries=0"], "score.recall_queries"),
        (["store.dtype=int4"], "store.dtype"),
        (["score.top_k=5", "score.rerank=scan"],
         "score.rerank (scan) sets how the two-stage top-k re-ranks its candidates, which needs store.dtype int8 or "
         "binary (here float32) and score.top_k (here 5); set both, or unset score.rerank"),
        ([*_dtype("int8"), "score.rerank=scan"], "and score.top_k (here None)"),
        ([*_dtype("int8"), "score.top_k=5", "score.rerank=fast"], "score.rerank"),
        ([*_dtype("int8"), "score.top_k=5", "score.rerank=rows"], "score.rerank"),
    ]
    for args, message in cases:
        res = run(project, "score", "run.yaml", "-q", *args)
        assert res.returncode == 1 and message in res.stderr, (args, res.returncode, res.stderr)
    # another multiplier on a finished experiment: refused with the difference, not silently mixed
    res = run(project, "score", "run.yaml", "-q", *_dtype("int8"), f"score.top_k={K}", "score.rerank=scan", "score.experiment=again")
    assert res.returncode == 0, res.stderr
    res = run(project, "score", "run.yaml", "-q", *_dtype("int8"), f"score.top_k={K}", "score.rerank=scan", "score.experiment=again",
              "score.rescore_multiplier=3")
    assert res.returncode == 1 and "rescore_multiplier" in res.stderr and "--overwrite" in res.stderr, res.stderr


def test_a_top_k_the_codes_cannot_approximate_is_exact_and_says_so(project):
    # cosines (score.normalize unit): the exact streamed pass over the bfloat16 copy, one line saying why
    res = run(project, "score", "run.yaml", *_dtype("int8"), f"score.top_k={K}", "score.normalize=unit",
              "score.experiment=unit", "score.show_targets=0")
    assert res.returncode == 0, res.stderr
    assert "two-stage top-k not used (score.normalize unit ranks by cosines" in res.stderr
    assert "recall@" not in res.stderr
    top, rec = _top(project, "int8", "unit")
    assert rec is None and top["proponents"].shape == (90, K)


def _as_sets(values, indices):
    return [dict(zip(i.tolist(), v.tolist())) for v, i in zip(values, indices)]


@pytest.mark.parametrize("largest", [True, False])
def test_filtered_running_top_k_keeps_what_a_topk_of_every_column_keeps(largest):
    import torch

    from trakcli.topk.stream import FILTER_GROUP, SEED_STRIDE, merge_top_k_filtered
    from trakcli.scoring import merge_top_k

    k = 20
    g = torch.Generator().manual_seed(0)
    wide = 4 * SEED_STRIDE * k  # a first block this wide takes the seeded threshold
    assert wide % FILTER_GROUP == 0
    # runs of FILTER_GROUP columns compared first (widths divisible by it), or every column (50)
    blocks = [torch.randn(6, wide, generator=g), torch.randn(6, 50, generator=g) * 3,
              torch.randn(6, 5 * FILTER_GROUP, generator=g), torch.full((6, FILTER_GROUP), 0.0),
              torch.randn(6, 2 * FILTER_GROUP, generator=g) * 4]
    # target 0: its best scores sit on every SEED_STRIDE-th column of the first block, so that the seeded threshold
    # leaves fewer than k of them: the block must be merged whole
    first = blocks[0]
    first[0, ::SEED_STRIDE] += 100.0 if largest else -100.0
    want = got = (None, None)
    offset = 0
    for block in blocks:
        want = merge_top_k(*want, block, offset, k, largest)
        got = merge_top_k_filtered(*got, block, offset, k, largest)
        assert got[0].shape == (6, k)
        assert _as_sets(*got) == _as_sets(*want)
        offset += block.shape[1]


@pytest.mark.parametrize("largest", [True, False])
def test_running_top_k_keeps_what_a_topk_of_every_row_keeps(largest):
    import torch

    from trakcli.topk.stream import FILTER_GROUP, RunningTopK
    from trakcli.scoring import merge_top_k

    k, n = 15, 7
    g = torch.Generator().manual_seed(3)
    # blocks laid out train row first: a wide first block, widths not divisible by FILTER_GROUP, a constant
    # block (ties with nothing kept), a block where most scores pass (merged at once), then many small ones
    # whose passing scores are set aside and merged later
    blocks = [torch.randn(40 * FILTER_GROUP, n, generator=g), torch.randn(37, n, generator=g),
              torch.zeros(FILTER_GROUP, n), torch.randn(8 * FILTER_GROUP, n, generator=g) * 10,
              *[torch.randn(4 * FILTER_GROUP, n, generator=g) * (1 + i / 4) for i in range(30)]]
    want, running, offset = (None, None), RunningTopK(k, largest), 0
    for block in blocks:
        want = merge_top_k(*want, block.T.contiguous(), offset, k, largest)
        running.add(block, offset)
        offset += block.shape[0]
    got = running.result()
    assert got[0].shape == (n, k)
    assert _as_sets(*got) == _as_sets(*want)


@pytest.mark.parametrize("largest", [True, False])
def test_segments_filtered_by_the_kth_best_of_those_before_merge_to_the_top_k_of_every_row(largest):
    import torch

    from trakcli.topk.stream import FILTER_GROUP, RunningTopK, _KthBest, _merge_parts
    from trakcli.scoring import merge_top_k

    k, n = 12, 5
    g = torch.Generator().manual_seed(5)
    # segments as the candidate pass makes them, each of blocks laid out train row first; the later segments
    # hold a target whose scores mostly beat the floor, and one where none do
    segs = []
    for s in range(4):
        blocks = [torch.randn(4 * FILTER_GROUP, n, generator=g) for _ in range(6)]
        if s == 2:
            blocks[3][:, 1] += 5 if largest else -5
            blocks = [b.clone() for b in blocks]
            for b in blocks:
                b[:, 3] = -50 if largest else 50
        segs.append(blocks)
    want, offset, seen, parts = (None, None), 0, _KthBest(k, largest), []
    for s, blocks in enumerate(segs):
        running = RunningTopK(k, largest, floor=seen.kth)
        assert (seen.kth is None) == (s == 0)
        for block in blocks:
            want = merge_top_k(*want, block.T.contiguous(), offset, k, largest)
            running.add(block, offset)
            offset += block.shape[0]
        values, rows = running.result()
        assert ((rows == -1) == ~torch.isfinite(values)).all()  # a target with fewer than k beyond the floor
        seen.add(values)
        pad = k - values.shape[1]
        fill = float("-inf") if largest else float("inf")
        parts.append((torch.nn.functional.pad(values, (0, pad), value=fill),
                      torch.nn.functional.pad(rows, (0, pad), value=-1)))
    assert any((p[1] == -1).any() for p in parts[1:])  # the floor left some target fewer than k in a segment
    vals = np.stack([p[0].numpy() for p in parts])
    idx = np.stack([p[1].numpy() for p in parts])
    got = _merge_parts(vals, idx, k, largest)
    assert _as_sets(torch.from_numpy(got[0]), torch.from_numpy(got[1])) == _as_sets(*want)


def test_the_float_copy_and_the_codes_are_uncompressed_and_read_from_their_chunk_files(project):
    from trakcli.store import Store
    from trakcli.store.chunkread import chunk_files

    store = Store.open_existing(project / "out" / "int8.zarr", mode="r")
    rows = store.train(0, create=False)
    feats = rows.data["features"]
    assert [type(c).__name__ for c in feats.metadata.codecs] == ["BytesCodec", "Crc32cCodec"]
    # the codes too are uncompressed, read whole by the one-pass scan
    assert [type(c).__name__ for c in rows.data["codes"].metadata.codecs] == ["BytesCodec", "Crc32cCodec"]
    assert [type(c).__name__ for c in rows.data["scale"].metadata.codecs] == ["BytesCodec", "ZstdCodec", "Crc32cCodec"]
    assert chunk_files(feats) is not None and rows.reads_chunk_files("codes")
    assert "features_crc32c" not in rows.data
    bits = rows.read_direct("features", 40, 120, raw=True)
    assert bits.dtype == np.uint16
    np.testing.assert_array_equal(rows.read_direct("features", 40, 120), rows.read("features", 40, 120))


def test_a_corrupt_candidate_row_is_reported_and_featurize_verify_repairs_it(tmp_path):
    root = make_project(tmp_path / "p")
    args = ["run.yaml", "-q", *_dtype("int8")]
    assert run(root, "featurize", *args).returncode == 0
    every = [f"score.top_k={K}", f"score.rescore_multiplier={-(-N_TRAIN // K)}",
             "score.rerank=scan"]  # every row a candidate
    assert run(root, "score", *args, *every, "score.experiment=before").returncode == 0
    feats = zarr.open_group(str(root / "out" / "int8.zarr"), mode="r")["train/0/features"]
    chunk_file = root / "out" / "int8.zarr" / "train" / "0" / "features" / feats.metadata.encode_chunk_key((3, 0))
    raw = bytearray(chunk_file.read_bytes())
    row_bytes = feats.shape[1] * 2
    raw[5 * row_bytes + 7] ^= 0x40  # row 3 · 40 + 5 = 125: one bit of one entry
    chunk_file.write_bytes(bytes(raw))
    res = run(root, "score", *args, *every, "score.experiment=after")
    assert res.returncode == 1
    # the chunk is read whole, checked by the chunk's checksum
    assert "train/0/features chunk 3 (entries 120:160 along axis 0) fails its checksum" in res.stderr
    assert "trak featurize CONFIG --verify" in res.stderr
    assert run(root, "featurize", *args, "--verify").returncode == 0
    assert run(root, "score", *args, *every, "score.experiment=after").returncode == 0
    a, _ = _top(root, "int8", "before")
    b, _ = _top(root, "int8", "after")
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])


def test_recall_over_a_sample_of_the_rows_is_estimated_and_says_so(project, monkeypatch):
    import trakcli.topk.plan as topk

    monkeypatch.setattr(topk, "RECALL_ROWS", 150)  # 3 of the 8 segments (the last holds 40 rows)
    segs = topk.segments(N_TRAIN, 40, topk.TWO_STAGE_SEGMENT_ROWS)
    measured = topk.measured_segments(segs, 150)
    assert len(segs) == 8 and measured == [0, 4, 7]
    rows = np.concatenate([np.arange(*segs[s]) for s in measured])
    res = run(project, "score", "run.yaml", *_dtype("binary"), f"score.top_k={K}", "score.rerank=scan", "score.rescore_multiplier=1",
              "score.recall_queries=30", "score.experiment=sampled", "score.show_targets=0")
    assert res.returncode == 0, res.stderr
    top, rec = _top(project, "binary", "sampled")
    full = _full(project, "binary")
    frac = len(rows) / N_TRAIN
    assert rec["rows_measured"] == pytest.approx(frac)
    sample = np.array(rec["recall_queries"])
    for side, sign in (("proponent", -1), ("opponent", 1)):
        est = []
        for t in sample:  # rows of the measured segments that beat the K-th kept score and were not kept
            kept, tau = top[f"{side}s"][t], top[f"{side}_scores"][t, -1]
            beyond = rows[(full[t, rows] > tau) if sign < 0 else (full[t, rows] < tau)]
            u = len(set(beyond.tolist()) - set(kept.tolist()))
            est.append(1 - min(K, u / frac) / K)
        assert rec["recall"][f"{side}s"] == pytest.approx(float(np.mean(est)), abs=1e-12)
    assert min(rec["recall"].values()) < 1  # the sample sees a miss
    assert f"of 30 targets, estimated over {frac:.1%} of the train rows" in res.stderr
    # every row a candidate: nothing is missed, and the estimate says so
    res = run(project, "score", "run.yaml", *_dtype("binary"), f"score.top_k={K}", "score.rerank=scan",
              f"score.rescore_multiplier={-(-N_TRAIN // K)}", "score.experiment=sampled_all", "score.show_targets=0")
    assert res.returncode == 0, res.stderr
    assert _top(project, "binary", "sampled_all")[1]["recall"] == {"proponents": 1.0, "opponents": 1.0}


def test_a_store_with_row_checksums_of_an_earlier_layout_scores_the_same(project, tmp_path):
    # an int8 store whose float copy carries per-row checksums (features_crc32c): not read, the same top-k
    from trakcli.store import Store

    root = make_project(tmp_path / "p")
    shutil.copytree(project / "out" / "int8.zarr", root / "out" / "int8.zarr")
    group = zarr.open_group(str(root / "out" / "int8.zarr" / "train" / "0"), mode="a")
    group.create_array("features_crc32c", shape=(N_TRAIN,), chunks=(40,), dtype="uint32", fill_value=0)
    rows = Store.open_existing(root / "out" / "int8.zarr", mode="r").train(0, create=False)
    assert "features_crc32c" not in rows.data
    args = ["run.yaml", *_dtype("int8"), f"score.top_k={K}", "score.rerank=scan", "score.experiment=old", "score.show_targets=0"]
    for where in (project, root):
        res = run(where, "score", *args)
        assert res.returncode == 0, res.stderr
    new, _ = _top(project, "int8", "old")
    old, _ = _top(root, "int8", "old")
    for name in new:
        np.testing.assert_array_equal(old[name], new[name])


def _small_blocks(monkeypatch):
    """One-pass blocks of one chunk, so that the test store (8 chunks) has blocks to sample a floor from."""
    import trakcli.topk.plan as topk

    monkeypatch.setattr(topk, "APPROX_BLOCK_BYTES", 1)  # block_rows() rounds up to one chunk
    monkeypatch.setattr(topk, "SEED_STRIDE_BLOCKS", 2)
    monkeypatch.setattr(topk, "SEED_MIN", 1)
    return topk


def test_the_sampled_floor_of_the_one_pass_leaves_the_top_k_unchanged(project, monkeypatch):
    topk = _small_blocks(monkeypatch)
    seeds = []
    real = StoredTopK._seed_floors
    monkeypatch.setattr(StoredTopK, "_seed_floors", lambda self, s: seeds.append(real(self, s)) or seeds[-1])
    args = ["run.yaml", *_dtype("int8"), "score.top_k=1", "score.rerank=scan", "score.show_targets=0"]
    assert run(project, "score", *args, "score.experiment=seeded").returncode == 0
    assert seeds and all(f is not None for f in seeds[0])  # K' = 2: a floor from 4 sampled chunks of 8
    monkeypatch.setattr(topk, "SEED_MIN", 10**9)  # no floor
    assert run(project, "score", *args, "score.experiment=unseeded").returncode == 0
    a, _ = _top(project, "int8", "seeded")
    b, _ = _top(project, "int8", "unseeded")
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    full = _full(project, "int8")
    np.testing.assert_array_equal(a["proponents"][:, 0], full.argmax(1))  # K' = 2 finds these rows' top 1


def test_a_floor_above_a_targets_kth_best_is_found_and_the_pass_runs_again_without_it(project, monkeypatch):
    import torch

    _small_blocks(monkeypatch)
    full = _full(project, "int8")
    # a floor no score beats for target 0's proponents: it keeps no candidate, which the check after the pass sees
    too_high = torch.full((full.shape[0],), -1e30)
    too_high[0] = 1e30
    low = torch.full((full.shape[0],), 1e30)
    monkeypatch.setattr(StoredTopK, "_seed_floors", lambda self, s: [too_high, low])
    args = ["run.yaml", *_dtype("int8"), f"score.top_k={K}", "score.rerank=scan", "score.show_targets=0"]
    res = run(project, "score", *args, "score.experiment=bad_floor")
    assert res.returncode == 0, res.stderr
    assert "scanning again without it" in res.stderr
    monkeypatch.setattr(StoredTopK, "_seed_floors", lambda self, s: [None, None])
    assert run(project, "score", *args, "score.experiment=no_floor").returncode == 0
    a, _ = _top(project, "int8", "bad_floor")
    b, _ = _top(project, "int8", "no_floor")
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])


def test_two_stage_settings_re_rank_in_one_pass():
    from trakcli.errors import StoreError
    from trakcli.topk.plan import TwoStage

    two = TwoStage.of("int8", None, 16, 1000, 100, "auto")
    assert two.rerank == "scan" and two.settings()["rerank"] == "scan" and two.multiplier == 2
    assert TwoStage.of("binary", None, 16, 1000, 100, "scan").multiplier == 16
    with pytest.raises(StoreError, match="score.rerank must be auto or scan, got 'rows'"):
        TwoStage.of("int8", None, 16, 1000, 100, "rows")


def test_auto_takes_the_plain_pass_on_a_store_too_small_for_the_scans_floor(project):
    from trakcli.topk.plan import scan_has_floor

    assert not scan_has_floor(None, "int8", 90, K, N_TRAIN, 40, 32)  # this store: 9 chunks
    assert not scan_has_floor(None, "int8", 1000, 100, 200_000, 512, 1024)  # 391 chunks, K' = 200
    assert scan_has_floor(None, "int8", 1000, 100, 1_000_000, 512, 1024)
    res = run(project, "score", "run.yaml", *_dtype("int8"), f"score.top_k={K}", "score.experiment=auto_small",
              "score.show_targets=0")
    assert res.returncode == 0, res.stderr
    assert "too few for the one-pass scan's sampled floor" in res.stderr and "recall@" not in res.stderr
    top, rec = _top(project, "int8", "auto_small")
    full = _full(project, "int8")
    assert rec is None
    order = np.argsort(-full, axis=1, kind="stable")[:, :K]
    np.testing.assert_array_equal(top["proponents"], order)
