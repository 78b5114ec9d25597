"""Half-precision feature storage: ``store.dtype`` bfloat16 (and float16) through featurize, score, resume,
inspect and export.

bfloat16 features are stored as uint16 bits (trakcli.store.bfloat16); the rounding is checked bit for bit
against torch's own ``.to(torch.bfloat16)``, and a bfloat16 store against a float32 one of the same project.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
import zarr

from trakcli.errors import StoreError
from trakcli.store import Store, StoreLayout
from trakcli.store.bfloat16 import from_bits, round_to_bfloat16, to_bits

from projects import CHUNK, N_TARGET, N_TRAIN, assert_same_store, kill_at, make_project, run, run_subprocess

STORE = Path("out") / "attrib.zarr"
U_BF16 = 2.0**-8  # unit roundoff of bfloat16: 8 significant bits (7 stored + the implicit one)
U_FP16 = 2.0**-11  # float16: 11 significant bits


def f32(bits: list[int]) -> np.ndarray:
    return np.array(bits, dtype=np.uint32).view(np.float32)


SPECIAL = f32([
    0x00000000, 0x80000000,  # ±0
    0x3F800000, 0xBF800000,  # ±1
    0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000,  # exact ties: to even (down, up), negative too
    0x3F808001, 0x3F807FFF, 0xBF808001,  # just past / before a tie
    0x00000001, 0x80000001, 0x00008000, 0x00018000, 0x007FFFFF, 0x807FFFFF,  # subnormals, incl. ties
    0x00800000, 0x7F7F0000, 0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0xFF7FFFFF,  # normal min, max, overflow to inf
    0x7F800000, 0xFF800000,  # ±inf
    0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F80FFFF,  # NaNs: quiet, signalling, payloads
])


def torch_bits(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("source", ["special", "random_bits", "gaussian"])
def test_bfloat16_rounding_is_torch_s_bit_for_bit(source):
    g = np.random.default_rng(0)
    x = {
        "special": SPECIAL,
        "random_bits": g.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32),
        "gaussian": (g.standard_normal(200_000) * 10.0 ** g.integers(-40, 38, 200_000)).astype(np.float32),
    }[source]
    nan = np.isnan(x)
    ours, ref = to_bits(x), torch_bits(x)
    assert ours.dtype == np.uint16 and ours.shape == x.shape
    np.testing.assert_array_equal(ours[~nan], ref[~nan])  # every non-NaN bit pattern, ties and subnormals included
    back, ref_back = round_to_bfloat16(x), torch.from_numpy(x.copy()).to(torch.bfloat16).float().numpy()
    assert back.dtype == np.float32
    np.testing.assert_array_equal(back[~nan].view(np.uint32), ref_back[~nan].view(np.uint32))
    assert np.isnan(back[nan]).all() and np.isnan(ref_back[nan]).all()  # NaN stays NaN (torch's NaN bits vary)
    np.testing.assert_array_equal(np.signbit(back[nan]), np.signbit(x[nan]))  # with its sign
    if source == "special":
        ties_and_overflow = f32([0x3F808000, 0x3F818000, 0x00008000, 0x7F7FFFFF])
        assert (to_bits(ties_and_overflow) == [0x3F80, 0x3F82, 0x0000, 0x7F80]).all()


def test_bfloat16_round_trip_is_exact_and_bad_input_is_refused():
    bits = np.arange(2**16, dtype=np.uint16)
    x = from_bits(bits)
    nan = np.isnan(x)
    np.testing.assert_array_equal(to_bits(x)[~nan], bits[~nan])  # every bfloat16 number is kept as is
    assert nan.sum() == 2 * (2**7 - 1) and np.isnan(from_bits(to_bits(x[nan]))).all()
    np.testing.assert_array_equal(to_bits(np.array([1.5], np.float16)), to_bits(np.array([1.5], np.float64)))
    with pytest.raises(StoreError, match="floating-point features, got dtype int64"):
        to_bits(np.arange(3))
    with pytest.raises(StoreError, match="must be uint16, got dtype int16"):
        from_bits(np.zeros(3, np.int16))


def set_dtype(root: Path, dtype: str) -> Path:
    cfg = yaml.safe_load((root / "run.yaml").read_text())
    cfg["store"]["dtype"] = dtype
    (root / "run.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return root


def featurize_and_score(root: Path) -> Path:
    for cmd in ("featurize", "score"):
        res = run(root, cmd, "run.yaml", "-q")
        assert res.returncode == 0, res.stderr
    return root


@pytest.fixture(scope="module")
def ref32(tmp_path_factory) -> Path:
    return featurize_and_score(make_project(tmp_path_factory.mktemp("f32")))


@pytest.fixture(scope="module")
def bf16(tmp_path_factory) -> Path:
    return featurize_and_score(set_dtype(make_project(tmp_path_factory.mktemp("bf16")), "bfloat16"))


def test_bfloat16_store_holds_the_rounded_float32_features_and_close_scores(ref32, bf16):
    g = zarr.open_group(str(bf16 / STORE), mode="r")
    arr = g["train/0/features"]
    assert arr.dtype == np.uint16 and arr.attrs["logical_dtype"] == "bfloat16"
    assert g["targets/default/0/features"].dtype == np.uint16 and g["train/0/out_to_loss"].dtype == np.float32
    assert g.attrs["layout"]["dtype"] == "bfloat16" and g.attrs["identity"]["storage"]["dtype"] == "bfloat16"
    # a plain zarr reader decodes it with the formula the attribute states
    assert "(bits.astype(uint32) << 16).view(float32)" in arr.attrs["encoding"]
    plain = (np.asarray(arr[:]).astype(np.uint32) << 16).view(np.float32)

    s32, s16 = Store.open_existing(ref32 / STORE, mode="r"), Store.open_existing(bf16 / STORE, mode="r")
    for m in range(3):
        for name in (f"train/{m}/features", f"targets/default/{m}/features"):
            ours, full = s16.read(name), s32.read(name)
            assert ours.dtype == np.float32 and ours.shape == full.shape
            np.testing.assert_array_equal(ours, round_to_bfloat16(full), err_msg=name)  # the same features, rounded
    np.testing.assert_array_equal(plain, s16.read("train/0/features"))

    # scores: each of Φ_t, Φ and the kernel made from Φ carries a relative rounding error of at most
    # U_BF16 = 2^-8 per entry; allow 4·U_BF16 of each target's largest |score| (measured: 1.3·U_BF16)
    a, b = s32.read_scores("default")[0], s16.read_scores("default")[0]
    scale = np.abs(a).max(axis=1, keepdims=True)
    err = np.abs(a - b) / scale
    assert err.max() <= 4 * U_BF16, err.max()
    assert err.max() > U_FP16  # bfloat16 was stored, not float32
    assert np.corrcoef(a.ravel(), b.ravel())[0, 1] > 0.9999


def test_float16_scores_within_the_same_bound_of_its_mantissa(tmp_path, ref32):
    root = featurize_and_score(set_dtype(make_project(tmp_path / "p"), "float16"))
    g = zarr.open_group(str(root / STORE), mode="r")
    assert g["train/0/features"].dtype == np.float16 and "logical_dtype" not in g["train/0/features"].attrs
    a = Store.open_existing(ref32 / STORE, mode="r").read_scores("default")[0]
    b = Store.open_existing(root / STORE, mode="r").read_scores("default")[0]
    assert (np.abs(a - b) / np.abs(a).max(axis=1, keepdims=True)).max() <= 4 * U_FP16


def test_changing_store_dtype_refuses_and_a_finished_bfloat16_store_is_recognized(tmp_path, bf16):
    root = tmp_path / "p"
    shutil.copytree(bf16, root)
    for other in ("float32", "float16"):
        res = run(root, "featurize", "run.yaml", f"store.dtype={other}")
        assert res.returncode == 1
        text = " ".join(res.stderr.split())
        assert "storage.dtype" in text and "bfloat16" in text and "--overwrite" in text, text

    attrs = json.loads((root / STORE / "zarr.json").read_text())["attributes"]
    layout = StoreLayout(**attrs["layout"])
    assert layout.dtype == "bfloat16"
    before = {f: f.read_bytes() for f in sorted((root / STORE).rglob("*")) if f.is_file()}
    res = run(root, "featurize", "run.yaml")  # the finished bfloat16 store: nothing to do
    assert res.returncode == 0, res.stderr
    assert "nothing to do" in " ".join(res.stderr.split())
    assert {f: f.read_bytes() for f in sorted((root / STORE).rglob("*")) if f.is_file()} == before
    meta_path = root / STORE / "train" / "1" / "features" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    del meta["attributes"]["logical_dtype"]  # uint16 without the attribute: not bfloat16 features
    meta_path.write_text(json.dumps(meta))
    res = run(root, "featurize", "run.yaml")
    assert res.returncode == 1
    assert "train/1/features holds uint16, this run stores bfloat16" in " ".join(res.stderr.split())

    with pytest.raises(StoreError, match="dtype 'bf16' is not one of float32, float16, bfloat16"):
        StoreLayout(N_TRAIN, 32, CHUNK, "bf16")
    res = run(root, "featurize", "run.yaml", "store.dtype=bf16")
    assert res.returncode == 1 and "bfloat16" in res.stderr


def test_bfloat16_kill_and_resume_gives_the_identical_store(tmp_path, bf16):
    root = set_dtype(make_project(tmp_path / "p"), "bfloat16")
    log = tmp_path / "events.log"
    assert kill_at(root, ["featurize", "run.yaml", "-q"], log, 9)  # inside model 0's row chunks
    assert kill_at(root, ["featurize", "run.yaml", "-q"], log, 30)  # inside model 1's
    res = run_subprocess(root, "featurize", "run.yaml", "-q")
    assert res.returncode == 0, res.stderr
    slog = tmp_path / "score.log"
    assert kill_at(root, ["score", "run.yaml", "-q"], slog, 7)  # inside model 1's target features
    assert "done targets 0 0" in slog.read_text()
    res = run(root, "score", "run.yaml", "-q")  # reads the done target chunks back, computes and keeps the rest
    assert res.returncode == 0, res.stderr
    assert_same_store(root / STORE, bf16 / STORE)  # bit-identical bits, kernels and scores


def test_bfloat16_inspect_verify_export_and_repair(tmp_path, bf16):
    root = tmp_path / "p"
    shutil.copytree(bf16, root)
    res = run(root, "inspect", str(STORE), "--verify", "--json")
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert [t["rows_done"] for t in info["train"]] == [N_TRAIN] * 3 and not info.get("corrupt")

    store = Store.open_existing(root / STORE, mode="r")
    res = run(root, "export", str(STORE), "--what", "features", "--model-id", "1", "--out", "f.npy")
    assert res.returncode == 0, res.stderr
    f = np.load(root / "f.npy")
    assert f.dtype == np.float32 and f.shape == (N_TRAIN, 32)
    np.testing.assert_array_equal(f, store.read("train/1/features"))
    assert run(root, "export", str(STORE), "--what", "targets/default/2/features", "--out", "t.csv").returncode == 0
    t = np.loadtxt(root / "t.csv", delimiter=",", dtype=np.float32)
    # 7 significant digits identify a bfloat16 number (it has under 3): rounding the text gives it back
    np.testing.assert_array_equal(round_to_bfloat16(t), store.read("targets/default/2/features"))

    chunk = root / STORE / "train" / "2" / "features" / "c" / "5" / "0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    res = run(root, "inspect", str(STORE), "--verify", "--json")
    assert res.returncode == 1
    assert [(d["array"], d["chunks"]) for d in json.loads(res.stdout)["corrupt"]] == [("train/2/features", [5])]
    res = run(root, "featurize", "run.yaml", "--verify")
    assert res.returncode == 0, res.stderr
    assert "model 2: chunks [5] failed their checksum or are missing; recomputed" in " ".join(res.stderr.split())
    assert run(root, "score", "run.yaml", "-q").returncode == 0
    assert_same_store(root / STORE, bf16 / STORE)
    assert info["scores"]["default"]["shape"] == [N_TARGET, N_TRAIN]


@pytest.mark.filterwarnings("ignore:Failed to open Zarr store with consolidated metadata")
def test_xarray_opens_bfloat16_features_as_their_bits_and_attributes(bf16):
    xarray = pytest.importorskip("xarray")
    ds = xarray.open_zarr(str(bf16 / STORE), group="train/0", consolidated=False)
    bits = ds["features"]
    assert bits.dims == ("train", "proj") and bits.dtype == np.uint16 and bits.attrs["logical_dtype"] == "bfloat16"
    np.testing.assert_array_equal(from_bits(bits.values), Store.open_existing(bf16 / STORE, mode="r").read(
        "train/0/features"))
