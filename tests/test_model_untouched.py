"""No recipe changes the user's model, whether it answers, refuses or fails (issue 25, item 2): every
parameter and buffer is compared byte for byte, and so are each module's training flag, its hooks, its
attributes and the parameters' .grad and requires_grad. Models with buffers (BatchNorm in eval mode, with
running statistics away from their initial values, and a buffer of the model's own), with a GRU (which
the per-example recipes run on a stand-in), and with buffers its own forward pass and a backward hook write
into (put back by _batch._model_kept; one through .data, with a Python call counter and a buffer registered
lazily besides) go through every data-taking recipe."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.utils.parametrize as parametrize

import torch_func_recipes as tfr
from test_validation import ALL, CURVATURE

GEN = torch.Generator().manual_seed(41)
X = torch.randn(5, 6, 4, generator=GEN, dtype=torch.float64)
T = torch.randint(3, (5,), generator=GEN)


class WithBuffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.encode, self.norm, self.head = nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        return self.head(self.norm(torch.tanh(self.encode(x)).mean(1)))


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn, self.head = nn.GRU(4, 5, batch_first=True), nn.Linear(5, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


class WritesItsBuffers(nn.Module):
    """A forward pass that keeps a running mean of its hidden layer by hand, in place, and a backward hook that
    adds up the head's output gradients into another buffer: every call of the model changes them. The forward
    pass also counts its calls in a buffer written through .data (which moves no version counter) and in a Python
    attribute, and registers a buffer when it has none."""

    def __init__(self, backward_hook=True):
        super().__init__()
        self.encode, self.head = nn.Linear(4, 6), nn.Linear(6, 3)
        self.register_buffer("seen", torch.zeros(6))
        self.register_buffer("backward_total", torch.zeros(()))
        self.register_buffer("calls_through_data", torch.zeros(()))
        self.calls = 0
        if backward_hook:
            self.head.register_full_backward_hook(self.count)

    def count(self, module, grad_in, grad_out):
        with torch.no_grad():
            self.backward_total.add_(grad_out[0].detach().square().sum())

    def forward(self, x):
        h = torch.tanh(self.encode(x)).mean(1)
        with torch.no_grad():
            self.seen.mul_(0.9).add_(0.1 * h.detach().mean(0))
        self.calls_through_data.data.add_(1)
        self.calls += 1
        if "registered_lazily" not in self._buffers:
            self.register_buffer("registered_lazily", torch.ones(()))
        return self.head(h)


def build(kind, backward_hook=True):
    torch.manual_seed(42)
    model = (WritesItsBuffers(backward_hook) if kind == "writes" else {"buffers": WithBuffers, "recurrent": Recurrent}[kind]()).double()
    if kind == "writes":
        model(X).sum().backward()  # the buffers and every .grad away from their initial values
        del model.registered_lazily  # the next call registers it again
    if kind == "buffers":
        with torch.no_grad():  # running statistics and the own buffer away from their initial values
            model(X)
            model.calls += 3
        model.eval()
    model.head.register_forward_hook(lambda module, args, out: None)
    return model


def snapshot(model):
    """Everything a recipe could change, as comparable values: tensors as their bytes."""
    as_bytes = lambda t: (t.dtype, tuple(t.shape), t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())  # noqa: E731
    return {
        "state": {k: as_bytes(v) for k, v in model.state_dict(keep_vars=True).items()},
        "grad": {k: None if p.grad is None else as_bytes(p.grad) for k, p in model.named_parameters()},
        "requires_grad": {k: p.requires_grad for k, p in model.named_parameters()},
        "identity": {k: id(p) for k, p in model.named_parameters()},
        "training": {k: m.training for k, m in model.named_modules()},
        "hooks": {k: (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks)) for k, m in model.named_modules()},
        "attributes": {k: sorted(vars(m)) for k, m in model.named_modules()},
        "modules": {k: id(m) for k, m in model.named_modules()},
        "parameter hooks": {k: len(p._backward_hooks or {}) for k, p in model.named_parameters()},
        "post-accumulate hooks": {k: len(p._post_accumulate_grad_hooks or {}) for k, p in model.named_parameters()},
        "buffers": {(k, b): None if v is None else as_bytes(v) for k, m in model.named_modules() for b, v in m._buffers.items()},
        "values": {k: {name: v for name, v in vars(m).items() if isinstance(v, (bool, int, float, str))}
                   for k, m in model.named_modules()},
        "forward": {k: type(m).forward for k, m in model.named_modules()},
        "class": {k: type(m) for k, m in model.named_modules()},
        "buffers require grad": {(k, b): v.requires_grad for k, m in model.named_modules() for b, v in m._buffers.items() if v is not None},
    }


def fails_midway(out, t):
    raise RuntimeError("the loss failed on purpose")


@pytest.mark.parametrize("kind", ["buffers", "recurrent", "writes"])
@pytest.mark.parametrize("recipe", list(ALL))
def test_the_model_is_left_as_it_was(recipe, kind):
    model = build(kind)
    before = snapshot(model)
    if kind == "writes" and recipe in CURVATURE:  # refuses a module backward hook; without it, its forward pass writes
        with pytest.raises(ValueError, match=r"^module head has a backward hook"):
            ALL[recipe](model, F.cross_entropy, X, T)
        assert snapshot(model) == before
        model = build(kind, backward_hook=False)
        before = snapshot(model)
    ALL[recipe](model, F.cross_entropy, X, T)  # answers (a GRU too: the curvature recipes reuse the fall-backs)
    assert snapshot(model) == before
    with pytest.raises(RuntimeError, match="the loss failed on purpose"):  # fails
        if recipe == "output_jacobian":  # it takes no loss: its selector fails instead
            tfr.output_jacobian(model, X, select=lambda out: fails_midway(out, None))
        else:
            ALL[recipe](model, fails_midway, X, T)
    assert snapshot(model) == before
    if kind == "buffers":  # refuses: training mode, BatchNorm with batch statistics
        model.train()
        trained_before = snapshot(model)
        with pytest.raises(ValueError, match=r"norm \(BatchNorm1d\) is a BatchNorm in training mode"):
            ALL[recipe](model, F.cross_entropy, X, T)
        assert snapshot(model) == trained_before


def test_the_snapshot_sees_each_kind_of_change():
    """The comparison can fail: a buffer's one byte, a .grad, a mode, a hook and an attribute are each seen."""
    next_up = lambda t: torch.nextafter(t, torch.full_like(t, float("inf")))  # noqa: E731  (one unit in the last place)
    changes = [lambda m: m.norm.running_mean[:1].copy_(next_up(m.norm.running_mean[:1])),
               lambda m: setattr(m.head.weight, "grad", torch.zeros_like(m.head.weight)),
               lambda m: m.norm.train(), lambda m: m.encode.register_forward_hook(lambda *a: None),
               lambda m: setattr(m.head, "note", 1), lambda m: m.calls.add_(1)]
    for change in changes:
        model = build("buffers")
        before = snapshot(model)
        change(model)
        assert snapshot(model) != before
    # what WritesItsBuffers' forward pass changes besides its running mean, each on its own
    changes = [lambda m: m.calls_through_data.data.add_(1), lambda m: setattr(m, "calls", m.calls + 1),
               lambda m: m.register_buffer("registered_lazily", torch.ones(()))]
    for change in changes:
        model = build("writes")
        before = snapshot(model)
        change(model)
        assert snapshot(model) != before
    assert set(CURVATURE) < set(ALL)


class WritesItsWeight(nn.Module):
    """A forward pass that clamps its first layer's weight in place (a constraint applied by hand)."""

    def __init__(self):
        super().__init__()
        self.encode, self.head = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x):
        with torch.no_grad():
            self.encode.weight.clamp_(-0.3, 0.3)
        return self.head(torch.tanh(self.encode(x)).mean(1))


@pytest.mark.parametrize("recipe", list(ALL))
def test_a_model_that_writes_its_parameters_is_refused(recipe):
    """nn.Embedding(max_norm=...) renormalises the rows it looks up in place on every forward pass: a recipe changed
    the model's weight (by up to 1.38), so it is refused before anything runs. Any other parameter written in place
    during the call is reported after it (its values are not copied, so they are not put back)."""
    torch.manual_seed(5)
    embedded = nn.Sequential(nn.Embedding(10, 4, max_norm=0.5), nn.Flatten(), nn.Linear(24, 3)).double()
    with torch.no_grad():
        embedded[0].weight.mul_(3)  # rows longer than max_norm
    ids = torch.randint(10, (5, 6), generator=torch.Generator().manual_seed(6))
    before = snapshot(embedded)
    with pytest.raises(ValueError, match=r"^module 0 \(Embedding with max_norm=0.5\) renormalises"):
        ALL[recipe](embedded, F.cross_entropy, ids, T)
    assert snapshot(embedded) == before
    torch.manual_seed(7)
    model = WritesItsWeight().double()
    with torch.no_grad():
        model.encode.weight.mul_(10)
    with pytest.raises(ValueError, match=r"^parameter encode.weight was written in place during the call"):
        ALL[recipe](model, F.cross_entropy, X, T)


class ChangesItsStructure(nn.Module):
    """A forward pass that changes what the model is made of, one way per `how`, as models do: a submodule built on
    the first call (a plain attribute None until then), a parameter made on the first call, a forward hook, a
    gradient hook or a post-accumulate-grad hook on a parameter registered by every call, a buffer None until the first call fills it, a buffer cast
    to the input's dtype through .data, a parameter frozen by the forward pass, a parametrization registered on
    the first call (which swaps the module's class), a buffer made to require grad."""

    def __init__(self, how):
        super().__init__()
        torch.manual_seed(44)
        self.encode, self.head, self.how, self.extra = nn.Linear(4, 6).double(), nn.Linear(6, 3).double(), how, None
        self.register_buffer("cache", None, persistent=False)
        self.register_buffer("scale", torch.ones(3))  # float32

    def forward(self, x):
        h = torch.tanh(self.encode(x)).mean(1)
        if self.how == "lazy submodule" and self.extra is None:
            self.extra = nn.Identity()
        if self.how == "lazy parameter" and "temperature" not in self._parameters:
            self.temperature = nn.Parameter(torch.ones((), dtype=torch.float64))
        if self.how == "forward hook":
            self.head.register_forward_hook(lambda module, args, out: None)
        if self.how == "parameter hook" and self.head.weight.requires_grad:
            self.head.weight.register_hook(lambda g: g)
        if self.how == "post-accumulate hook":
            self.head.weight.register_post_accumulate_grad_hook(lambda p: None)
        if self.how == "None buffer filled" and self.cache is None:
            self.cache = torch.ones(3, dtype=x.dtype)
        if self.how == "buffer cast through .data":
            self.scale.data = self.scale.data.to(x.dtype)
        if self.how == "frozen by forward":
            self.encode.bias.requires_grad_(False)
        if self.how == "parametrization registered" and not parametrize.is_parametrized(self.head):
            parametrize.register_parametrization(self.head, "weight", nn.Identity())
        if self.how == "buffer made to require grad":
            self.scale.requires_grad_(True)
        return self.head(h) * (self.scale.to(x.dtype) if self.cache is None else self.cache)


STRUCTURE = ["lazy submodule", "lazy parameter", "forward hook", "parameter hook", "post-accumulate hook",
             "None buffer filled", "buffer cast through .data", "frozen by forward", "parametrization registered",
             "buffer made to require grad"]


@pytest.mark.parametrize("how", STRUCTURE)
@pytest.mark.parametrize("recipe", list(ALL))
def test_a_forward_pass_that_changes_the_models_structure_leaves_it_as_it_was(recipe, how):
    """What such a forward pass did (the recipes run it several times: the trace, the checks, the loop) is undone,
    whether the recipe answers or raises (a parameter frozen during the call, say: autograd's error). An
    adversarial review found each left behind; a shallow put-back of the attributes alone made the lazy submodule
    worse: the attribute None again, the submodule still registered. A second review found a parametrization
    registered during the call left the module's class swapped, the model broken (KeyError on its next call)."""
    model = ChangesItsStructure(how)
    before = snapshot(model)
    if how == "frozen by forward":  # every pass would differentiate another set of parameters: refused
        with pytest.raises(ValueError, match=r"^parameter encode.bias had requires_grad switched during the call"):
            ALL[recipe](model, F.cross_entropy, X, T)
    else:
        try:
            ALL[recipe](model, F.cross_entropy, X, T)
        except (ValueError, RuntimeError):  # the lazy parameter: not among those the call began with
            pass
    assert snapshot(model) == before
    model(X)  # and it still runs


def test_the_snapshot_sees_each_change_of_structure():
    """The comparison can fail: each way ChangesItsStructure changes the model is seen when its forward runs once."""
    for how in STRUCTURE:
        model = ChangesItsStructure(how)
        before = snapshot(model)
        model(X)
        assert snapshot(model) != before, how


@pytest.mark.parametrize("recipe", [name for name in ALL if name not in ("param_hvp", "ggn_vp", "empirical_fisher_vp")])
def test_a_lazy_module_not_yet_initialised_is_refused_and_left_lazy(recipe):
    """nn.LazyLinear before its first forward pass: the recipes failed with torch's error about uninitialised
    parameters, raised from inside their own bookkeeping. They now refuse it before anything runs, naming the
    parameter, and the module is still lazy afterwards. (The products with a vector are left out: no vector can be
    made for parameters without a shape.)"""
    model = nn.Sequential(nn.LazyLinear(6), nn.Tanh(), nn.Linear(6, 3)).double()
    with pytest.raises(ValueError, match=r"^parameter 0\.weight \(LazyLinear\) is not initialised yet"):
        ALL[recipe](model, F.cross_entropy, X.mean(1), T)
    assert isinstance(model[0], nn.LazyLinear) and isinstance(model[0].weight, nn.parameter.UninitializedParameter)
    model(X.mean(1))  # once initialised, the recipes take it
    before = snapshot(model)
    ALL[recipe](model, F.cross_entropy, X.mean(1), T)
    assert snapshot(model) == before
