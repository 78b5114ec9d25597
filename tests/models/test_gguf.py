"""GGUF files as ``hf:`` specs: converted once into a cached Hugging Face folder (trakcli.models.hf.gguf_to_hf).

Each test writes a tiny llama GGUF (2 layers, width 64, 268-token byte-level
BPE vocabulary with a chat template; the MLP weights Q8_0-quantized, the rest
float32) with the ``gguf`` package's own writer, so nothing is downloaded and
the conversion takes well under a second. The cache goes to a temporary
``XDG_CACHE_HOME``.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from gguf.quants import dequantize, quantize  # noqa: E402
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.convert_slow_tokenizer import bytes_to_unicode  # noqa: E402

from trakcli.data.text import load_tokenizer  # noqa: E402
from trakcli.errors import DataError, ModelError  # noqa: E402
from trakcli.models import hf  # noqa: E402
from trakcli.models.hf import build_hf_model, gguf_cache_root, resolve_hf_path  # noqa: E402

CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
LAYER_NAMES = [  # transformers name -> GGUF name, per block
    ("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
    ("self_attn.o_proj", "attn_output"), ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"),
    ("mlp.down_proj", "ffn_down"), ("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm"),
]
HEADS, KV_HEADS = 4, 2


def _permute(w, n_head):
    """llama.cpp's q/k row order (convert_hf_to_gguf.py LlamaModel.permute), which transformers undoes."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, seed: int = 0) -> LlamaForCausalLM:
    """Write a 2-layer llama GGUF to ``path``; return the transformers model with exactly its weights."""
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    merges = []
    for a, b in [("t", "h"), ("th", "e"), ("h", "e"), ("Ġ", "t"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"),
                 ("a", "n"), ("an", "d")]:
        merges.append(f"{a} {b}")
        tokens.append(a + b)
    tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = len(tokens)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=vocab - 2, eos_token_id=vocab - 1,
    )
    torch.manual_seed(seed)
    ref = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            if p.ndim == 1:
                p.normal_(1.0, 0.1)  # norms other than all-ones, so a lost norm shows
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_block_count(2)
    w.add_feed_forward_length(128)
    w.add_rope_dimension_count(16)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (vocab - 3) + [3, 3, 3])  # 3: control (special) tokens
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab - 2)
    w.add_eos_token_id(vocab - 1)
    w.add_chat_template(CHAT_TEMPLATE)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    for i in range(2):
        names.update({f"model.layers.{i}.{a}.weight": f"blk.{i}.{b}.weight" for a, b in LAYER_NAMES})
    sd = ref.state_dict()
    q8 = gguf.GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for name, gguf_name in names.items():
            t = sd[name].numpy()
            if ".mlp." in name:  # quantized: the reference gets what the file holds
                packed = quantize(t, q8)
                sd[name].copy_(torch.from_numpy(dequantize(packed, q8)))
                w.add_tensor(gguf_name, packed, raw_shape=packed.shape, raw_dtype=q8)
            else:
                if "q_proj" in name:
                    t = _permute(t, HEADS)
                elif "k_proj" in name:
                    t = _permute(t, KV_HEADS)
                w.add_tensor(gguf_name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ref


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "trakcli" / "gguf"


@pytest.fixture
def tiny(tmp_path) -> tuple[Path, LlamaForCausalLM]:
    (tmp_path / "models").mkdir()
    path = tmp_path / "models" / "tiny.gguf"
    return path, write_tiny_gguf(path)


@pytest.fixture
def conversions(monkeypatch) -> list[Path]:
    """The GGUF files converted (not reused) during the test."""
    done: list[Path] = []
    convert = hf._convert_gguf

    def counted(tf, path, out):
        done.append(path)
        convert(tf, path, out)

    monkeypatch.setattr(hf, "_convert_gguf", counted)
    return done


def test_gguf_converts_once_into_a_plain_float32_model_with_the_same_logits(cache, tiny, conversions):
    path, ref = tiny
    model = build_hf_model(f"hf:{path}", model_class="causal_lm")
    folder = Path(model.trak_hf_path)
    assert folder.parent == cache == gguf_cache_root()
    assert folder.name.startswith("tiny-") and len(folder.name) == len("tiny-") + 16
    assert type(model).__name__ == "LlamaForCausalLM" and model.trak_missing == []
    assert getattr(model, "hf_quantizer", None) is None and not hasattr(model.config, "quantization_config")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    ids = torch.tensor([[5, 70, 200, 3, 9, 266, 100]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits)
    files = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", hf.GGUF_INFO} <= files
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    info = json.loads((folder / hf.GGUF_INFO).read_text())
    assert info["source"] == str(path.resolve()) and info["sha256"].startswith(folder.name[-16:])
    assert [p.name for p in cache.iterdir() if p.is_dir()] == [folder.name]  # no temporary folder left
    assert conversions == [path.resolve()]
    # later calls (and the other ways to name it) reuse the folder
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    assert resolve_hf_path(f"hf:{path}") == folder
    assert resolve_hf_path(str(path.parent)) == folder  # a directory holding one .gguf and no config.json
    assert load_tokenizer(str(path)).name_or_path == str(folder)
    assert conversions == [path.resolve()] and (folder / "model.safetensors").stat().st_mtime_ns == mtime


def test_conversion_without_gguf_config_drops_the_quantizer(cache, tiny, tmp_path):
    """Loaded the plain way (no GgufConfig(dequantize=True)), the model keeps a GGUF quantizer: drop it."""
    import transformers

    path, ref = tiny
    tf = SimpleNamespace(AutoModelForCausalLM=transformers.AutoModelForCausalLM,
                         AutoTokenizer=transformers.AutoTokenizer)  # no GgufConfig
    hf._convert_gguf(tf, path, tmp_path / "out")
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    model = build_hf_model(str(tmp_path / "out"), model_class="causal_lm")
    assert getattr(model, "hf_quantizer", None) is None
    ids = torch.tensor([[4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits)


def test_gguf_tokenizer_and_its_chat_template_are_converted(cache, tiny):
    path, _ = tiny
    tok = load_tokenizer(f"hf:{path}")
    direct = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = "the and in<|im_end|>"
    assert tok(text).input_ids == direct(text).input_ids
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|im_end|>"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n"


def test_gguf_inside_an_installed_package(cache, tmp_path, monkeypatch):
    pkg = tmp_path / "site" / "tiny_gguf_pkg_xyz"
    (pkg / "weights").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('importing the package is not needed')\n")
    write_tiny_gguf(pkg / "weights" / "tiny.gguf")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.chdir(tmp_path)
    folder = resolve_hf_path("hf:tiny_gguf_pkg_xyz/weights/tiny.gguf")
    assert folder.parent == cache and hf._is_converted(folder)
    assert resolve_hf_path("hf:tiny_gguf_pkg_xyz/weights") == folder


def test_concurrent_conversions_convert_once(cache, tiny, conversions):
    path, _ = tiny
    out: list[Path] = []
    threads = [threading.Thread(target=lambda: out.append(hf.gguf_to_hf(path))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(out) == 3 and len(set(out)) == 1 and len(conversions) == 1


def test_killed_or_failed_conversion_leaves_no_folder_taken_as_done(cache, tiny, monkeypatch):
    path, ref = tiny
    digest = hf._sha256(path)[:16]
    dest = cache / f"tiny-{digest}"

    def dies_half_way(tf, src, out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("killed")

    with monkeypatch.context() as m:
        m.setattr(hf, "_convert_gguf", dies_half_way)
        with pytest.raises(ModelError, match=r"cannot convert the GGUF file .*tiny\.gguf.*RuntimeError: killed"):
            resolve_hf_path(str(path))
    assert not dest.exists() and not list(cache.glob(".*.tmp-*"))
    # what a killed process leaves: its temporary folder, and (written by hand) a folder without the info file
    (cache / f".{dest.name}.tmp-killed").mkdir()
    (cache / f".{dest.name}.tmp-killed" / "config.json").write_text("{}")
    dest.mkdir()
    (dest / "config.json").write_text("{}")
    model = build_hf_model(str(path), model_class="causal_lm")
    assert Path(model.trak_hf_path) == dest and hf._is_converted(dest)
    assert not list(cache.glob(".*.tmp-*"))
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits)


def test_gguf_errors_say_what_and_how_to_fix(cache, tiny, tmp_path, monkeypatch):
    path, _ = tiny
    with pytest.raises(ModelError, match=r"model.entrypoint 'hf:.*nope\.gguf': no directory at .*nope\.gguf"):
        resolve_hf_path(f"hf:{tmp_path / 'nope.gguf'}")
    fake = tmp_path / "fake.gguf"
    fake.write_text("not a gguf at all")
    with pytest.raises(ModelError, match=r"fake\.gguf is not a GGUF file \(it starts with b'not '"):
        resolve_hf_path(f"hf:{fake}")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[:2000])
    with pytest.raises(ModelError, match=r"cannot convert the GGUF file .*truncated\.gguf into a Hugging Face folder"):
        resolve_hf_path(str(truncated))
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x")
    with pytest.raises(ModelError, match=r"is a file but not a \.gguf file"):
        resolve_hf_path(str(weights))
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (two / name).write_bytes(path.read_bytes())
    with pytest.raises(ModelError, match=r"2 \.gguf files \(a\.gguf, b\.gguf\); name one, e\.g\. hf:.*two/a\.gguf"):
        resolve_hf_path(str(two))

    find_spec = hf.importlib.util.find_spec

    def without(*missing):
        return lambda name, *a: None if name in missing else find_spec(name, *a)

    with monkeypatch.context() as m:
        m.setattr(hf.importlib.util, "find_spec", without("gguf"))
        with pytest.raises(ModelError, match=r"needs the gguf package; install with pip install 'trakcli-attribution\[lm"):
            resolve_hf_path(str(path))
        m.setattr(hf.importlib.util, "find_spec", without("gguf", "accelerate"))
        with pytest.raises(ModelError, match=r"needs the gguf and accelerate packages; install with pip install"):
            resolve_hf_path(str(path))
    folder = resolve_hf_path(str(path))
    with monkeypatch.context() as m:  # once converted, the folder is used without gguf or accelerate
        m.setattr(hf.importlib.util, "find_spec", without("gguf", "accelerate"))
        assert resolve_hf_path(str(path)) == folder


def test_tokenizer_only_directory_is_a_tokenizer_but_not_a_model(cache, tiny, tmp_path):
    path, _ = tiny
    tok_dir = tmp_path / "tok"
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(tok_dir)
    assert not (tok_dir / "config.json").exists()
    tok = load_tokenizer(str(tok_dir))
    assert tok("the").input_ids == [257]
    assert resolve_hf_path(str(tok_dir), need="tokenizer") == tok_dir
    with pytest.raises(ModelError, match="has no config.json"):
        resolve_hf_path(str(tok_dir))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"data.train.tokenizer: tokenizer .*empty.* has no config.json nor tokenizer"):
        load_tokenizer(str(tmp_path / "empty"))
