"""per_sample_grad_norms off its fast path holds what its docstring promises (issue 25, item 4): at most
chunk_size examples' gradients beyond the model's own forward and backward pass, measured as its peak tensor
memory above one batch gradient's peak, at most chunk_size * P floats plus 10%; and its result carries no
autograd graph. Measured with the book's own counter (book/_shared/measure.py: the bytes of the tensors a
call creates, the same on any device) on a transformer with PyTorch's fused attention (the vmap path) and a
GRU (the unroll), at two chunk sizes. Before, each chunk's per-example gradients stayed alive in an autograd
graph through the covered layers' weights: 21 to 41 P floats above the batch gradient at chunk_size
1 and 4 on these models."""
import importlib.util
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_func_recipes as tfr
from bookcheck import ROOT

_spec = importlib.util.spec_from_file_location("measure", ROOT / "book" / "_shared" / "measure.py")
measure = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(measure)

B = 32


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.encoder = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(32, 3)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)).mean(1))


class LastStep(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn, self.head = nn.GRU(8, 32, batch_first=True), nn.Linear(32, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


def case(name):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "transformer":
        return Transformer(), torch.randint(50, (B, 12), generator=g), torch.randint(3, (B,), generator=g), "vmap"
    return LastStep(), torch.randn(B, 10, 8, generator=g), torch.randint(3, (B,), generator=g), "unroll"


def excess_over_batch_gradient(model, x, y, chunk_size):
    """(peak above one batch gradient's peak, in P floats; the norms; their PathReport)."""
    params = list(model.parameters())
    base = measure.peak_tensor_memory(lambda: torch.autograd.grad(F.cross_entropy(model(x), y), params))
    found = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="There is a performance drop")
        peak = measure.peak_tensor_memory(lambda: found.setdefault("norms", tfr.per_sample_grad_norms(
            model, F.cross_entropy, x, y, chunk_size=chunk_size, report=True)))
    norms, how = found["norms"]
    return (peak - base) / (4 * sum(p.numel() for p in params)), norms, how


@pytest.mark.parametrize("name", ["transformer", "GRU"])
@pytest.mark.parametrize("chunk_size", [1, 4])
def test_norms_hold_at_most_chunk_size_gradients_and_no_graph(name, chunk_size):
    model, x, y, path = case(name)
    excess, norms, how = excess_over_batch_gradient(model, x, y, chunk_size)
    assert how.path == path, how.reason
    assert excess <= 1.1 * chunk_size, f"{excess:.2f} P floats above a batch gradient's peak, chunk_size {chunk_size}"
    assert not norms.requires_grad and norms.grad_fn is None
    expected = torch.stack([torch.cat([g.flatten() for g in torch.autograd.grad(
        F.cross_entropy(model(x[n:n + 1]), y[n:n + 1]), list(model.parameters()))]).norm() for n in range(B)])
    assert torch.allclose(norms, expected, rtol=1e-4, atol=1e-6)  # float32: rounding of sums over up to 64 terms


def test_the_counter_sees_per_example_gradients():
    """The measurement can fail: per_sample_grads, which returns the whole batch's per-example gradients
    (B * P floats), is far above the bound checked above for chunk_size 4."""
    model, x, y, _ = case("GRU")
    base = measure.peak_tensor_memory(lambda: torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters())))
    kept = {}
    peak = measure.peak_tensor_memory(lambda: kept.setdefault("g", tfr.per_sample_grads(model, F.cross_entropy, x, y)))
    assert (peak - base) / (4 * sum(p.numel() for p in model.parameters())) > 1.1 * 4


class PointwiseChain(nn.Module):
    """Two linear layers joined by 24 operations with plain numbers, none of whose results autograd saves."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 512), nn.Linear(512, 3)

    def forward(self, x):
        h = self.a(x)
        for _ in range(12):
            h = (h + 1.0) * 0.5
        return self.b(h)


def test_the_fast_paths_trace_does_not_keep_every_intermediate():
    """The trace once kept every result of the forward pass alive so that no key could be reused, holding
    intermediates autograd frees: on this chain the norms' peak was 8.3 times a batch gradient's. It now holds a
    weak reference to each (which keeps the key, not the memory), and the peak is the batch pass's plus the
    layers' recorded inputs and outputs, 1.3 times here; at most 2 times is asked (a second copy of the hidden
    layer's activations is 1.3 times)."""
    torch.manual_seed(0)
    model = PointwiseChain().double()
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    t = torch.randint(0, 3, (256,), generator=torch.Generator().manual_seed(2))
    norms = lambda: tfr.per_sample_grad_norms(model, F.cross_entropy, x, t)  # noqa: E731
    assert tfr.per_sample_grad_norms(model, F.cross_entropy, x, t, report=True)[1].path == "fast"
    batch = measure.peak_tensor_memory(lambda: torch.autograd.grad(F.cross_entropy(model(x), t), list(model.parameters())))
    assert measure.peak_tensor_memory(norms) <= 2 * batch


def test_the_trace_knows_a_tensor_by_its_cpp_tensor(recipes):
    """The trace keys tensors by their C++ tensor, whose address its weak reference keeps from reuse while the
    memory is freed: a result whose Python object is gone stays known (PyTorch may hand it back), and a tensor
    made without an operation the trace saw that shares example data's memory is refused."""
    x = torch.randn(4, 3, dtype=torch.float64)
    trace = recipes["_BatchTrace"](4, [x], {})
    with trace:
        h = x * 2.0
        key = h._cdata
        del h
        assert trace.rows[key] == 1 and trace.refs[key].expired()
        h = x * 3.0
        with pytest.raises(recipes["_NotPerExample"], match="shares memory with example data"):
            torch.from_numpy(h.detach().numpy()).sum(0)
    constant, trace = torch.ones(3, dtype=torch.float64), recipes["_BatchTrace"](4, [x], {})
    with trace:  # a constant from outside the forward pass is admitted
        assert trace.r_of(x + constant) == 1 and not trace.refs[constant._cdata].expired()
