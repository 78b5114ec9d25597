import pytest
import torch
from torch import nn

from trakcli.errors import ConfigError, DataError, GradientError
from trakcli.gradients.vmap import PerExampleGradients, check_finite, select_parameters
from trakcli.tasks import classification_margin

from projects import tiny_model


def loop_reference(model, names, x, y):
    """Per-example gradients and 1 - p_y by a plain autograd loop, explicit indexing."""
    model.eval()
    params = dict(model.named_parameters())
    grads, qs = [], []
    for i in range(len(y)):
        logits = model(x[i : i + 1])[0]
        c = int(y[i])
        others = torch.cat([logits[:c], logits[c + 1 :]])
        margin = logits[c] - torch.logsumexp(others, 0)
        g = torch.autograd.grad(margin, [params[n] for n in names])
        grads.append(torch.cat([t.reshape(-1) for t in g]))
        qs.append(1 - torch.softmax(logits, 0)[c])
    return torch.stack(grads), torch.stack(qs).detach()


def bn_model():
    torch.manual_seed(3)
    m = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.ReLU(), nn.Dropout(0.5), nn.Linear(7, 4))
    with torch.no_grad():  # non-trivial running statistics
        m[1].running_mean.uniform_(-1, 1)
        m[1].running_var.uniform_(0.5, 2)
    return m


@pytest.mark.parametrize("make", [lambda: tiny_model(), bn_model], ids=["mlp", "batchnorm+dropout"])
def test_vmap_gradients_match_per_example_loop(make):
    model = make()
    n_in = model[0].in_features
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, n_in, generator=g)
    n_cls = model[-1].out_features
    y = torch.randint(0, n_cls, (9,), generator=g)
    pg = PerExampleGradients(model)
    grads, q = pg(x, y)
    flat = pg.flatten(grads)
    ref, ref_q = loop_reference(model, pg.param_names, x, y)
    assert flat.shape == (9, pg.grad_dim)
    torch.testing.assert_close(flat, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(q, ref_q, rtol=1e-5, atol=1e-6)


def test_grad_wrt_selects_only_matching_parameters():
    model = tiny_model()
    pg = PerExampleGradients(model, ["2.*"])
    assert pg.param_names == ["2.weight", "2.bias"]
    assert pg.grad_dim == 8 * 3 + 3
    x, y = torch.randn(4, 6), torch.tensor([0, 1, 2, 0])
    grads, _ = pg(x, y)
    assert set(grads) == {"2.weight", "2.bias"}
    ref, _ = loop_reference(model, pg.param_names, x, y)
    torch.testing.assert_close(pg.flatten(grads), ref, rtol=1e-5, atol=1e-6)


def test_grad_wrt_unknown_pattern_names_parameters():
    with pytest.raises(ConfigError, match=r"pattern 'encoder\.\*' matches no parameter.*0\.weight"):
        select_parameters(tiny_model(), ["encoder.*"])


def test_margin_is_log_odds():
    logits = torch.tensor([1.0, 3.0, -2.0])
    margin, q = classification_margin(logits, torch.tensor(1))
    p = torch.softmax(logits, 0)[1]
    torch.testing.assert_close(margin, torch.log(p / (1 - p)))
    torch.testing.assert_close(q, 1 - p)


def test_labels_out_of_range_and_wrong_input_shape_are_data_errors():
    pg = PerExampleGradients(tiny_model())
    with pytest.raises(DataError, match=r"3 classes but examples \[11\] have labels \[5\]"):
        pg(torch.randn(2, 6), torch.tensor([0, 5]), row_offset=10)
    with pytest.raises(DataError, match=r"cannot take inputs of shape \[4\]"):
        pg(torch.randn(2, 4), torch.tensor([0, 1]))


def test_nonfinite_gradients_name_the_examples():
    pg = PerExampleGradients(tiny_model())
    x = torch.randn(4, 6)
    x[2, 0] = float("nan")
    grads, _ = pg(x, torch.tensor([0, 1, 2, 0]))
    with pytest.raises(GradientError, match=r"examples \[12\]"):
        check_finite(pg.flatten(grads), row_offset=10)
    check_finite(pg.flatten(grads)[[0, 1, 3]], row_offset=0)  # the finite rows pass


# --- grad_wrt patterns that match no parameter: the pattern that would, and every name, grouped -----------------

def _expand(line: str) -> list[str]:
    """The names one line of :func:`group_names` stands for: ``a.{0..2,5}.w`` -> a.0.w, a.1.w, a.2.w, a.5.w."""
    import itertools
    import re

    line = re.sub(r" \(\d+\)$", "", line)
    slots = []
    for text, braced in re.findall(r"([^{]+)|\{([^}]*)\}", line):
        if text:
            slots.append([text])
            continue
        values = []
        for piece in braced.split(","):
            lo, _, hi = piece.partition("..")
            values += [str(v) for v in range(int(lo), int(hi or lo) + 1)]
        slots.append(values)
    return ["".join(p) for p in itertools.product(*slots)]


def test_group_names_collapses_index_parts_and_leaves_no_name_out():
    from trakcli.gradients.vmap import group_names

    names = [f"model.layers.{i}.mlp.up_proj.weight" for i in range(30)] + ["model.norm.weight", "lm_head.weight"]
    assert group_names(names) == ["model.layers.{0..29}.mlp.up_proj.weight", "model.norm.weight", "lm_head.weight"]
    assert group_names(["h.1.w", "h.2.w", "h.4.w", "h.5.w", "h.6.w"]) == ["h.{1,2,4..6}.w"]
    # several index parts that are not a full grid say how many names they stand for
    odd = ["b.0.m.0.weight", "b.0.m.2.weight", "b.1.m.0.weight"]
    assert group_names(odd) == ["b.{0,1}.m.{0,2}.weight (3)"]
    assert group_names(["conv1.weight", "conv2.weight", "0.weight"]) == ["conv1.weight", "conv2.weight", "0.weight"]


def test_grad_wrt_suggests_the_pattern_that_would_match_on_a_tiny_model():
    with pytest.raises(ConfigError) as e:
        select_parameters(tiny_model(), ["2", "0.weight", "enc.*"])
    assert e.value.problems[0] == "grad_wrt: pattern '2' matches no parameter; did you mean '2.*'? it matches 2 parameters"
    assert len(e.value.problems) == 2  # '0.weight' matches: not a problem
    assert e.value.problems[1].startswith("grad_wrt: pattern 'enc.*' matches no parameter; the model's")
    assert "did you mean" not in e.value.problems[1]
    # a few parameters: each named, on the last problem's line
    assert e.value.problems[1].endswith("; the model's parameters are: 0.weight, 0.bias, 2.weight, 2.bias")


@pytest.mark.parametrize("n_layers", [2, 30])
def test_grad_wrt_on_a_llama_suggests_the_trailing_star_and_groups_every_name(n_layers):
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=29, hidden_size=8, intermediate_size=12, num_hidden_layers=n_layers, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=16, tie_word_embeddings=False))
    names = [n for n, _ in model.named_parameters()]
    last = n_layers - 1
    with pytest.raises(ConfigError) as e:
        select_parameters(model, [f"model.layers.{last}.self_attn.*_proj", "layers.0.mlp", "nope"])
    problems = e.value.problems
    assert problems[0] == (f"grad_wrt: pattern 'model.layers.{last}.self_attn.*_proj' matches no parameter; did you "
                           f"mean 'model.layers.{last}.self_attn.*_proj.*'? it matches 4 parameters")
    assert problems[1] == ("grad_wrt: pattern 'layers.0.mlp' matches no parameter; did you mean '*layers.0.mlp.*'? "
                           "it matches 3 parameters")
    head, *lines = problems[2].split("\n")
    assert head == (f"grad_wrt: pattern 'nope' matches no parameter; the model's {len(names)} parameters, in 12 "
                    "groups (index parts collapsed):")
    lines = [line.strip() for line in lines]
    rng = "{0,1}" if n_layers == 2 else "{0..29}"
    assert lines[1] == f"model.layers.{rng}.self_attn.q_proj.weight" and len(lines) == 12
    assert sorted(n for line in lines for n in _expand(line)) == sorted(names)  # every name, none cut off
    # the CLI's one error: its first line, then one problem per line
    text = str(e.value)
    assert text.startswith("3 problems with the config:\n  - grad_wrt: pattern 'model.layers.")
    assert "..." not in text.replace("{0..29}", "")


GROUPED_LLAMA_FILE = '''
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def llama(n_layers=4):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=29, hidden_size=8, intermediate_size=12, num_hidden_layers=n_layers,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16))
'''


def test_grad_wrt_error_through_the_cli_on_a_language_model(tmp_path):
    pytest.importorskip("transformers")
    from projects import run, write_config, write_jsonl

    (tmp_path / "lm_model.py").write_text(GROUPED_LLAMA_FILE)
    import importlib.util

    spec = importlib.util.spec_from_file_location("grouped_llama_for_ckpt", tmp_path / "lm_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.save(mod.llama().state_dict(), tmp_path / "ck0.pt")
    rows = [{"ids": list(range(1, 9)), "labels": list(range(1, 9))} for _ in range(4)]
    write_jsonl(tmp_path / "train.jsonl", rows)
    data = {"path": "train.jsonl", "input_ids": "ids", "labels": "labels", "max_length": 8}
    write_config(tmp_path / "run.yaml", {
        "model": {"entrypoint": "lm_model.py:llama"}, "task": "language_modeling", "checkpoints": ["ck0.pt"],
        "data": {"train": data, "target": data, "batch_size": 4}, "projector": {"kind": "noop"},
        "store": {"path": "s.zarr"}, "num_threads": 1, "grad_wrt": ["model.layers.3.self_attn.*_proj"],
    })
    res = run(tmp_path, "featurize", "run.yaml", "-q")
    assert res.returncode == 1, res.stderr
    lines = res.stderr.splitlines()
    assert lines[0].startswith("error: config") and "Traceback" not in res.stderr
    one = " ".join(res.stderr.split())
    assert ("pattern 'model.layers.3.self_attn.*_proj' matches no parameter; did you mean "
            "'model.layers.3.self_attn.*_proj.*'? it matches 4 parameters") in one
    assert f"the model's {len(list(mod.llama().parameters()))} parameters, in 12 groups" in one
    assert "      model.layers.{0..3}.mlp.down_proj.weight" in lines  # one group per line
    assert not (tmp_path / "s.zarr").exists()
