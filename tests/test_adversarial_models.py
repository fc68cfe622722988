"""The recipes' fast paths must never be silently wrong: models built to break each assumption of
the fast path (examples kept apart, every trainable parameter in one linear or convolution
operation, recorded activations left alone), each checked against the loop (every example as a
batch of one) in float64, with the path the recipe must take."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from test_recipes import close, loop_output_jacobian, loop_per_sample, recipes  # noqa: F401 (fixture)

G = torch.Generator().manual_seed(7)


def randn(*shape):
    return torch.randn(*shape, generator=G, dtype=torch.float64)


class SeedCNN(nn.Module):
    """The per-sample tutorial's network as the tutorial writes it (smaller images)."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 4, 3), nn.Conv2d(4, 6, 3)
        self.fc1, self.fc2 = nn.Linear(6 * 5 * 5, 12), nn.Linear(12, 3)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        return F.log_softmax(self.fc2(F.relu(self.fc1(torch.flatten(x, 1)))), dim=1)


class SeedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x.view(x.shape[0], -1))))


class Body(nn.Module):
    def __init__(self, head_in=8):
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(head_in, 3)


class MinusBatchMean(Body):
    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h - h.mean(0))


class BatchNormalisedByHand(Body):
    def forward(self, x):
        h = self.a(x)
        return self.b((h - h.mean(dim=0)) * torch.rsqrt(h.pow(2).mean(dim=0) + 1.0))


class LayerTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(torch.tanh(self.a(x)))))


class TiedWeights(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 3)
        self.c = nn.Linear(6, 6)
        self.c.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.tanh(self.c(torch.tanh(self.a(x)))))


class BareParameter(Body):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)) * self.scale)


class WeightUsedOutsideItsLayer(Body):
    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) + 0.1 * (x @ self.a.weight.T)[:, :3]


class InPlaceAdd(Body):
    def forward(self, x):
        h = self.a(x)
        h += 1.0  # changes the linear layer's recorded output
        return self.b(torch.tanh(h))


class RollThroughFlattenedBatch(Body):
    def forward(self, x):  # each example gets its neighbour's features (for a batch of one, its own)
        h = torch.tanh(self.a(x))
        return self.b(h.reshape(-1).roll(8).reshape(h.shape))


class BatchRoll(Body):
    def forward(self, x):
        return self.b(torch.roll(torch.tanh(self.a(x)), 1, dims=0))


class ItemInForward(Body):
    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h * (1.0 + 0.0 * h.max().item()))


def hooked(change_in_place):
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    if change_in_place:
        model[0].register_forward_hook(lambda module, args, output: output.mul_(2.0))
    else:
        model[0].register_forward_hook(lambda module, args, output: 2.0 * output + 1.0)
    return model


def frozen():
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model[0].weight.requires_grad_(False)
    model[2].bias.requires_grad_(False)
    return model


def backward_hooked():
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model[0].register_full_backward_hook(lambda module, grad_in, grad_out: None)
    return model


# name: (model, inputs, path the recipes must take)
CASES = {
    "seed CNN as a class": (SeedCNN(), randn(6, 1, 14, 14), "fast"),
    "seed MLP as a class": (SeedMLP(), randn(6, 1, 4, 4), "fast"),
    "softmax over the batch by dim=-2": (nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3), nn.LogSoftmax(dim=-2)),
                                         randn(6, 6), "general"),
    "h - h.mean(0)": (MinusBatchMean(), randn(6, 6), "general"),
    "batch statistics by hand": (BatchNormalisedByHand(), randn(6, 6), "general"),
    "one layer used twice": (LayerTwice(), randn(6, 6), "general"),
    "tied weights": (TiedWeights(), randn(6, 6), "general"),
    "a bare nn.Parameter in forward": (BareParameter(), randn(6, 6), "general"),
    "a weight used outside its layer": (WeightUsedOutsideItsLayer(), randn(6, 6), "general"),
    "forward hook that changes an output": (hooked(change_in_place=False), randn(6, 6), "fast"),
    "forward hook that changes an output in place": (hooked(change_in_place=True), randn(6, 6), "general"),
    "in-place ReLU": (nn.Sequential(nn.Linear(6, 8), nn.ReLU(inplace=True), nn.Linear(8, 3)), randn(6, 6), "general"),
    "in-place add": (InPlaceAdd(), randn(6, 6), "general"),
    "frozen parameters": (frozen(), randn(6, 6), "fast"),
    "a roll through the flattened batch": (RollThroughFlattenedBatch(), randn(6, 6), "general"),
    "torch.roll over the batch": (BatchRoll(), randn(6, 6), "general"),
}
TARGETS = torch.randint(3, (6,), generator=G)


@pytest.mark.parametrize("name", list(CASES))
def test_per_sample_grads_equal_the_loop(recipes, name):
    model, x, expected_path = CASES[name]
    model = model.double()
    expected = loop_per_sample(model, x, TARGETS)
    got, report = recipes["per_sample_grads"](model, F.cross_entropy, x, TARGETS, report=True)
    assert report.path == expected_path, report.reason
    assert list(got) == list(expected) and all(close(got[k], expected[k]) for k in expected)


@pytest.mark.parametrize("name", list(CASES))
def test_output_jacobian_equals_the_loop(recipes, name):
    model, x, expected_path = CASES[name]
    model = model.double()
    got, report = recipes["output_jacobian"](model, x, report=True)
    assert report.path == expected_path, report.reason
    assert close(got, loop_output_jacobian(model, x))


def test_the_adversarial_models_differ_from_the_fast_paths_arithmetic(recipes):
    """The models sent to the general path really would be wrong on the fast path: forcing the
    layer products onto a model that mixes examples gives a different answer (so the tests above
    can fail)."""
    model = MinusBatchMean().double()
    x = randn(6, 6)
    trainable = dict(model.named_parameters())
    out = {name: torch.empty((6, *p.shape), dtype=p.dtype) for name, p in trainable.items()}
    tracer = recipes["_BatchTrace"](6, x, trainable)
    tracer.fail = lambda why: None  # a trace that never objects
    with tracer:
        output = model(x)
    total = F.cross_entropy(output, TARGETS, reduction="sum")
    deltas = torch.autograd.grad(total, [layer["z"] for layer in tracer.layers])
    for layer, delta in zip(tracer.layers, deltas):
        recipes["_per_example_products"](layer, delta, out)
    expected = loop_per_sample(model, x, TARGETS)
    assert not all(close_enough(out[k], expected[k]) for k in expected)


def close_enough(a, b):
    return torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_inside_no_grad_and_inference_mode(recipes):
    model, x, _ = CASES["seed CNN as a class"]
    model = model.double()
    expected = loop_per_sample(model, x, TARGETS)
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            got = recipes["per_sample_grads"](model, F.cross_entropy, x, TARGETS)
            jac = recipes["output_jacobian"](model, x)
        assert all(close(got[k], expected[k]) for k in expected)
        assert close(jac, loop_output_jacobian(model, x))
    with torch.inference_mode():
        x_inference, t_inference = x.clone(), TARGETS.clone()
    got = recipes["per_sample_grads"](model, F.cross_entropy, x_inference, t_inference)
    assert all(close(got[k], expected[k]) for k in expected)


def test_batch_of_one_and_empty_batch(recipes):
    model, x, _ = CASES["seed CNN as a class"]
    model = model.double()
    one, report = recipes["per_sample_grads"](model, F.cross_entropy, x[:1], TARGETS[:1], report=True)
    expected = loop_per_sample(model, x[:1], TARGETS[:1])
    assert report.path == "fast" and all(close(one[k], expected[k]) for k in expected)
    assert close(recipes["output_jacobian"](model, x[:1]), loop_output_jacobian(model, x[:1]))
    empty = recipes["per_sample_grads"](model, F.cross_entropy, x[:0], TARGETS[:0])
    assert {k: tuple(v.shape) for k, v in empty.items()} == {k: (0, *p.shape) for k, p in model.named_parameters()}
    with pytest.raises(ValueError, match="batch of 0"):
        recipes["output_jacobian"](model, x[:0])


@pytest.mark.parametrize("model", [ItemInForward(), backward_hooked()], ids=[".item() in forward", "a backward hook"])
def test_models_vmap_cannot_run_raise(recipes, model):
    """The trace refuses these, and vmap cannot run them: the recipes raise (as vmap(grad) does)
    instead of returning a wrong answer."""
    model = model.double()
    with pytest.raises(RuntimeError):
        recipes["per_sample_grads"](model, F.cross_entropy, randn(6, 6), TARGETS)
    with pytest.raises(RuntimeError):
        recipes["output_jacobian"](model, randn(6, 6))


def test_errors_name_the_problem(recipes):
    model, x, _ = CASES["h - h.mean(0)"]
    model = model.double()
    with pytest.raises(ValueError, match="batch dimension"):
        recipes["per_sample_grads"](model, F.cross_entropy, x, TARGETS, path="fast")
    with pytest.raises(ValueError, match="scalar"):
        recipes["per_sample_grads"](SeedMLP().double(), lambda p, t: F.cross_entropy(p, t, reduction="none").expand(2),
                                    randn(6, 1, 4, 4), TARGETS)
    with pytest.raises(ValueError, match="different batch sizes|one row per example"):
        recipes["per_sample_grads"](model, F.cross_entropy, x, TARGETS[:3])
    with pytest.raises(ValueError, match=r"\(B, Y\)"):
        recipes["output_jacobian"](nn.Conv2d(1, 2, 3).double(), randn(4, 1, 5, 5))
