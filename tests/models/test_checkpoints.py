"""Checkpoints: whole-model pickles refused, wrapper prefixes stripped, safetensors and wrapped state dicts read,
and mismatches named by key and shape."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from projects import invoke as trak
from projects import tiny_model
from trakcli.errors import CheckpointError
from trakcli.models.checkpoints import load_checkpoint, read_state_dict


def test_whole_model_pickle_says_to_save_the_state_dict(tmp_path):
    path = tmp_path / "whole.pt"
    torch.save(tiny_model(), path)
    with pytest.raises(CheckpointError, match=r"torch\.save\(model\.state_dict\(\), PATH\)") as e:
        read_state_dict(path)
    assert "whole model" in str(e.value) and "Traceback" not in str(e.value)


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "_orig_mod.module."])
def test_wrapper_prefixes_are_stripped(tmp_path, prefix):
    src = tiny_model(seed=3)
    path = tmp_path / "wrapped.pt"
    torch.save({prefix + k: v for k, v in src.state_dict().items()}, path)
    model = tiny_model(seed=0)
    stripped = load_checkpoint(model, path)
    assert "".join(stripped) == prefix
    for a, b in zip(model.state_dict().values(), src.state_dict().values()):
        assert torch.equal(a, b)


def test_plain_state_dict_strips_nothing(tmp_path):
    path = tmp_path / "plain.pt"
    torch.save(tiny_model(seed=1).state_dict(), path)
    assert load_checkpoint(tiny_model(), path) == []


def test_featurize_reports_a_stripped_prefix_once(user_project):
    for ck in sorted(Path("ckpts").glob("model_*.pt")):
        sd = torch.load(ck, weights_only=True)
        torch.save({"module." + k: v for k, v in sd.items()}, ck)
    res = trak("featurize", "run.yaml")
    assert res.exit_code == 0, res.stderr
    assert res.stderr.count("stripped the key prefix 'module.'") == 1


def test_checkpoint_mismatch_names_keys_and_shapes(tmp_path):
    torch.save(tiny_model(hidden=9).state_dict(), tmp_path / "wide.pt")
    with pytest.raises(CheckpointError, match=r"0\.weight: checkpoint \[9, 6\] vs model \[8, 6\]"):
        load_checkpoint(tiny_model(), tmp_path / "wide.pt")
    sd = tiny_model().state_dict()
    sd["extra.weight"] = torch.zeros(1)
    del sd["2.bias"]
    torch.save(sd, tmp_path / "keys.pt")
    with pytest.raises(CheckpointError, match=r"missing keys \['2\.bias'\].*unexpected keys \['extra\.weight'\]"):
        load_checkpoint(tiny_model(), tmp_path / "keys.pt")


def test_safetensors_and_wrapped_checkpoints(tmp_path):
    src = tiny_model(seed=4)
    save_file(src.state_dict(), str(tmp_path / "m.safetensors"))
    torch.save({"state_dict": src.state_dict(), "epoch": 3}, tmp_path / "wrapped.pt")
    for name in ("m.safetensors", "wrapped.pt"):
        dst = tiny_model(seed=0)
        load_checkpoint(dst, tmp_path / name)
        assert torch.equal(dst[0].weight, src[0].weight)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        read_state_dict(tmp_path / "junk.pt")
