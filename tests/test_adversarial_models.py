"""The recipes' fast paths must never be silently wrong: models built to break each assumption of
the fast path (examples kept apart, every trainable parameter in one linear or convolution
operation, recorded activations left alone), each checked against the loop (every example as a
batch of one) in float64, with the path the recipe must take."""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import vmap
from torch.utils.checkpoint import checkpoint

from test_recipes import Model, close, loop_output_jacobian, loop_per_sample

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


def net(forward, inputs=6, width=8, **parts):
    """Linear layers `a` (inputs -> width) and `b` (width -> 3), joined by the forward function given."""
    return Model(forward, a=nn.Linear(inputs, width), b=nn.Linear(width, 3), **parts)


def mixing(mix):
    """b(mix(tanh(a(x)))): `mix` acts on the hidden activations of the whole batch."""
    return net(lambda m, x: m.b(mix(torch.tanh(m.a(x)))))


def saved_output(h):
    """exp(h) as autograd saved it for the backward pass, fetched back after the result itself was freed (a new
    tensor that shares its memory); exp(h) itself where no graph is recorded."""
    grad_fn = h.exp().grad_fn
    return grad_fn._saved_result if grad_fn is not None else h.exp()


def reseeded_offset(m, h):
    m.g.manual_seed(3)
    return h + 0.1 * torch.randn(1, h.shape[1], generator=m.g, dtype=h.dtype).to(h.device)


def attend(h):
    """Self-attention of each example's 8 features as 2 tokens of 4, by scaled_dot_product_attention (4-D inputs: its
    fused kernel on a CPU, float64 included)."""
    tokens = h.view(len(h), 1, 2, 4)
    return F.scaled_dot_product_attention(tokens, tokens, tokens).reshape(h.shape)


def mlp(*change):
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    for f in change:
        f(model)
    return model


def tied():
    model = net(lambda m, x: m.b(torch.tanh(m.c(torch.tanh(m.a(x))))), width=6)
    model.c = nn.Linear(6, 6)
    model.c.weight = model.a.weight
    return model


class DoubledLinear(torch.autograd.Function):
    """F.linear with a backward pass of its own: twice the usual gradients. Its forward runs with gradients off, so
    the operations a trace sees there are not what autograd differentiates."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        return 2 * g @ weight, 2 * g.t() @ x, 2 * g.sum(0)


class MixedBackward(torch.autograd.Function):
    """The identity forward, but a backward pass that hands every example the batch's mean gradient (doubled): the
    forward keeps the examples apart, the backward does not. Each example alone (the loop) gets twice its own."""

    @staticmethod
    def forward(ctx, h):
        return h * 1.0

    @staticmethod
    def backward(ctx, g):
        return 2 * g.mean(0, keepdim=True).expand_as(g)


def positive(x):
    with torch.no_grad():
        return (x[:, :1] > 0).to(x.dtype)


def weight_norm(layer):
    with torch.no_grad():
        return layer.weight.norm()


class ReadsALayer(torch.autograd.Function):
    """A Function that applies a layer it is not given as tensors: autograd never hands the layer's parameters a
    gradient (the backward pass returns the input's alone)."""

    @staticmethod
    def forward(ctx, h, layer):
        ctx.layer = layer
        return layer(h)

    @staticmethod
    def backward(ctx, g):
        return g @ ctx.layer.weight, None


class DoubledLinearGradOn(DoubledLinear):
    """DoubledLinear whose forward builds a graph of its own (enable_grad): autograd still runs the Function's backward."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        with torch.enable_grad():
            return F.linear(x, weight, bias)


class MixedBackwardGradOn(MixedBackward):
    @staticmethod
    def forward(ctx, h):
        with torch.enable_grad():
            return h * 1.0


class ReadsALayerGradOn(ReadsALayer):
    @staticmethod
    def forward(ctx, h, layer):
        ctx.layer = layer
        with torch.enable_grad():
            return layer(h)


# name: (model, path the recipes must take, or "refused" for a model that mixes the examples of a batch, where no
# example has a gradient of its own); inputs (6, 6) unless the model is a CNN or the MLP on images
CASES = {
    "seed CNN as a class": (SeedCNN(), "fast"),
    "seed MLP as a class": (net(lambda m, x: m.b(F.relu(m.a(x.view(x.shape[0], -1)))), inputs=16), "fast"),
    "softmax over the batch by dim=-2": (nn.Sequential(*mlp(), nn.LogSoftmax(dim=-2)), "refused"),
    "h - h.mean(0)": (mixing(lambda h: h - h.mean(0)), "refused"),
    "batch statistics by hand": (mixing(lambda h: (h - h.mean(0)) * torch.rsqrt(h.pow(2).mean(0) + 1.0)), "refused"),
    # a parameter used twice: its uses' shares add up for gradients and Jacobians, and the norms add the cross terms
    "one layer used twice": (net(lambda m, x: m.b(torch.tanh(m.a(torch.tanh(m.a(x))))), width=6), "fast"),
    "tied weights": (tied(), "fast"),
    # a bare parameter that scales each feature is a layer scale (the parameter rule); one used as a matrix is not
    "a layer scale": (net(lambda m, x: m.b(torch.tanh(m.a(x)) * m.scale), scale=nn.Parameter(torch.linspace(0.5, 1.5, 8))), "fast"),
    "a bare nn.Parameter in forward": (net(lambda m, x: m.b(torch.tanh(m.a(x)) @ m.mix),
                                           mix=nn.Parameter(torch.linspace(0.5, 1.5, 64).view(8, 8))), "vmap"),
    # a transpose that swaps nothing (transpose(0, -2) or permute(0, 1) of a matrix) is no linear layer's W^T
    "a weight transposed by transpose(0, -2)": (net(lambda m, x: m.b(torch.tanh(torch.addmm(m.a.bias, x, m.a.weight.transpose(0, -2)))), width=6), "vmap"),
    "a weight permuted by permute(0, 1)": (net(lambda m, x: m.b(torch.tanh(torch.addmm(m.a.bias, x, m.a.weight.permute(0, 1)))), width=6), "vmap"),
    # custom autograd.Functions: the trace sees their forward's operations, run with gradients off, but autograd
    # differentiates their own backward; vmap cannot run one without vmap support, so the loop answers
    "a custom Function around a layer": (net(lambda m, x: m.b(torch.tanh(DoubledLinear.apply(x, m.a.weight, m.a.bias)))), "loop"),
    "a custom Function whose backward mixes examples": (mixing(MixedBackward.apply), "loop"),
    # the same with a forward under enable_grad: its operations run with gradients on, but on a graph of their own
    "a custom Function around a layer, under enable_grad": (
        net(lambda m, x: m.b(torch.tanh(DoubledLinearGradOn.apply(x, m.a.weight, m.a.bias)))), "loop"),
    "a custom Function mixing examples, under enable_grad": (mixing(MixedBackwardGradOn.apply), "loop"),
    "a custom Function on the model's output": (net(lambda m, x: MixedBackwardGradOn.apply(m.b(torch.tanh(m.a(x))))), "loop"),
    # a weight also read under no_grad (a constant there): autograd reaches it through its layer, so vmap answers
    # a mask made under no_grad from the examples (no tensor that requires grad): the trace follows it as usual
    "a mask made under no_grad": (net(lambda m, x: m.b(torch.tanh(m.a(x)) * positive(x))), "fast"),
    "a weight read under no_grad as well": (net(lambda m, x: m.b(torch.tanh(m.a(x)) / weight_norm(m.a))), "vmap"),
    "a weight used outside its layer": (net(lambda m, x: m.b(torch.tanh(m.a(x))) + 0.1 * (x @ m.a.weight.T)[:, :3]), "fast"),
    "forward hook that changes an output": (
        mlp(lambda m: m[0].register_forward_hook(lambda module, args, output: 2.0 * output + 1.0)), "fast"),
    "forward hook that changes an output in place": (
        mlp(lambda m: m[0].register_forward_hook(lambda module, args, output: output.mul_(2.0))), "vmap"),
    "in-place ReLU": (nn.Sequential(nn.Linear(6, 8), nn.ReLU(inplace=True), nn.Linear(8, 3)), "vmap"),
    # an addition in place into a layer's fresh output leaves its gradient there unchanged: the fast path stays
    "in-place add": (net(lambda m, x: m.b(torch.tanh(m.a(x).add_(1.0)))), "fast"),
    "frozen parameters": (mlp(lambda m: m[0].weight.requires_grad_(False), lambda m: m[2].bias.requires_grad_(False)), "fast"),
    "a roll through the flattened batch": (mixing(lambda h: h.reshape(-1).roll(8).reshape(h.shape)), "refused"),
    "torch.roll over the batch": (mixing(lambda h: torch.roll(h, 1, dims=0)), "refused"),
    # example data the trace never saw made: a copy that shares its memory, an output autograd saved, a view's base
    "example data through NumPy": (mixing(lambda h: h + torch.from_numpy(h.detach().numpy()).mean(0)), "refused"),
    "an output autograd saved": (mixing(lambda h: h + 0.1 * saved_output(h).mean(0)), "refused"),
    "a view's base fetched back": (mixing(lambda h: h + (h * 1.0)[:, :4]._base.mean(0)), "refused"),
    # Python numbers read from the batch, which no dispatch mode sees: the trace passes, the check of the first two
    # examples together and alone refuses
    "the batch's size in arithmetic": (mixing(lambda h: h / h.shape[0]), "refused"),
    "the batch's values by .tolist()": (mixing(lambda h: h * max(h[:, 0].tolist())), "refused"),
    # attention's fused kernels are tagged as operations that may draw random numbers (their dropout), at a rate of 0
    # too: the check must not take the tag for a draw, and leave itself undone
    "the batch's size after attention": (mixing(lambda h: attend(h) / h.shape[0]), "refused"),
    # a forward pass that re-seeds a generator the model holds, then draws a fixed offset: deterministic, though the
    # generator's state moves (a second pass agrees, so the check runs); reading the batch's size as well, refused
    "a generator re-seeded in forward": (net(lambda m, x: m.b(reseeded_offset(m, torch.tanh(m.a(x)))), g=torch.Generator()), "fast"),
    "a generator re-seeded in forward, the batch's size read": (
        net(lambda m, x: m.b(reseeded_offset(m, torch.tanh(m.a(x))) / x.shape[0]), g=torch.Generator()), "refused"),
}
INPUTS = {"seed CNN as a class": randn(6, 1, 14, 14), "seed MLP as a class": randn(6, 1, 4, 4)}
X = randn(6, 6)
TARGETS = torch.randint(3, (6,), generator=G)


def case(name):
    model, path = CASES[name]
    return model.double(), INPUTS.get(name, X), path


@pytest.mark.parametrize("name", list(CASES))
def test_recipes_equal_the_loop(recipes, name):
    model, x, expected_path = case(name)
    if expected_path == "refused":  # the loop would answer each example alone, where the batch mixes them
        for call in (lambda: recipes["per_sample_grads"](model, F.cross_entropy, x, TARGETS),
                     lambda: recipes["per_sample_grad_norms"](model, F.cross_entropy, x, TARGETS),
                     lambda: recipes["clipped_noisy_gradient"](model, F.cross_entropy, x, TARGETS, max_norm=1.0, noise_multiplier=0.0),
                     lambda: recipes["output_jacobian"](model, x)):
            with pytest.raises(ValueError, match="depends on the other examples of the batch"):
                call()
        with torch.no_grad():  # what the check sees: the first two examples, together and alone
            assert not torch.allclose(model(x[:2]), torch.cat([model(x[:1]), model(x[1:2])]))
        return
    expected = loop_per_sample(model, x, TARGETS)
    got, report = recipes["per_sample_grads"](model, F.cross_entropy, x, TARGETS, report=True)
    assert report.path == expected_path, report.reason
    assert list(got) == list(expected) and all(close(got[k], expected[k]) for k in expected)
    jacobian, report = recipes["output_jacobian"](model, x, report=True)
    assert report.path == expected_path, report.reason
    assert close(jacobian, loop_output_jacobian(model, x))
    norms, report = recipes["per_sample_grad_norms"](model, F.cross_entropy, x, TARGETS, report=True)
    assert report.path == expected_path, report.reason
    assert close(norms, torch.stack([torch.cat([g[n].flatten() for g in expected.values()]).norm() for n in range(len(x))]))


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True")
@pytest.mark.parametrize("forward", [
    lambda m, x: m.b(torch.tanh(checkpoint(m.a, x, use_reentrant=True))),  # reentrant: a no_grad pass, recomputed in backward
    lambda m, x: m.b(torch.tanh(ReadsALayer.apply(x * 1.0, m.a))),
    lambda m, x: m.b(torch.tanh(ReadsALayerGradOn.apply(x * 1.0, m.a))),
], ids=["reentrant checkpoint", "a Function reading a layer it is not given", "the same under enable_grad"])
def test_a_parameter_read_inside_a_custom_function_where_autograd_cannot_reach_it_is_refused(recipes, forward):
    """Every path would give such a parameter no gradient (torch.autograd.grad never runs a reentrant checkpoint's
    backward pass for the block's parameters) and no curvature: each per-example recipe refuses, naming the
    parameter, on every path, and so do the curvature recipes (before: zeros for the block, on every path)."""
    model = net(forward).double()
    calls = {"per_sample_grads": lambda path: recipes["per_sample_grads"](model, F.cross_entropy, X, TARGETS, path=path),
             "norms": lambda path: recipes["per_sample_grad_norms"](model, F.cross_entropy, X, TARGETS, path=path),
             "DP step": lambda path: recipes["clipped_noisy_gradient"](model, F.cross_entropy, X, TARGETS, max_norm=1.0,
                                                                       noise_multiplier=0.0, path=path),
             "output_jacobian": lambda path: recipes["output_jacobian"](model, X, path=path)}
    for name, call in calls.items():
        for path in ("auto", "loop"):
            with pytest.raises(ValueError, match="^a.weight(, a.bias)?: read inside a custom autograd.Function's forward"):
                call(path)
    vector = {n: torch.ones_like(p) for n, p in model.named_parameters()}  # the curvature recipes too: no curvature there
    for name in ("param_hvp", "ggn_vp", "empirical_fisher_vp"):
        with pytest.raises(ValueError, match="^a.weight(, a.bias)?: read inside a custom autograd.Function's forward"):
            recipes[name](model, F.cross_entropy, X, TARGETS, vector)


def test_a_weight_read_only_under_a_plain_no_grad_gets_no_gradient_as_with_backward(recipes):
    """A trainable weight read only under torch.no_grad() (transformers' LayoutLMv3 reads its relative position
    biases so, and CLIPSeg its text tower): autograd gives it no gradient, and neither does .backward(); the recipes
    answer with zeros for it and the loop's gradients for the rest, not refusing it as they refuse a reentrant
    checkpoint's parameters (a custom Function's forward, whose backward would give them one)."""
    model = net(lambda m, x: m.b(torch.tanh(x @ (weight_norm(m.a) * torch.ones(6, 8, dtype=x.dtype))))).double()
    grads, report = recipes["per_sample_grads"](model, F.cross_entropy, X, TARGETS, report=True)
    assert report.path == "vmap", report.reason  # the trace stops at the weight's use outside its layer
    assert not grads["a.weight"].any() and not grads["a.bias"].any()
    for n in range(len(X)):
        model.zero_grad()
        F.cross_entropy(model(X[n:n + 1]), TARGETS[n:n + 1]).backward()
        assert model.a.weight.grad is None and close(grads["b.weight"][n], model.b.weight.grad)


def lookup_in_examples(m, x):
    """Row n of the result is example B-1-n's hidden state: a lookup whose table is example data."""
    return m.b(F.embedding(torch.arange(len(x)).flip(0), torch.tanh(m.a(x))))


def index_from_examples(m, x):
    """Every example's hidden state at the columns every example's input picks: one index for all rows, made
    from example data."""
    h = torch.tanh(m.a(x))
    return m.b(h * h.index_select(1, x.argmax(1) % h.shape[1]).mean(1, keepdim=True))


def norm_weight_from_examples(m, x):
    """A LayerNorm whose weight is the examples' first feature (width = batch size): feature j scaled by example j.
    Defined for a batch of 6 only, so there is no loop to compare with: the trace must stop all the same."""
    h = torch.tanh(m.a(x))
    return m.b(F.layer_norm(h, h.shape[1:], weight=h[:, 0]))


def written_by_out(m, x):
    """Example data written by out= into a buffer of zeros, then averaged over the batch through a view taken
    before the write."""
    buffer = torch.zeros_like(x)
    view = buffer.view(-1)
    torch.mul(x, 1.0, out=buffer)  # x: out= takes no tensor that requires grad
    return m.b(torch.tanh(m.a(x + view.view(x.shape).mean(0))))


# models whose first two examples may pass the check together and alone: the trace itself must stop, and says why
TRACE_STOPS = {
    "a lookup in a table of example data": (lookup_in_examples, "takes example data in an argument other than its input"),
    "an index made from example data": (index_from_examples, "takes example data in an argument other than its input"),
    "a LayerNorm weight made from example data": (norm_weight_from_examples, "takes example data in an argument other than its input"),
    "example data written by out=": (written_by_out, "writes example data into a tensor that held none"),
}


@pytest.mark.parametrize("name", list(TRACE_STOPS))
def test_the_trace_stops_at_example_data_in_another_argument(recipes, name):
    """Where example data reaches an operation through an argument that is not its input (a lookup's table, an
    index, a normalisation's weight, an out= buffer), the trace stops; had it gone on, the layer products would
    differ from the loop."""
    forward, reason = TRACE_STOPS[name]
    model = net(forward, width=6).double()
    trainable = dict(model.named_parameters())
    batch = recipes["_as_batch"](X, TARGETS, (), {})
    output, layers, why = recipes["_run_trace"](model, batch, trainable, "grads", None)
    assert output is None and reason in why, why
    if forward is norm_weight_from_examples:
        return
    assert not forced_fast_path_is_right(recipes, model, X)


def forced_fast_path_is_right(recipes, model, x):
    """Whether the fast path's layer products, forced onto the model by a trace that never objects, equal the loop."""
    trainable = dict(model.named_parameters())
    tracer = recipes["_BatchTrace"](len(x), [x], trainable)
    tracer.fail = lambda why: None  # a trace that never objects
    with tracer:
        output = model(x)
    deltas = torch.autograd.grad(F.cross_entropy(output, TARGETS, reduction="sum"), [layer["z"] for layer in tracer.layers])
    out = {name: torch.zeros((len(x), *p.shape), dtype=p.dtype) for name, p in trainable.items()}
    done: set = set()
    for layer, delta in zip(tracer.layers, deltas):
        recipes["_per_example_products"](layer, delta, out, done)
    expected = loop_per_sample(model, x, TARGETS)
    return all(torch.allclose(out[k], expected[k], rtol=1e-10, atol=1e-12) for k in expected)


def test_the_adversarial_models_differ_from_the_fast_paths_arithmetic(recipes):
    """The models sent to the vmap path really would be wrong on the fast path: forcing the
    layer products onto a model that mixes examples gives a different answer (so the tests above
    can fail)."""
    model, x, _ = case("h - h.mean(0)")
    assert not forced_fast_path_is_right(recipes, model, x)
    assert forced_fast_path_is_right(recipes, mlp().double(), X)  # and on a model that keeps its examples apart, equal


def branching(m, x):
    """Python control flow on the values: vmap cannot take the branch, the loop can. Without `strict` both
    branches compute the same function, so a branch another example flips changes nothing (a model whose
    output did change that way would mix the examples, and be refused)."""
    h = torch.tanh(m.a(x))
    if h.sum() > 0:
        return m.b(h)
    if m.strict:
        raise ValueError("this model takes no example whose hidden sum is negative")
    return m.b(h.clone())


VMAP_CANNOT_RUN = {  # the trace refuses these and vmap raises on them; one example at a time they run
    ".item() in forward": mixing(lambda h: h * (1.0 + 0.0 * h.max().item())),
    "a backward hook": mlp(lambda m: m[0].register_full_backward_hook(lambda module, grad_in, grad_out: None)),
    "if on an example's values": net(branching, strict=False),
}


# The loop with a backward hook and inputs that need no grad: torch says so, by this exact message.
@pytest.mark.filterwarnings("ignore:Full backward hook is firing when gradients are computed with respect to module outputs")
@pytest.mark.parametrize("name", list(VMAP_CANNOT_RUN))
def test_models_vmap_cannot_run_take_the_loop(recipes, name):
    """With path="auto", whatever vmap raised, the loop runs, and the report names what vmap raised;
    with path="vmap", vmap's own error is raised, as vmap(grad) raises it."""
    model = VMAP_CANNOT_RUN[name].double()
    got, report = recipes["per_sample_grads"](model, F.cross_entropy, X, TARGETS, report=True)
    expected = loop_per_sample(model, X, TARGETS)
    assert report.path == "loop" and report.reason.startswith("vmap raised RuntimeError: "), report
    assert all(close(got[k], expected[k]) for k in expected)
    jacobian, report = recipes["output_jacobian"](model, X, report=True)
    assert report.path == "loop" and report.reason.startswith("vmap raised RuntimeError: "), report
    assert close(jacobian, loop_output_jacobian(model, X))
    norms, report = recipes["per_sample_grad_norms"](model, F.cross_entropy, X, TARGETS, report=True)
    assert report.path == "loop" and report.reason.startswith("vmap raised RuntimeError: "), report
    assert close(norms, torch.stack([torch.cat([g[n].flatten() for g in expected.values()]).norm() for n in range(len(X))]))
    with pytest.raises(RuntimeError):
        recipes["per_sample_grads"](model, F.cross_entropy, X, TARGETS, path="vmap")
    with pytest.raises(RuntimeError):
        recipes["output_jacobian"](model, X, path="vmap")


def vmap_error_of(model):
    """What torch.func raises on the model's per-example gradients, as (type, message)."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    loss = lambda params, x, t: F.cross_entropy(torch.func.functional_call(model, params, (x[None],)), t[None])
    with pytest.raises(Exception) as raised:
        torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, X, TARGETS)
    return type(raised.value), str(raised.value)


def test_the_vmap_path_raises_vmaps_error_unchanged(recipes):
    model = net(branching, strict=False).double()
    expected = vmap_error_of(model)
    with pytest.raises(Exception) as raised:
        recipes["per_sample_grads"](model, F.cross_entropy, X, TARGETS, path="vmap")
    assert (type(raised.value), str(raised.value)) == expected and raised.value.__cause__ is None


def test_a_model_that_fails_both_raises_the_loops_error_chained_to_vmaps(recipes):
    torch.manual_seed(3)
    model = net(branching, strict=True).double()
    with torch.no_grad():  # the loop accepts the first example (which per_sample_grad_norms runs first, to find its layers),
        sums = torch.tanh(model.a(X)).sum(1)  # and refuses a later one
    assert sums[0] > 0 and (sums < 0).any()
    vmap_type, vmap_message = vmap_error_of(model)
    for call in (lambda: recipes["per_sample_grads"](model, F.cross_entropy, X, TARGETS),
                 lambda: recipes["output_jacobian"](model, X),
                 lambda: recipes["per_sample_grad_norms"](model, F.cross_entropy, X, TARGETS)):
        with pytest.raises(ValueError, match="hidden sum is negative") as raised:
            call()
        cause = raised.value.__cause__
        assert type(cause) is vmap_type and str(cause) == vmap_message


def test_errors_name_the_problem(recipes):
    model, x, _ = case("in-place ReLU")
    with pytest.raises(ValueError, match="the fast path does not apply: an in-place operation changed"):
        recipes["per_sample_grads"](model, F.cross_entropy, x, TARGETS, path="fast")
    with pytest.raises(ValueError, match="scalar"):
        recipes["per_sample_grads"](model, lambda p, t: F.cross_entropy(p, t, reduction="none").expand(2), x, TARGETS)
    with pytest.raises(ValueError, match="different batch sizes|one row per example"):
        recipes["per_sample_grads"](model, F.cross_entropy, x, TARGETS[:3])
    with pytest.raises(ValueError, match=r"\(B, Y\)"):
        recipes["output_jacobian"](nn.Conv2d(1, 2, 3).double(), randn(4, 1, 5, 5))


def test_a_tied_linear_layer_is_never_probed_and_no_candidate_means_no_extra_pass(recipes):
    """The norms' vmap path probes the nn.Linear layers whose parameters one F.linear call uses once, found by a
    forward pass of one example. A layer whose weight another module also registers is never a candidate, and
    a model left with no candidate is not run at all (GPT-2 with tied embeddings: that pass cost a tenth of a
    batch gradient on every call)."""
    covered, as_batch = recipes["_covered_linear_layers"], recipes["_as_batch"]
    model, x, _ = case("tied weights")
    assert set(covered(model, as_batch(x), dict(model.named_parameters()))) == {"b"}  # a and c share a weight
    only_tied = net(lambda m, x: m.b(torch.tanh(m.a(x))), width=6).double()
    only_tied.b = nn.Linear(6, 6).double()
    only_tied.b.weight = only_tied.a.weight
    runs = []
    only_tied.register_forward_pre_hook(lambda module, args: runs.append(1))
    assert covered(only_tied, as_batch(x), dict(only_tied.named_parameters())) == {} and runs == []
    norms = recipes["per_sample_grad_norms"](only_tied, F.cross_entropy, x, TARGETS)
    assert close(norms, torch.cat([g.flatten(1) for g in loop_per_sample(only_tied, x, TARGETS).values()], 1).norm(dim=1))


class ProbedMLP(nn.Module):
    """An MLP that also runs a layer whose output it drops (a debugging probe): a traced layer the output does not
    depend on."""

    def __init__(self):
        super().__init__()
        self.a, self.probe, self.b = nn.Linear(6, 8), nn.Linear(6, 2), nn.Linear(8, 3)

    def forward(self, x):
        self.probe(x)
        return self.b(torch.tanh(self.a(x)))


def test_layouts_and_layers_the_fast_path_meets_on_the_way(recipes):
    """A channels-last input through a GroupNorm (whose backward vmap cannot batch over the Jacobian's outputs), a
    layer whose output the model drops, and out= buffers that are not contiguous: the fast path answers as the
    loop, where it raised before."""
    torch.manual_seed(3)
    cnn = nn.Sequential(nn.Conv2d(3, 4, 2, stride=2), nn.GroupNorm(2, 4), nn.Flatten(), nn.Linear(64, 3)).double()
    images = randn(6, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    for model, x in [(cnn, images), (ProbedMLP().double(), X)]:
        jacobian, report = recipes["output_jacobian"](model, x, report=True)
        assert report.path == "fast" and close(jacobian, loop_output_jacobian(model, x)), report.reason
    embed = nn.Sequential(nn.Embedding(7, 4), nn.Conv1d(3, 3, 2), nn.LayerNorm(3), nn.Flatten(), nn.Linear(9, 3)).double()
    for model, x in [(embed, torch.randint(0, 7, (6, 3), generator=G)), (cnn, images)]:
        out = {n: torch.empty(*p.shape, 6, dtype=p.dtype).permute(-1, *range(p.dim())) for n, p in model.named_parameters()}
        got, report = recipes["per_sample_grads"](model, F.cross_entropy, x, TARGETS, out=out, report=True)
        expected = loop_per_sample(model, x, TARGETS)
        assert report.path == "fast" and all(got[k] is out[k] and close(got[k], expected[k]) for k in expected), report.reason


def test_bad_norms_and_out_are_refused(recipes):
    model = mlp().double()
    for norms in (-torch.ones(6, dtype=torch.float64), torch.full((6,), float("nan"), dtype=torch.float64)):
        with pytest.raises(ValueError, match="norms must be non-negative"):
            recipes["clipped_grad_sum"](model, F.cross_entropy, X, TARGETS, max_norm=1.0, norms=norms)
    with pytest.raises(TypeError, match="out must be a dict"):
        recipes["per_sample_grads"](model, F.cross_entropy, X, TARGETS, out=[])


def functional_dropout(m, x):
    """Dropout by F.dropout in training mode (no Dropout module), and noise added by hand: random draws that no
    module declares."""
    h = F.dropout(torch.tanh(m.a(x)), 0.3, m.training)
    return m.b(h + 0.1 * torch.randn_like(h) if m.training else h)


def test_randomness_without_a_dropout_module(recipes):
    """A forward pass that draws random numbers outside a Dropout module: the check of the first two examples
    together and alone cannot compare such passes, sees that the default generator moved, and leaves the model to the
    recipes (not refused; the caller's generator left as it was), each example drawing its own noise; and norms
    given from another forward pass are refused, since the sum's draws would not be theirs."""
    model = net(functional_dropout).double().train()
    state = torch.get_rng_state()
    recipes["_check_examples_apart"](model, recipes["_as_batch"](X, TARGETS, (), {}))
    assert torch.equal(torch.get_rng_state(), state)
    grads, report = recipes["per_sample_grads"](model, F.cross_entropy, X, TARGETS, report=True)
    assert report.path == "fast" and grads["a.weight"].shape == (6, 8, 6), report.reason
    norms = recipes["per_sample_grad_norms"](model, F.cross_entropy, X, TARGETS)
    with pytest.raises(ValueError, match="norms were given, but the model's forward pass draws random numbers"):
        recipes["clipped_grad_sum"](model, F.cross_entropy, X, TARGETS, max_norm=1.0, norms=norms)
    model.eval()  # no draws: norms given are welcome
    norms = recipes["per_sample_grad_norms"](model, F.cross_entropy, X, TARGETS)
    expected = recipes["clipped_grad_sum"](model, F.cross_entropy, X, TARGETS, max_norm=1.0)
    given = recipes["clipped_grad_sum"](model, F.cross_entropy, X, TARGETS, max_norm=1.0, norms=norms)
    assert all(close(given[k], expected[k]) for k in expected)


def noise_from_its_own_generator(m, x):
    """Noise drawn from a torch.Generator the model holds (not a default generator, whose state the recipes compare)."""
    h = torch.tanh(m.a(x))
    return m.b(h + 0.1 * torch.randn(h.shape, generator=m.g, dtype=h.dtype, device=h.device) if m.training else h)


def test_randomness_from_a_generator_of_the_models_own(recipes):
    """A forward pass that draws from a generator the model holds: the check compares that generator's state too, so
    it leaves the model to the recipes rather than refusing it as mixing its examples (its passes' draws differ), and
    leaves that generator as it found it. The per-example gradients then add up to the batch gradient with the same
    draws; norms given from another pass are refused, for a batch of one too (where the check does not run)."""
    model = net(noise_from_its_own_generator, g=torch.Generator().manual_seed(3)).double().train()
    seed = model.g.get_state()
    recipes["_check_examples_apart"](model, recipes["_as_batch"](X, TARGETS, (), {}))
    assert torch.equal(model.g.get_state(), seed)
    grads, report = recipes["per_sample_grads"](model, F.cross_entropy, X, TARGETS, report=True)
    assert report.path == "fast", report.reason
    model.g.set_state(seed)  # the same draws, for the whole batch at once
    total = torch.autograd.grad(F.cross_entropy(model(X), TARGETS, reduction="sum"), list(model.parameters()))
    assert all(close(grads[name].sum(0), g) for (name, _), g in zip(model.named_parameters(), total))
    for x, t in ((X, TARGETS), (X[:1], TARGETS[:1])):
        norms = recipes["per_sample_grad_norms"](model, F.cross_entropy, x, t)
        before, default = model.g.get_state(), torch.get_rng_state()
        with pytest.raises(ValueError, match="norms were given, but the model's forward pass draws random numbers"):
            recipes["clipped_grad_sum"](model, F.cross_entropy, x, t, max_norm=1.0, norms=norms)
        assert torch.equal(model.g.get_state(), before) and torch.equal(torch.get_rng_state(), default)  # put back


def noise_from_a_generator_held_deeper(m, x):
    """Noise from a generator the model holds in a nested list, where _held_generators does not look."""
    h = torch.tanh(m.a(x))
    return m.b(h + 0.1 * torch.randn(h.shape, generator=m.deep[0][0], dtype=h.dtype, device=h.device) if m.training else h)


def test_randomness_from_a_generator_held_deeper(recipes):
    """A generator no scan of the model finds (in a nested list here; a global one is the same): the random
    operation itself is seen (_DrawWatch), so the model is treated as any that draws: left to the recipes, each
    example drawing its own noise, rather than refused as mixing its examples (before: "depends on the other
    examples", the passes' draws differing), and norms given from another pass refused (before: that refusal,
    for a reason not its own, or, for a batch of one, where the examples' check does not run, nothing: the sum took
    other draws than its norms)."""
    model = net(noise_from_a_generator_held_deeper).double().train()
    model.deep = [[torch.Generator().manual_seed(3)]]
    assert recipes["_held_generators"](model) == []
    seed = model.deep[0][0].get_state()
    recipes["_check_examples_apart"](model, recipes["_as_batch"](X, TARGETS, (), {}))
    assert torch.equal(model.deep[0][0].get_state(), seed)  # its passes drew from it, and put it back
    grads, report = recipes["per_sample_grads"](model, F.cross_entropy, X, TARGETS, report=True)
    assert report.path == "fast" and grads["a.weight"].shape == (6, 8, 6), report.reason
    for x, t in ((X, TARGETS), (X[:1], TARGETS[:1])):
        norms = recipes["per_sample_grad_norms"](model, F.cross_entropy, x, t)
        for path in ("auto", "vmap", "loop"):
            deep = model.deep[0][0].get_state()
            with pytest.raises(ValueError, match="norms were given, but the model's forward pass draws random numbers"):
                recipes["clipped_grad_sum"](model, F.cross_entropy, x, t, max_norm=1.0, norms=norms, path=path)
            assert torch.equal(model.deep[0][0].get_state(), deep)  # a refused call puts it back
    model.eval()  # no draws: norms given are welcome
    norms = recipes["per_sample_grad_norms"](model, F.cross_entropy, X, TARGETS)
    recipes["clipped_grad_sum"](model, F.cross_entropy, X, TARGETS, max_norm=1.0, norms=norms)


def noise_then_a_flip(m, x):
    """Noise from the model's own generator, then an operation the fast path does not cover (a flip of the features)."""
    h = torch.tanh(m.a(x))
    return m.b((h + 0.1 * torch.randn(h.shape, generator=m.g, dtype=h.dtype, device=h.device)).flip(1))


def test_a_failed_trace_leaves_the_generators_as_it_found_them(recipes):
    """The fast path's trace draws from the model's generator before it meets the flip and stops: refused
    (path="fast"), every recipe leaves that generator and the default one as it found them (before: moved, but
    clipped_grad_sum's); on path "auto", vmap then starts from the call's state, so the answer and the generator
    after it are those of path="vmap" alone."""
    def calls(model):
        return {"per_sample_grads": lambda **kw: recipes["per_sample_grads"](model, F.cross_entropy, X, TARGETS, **kw),
                "per_sample_grad_norms": lambda **kw: recipes["per_sample_grad_norms"](model, F.cross_entropy, X, TARGETS, **kw),
                "clipped_grad_sum": lambda **kw: recipes["clipped_grad_sum"](model, F.cross_entropy, X, TARGETS, max_norm=1.0, **kw),
                "output_jacobian": lambda **kw: recipes["output_jacobian"](model, X, **kw)}

    model = net(noise_then_a_flip, g=torch.Generator().manual_seed(3)).double().train()
    for name, call in calls(model).items():
        seed, default = model.g.get_state(), torch.get_rng_state()
        with pytest.raises(ValueError, match="the fast path does not apply: aten.flip"):
            call(path="fast")
        assert torch.equal(model.g.get_state(), seed) and torch.equal(torch.get_rng_state(), default), name
    for name in calls(model):
        model = net(noise_then_a_flip, g=torch.Generator().manual_seed(3)).double().train()  # its first trace
        seed = model.g.get_state()
        auto, how = calls(model)[name](report=True)
        after = model.g.get_state()
        model.g.set_state(seed)
        alone = calls(model)[name](path="vmap")
        assert how.path == "vmap" and torch.equal(after, model.g.get_state()), name
        assert all(torch.equal(auto[k], alone[k]) for k in auto) if isinstance(auto, dict) else torch.equal(auto, alone), name


class LocalSeeded(nn.Module):
    """Deterministic, though it draws: a generator made and seeded in every forward pass, the same noise each time."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h + 0.1 * torch.randn(h.shape[1:], generator=torch.Generator().manual_seed(5), dtype=h.dtype))


def test_a_generator_made_and_seeded_in_forward_is_deterministic_where_seen_twice(recipes):
    """Norms given for a model that makes and seeds its own generator: the examples' check ran it twice and found it
    deterministic, so the sum equals the one-pass sum; on a batch of one, where no check runs, a pass that drew from
    an unknown generator is refused, on the safe side (the curvature recipes refuse it always, as documented)."""
    model = LocalSeeded().double()
    norms = recipes["per_sample_grad_norms"](model, F.cross_entropy, X, TARGETS)
    given = recipes["clipped_grad_sum"](model, F.cross_entropy, X, TARGETS, max_norm=0.05, norms=norms)
    expected = recipes["clipped_grad_sum"](model, F.cross_entropy, X, TARGETS, max_norm=0.05)
    assert all(close(given[k], expected[k]) for k in expected)
    one = recipes["per_sample_grad_norms"](model, F.cross_entropy, X[:1], TARGETS[:1])
    with pytest.raises(ValueError, match="norms were given, but the model's forward pass draws random numbers"):
        recipes["clipped_grad_sum"](model, F.cross_entropy, X[:1], TARGETS[:1], max_norm=0.05, norms=one)


class SubclassedGenerator(torch.Generator):
    pass


def test_the_generator_watch_sees_every_generator_a_torch_function_is_given(recipes):
    """_GeneratorWatch notes a generator passed to any random function (a keyword-only argument), under a transform
    too, and others() leaves out the default and the known ones; a call without a generator notes nothing."""
    g, known = torch.Generator().manual_seed(1), torch.Generator()
    x = torch.zeros(3, dtype=torch.float64)
    with recipes["_GeneratorWatch"]() as watch:
        torch.randn(3, generator=(sub := SubclassedGenerator().manual_seed(2)))
    assert watch.others() == [sub]  # a subclass is a generator too
    before = g.get_state()
    with recipes["_GeneratorWatch"]() as watch:
        torch.randn(3, generator=g), torch.randn(3, generator=g)
    watch.restore()
    assert torch.equal(g.get_state(), before)  # the state it had when first passed, before its first draw
    drawing = [lambda: torch.randn(3, generator=g), lambda: x.clone().normal_(generator=g), lambda: torch.bernoulli(x, generator=g),
               lambda: torch.randperm(4, generator=g), lambda: torch.multinomial(x + 1, 2, generator=g),
               lambda: nn.init.uniform_(x.clone(), generator=g), lambda: x.clone().random_(0, 5, generator=g),
               lambda: x.clone().uniform_(0.0, 1.0, generator=g),
               lambda: vmap(lambda r: r + torch.randn(3, generator=g, dtype=r.dtype), randomness="different")(x[None]),
               lambda: torch.func.grad(lambda r: (r * torch.rand(3, generator=g, dtype=r.dtype)).sum())(x)]
    for k, run in enumerate(drawing):
        with recipes["_GeneratorWatch"]() as watch:
            run()
            torch.randn(3, generator=known)
            torch.randn(3, generator=torch.default_generator)
        assert watch.others([known]) == [g], k
    with recipes["_GeneratorWatch"]() as watch:
        torch.randn(3), F.dropout(x, 0.5, True), torch.sin(x)
    assert watch.generators == {}


class Reseeded(nn.Module):
    """Noise from a generator the model holds, re-seeded by the forward pass itself before it draws."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.g = nn.Linear(6, 8), nn.Linear(8, 3), torch.Generator().manual_seed(3)

    def forward(self, x):
        self.g.manual_seed(self.g.initial_seed() + 1)
        return self.b(torch.tanh(self.a(x)) + 0.1 * torch.randn(len(x), 8, generator=self.g, dtype=x.dtype))


def test_a_generator_re_seeded_in_forward_ends_where_one_plain_pass_leaves_it(recipes):
    """The check's passes are invisible: the model's generator, re-seeded by each pass before its draw, is put back
    as it was before the first pass (not before the first draw), so the recipe's own pass draws what a plain pass
    draws and leaves the generator where a plain pass leaves it."""
    model, twin = Reseeded().double().train(), Reseeded().double().train()
    twin.load_state_dict(model.state_dict())
    grads = recipes["per_sample_grads"](model, F.cross_entropy, X, TARGETS)
    total = torch.autograd.grad(F.cross_entropy(twin(X), TARGETS, reduction="sum"), list(twin.parameters()))
    assert model.g.initial_seed() == twin.g.initial_seed() == 4 and torch.equal(model.g.get_state(), twin.g.get_state())
    assert all(close(grads[name].sum(0), g) for (name, _), g in zip(twin.named_parameters(), total))


def test_the_generators_a_model_holds(recipes):
    """_held_generators finds a generator held as an attribute of any module, or in a list, tuple or dict there."""
    g = [torch.Generator() for _ in range(5)]
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model.g, model[0].pair, model[1].table, model[1].nested = g[0], (g[1], 1.0), {"noise": g[2], "other": 3}, [[g[4]]]
    model[0].several = [g[3], g[0]]
    found = recipes["_held_generators"](model)
    assert len(found) == 4 and {id(x) for x in found} == {id(x) for x in g[:4]}  # each once, not the nested one


def test_a_higher_order_operator_does_not_hide_a_model_that_mixes_examples(recipes):
    """torch.cond (a higher-order operator, which a dispatch mode has no rule for) in a model that subtracts the batch's
    mean: the check runs the model as it is, without a mode around it, and refuses it."""
    model = net(lambda m, x: m.b(mean_removed(torch.cond(m.b.bias.sum() > -100, torch.sin, torch.cos, (torch.tanh(m.a(x)),)))))
    with pytest.raises(ValueError, match="depends on the other examples of the batch"):
        recipes["per_sample_grads"](model.double(), F.cross_entropy, X, TARGETS)


def mean_removed(h):
    return h - h.mean(0)


def test_constant_padding_keeps_the_fast_path_unless_it_pads_the_batch(recipes):
    """F.pad with a constant (aten.constant_pad_nd: nn.ZeroPad2d, ConstantPad, a convolution's padding="same" with
    an even kernel) pads each example's rows on their own: fast, equal to the loop. A pad whose pair for dimension 0
    is not empty moves rows between examples (1 before and -1 after: every example gets its neighbour's row, the batch
    keeping its size): the trace stops there."""
    images = randn(6, 2, 8, 8)
    for model in (nn.Sequential(nn.Conv2d(2, 3, 2, padding="same"), nn.Flatten(), nn.Linear(192, 3)),
                  nn.Sequential(nn.ZeroPad2d((1, 0, 2, 1)), nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(189, 3)),
                  nn.Sequential(nn.ConstantPad1d(2, 0.5), nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(180, 3))):
        model = model.double()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # padding="same" with an even kernel warns that it copies the input
            got, report = recipes["per_sample_grads"](model, F.cross_entropy, images, TARGETS, report=True)
            expected = loop_per_sample(model, images, TARGETS)
        assert report.path == "fast" and all(close(got[k], expected[k]) for k in expected), report.reason
    shifted = net(lambda m, x: m.b(F.pad(torch.tanh(m.a(x)), (0, 0, 1, -1))))
    _, _, why = recipes["_run_trace"](shifted.double(), recipes["_as_batch"](X, TARGETS, (), {}),
                                      dict(shifted.named_parameters()), "grads", None)
    assert why is not None and "pads along the batch dimension" in why, why


def test_a_batch_whose_first_examples_are_equal_does_not_switch_the_check_off(recipes):
    """Two equal examples agree together and alone even through a batch mean: a batch whose first two rows were
    equal passed the check, which was remembered for the call's signature, and every later batch of that shape
    took vmap and came back 0 for the mixed layers. The check compares example 0 with the first one that differs;
    a batch of copies of one example is left unchecked and not remembered."""
    model = mixing(mean_removed).double()
    twin_rows = X.clone()
    twin_rows[1] = twin_rows[0]
    for x in (twin_rows, X):
        with pytest.raises(ValueError, match=r"examples 0 and 2 give outputs|first two examples give outputs"):
            recipes["per_sample_grads"](model, F.cross_entropy, x, TARGETS)
    copies = X[:1].expand(len(X), -1).clone()
    recipes["per_sample_grads"](model, F.cross_entropy, copies, TARGETS)  # copies of one example do not mix
    with pytest.raises(ValueError, match="first two examples give outputs"):
        recipes["per_sample_grads"](model, F.cross_entropy, X, TARGETS)


class RowsOfAnUnbatchedTensor(nn.Module):
    """x + c with c passed unbatched but with a row per example: vmap and the loop give each example all of c (the
    recipes' contract for unbatched), the batched forward pairs row n of c with example n."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x, c):
        return self.b(torch.tanh(self.a(x + c)))


def mean_of_rows_loss(out, t):
    """Cross-entropy of one example's rows averaged (an example given all of c has a row per row of c)."""
    return F.cross_entropy(out.mean(0, keepdim=True), t)


def test_an_unbatched_tensor_with_a_row_per_example_keeps_off_the_fast_path(recipes):
    """The check's two examples together fail to broadcast against c's rows, which it took for an error to leave to
    the recipe's own path; the trace took c for a constant, and the fast path paired its rows with the examples
    (0.11 where the loop gives 0.78 on the helper's model). A model that runs on each example and on the batch but
    not on two examples depends on the batch's size: auto takes vmap, which equals the loop; path="fast" refuses."""
    model = RowsOfAnUnbatchedTensor().double()
    c = randn(len(X), 6)
    expected = {n: torch.stack([torch.autograd.grad(mean_of_rows_loss(model(X[k:k + 1], c), TARGETS[k:k + 1]), p)[0]
                                for k in range(len(X))]) for n, p in model.named_parameters()}
    grads, report = recipes["per_sample_grads"](model, mean_of_rows_loss, (X, c), TARGETS, unbatched=1, report=True)
    assert report.path == "vmap" and "depends on the batch's size" in report.reason
    assert all(close(grads[n], expected[n]) for n in expected)
    with pytest.raises(ValueError, match="not on two of them together"):
        recipes["per_sample_grads"](model, mean_of_rows_loss, (X, c), TARGETS, unbatched=1, path="fast")


@pytest.mark.parametrize("path", ["auto", "vmap", "loop"])
def test_a_select_that_mixes_the_examples_is_refused(recipes, path):
    """output_jacobian checked the model, not select: select=lambda o: o - o.mean(0) on a model that keeps the
    examples apart made vmap and the loop (each example's output alone, minus itself) return zeros where the batched
    function's rows have Jacobians of up to 0.5. Refused on every path; a select of each example's rows answers."""
    model = net(lambda m, x: m.b(torch.tanh(m.a(x)))).double()
    with pytest.raises(ValueError, match="^select mixes the examples"):
        recipes["output_jacobian"](model, X, select=lambda o: o - o.mean(0), path=path)
    picked = recipes["output_jacobian"](model, X, select=lambda o: o[:, :2] * 2, path=path)
    assert close(picked, 2 * loop_output_jacobian(model, X)[:, :2])


def test_the_select_check_runs_once_per_select_and_call_signature(recipes):
    """The select check cost one forward pass of two examples on every output_jacobian call with a select. It is now
    remembered for the same select function, model and call signature (a loop over batches pays it once), not for
    a new function (a lambda made in the call), and a mixing select is refused on every call."""
    sizes = []
    model = net(lambda m, x: (sizes.append(len(x)), m.b(torch.tanh(m.a(x))))[1]).double()
    first_two = lambda o: o[:, :2]  # noqa: E731
    for _ in range(3):
        recipes["output_jacobian"](model, X, select=first_two)
    assert sizes.count(2) == 2  # the model's check of examples apart, and the select's, once each
    recipes["output_jacobian"](model, X, select=lambda o: o[:, :2])
    assert sizes.count(2) == 3  # another function: checked again
    for _ in range(2):
        with pytest.raises(ValueError, match="^select mixes the examples"):
            recipes["output_jacobian"](model, X, select=lambda o: o - o.mean(0))


def test_an_output_that_depends_on_no_parameter_has_a_zero_jacobian_on_every_path(recipes):
    """select=lambda o: o.detach() (or a model whose output uses no parameter): vmap gave zeros, the loop raised
    torch's "element 0 of tensors does not require grad"; the loop now gives zeros too, and auto takes vmap."""
    model = net(lambda m, x: m.b(torch.tanh(m.a(x)))).double()
    P = sum(p.numel() for p in model.parameters())
    for path in ("auto", "vmap", "loop"):
        assert torch.equal(recipes["output_jacobian"](model, X, select=lambda o: o.detach(), path=path), torch.zeros(len(X), 3, P, dtype=torch.float64))


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # cummax's backward under vmap: torch's fallback
def test_a_trace_that_failed_for_one_select_is_not_remembered_for_another(recipes):
    """A failed trace is remembered per model and call signature; output_jacobian's select was not part of it, so one
    call with a select the trace refuses cost every later call its fast path, and path="fast" then refused naming an
    operation the call never ran."""
    model = net(lambda m, x: m.b(torch.tanh(m.a(x)))).double()
    J, report = recipes["output_jacobian"](model, X, select=lambda o: o.cummax(1).values, report=True)
    assert report.path != "fast" and "cummax" in report.reason
    J, report = recipes["output_jacobian"](model, X, path="fast", report=True)
    assert report.path == "fast" and close(J, loop_output_jacobian(model, X))
