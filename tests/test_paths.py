"""One path vocabulary for every recipe that chooses a path: per_sample_grads, output_jacobian,
per_sample_grad_norms and clipped_noisy_gradient each take path in {"auto", "fast", "vmap", "unroll",
"loop"}, and an explicit path means exactly that path: where it applies the report names it (and the
result equals the loop's), where it does not the call raises (never a quiet fall back to another path)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_func_recipes
from torch_func_recipes import clipped_noisy_gradient, output_jacobian, per_sample_grad_norms, per_sample_grads

X_FLAT = torch.randn(5, 6, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
X_SEQ = torch.randn(5, 4, 3, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
TARGETS = torch.randint(3, (5,), generator=torch.Generator().manual_seed(13))
PATHS = ("fast", "vmap", "unroll", "loop")


class GRUHead(nn.Module):
    """A GRU, then a head on its last output: vmap cannot run the layer's forward (its unbatched initial state), the unroll can."""

    def __init__(self):
        super().__init__()
        self.rnn, self.head = nn.GRU(3, 6, batch_first=True), nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


class ReadsAValue(nn.Module):
    """Linear layers only, but forward reads an example's value with .item(), which vmap cannot do."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h if h.sum().item() > -1e9 else -h)


def models():
    torch.manual_seed(14)
    return {"linear": (nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double(), X_FLAT),
            "GRU": (GRUHead().double(), X_SEQ),
            "item": (ReadsAValue().double(), X_FLAT)}


MODELS = models()
# Where each explicit path applies (every other pair must raise).
APPLIES = {"linear": {"fast", "vmap", "loop"}, "GRU": {"unroll", "loop"}, "item": {"loop"}}
# What a path raises where it does not apply: its type, and words of its message.
REFUSALS = {("linear", "unroll"): (ValueError, "nn.RNN, nn.GRU or nn.LSTM"),
            ("item", "unroll"): (ValueError, "nn.RNN, nn.GRU or nn.LSTM"),
            ("GRU", "fast"): (ValueError, "the fast path does not apply: parameter rnn.weight_ih_l0 belongs to GRU"),
            ("GRU", "vmap"): (RuntimeError, ""),  # vmap's own error, from the unbatched initial state
            ("item", "vmap"): (RuntimeError, ""),  # vmap's own error, from .item()
            ("item", "fast"): (ValueError, "the fast path does not apply: ")}

RECIPES = {
    "per_sample_grads": lambda model, x, **o: per_sample_grads(model, F.cross_entropy, x, TARGETS, **o),
    "output_jacobian": lambda model, x, **o: output_jacobian(model, x, **o),
    "per_sample_grad_norms": lambda model, x, **o: per_sample_grad_norms(model, F.cross_entropy, x, TARGETS, **o),
    "clipped_noisy_gradient": lambda model, x, **o: clipped_noisy_gradient(
        model, F.cross_entropy, x, TARGETS, norms=torch.linspace(0.5, 2.0, len(x), dtype=x.dtype), max_norm=1.0,
        noise_multiplier=0.0, **o),
}


def flat(result):
    """A recipe's result as one vector, to compare two paths."""
    return torch.cat([t.flatten() for t in result.values()]) if isinstance(result, dict) else result.flatten()


def check_path_runs_as_asked(recipe, name, path):
    model, x = MODELS[name]
    result, report = RECIPES[recipe](model, x, path=path, report=True)
    assert report.path == path, report
    torch.testing.assert_close(flat(result), flat(RECIPES[recipe](model, x, path="loop")), rtol=1e-10, atol=1e-12)


def check_path_refused(recipe, name, path):
    model, x = MODELS[name]
    kind, words = REFUSALS[(name, path)]
    with pytest.raises(kind) as raised:
        RECIPES[recipe](model, x, path=path)
    assert words in str(raised.value)


@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("path", PATHS)
def test_an_explicit_path_is_taken_or_raises(recipe, name, path):
    if path in APPLIES[name]:
        check_path_runs_as_asked(recipe, name, path)
    else:
        check_path_refused(recipe, name, path)


@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_auto_takes_the_first_path_that_applies(recipe):
    for name, expected in (("linear", "fast"), ("GRU", "unroll"), ("item", "loop")):
        model, x = MODELS[name]
        assert RECIPES[recipe](model, x, report=True)[1].path == expected, (name, expected)


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("path", ["general", "Fast", "", None, 1])
def test_an_unknown_path_is_refused_listing_the_valid_ones(recipe, path):
    model, x = MODELS["linear"]
    with pytest.raises(ValueError, match="path must be one of 'auto', 'fast', 'vmap', 'unroll', 'loop', got "):
        RECIPES[recipe](model, x, path=path)


@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_the_checks_catch_a_vmap_path_that_falls_back(recipe, monkeypatch):
    """A driver whose "vmap" quietly does what "auto" does (unroll, or loop where vmap raised) passes
    nothing above: the refusal checks fail, on the GRU (which it would unroll) and on .item() (which it
    would loop)."""
    driver = torch_func_recipes.per_sample._with_fallbacks
    lenient = lambda model, batch, path, *rest: driver(model, batch, "auto" if path == "vmap" else path, *rest)
    for module in (torch_func_recipes.per_sample, torch_func_recipes.output_jacobians):
        monkeypatch.setattr(module, "_with_fallbacks", lenient)
    for name in ("GRU", "item"):
        with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
            check_path_refused(recipe, name, "vmap")
    monkeypatch.undo()
    for name in ("GRU", "item"):
        check_path_refused(recipe, name, "vmap")
