"""The fast path's layer registry (src/torch_func_recipes/_layers.py and one _layer_<kind>.py per kind):
which rules there are and what each provides, the trace's run-time check that a parameter is used by its
own module's rule, and that adding a layer kind is adding one rule."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_func_recipes import output_jacobian, per_sample_grad_norms, per_sample_grads
from torch_func_recipes._batch import _as_batch
from torch_func_recipes._layers import _RULES, _LayerRule, _register, _rules_for
from torch_func_recipes._trace import _traced_forward

GEN = torch.Generator().manual_seed(41)
X = torch.randn(6, 4, generator=GEN, dtype=torch.float64)
T = torch.randint(2, (6,), generator=GEN)


def loop_grads(model, x, t):
    """{name: (B, *shape)} for the trainable parameters, one autograd call per example."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    rows = [torch.autograd.grad(F.cross_entropy(model(x[n : n + 1]), t[n : n + 1]), list(params.values())) for n in range(len(x))]
    return {name: torch.stack([row[k] for row in rows]) for k, name in enumerate(params)}


def test_each_kind_has_its_module_and_says_what_it_provides():
    assert sorted(_RULES) == ["batch_norm", "conv", "embedding", "group_norm", "hf_conv1d", "layer_norm", "linear", "parameter",
                              "rms_norm"]
    assert all({rule.kind for rule in _rules_for(need)} == set(_RULES) for need in ("grads", "jacobian", "norms"))
    for rule in _RULES.values():  # transformers' Conv1D is looked up only once transformers is imported; the
        assert (rule.modules or rule.kind in ("hf_conv1d", "parameter")) and rule.ops  # parameter rule covers by name
        assert type(rule).__module__ == f"torch_func_recipes._layer_{rule.kind.replace('layer_', '')}"
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils")
    assert _RULES["hf_conv1d"].modules == (pytorch_utils.Conv1D,)
    with pytest.raises(ValueError, match="need must be one of"):
        _rules_for("hessian")
    with pytest.raises(ValueError, match="a kind of its own"):
        _register(_RULES["linear"])


class OnlyAsTable(nn.Module):
    """A Linear's weight used only as an embedding table, never by F.linear: the owner check alone refuses it."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(4, 5), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.tanh(x + F.embedding((x[:, 0] > 0).long(), self.lin.weight)))


def test_the_owner_check_is_what_refuses():
    torch.manual_seed(43)
    model = OnlyAsTable().double()
    model.lin.bias.requires_grad_(False)  # lin's bias is unused: keep it out of the trainable set
    norms, how = per_sample_grad_norms(model, F.cross_entropy, X, T, report=True)
    assert how.path == "vmap" and how.reason.startswith("parameter lin.weight is used by aten.embedding.default under the embedding rule"), how.reason
    assert how.reason.endswith("but its module's rule is linear")
    expected = torch.cat([g.flatten(1) for n, g in loop_grads(model, X, T).items() if n != "lin.bias"], 1).norm(dim=1)
    assert torch.allclose(norms, expected, rtol=1e-10)
    # Without the owners (a plain function in place of the module), the embedding rule would take the weight:
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    _, layers, reason = _traced_forward(lambda x: model(x), _as_batch(X), trainable, "norms")
    assert reason is None and [layer["kind"] for layer in layers] == ["embedding", "linear"]


class Scale(nn.Module):
    """y = x * w, w one number per feature: a layer kind the package does not know."""

    def __init__(self, size):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, size))

    def forward(self, x):
        return x * self.weight


class ScaleRule(_LayerRule):
    """What adding a layer kind takes: its module types, the operation it recognises, and the per-example product."""

    kind = "test_scale"
    modules = (Scale,)
    ops = frozenset({torch.ops.aten.mul.Tensor})

    def record(self, trace, func, args, kwargs, result, r, params, transposed):
        a, w = args
        if not params or trace.param_of(w) is None or trace.r_of(a) != 1 or a.dim() != 2 or w.dim() != 1:
            return NotImplemented
        trace.layers.append(dict(kind=self.kind, weight=trace.use(trace.param_of(w), func, self), bias=None, a=a, z=result,
                                 r=1, versions=(a._version, result._version)))
        return 1

    def per_example_grads(self, layer, delta, out):
        out[layer["weight"]].copy_(layer["a"].detach() * delta)


def test_adding_a_layer_kind_is_adding_one_rule():
    torch.manual_seed(44)
    model = nn.Sequential(nn.Linear(4, 3), Scale(3), nn.Tanh(), nn.Linear(3, 2)).double()
    expected = loop_grads(model, X, T)
    grads, how = per_sample_grads(model, F.cross_entropy, X, T, report=True)
    assert how.path == "vmap" and "parameter 1.weight belongs to Scale" in how.reason  # unknown: vmap
    _register(ScaleRule())
    try:
        grads_fast, how = per_sample_grads(model, F.cross_entropy, X, T, report=True)
        assert how.path == "fast", how.reason
        assert all(torch.allclose(grads_fast[k], expected[k], rtol=1e-10, atol=1e-12) for k in expected)
        _, how = output_jacobian(model, X, report=True)  # the rule gives no Jacobian rows: not used there
        assert how.path == "vmap" and "not to a layer the fast path covers" in how.reason
    finally:
        _RULES.pop("test_scale")
    assert all(torch.allclose(grads[k], expected[k], rtol=1e-10, atol=1e-12) for k in expected)
