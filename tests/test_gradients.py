import pytest
import torch
from torch import nn

from trakcli.errors import ConfigError, DataError, GradientError
from trakcli.gradients import PerExampleGradients, check_finite, select_parameters
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
