"""The batch convention and the one validator (src/torch_func_recipes/_batch.py), recipe by recipe.

Every recipe that takes data reads its batch the same way (a tensor, a tuple of positional inputs or a
dict of keyword inputs; targets of any of those shapes, or None; tensors named in `unbatched` given whole
to every example), and answers the same questions the same documented way: an empty batch, tensors with
different numbers of rows, a loss that is not one number, BatchNorm in training mode, a random module in
training mode, no trainable parameter, and a call inside no_grad or inference_mode. The table in _batch's
docstring is what these tests check."""
import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._higher_order_ops.while_loop import while_loop  # torch's own loop operator, not yet public
from torch.utils._pytree import tree_flatten

import torch_func_recipes as tfr

GEN = torch.Generator().manual_seed(31)
X = torch.randn(5, 4, generator=GEN, dtype=torch.float64)
Z = torch.randn(5, 2, generator=GEN, dtype=torch.float64)
SCALE = torch.rand(3, generator=GEN, dtype=torch.float64) + 0.5
T = torch.randint(3, (5,), generator=GEN)


class TwoInputs(nn.Module):
    """Two batched inputs, an optional shared scale, and (as_dict=True) a dict as output, as a Hugging Face model returns."""

    def __init__(self, as_dict=False):
        super().__init__()
        self.a, self.b, self.head, self.as_dict = nn.Linear(4, 3), nn.Linear(2, 3), nn.Linear(3, 3), as_dict

    def forward(self, x, z, scale=None):
        h = torch.tanh(self.a(x) + self.b(z))
        logits = self.head(h * scale if scale is not None else h)
        return {"logits": logits} if self.as_dict else logits


def two_inputs(as_dict=False):
    torch.manual_seed(32)
    return TwoInputs(as_dict).double()


def loop_grads(model, loss_of_example):
    """{name: (B, *shape)} from one autograd call per example; loss_of_example(n) is example n's loss."""
    params = dict(model.named_parameters())
    rows = [torch.autograd.grad(loss_of_example(n), list(params.values())) for n in range(len(X))]
    return {name: torch.stack([row[k] for row in rows]) for k, name in enumerate(params)}


def same(a, b):
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-10, atol=1e-12) for k in a)


CE = F.cross_entropy
CE_OF_DICT = lambda out, t: F.cross_entropy(out["logits"], t)  # noqa: E731


@pytest.mark.parametrize("path", ["auto", "fast", "vmap", "loop"])
def test_inputs_as_a_tuple_a_dict_and_with_a_shared_tensor_equal_the_loop(path):
    model = two_inputs()
    expected = loop_grads(model, lambda n: CE(model(X[n : n + 1], Z[n : n + 1], SCALE), T[n : n + 1]))
    for inputs, unbatched in [((X, Z, SCALE), 2), ({"x": X, "z": Z, "scale": SCALE}, "scale"), ([X, Z, SCALE], (-1,))]:
        grads, how = tfr.per_sample_grads(model, CE, inputs, T, unbatched=unbatched, path=path, report=True)
        assert same(grads, expected) and how.path == ("fast" if path == "auto" else path), how.reason
    norms = tfr.per_sample_grad_norms(model, CE, {"x": X, "z": Z, "scale": SCALE}, T, unbatched="scale", path=path)
    assert torch.allclose(norms, torch.cat([g.flatten(1) for g in expected.values()], 1).norm(dim=1), rtol=1e-10)


def test_inputs_as_the_recipes_own_keywords_as_a_collators_batch_is_passed():
    """per_sample_grads(model, loss_fn, targets=t, **batch): the same as the dict, on every per-example recipe."""
    model = two_inputs()
    batch = {"x": X, "z": Z, "scale": SCALE}
    expected = loop_grads(model, lambda n: CE(model(X[n : n + 1], Z[n : n + 1], SCALE), T[n : n + 1]))
    assert same(tfr.per_sample_grads(model, CE, targets=T, unbatched="scale", **batch), expected)
    norms = tfr.per_sample_grad_norms(model, CE, targets=T, unbatched="scale", **batch)
    assert torch.allclose(norms, torch.cat([g.flatten(1) for g in expected.values()], 1).norm(dim=1), rtol=1e-10)
    step = tfr.clipped_noisy_gradient(model, CE, targets=T, max_norm=1e9, noise_multiplier=0.0, unbatched="scale", **batch)
    assert same(step, {n: g.mean(0) for n, g in expected.items()})  # a clipping norm no example reaches: the mean gradient
    assert torch.allclose(tfr.output_jacobian(model, unbatched="scale", **batch), tfr.output_jacobian(model, batch, unbatched="scale"))
    with pytest.raises(TypeError, match="either as one argument .* or as keyword arguments \\(x, z, scale\\), not both"):
        tfr.per_sample_grads(model, CE, (X, Z), T, **batch)
    with pytest.raises(TypeError, match="no inputs"):
        tfr.per_sample_grads(model, CE, targets=T)


def test_a_shared_tensor_must_be_named_and_the_wrong_argument_is_named():
    """Without unbatched=, SCALE (3 rows) is taken for a batched tensor and refused, naming it: the check can fail."""
    model = two_inputs()
    with pytest.raises(ValueError, match=r"inputs\['scale'\] has 3 rows along dimension 0 but inputs\['x'\] has 5"):
        tfr.per_sample_grads(model, CE, {"x": X, "z": Z, "scale": SCALE}, T)
    with pytest.raises(ValueError, match=r"targets has 4 rows along dimension 0 but inputs\[0\] has 5"):
        tfr.per_sample_grads(model, CE, (X, Z), T[:4])
    with pytest.raises(ValueError, match="unbatched names 'mask'"):
        tfr.per_sample_grads(model, CE, {"x": X, "z": Z}, T, unbatched="mask")
    with pytest.raises(TypeError, match="inputs must be a tensor, a tuple"):
        tfr.per_sample_grads(model, CE, {X, Z}, T)


def test_loss_fn_receives_whatever_the_model_returns_and_targets_may_be_absent():
    model = two_inputs(as_dict=True)
    expected = loop_grads(model, lambda n: CE_OF_DICT(model(X[n : n + 1], Z[n : n + 1]), T[n : n + 1]))
    grads, how = tfr.per_sample_grads(model, CE_OF_DICT, {"x": X, "z": Z}, T, report=True)
    assert same(grads, expected) and how.path == "fast", how  # a dict of per-example tensors: the trace follows it
    no_targets = lambda out: out["logits"].square().sum()  # noqa: E731
    expected = loop_grads(model, lambda n: no_targets(model(X[n : n + 1], Z[n : n + 1])))
    assert same(tfr.per_sample_grads(model, no_targets, (X, Z)), expected)
    jacobian = tfr.output_jacobian(model, (X, Z), select=lambda out: out["logits"])
    plain = tfr.output_jacobian(two_inputs(), (X, Z))
    assert jacobian.shape == (5, 3, sum(p.numel() for p in model.parameters())) and torch.allclose(jacobian, plain, rtol=1e-10)
    with pytest.raises(ValueError, match=r"needs a model whose output is \(B, Y\)"):
        tfr.output_jacobian(model, (X, Z))


def model_and_loss():
    torch.manual_seed(33)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def vector_like(model):
    return {n: torch.ones_like(p) for n, p in model.named_parameters()}


PER_EXAMPLE = {  # keyword arguments (path, report) passed on
    "per_sample_grads": lambda m, loss, x, t, **kw: tfr.per_sample_grads(m, loss, x, t, **kw),
    "per_sample_grad_norms": lambda m, loss, x, t, **kw: tfr.per_sample_grad_norms(m, loss, x, t, **kw),
    "clipped_grad_sum": lambda m, loss, x, t, **kw: tfr.clipped_grad_sum(m, loss, x, t, max_norm=1.0, **kw),
    "clipped_noisy_gradient": lambda m, loss, x, t, **kw: tfr.clipped_noisy_gradient(m, loss, x, t, max_norm=1.0, noise_multiplier=0.0,
                                                                                      expected_batch_size=5, **kw),
    "output_jacobian": lambda m, loss, x, t, **kw: tfr.output_jacobian(m, x, **kw),
}
CURVATURE = {
    "param_hvp": lambda m, loss, x, t: tfr.param_hvp(m, loss, x, t, vector_like(m)),
    "ggn_vp": lambda m, loss, x, t: tfr.ggn_vp(m, loss, x, t, vector_like(m)),
    "empirical_fisher_vp": lambda m, loss, x, t: tfr.empirical_fisher_vp(m, loss, x, t, vector_like(m)),
    "ggn_diagonal": lambda m, loss, x, t: tfr.ggn_diagonal(m, loss, x, t),
    "hessian_trace": lambda m, loss, x, t: tfr.hessian_trace(m, loss, x, t, samples=2, generator=torch.Generator().manual_seed(0)),
    "hessian_diagonal": lambda m, loss, x, t: tfr.hessian_diagonal(m, loss, x, t, samples=2, generator=torch.Generator().manual_seed(0)),
    "top_hessian_eigenvalues": lambda m, loss, x, t: tfr.top_hessian_eigenvalues(m, loss, x, t, k=1, generator=torch.Generator().manual_seed(0)),
    "gauss_newton_step": lambda m, loss, x, t: tfr.gauss_newton_step(m, loss, x, t, damping=1.0),
    "influence_scores": lambda m, loss, x, t: tfr.influence_scores(m, loss, x, t, x, t, damping=1.0),
}
ALL = {**PER_EXAMPLE, **CURVATURE}


def flat(result):
    if isinstance(result, tfr.Eigenpairs):
        return result.values
    if isinstance(result, dict):
        return torch.cat([v.flatten() for v in result.values()])
    return torch.as_tensor(result).flatten()


@pytest.mark.parametrize("recipe", list(PER_EXAMPLE))
def test_an_empty_batch_gives_empty_results(recipe):
    model = model_and_loss()
    result = PER_EXAMPLE[recipe](model, CE, X[:0], T[:0])
    expected = {"per_sample_grads": lambda: {n: (0, *p.shape) for n, p in model.named_parameters()},
                "per_sample_grad_norms": lambda: (0,),
                "output_jacobian": lambda: (0, 3, sum(p.numel() for p in model.parameters())),
                "clipped_grad_sum": lambda: {n: tuple(p.shape) for n, p in model.named_parameters()},
                "clipped_noisy_gradient": lambda: {n: tuple(p.shape) for n, p in model.named_parameters()}}[recipe]()
    shapes = {n: tuple(v.shape) for n, v in result.items()} if isinstance(result, dict) else tuple(result.shape)
    assert shapes == expected
    if isinstance(result, dict) and recipe != "per_sample_grads":
        assert all(v.abs().sum() == 0 for v in result.values())  # no example: no clipped gradient; the noise is off


def test_the_dp_step_on_an_empty_batch_is_noise_alone_with_an_expected_batch_size_else_refused():
    model = model_and_loss()
    noisy = tfr.clipped_noisy_gradient(model, CE, X[:0], T[:0], max_norm=2.0, noise_multiplier=1.0, expected_batch_size=4,
                                       generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(1)
    assert same(noisy, {n: 2.0 * torch.randn(p.shape, generator=g, dtype=p.dtype) / 4 for n, p in model.named_parameters()})
    with pytest.raises(ValueError, match="the batch is empty"):
        tfr.clipped_noisy_gradient(model, CE, X[:0], T[:0], max_norm=2.0, noise_multiplier=1.0)


@pytest.mark.parametrize("recipe", list(CURVATURE))
def test_curvature_of_an_empty_batch_is_refused(recipe):
    with pytest.raises(ValueError, match="the batch is empty: a loss over no examples has no curvature"):
        CURVATURE[recipe](model_and_loss(), CE, X[:0], T[:0])


@pytest.mark.parametrize("recipe", list(ALL))
def test_mismatched_lengths_are_refused_naming_both(recipe):
    if recipe == "output_jacobian":  # no targets: two inputs instead
        with pytest.raises(ValueError, match=r"inputs\[1\] has 4 rows along dimension 0 but inputs\[0\] has 5"):
            tfr.output_jacobian(two_inputs(), (X, Z[:4]))
        return
    with pytest.raises(ValueError, match=r"targets has 4 rows along dimension 0 but inputs has 5"):
        ALL[recipe](model_and_loss(), CE, X, T[:4])


@pytest.mark.parametrize("recipe", [r for r in ALL if r != "output_jacobian"])
def test_a_loss_that_is_not_one_number_is_refused(recipe):
    per_example = lambda out, t: F.cross_entropy(out, t, reduction="none")  # noqa: E731  (B,) for B examples, (1,) for one
    with pytest.raises(ValueError, match="loss_fn must return a scalar"):
        ALL[recipe](model_and_loss(), per_example, X, T)


@pytest.mark.parametrize("recipe", list(ALL))
def test_batchnorm_in_training_mode_is_refused(recipe):
    torch.manual_seed(34)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)).double()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"1 \(BatchNorm1d\) is a BatchNorm in training mode"):
        ALL[recipe](model, CE, X, T)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # running statistics untouched
    model.eval()
    ALL[recipe](model, CE, X, T)  # in eval mode it runs


@pytest.mark.parametrize("recipe", list(ALL))
def test_a_random_module_in_training_mode(recipe):
    """Per-example recipes: each example draws its own mask, as the loop does (so two calls differ). Curvature: refused."""
    torch.manual_seed(35)
    model = nn.Sequential(nn.Linear(4, 6), nn.Dropout(0.5), nn.Linear(6, 3)).double()
    if recipe in CURVATURE:
        with pytest.raises(ValueError, match=r"1 \(Dropout\) is random in training mode.*call model.eval\(\)"):
            CURVATURE[recipe](model, CE, X, T)
        model.eval()
        CURVATURE[recipe](model, CE, X, T)
        return
    first, second = flat(PER_EXAMPLE[recipe](model, CE, X, T)), flat(PER_EXAMPLE[recipe](model, CE, X, T))
    assert torch.isfinite(first).all() and not torch.equal(first, second)
    model.eval()
    assert torch.equal(flat(PER_EXAMPLE[recipe](model, CE, X, T)), flat(PER_EXAMPLE[recipe](model, CE, X, T)))


COMPILED = {"torch.compile(model)": lambda m, **kw: torch.compile(m, **kw),
            "model.compile()": lambda m, **kw: (m.compile(**kw), m)[1],
            "a compiled layer": lambda m, **kw: (m.__setitem__(2, torch.compile(m[2], **kw)), m)[1]}


@pytest.mark.parametrize("recipe", list(ALL))
@pytest.mark.parametrize("how", list(COMPILED))
def test_a_compiled_model_is_refused_where_torch_cannot_run_it(recipe, how):
    """fullgraph=True: torch raises inside torch.func's transforms ('found no compiled frames'), in every recipe;
    refused up front, naming the module. Without fullgraph, the per-example recipes answer as for the model itself
    (torch runs it eagerly there), and the curvature recipes are refused: torch's compiled autograd has no double
    backward, and ggn_diagonal failed with a batching rule for aten::mm.out."""
    where = "the model" if how != "a compiled layer" else "2"
    with pytest.raises(ValueError, match=rf"{where} \(\w+\) was compiled with fullgraph=True.*_orig_mod"):
        ALL[recipe](COMPILED[how](model_and_loss(), fullgraph=True), CE, X, T)
    compiled = COMPILED[how](model_and_loss())
    if recipe in CURVATURE:
        with pytest.raises(ValueError, match=rf"{where} \(\w+\) was compiled, and a compiled module gives no second"):
            ALL[recipe](compiled, CE, X, T)
    else:
        assert torch.allclose(flat(ALL[recipe](compiled, CE, X, T)), flat(ALL[recipe](model_and_loss(), CE, X, T)), rtol=1e-10)


@pytest.mark.parametrize("recipe", list(PER_EXAMPLE))
def test_a_deep_copy_of_a_fullgraph_compiled_model_is_answered_right_or_refused_by_name(recipe):
    """copy.deepcopy of torch.compile(model, fullgraph=True) keeps the compiled module but, in torch 2.13, not the
    flag that torch.func's transforms read (the copy's dynamo_ctx says fullgraph=False): torch runs the copy in the
    transforms, and the recipes take it as compiled without fullgraph, answering as for the model. A torch that
    kept the flag would have the copy refused by name, as above; either way, never a wrong answer or torch's error."""
    copied = copy.deepcopy(torch.compile(model_and_loss(), fullgraph=True))
    try:
        got = PER_EXAMPLE[recipe](copied, CE, X, T)
    except ValueError as error:
        assert "was compiled with fullgraph=True" in str(error)
        return
    assert torch.allclose(flat(got), flat(PER_EXAMPLE[recipe](model_and_loss(), CE, X, T)), rtol=1e-10)


class Forwarding(nn.Module):
    """A wrapper that holds a module without registering it and forwards unknown attributes to it (as some wrappers
    do), with a head of its own: only getattr on the wrapper sees that it is compiled."""

    def __init__(self, inner):
        super().__init__()
        object.__setattr__(self, "inner", inner)
        self.head = nn.Linear(3, 3).double()

    def forward(self, x):
        return self.head(self.inner(x))

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["inner"], name)


@pytest.mark.parametrize("recipe", list(ALL))
def test_a_wrapper_forwarding_to_a_compiled_model_is_refused_by_name(recipe):
    """_compiled reads dynamo_ctx as getattr does, through a class's own __getattr__: reading only the instance's
    attributes, this wrapper passed the check and torch raised inside the trace instead ('found no compiled frames')."""
    with pytest.raises(ValueError, match=r"the model \(Forwarding\) was compiled with fullgraph=True"):
        ALL[recipe](Forwarding(torch.compile(model_and_loss(), fullgraph=True)), CE, X, T)


class Sine(torch.autograd.Function):
    """sin with a backward pass written in differentiable operations: second derivatives go through it."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return torch.sin(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * torch.cos(x)


class SineDetached(Sine):
    """The same first derivative, computed outside the graph: with create_graph=True its gradient has none."""

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return (g * torch.cos(x)).detach()


class SineOnce(Sine):
    """The same, with once_differentiable: its gradients hang off an error node that a second pass never reaches."""

    backward = staticmethod(torch.autograd.function.once_differentiable(Sine.backward))


class MaskedSine(Sine):
    """sin(x) * mask, differentiable, with a zero gradient (not None) for the mask, a constant: not refused."""

    @staticmethod
    def forward(x, mask):
        return torch.sin(x) * mask

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        x, mask = ctx.saved_tensors
        return g * torch.cos(x) * mask, torch.zeros_like(mask)


class FusedCrossEntropy(torch.autograd.Function):
    """Cross-entropy with a backward pass by hand, outside the graph: its gradient in the outputs is right, its
    Hessian there would be taken as zero."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, t):
        return F.cross_entropy(x, t)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        x, t = ctx.saved_tensors
        return (g * (x.softmax(1) - F.one_hot(t, x.shape[1]).to(x.dtype)) / len(t)).detach(), None


class Branchy(nn.Module):
    def __init__(self, sine):
        super().__init__()
        self.a, self.b, self.sine = nn.Linear(4, 6), nn.Linear(6, 3), sine

    def forward(self, x):
        return self.b(self.sine(torch.tanh(self.a(x))))


SINES = {"torch.sin": torch.sin, "a Function with a differentiable backward": Sine.apply,
         "torch.cond": lambda h: torch.cond(h.sum() > -1e9, torch.sin, torch.cos, (h,)),  # always sin
         "a Function returning zeros for a constant": lambda h: MaskedSine.apply(h, torch.ones_like(h)),
         "a Function whose backward detaches": SineDetached.apply, "a once_differentiable Function": SineOnce.apply,
         "torch's while_loop": lambda h: while_loop(lambda i, y: i < 1, lambda i, y: (i + 1, torch.sin(y)), (torch.tensor(0), h))[1]}
NOT_DIFFERENTIABLE = ("torch.cond", "a Function whose backward detaches", "a once_differentiable Function", "torch's while_loop")
SECOND_ORDER = ("param_hvp", "ggn_vp", "hessian_trace", "hessian_diagonal", "top_hessian_eigenvalues", "influence_scores")


@pytest.mark.parametrize("recipe", list(CURVATURE))
@pytest.mark.parametrize("sine", list(SINES)[1:])
def test_a_backward_pass_that_is_not_differentiable_is_refused(recipe, sine):
    """torch.cond's backward (torch 2.13), a Function computing its gradient outside the graph and a
    once_differentiable one give first derivatives with no graph of their own: every recipe that differentiates
    twice lost the terms through them and answered wrongly, without a word; torch's while_loop's backward stays in
    the graph but its second derivatives are wrong (a higher-order operator's node is refused outright). They are
    refused, naming the node; the
    recipes that need first derivatives only (and ggn_diagonal, whose batched backward pass cond cannot take: it
    goes one cotangent at a time) answer as for the model with torch.sin, as do all with the differentiable
    Functions."""
    def model(name):
        torch.manual_seed(37)
        return Branchy(SINES[name]).double()

    expected = flat(CURVATURE[recipe](model("torch.sin"), CE, X, T))
    if recipe in SECOND_ORDER and sine in NOT_DIFFERENTIABLE:
        with pytest.raises(ValueError, match=r"the autograd node \w+Backward .*(is not differentiable|higher-order operator's)"):
            CURVATURE[recipe](model(sine), CE, X, T)
    else:
        assert torch.allclose(flat(CURVATURE[recipe](model(sine), CE, X, T)), expected, rtol=1e-10)


@pytest.mark.parametrize("recipe", list(ALL))
def test_a_model_calling_torch_cond_is_answered_and_left_working(recipe):
    """torch.cond on a constant, beside the examples. Under the fast path's trace (a dispatch mode) torch raised
    inside the model ("no rule registered for HigherOrderOperator cond"), and in torch 2.13 one run of torch.cond
    under any dispatch mode breaks every later call of it in the process: the user's own forward pass then failed
    too. The trace now stops at the operator and clears the compiler's caches (torch.compiler.reset), which mends
    that; vmap fails on it inside torch and the loop answers; ggn_diagonal's check that the examples are apart, by
    vmap, raised, and now loops too. Every recipe answers as for the same constant written plainly, and the model
    still runs afterwards; for one example too, where the examples' check does not run."""
    ones = torch.ones(6, dtype=torch.float64)

    def model(plain):
        torch.manual_seed(38)
        return Branchy(lambda h: torch.sin(h) + (torch.sin(ones) if plain else torch.cond(torch.tensor(True), torch.sin, torch.cos, (ones,)))).double()

    for rows in (slice(None), slice(0, 1)):
        x, t = X[rows], T[rows]
        if recipe in CURVATURE and len(x) == 1:
            continue
        expected = flat(ALL[recipe](model(True), CE, x, t))
        with_cond = model(False)
        assert torch.allclose(flat(ALL[recipe](with_cond, CE, x, t)), expected, rtol=1e-10)
        assert torch.allclose(with_cond(X), model(True)(X), rtol=1e-12)  # the user's own call still works


@pytest.mark.parametrize("recipe", list(PER_EXAMPLE))
def test_a_torch_cond_the_checks_do_not_see_leaves_the_model_working(recipe):
    """torch.cond taken only with gradients on: the checks' passes run under no_grad and do not see it, so the trace
    meets it, and the operator is broken for the rest of the process (torch 2.13); the trace stops there and clears
    the compiler's caches (torch.compiler.reset), which mends it. The recipe answers as for torch.sin, and the model
    runs afterwards, with and without gradients."""
    def model(use_cond):
        def sine(h):
            if use_cond and torch.is_grad_enabled():
                return torch.cond(torch.tensor(True), torch.sin, torch.cos, (h,))
            return torch.sin(h)
        torch.manual_seed(39)
        return Branchy(sine).double()

    with_cond = model(True)
    assert torch.allclose(flat(PER_EXAMPLE[recipe](with_cond, CE, X, T)), flat(PER_EXAMPLE[recipe](model(False), CE, X, T)), rtol=1e-10)
    assert torch.allclose(with_cond(X), model(False)(X), rtol=1e-12)
    with torch.no_grad():
        assert torch.allclose(with_cond(X), model(False)(X), rtol=1e-12)


def test_output_jacobian_remembers_its_checks_per_model():
    """output_jacobian traces a new function of the model on every call (model, then select): what the trace and the
    checks remember is kept per model, so a second call runs the model once, as per_sample_grads does."""
    model = model_and_loss()
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    expected = tfr.output_jacobian(model, X)
    for _ in range(2):
        calls.clear()
        assert torch.equal(tfr.output_jacobian(model, X), expected) and len(calls) == 1


@pytest.mark.parametrize("recipe", list(CURVATURE))
def test_a_loss_whose_backward_is_not_differentiable_is_refused(recipe):
    """A cross-entropy with a backward pass by hand, outside the graph: its node receives a constant gradient (the
    loss's), so the hook asks whether a tensor it saved is in the graph. Every recipe that takes the loss's second
    derivatives (all but the empirical Fisher's) answered wrongly, ggn_vp and ggn_diagonal with zeros (the loss
    looked linear in the outputs); they are refused. gauss_newton_step takes them with torch.func, which autograd's
    hooks do not see: one backward pass of the loss is checked first."""
    fused = lambda out, t: FusedCrossEntropy.apply(out, t)  # noqa: E731
    expected = flat(CURVATURE[recipe](model_and_loss(), CE, X, T))
    if recipe == "empirical_fisher_vp":
        assert torch.allclose(flat(CURVATURE[recipe](model_and_loss(), fused, X, T)), expected, rtol=1e-10)
    else:
        with pytest.raises(ValueError, match=r"the autograd node FusedCrossEntropyBackward .* is not differentiable"):
            CURVATURE[recipe](model_and_loss(), fused, X, T)


@pytest.mark.parametrize("recipe", list(ALL))
def test_no_trainable_parameter_is_refused(recipe):
    with pytest.raises(ValueError, match="the model has no parameters that require grad"):
        ALL[recipe](model_and_loss().requires_grad_(False), CE, X, T)


class Checkpointed(nn.Module):
    """model_and_loss()'s layers with the first one under torch.utils.checkpoint, reentrant or not."""

    def __init__(self, reentrant):
        super().__init__()
        self.first, self.rest, self.reentrant = model_and_loss()[0], model_and_loss()[1:], reentrant

    def forward(self, x):
        return self.rest(torch.utils.checkpoint.checkpoint(self.first, x, use_reentrant=self.reentrant))


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True")
@pytest.mark.parametrize("recipe", list(ALL))
def test_a_reentrant_checkpoint_is_refused_naming_its_parameters_and_a_plain_one_answers(recipe):
    """A reentrant checkpoint runs its block with gradients off and recomputes it in a backward pass that
    torch.autograd.grad never calls for the block's parameters: every recipe would give them zeros. The same model
    checkpointed without reentrance answers as unchecked."""
    with pytest.raises(ValueError, match=r"^first.weight, first.bias: read inside a custom autograd.Function's forward.*use_reentrant=False"):
        ALL[recipe](Checkpointed(reentrant=True), CE, X, T)
    assert torch.allclose(flat(ALL[recipe](Checkpointed(reentrant=False), CE, X, T)), flat(ALL[recipe](model_and_loss(), CE, X, T)))


class ReentrantMiddle(nn.Module):
    """model_and_loss()'s layers with a middle one under a reentrant checkpoint whose input, an intermediate,
    requires grad: the model's own pass gives no warning."""

    def __init__(self):
        super().__init__()
        self.first, self.middle, self.last = model_and_loss()[0], nn.Linear(6, 6).double(), model_and_loss()[1:]

    def forward(self, x):
        return self.last(torch.utils.checkpoint.checkpoint(self.middle, self.first(x), use_reentrant=True))


@pytest.mark.parametrize("recipe", list(ALL))
def test_a_reentrant_checkpoint_is_refused_without_a_warning_from_the_checks(recipe):
    """The checks' own forward passes (whether examples stay apart, which linear layers the norms cover) ran under
    no_grad, where that checkpoint warns that its gradients will be None: a warning about a pass the user never
    ran, on stderr. They run with gradients on, as every path of the recipes does."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match=r"^middle.weight, middle.bias: read inside a custom autograd.Function's forward"):
            ALL[recipe](ReentrantMiddle(), CE, X, T)
    assert [str(w.message) for w in caught] == []


class _HandWrittenReentrant(torch.autograd.Function):
    """A reentrant checkpoint written by hand and given its block's parameters as inputs (so autograd reaches them
    and _check_parameters_reached passes): its backward recomputes the block and calls backward() on it, which
    writes the parameters' .grad, and returns no gradient for them."""

    @staticmethod
    def forward(ctx, block, x, *params):
        ctx.block = block
        ctx.save_for_backward(x)
        with torch.no_grad():
            return block(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            torch.autograd.backward(ctx.block(x), g)
        return (None, x.grad, *[None] * len(list(ctx.block.parameters())))


class HandCheckpointed(nn.Module):
    """model_and_loss()'s layers with the middle one under _HandWrittenReentrant."""

    def __init__(self):
        super().__init__()
        self.first, self.middle, self.last = model_and_loss()[0], nn.Linear(6, 6).double(), model_and_loss()[1:]

    def forward(self, x):
        h = self.first(x)
        return self.last(_HandWrittenReentrant.apply(self.middle, h, *self.middle.parameters()))


@pytest.mark.parametrize("recipe", list(ALL))
def test_a_backward_pass_that_writes_grad_is_refused_and_grad_is_left_as_it_was(recipe):
    """Every path would give the middle layer's parameters no gradient (the Function returns none for them) and
    write their .grad; the recipes refuse (or, where the Function's backward is refused first, as not
    differentiable, raise that) and leave every .grad as it was: the user's own tensor, its values unchanged."""
    model = HandCheckpointed()
    model.middle.weight.grad = before = torch.ones_like(model.middle.weight)
    with pytest.raises(ValueError, match=r"^middle.weight, middle.bias: the backward pass wrote into their .grad|HandWrittenReentrantBackward"):
        ALL[recipe](model, CE, X, T)
    assert model.middle.weight.grad is before and bool((before == 1).all())
    assert model.middle.bias.grad is None and model.first.weight.grad is None


class WritesGrad(nn.Module):
    """model_and_loss()'s layers, with a hook on the first layer's output that writes the last layer's .grad when
    the backward pass reaches it (write=True); the fast path covers the model either way."""

    def __init__(self, write):
        super().__init__()
        self.first, self.rest, self.write = model_and_loss()[0], model_and_loss()[1:], write

    def forward(self, x):
        z = self.first(x)
        if self.write and z.requires_grad:
            z.register_hook(lambda g: setattr(self.rest[1].bias, "grad", torch.ones_like(self.rest[1].bias)))
        return self.rest(z)


@pytest.mark.parametrize("recipe", list(PER_EXAMPLE))
def test_a_hook_writing_grad_on_the_fast_path_is_refused_and_grad_is_left_as_it_was(recipe):
    """The fast path's backward pass runs the model's hooks too: the same guard holds there (without the hook the
    model takes the fast path)."""
    assert ALL[recipe](WritesGrad(write=False), CE, X, T, report=True)[1].path == "fast"
    model = WritesGrad(write=True)
    with pytest.raises(ValueError, match=r"^rest.2.bias: the backward pass wrote into their .grad"):
        ALL[recipe](model, CE, X, T)
    assert all(p.grad is None for p in model.parameters())


def masked_first_layer():
    """model_and_loss() with a gradient hook on its first weight that zeroes the gradient's first row."""
    model = model_and_loss()
    model[0].weight.register_hook(lambda g: g * torch.arange(4, dtype=g.dtype).clamp(max=1)[None, :])
    return model


@pytest.mark.parametrize("recipe", list(PER_EXAMPLE))
def test_a_parameter_with_a_gradient_hook_takes_the_loop_and_is_refused_where_the_hook_would_be_left_out(recipe):
    """The fast path and vmap compute each example's gradient without the parameter's own hook; the loop runs it
    (the hook zeroes column 0 of the first weight's gradient: the answers differ without it)."""
    got, how = ALL[recipe](masked_first_layer(), CE, X, T, report=True)
    assert how.path == "loop" and "gradient hook" in how.reason
    assert torch.equal(flat(got), flat(ALL[recipe](masked_first_layer(), CE, X, T, path="loop")))
    assert not torch.allclose(flat(got), flat(ALL[recipe](model_and_loss(), CE, X, T)))
    if recipe == "per_sample_grads":
        assert got["0.weight"][:, :, 0].abs().max() == 0 and got["0.weight"][:, :, 1:].abs().min() > 0
    for path in ("fast", "vmap"):
        with pytest.raises(ValueError, match=r"0.weight has a gradient hook \(Tensor.register_hook\)"):
            ALL[recipe](masked_first_layer(), CE, X, T, path=path)


@pytest.mark.parametrize("recipe", list(CURVATURE))
def test_a_parameter_with_a_gradient_hook_is_refused_by_the_curvature_recipes(recipe):
    """A gradient hook changes the gradients, not the loss: param_hvp's products left it out while
    empirical_fisher_vp's (by the loop) and gauss_newton_step's gradient ran it (0.147 and 0.153 apart from the
    model without the hook, the others 0). The same model without its hook answers."""
    with pytest.raises(ValueError, match=r"^parameter 0.weight has a gradient hook \(Tensor.register_hook\)"):
        CURVATURE[recipe](masked_first_layer(), CE, X, T)
    CURVATURE[recipe](model_and_loss(), CE, X, T)


@pytest.mark.filterwarnings("ignore:Complex modules are a new feature")  # torch's note on .to(complex128)
@pytest.mark.parametrize("recipe", list(CURVATURE))
def test_a_module_backward_hook_and_a_complex_parameter_are_refused_by_the_curvature_recipes(recipe):
    """A full backward hook halving the gradient through the Tanh leaves the loss as it is, but every product ran
    it (param_hvp 1.4 off the dense Hessian, ggn_vp 0.8, gauss_newton_step 0.86): refused, as a gradient hook is,
    and so is a global one. A complex parameter: the probes are real, so hessian_trace returned a complex number
    that was the trace of the real parts' block alone."""
    model = model_and_loss()
    handle = model[1].register_full_backward_hook(lambda module, grad_in, grad_out: (grad_in[0] * 0.5,))
    with pytest.raises(ValueError, match=r"^module 1 has a backward hook \(register_full_backward_hook\)"):
        CURVATURE[recipe](model, CE, X, T)
    handle.remove()
    handle = nn.modules.module.register_module_full_backward_hook(lambda module, grad_in, grad_out: None)
    try:
        with pytest.raises(ValueError, match=r"^a global module backward hook is registered"):
            CURVATURE[recipe](model, CE, X, T)
    finally:
        handle.remove()
    CURVATURE[recipe](model, CE, X, T)
    complex_model = nn.Linear(4, 3).to(torch.complex128)
    with pytest.raises(ValueError, match=r"^parameter weight is complex"):
        CURVATURE[recipe](complex_model, lambda out, t: CE(out.real, t), X.to(torch.complex128), T)


@pytest.mark.parametrize("recipe", list(ALL))
def test_inside_no_grad_and_inference_mode_the_answer_is_the_same(recipe):
    model = model_and_loss()
    expected = flat(ALL[recipe](model, CE, X, T))
    with torch.no_grad():
        assert torch.allclose(flat(ALL[recipe](model, CE, X, T)), expected, rtol=1e-10)
    with torch.inference_mode():
        x, t = X.clone(), T.clone()  # inference tensors
        result = ALL[recipe](model, CE, x, t)
    assert torch.allclose(flat(result), expected, rtol=1e-10)
    leaves = list(result.values()) if isinstance(result, dict) else [result] if isinstance(result, torch.Tensor) else []
    assert not any(v.is_inference() for v in leaves)


@pytest.mark.parametrize("recipe", list(CURVATURE))
def test_curvature_says_what_is_not_implemented_yet(recipe):
    with pytest.raises(NotImplementedError, match="tuples and dicts"):
        CURVATURE[recipe](model_and_loss(), CE, (X,), T)


@pytest.mark.parametrize("recipe", list(PER_EXAMPLE))
def test_a_model_that_mixes_the_examples_is_refused(recipe):
    """A batch mean taken by hand: each example's output depends on the others, so no example has a gradient of
    its own (vmap and the loop would see each alone, where the centred term is zero). Refused before anything
    runs; the model without the mixing, in float32 (whose rounding differs between batch sizes), runs."""
    torch.manual_seed(36)
    layers = nn.ModuleList([nn.Linear(4, 6), nn.Linear(6, 3)]).double()
    centred = lambda x: layers[1](torch.tanh(layers[0](x)) - torch.tanh(layers[0](x)).mean(0))  # noqa: E731
    mixer = type("Centred", (nn.Module,), {"forward": lambda self, x: centred(x)})()
    mixer.layers = layers
    with pytest.raises(ValueError, match=r"depends on the other examples of the batch .* no example has a gradient of its own"):
        PER_EXAMPLE[recipe](mixer, CE, X, T)
    plain = nn.Sequential(nn.Conv1d(1, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(8, 3))  # float32
    PER_EXAMPLE[recipe](plain, CE, X.float()[:, None], T)


class Difference(nn.Module):
    """f(x1) - f(x2) for inputs 1e-2 apart, in float32: an output 1e-2 of the numbers it is the difference of."""

    def __init__(self):
        super().__init__()
        self.f = nn.Linear(16, 3)

    def forward(self, x):
        return self.f(x[:, 0]) - self.f(x[:, 1])


@pytest.mark.parametrize("recipe", list(PER_EXAMPLE))
def test_a_difference_of_close_outputs_is_not_taken_for_mixing(recipe):
    """A batch of two and one example round differently, on the scale of the numbers an output is the difference of:
    here 4.4e-5 of the output, which the check of examples apart took for mixing (it refused the model on every path,
    the loop's too). Each example beside a copy of itself (a pass of the pair's size) gives the pair's rows exactly,
    so the model runs, and every recipe equals the loop. The gradients are differences of numbers 100 times larger,
    so float32 keeps about 100 u = 6e-6 of them: the tolerance is 1e-4 of the largest entry (measured within 5e-6)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 2, 16, generator=g)
    x[:, 1] = x[:, 0] + 1e-2 * torch.randn(5, 16, generator=g)
    model = Difference()
    found = PER_EXAMPLE[recipe](model, CE, x, T)
    expected = PER_EXAMPLE[recipe](model, CE, x, T, path="loop")
    for a, b in zip(*(tree_flatten(v)[0] for v in (found, expected))):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4 * b.abs().max().item())


@pytest.mark.parametrize("twins", ["run", "raise"])
def test_a_slight_mixing_is_still_refused_after_the_same_size_pass(twins):
    """1e-4 of the batch's mean added to each output: the pair and each example alone differ by less than
    _SIZES_ROUNDING, so each example beside a copy of itself runs too, and differs from the pair's row (a copy's mean
    is the example itself): refused, as before; also where a batch of two equal examples raises (it let the model
    through)."""
    torch.manual_seed(1)

    def forward(self, x):
        if twins == "raise" and len(x) == 2 and torch.equal(x[0], x[1]):
            raise RuntimeError("two equal examples")
        h = self.layer(x)
        return h + 1e-4 * h.mean(0)

    model = type("SlightMean", (nn.Module,), {"forward": forward})()
    model.layer = nn.Linear(4, 3).double()
    with pytest.raises(ValueError, match=r"depends on the other examples of the batch \(its first two examples give outputs \d"):
        tfr.per_sample_grads(model, CE, X, T)


@pytest.mark.parametrize("recipe", list(PER_EXAMPLE))
def test_the_examples_apart_check_is_remembered_per_call_signature(recipe):
    """A passed check is not paid again for the same model and call signature, but a new signature (here an
    argument that switches the mixing on, or the other mode) is checked again: without the signature in the
    memory, the last two calls would answer wrongly instead of refusing. The parameter used outside a layer keeps
    every recipe off the fast path (whose trace sees the examples apart itself), where the check runs."""
    torch.manual_seed(37)
    layers = nn.ModuleList([nn.Linear(4, 6), nn.Linear(6, 3)]).double()
    sizes = []

    def forward(self, x, centre):
        sizes.append(len(x))
        h = torch.tanh(layers[0](x))
        return layers[1](self.scale * (h - h.mean(0) if centre or not self.training else h))

    model = type("MixesWhenAsked", (nn.Module,), {"forward": forward})()
    model.layers, model.scale = layers, nn.Parameter(torch.tensor(1.5, dtype=torch.float64))
    PER_EXAMPLE[recipe](model, CE, (X, False), T)
    checks = sizes.count(2)  # the check's pass with two examples together
    assert checks == 1
    PER_EXAMPLE[recipe](model, CE, (X, False), T)
    assert sizes.count(2) == checks  # remembered: no second check
    with pytest.raises(ValueError, match="depends on the other examples of the batch"):
        PER_EXAMPLE[recipe](model, CE, (X, True), T)  # another argument: checked again
    with pytest.raises(ValueError, match="depends on the other examples of the batch"):
        PER_EXAMPLE[recipe](model.eval(), CE, (X, False), T)  # another mode: checked again


@pytest.mark.parametrize("recipe", list(PER_EXAMPLE))
def test_a_model_that_reads_the_batch_size_but_agrees_at_two_examples_keeps_off_the_fast_path(recipe):
    """h / max(x.shape[0], 2): one example and two agree, so the check of examples apart passes, and the trace cannot
    see a Python number; the fast path gave the batch of five's rows (each example's share divided by 5, not 2),
    where vmap and the loop see each example alone. Its traced first row is now compared with the first example
    alone: auto steps aside to vmap and equals the loop, path="fast" refuses, once per call signature (a second call
    runs no trace)."""
    torch.manual_seed(39)
    layers = nn.ModuleList([nn.Linear(4, 6), nn.Linear(6, 3)]).double()
    reader = type("ReadsTheSize", (nn.Module,), {"forward": lambda self, x: layers[1](torch.tanh(layers[0](x)) / max(x.shape[0], 2))})()
    reader.layers = layers
    expected = flat(PER_EXAMPLE[recipe](reader, CE, X, T, path="loop"))
    for _ in range(2):
        result, report = PER_EXAMPLE[recipe](reader, CE, X, T, report=True)
        assert torch.allclose(flat(result), expected, rtol=1e-10, atol=1e-12)
        assert report.path == "vmap" and "reads a number from the whole batch" in report.reason
    with pytest.raises(ValueError, match="the fast path does not apply: example 0's output in the batch of 5 differs"):
        PER_EXAMPLE[recipe](reader, CE, X, T, path="fast")
    if recipe == "output_jacobian":  # with a select, known by its id only: checked on every call
        jacobian = tfr.output_jacobian(reader, X, path="loop")
        for _ in range(2):
            result, report = tfr.output_jacobian(reader, X, select=lambda o: o[:, :2], report=True)
            assert report.path == "vmap" and torch.allclose(result, jacobian[:, :2], rtol=1e-10, atol=1e-12)
    plain = type("Plain", (nn.Module,), {"forward": lambda self, x: layers[1](torch.tanh(layers[0](x)) / 2)})()
    plain.layers = layers
    result, report = PER_EXAMPLE[recipe](plain, CE, X, T, report=True)
    assert report.path == "fast" and torch.allclose(flat(result), expected, rtol=1e-10, atol=1e-12)


def _row_factor(rows):
    """A model whose output rows are scaled by 1 + rows(arange(len(x))): a factor made from the batch's size."""
    torch.manual_seed(43)
    layers = nn.ModuleList([nn.Linear(4, 6), nn.Linear(6, 3)]).double()

    def forward(self, x):
        return layers[1](torch.tanh(layers[0](x))) * (1 + rows(torch.arange(x.shape[0])).to(x.dtype)[:, None])

    model = type("RowFactor", (nn.Module,), {"forward": forward})()
    model.layers = layers
    return model


@pytest.mark.parametrize("recipe", list(PER_EXAMPLE))
@pytest.mark.parametrize("rows", ["from 2 on", "row 2 only"])
def test_a_row_factor_made_from_the_batch_size_keeps_off_the_fast_path(recipe, rows):
    """1 + (arange(x.shape[0]) >= 2): the first two examples agree together and alone, and the first row agrees
    too, but rows 2 on get a factor the loop and vmap, which see each example alone, never apply; the trace took
    the arange for a constant. The last row's comparison with the last example alone caught that one, but not
    1 + (arange(x.shape[0]) == 2), whose end rows agree with their examples alone: the fast path was 1.13 off the
    loop (per_sample_grads), 0.76 (the norms), 0.38 (output_jacobian). The trace now compares the rows of a
    constant that lines up with the examples (_trace._same_for_each), and steps aside at the product."""
    model = _row_factor({"from 2 on": lambda i: i >= 2, "row 2 only": lambda i: i == 2}[rows])
    expected = flat(PER_EXAMPLE[recipe](model, CE, X, T, path="loop"))
    result, report = PER_EXAMPLE[recipe](model, CE, X, T, report=True)
    assert torch.allclose(flat(result), expected, rtol=1e-10, atol=1e-12)
    assert report.path == "vmap" and "whose rows differ from one example to the next" in report.reason


@pytest.mark.parametrize("recipe", list(PER_EXAMPLE))
def test_a_factor_the_same_for_every_row_keeps_the_fast_path(recipe):
    """What the comparison of a constant's rows lets through: a factor made from the batch's size whose rows are
    equal (a mask of ones made for the batch, as transformers builds when it is given none)."""
    model = _row_factor(lambda i: torch.ones_like(i))
    expected = flat(PER_EXAMPLE[recipe](model, CE, X, T, path="loop"))
    result, report = PER_EXAMPLE[recipe](model, CE, X, T, report=True)
    assert report.path == "fast" and torch.allclose(flat(result), expected, rtol=1e-10, atol=1e-12)


class _PerPosition(nn.Module):
    """Example data combined with a tensor of the batch's size, made without it, in each kind of operation the
    trace checks: a table added row by row (`x + pe[:len(x)]` on batch-first data), a product with a stack of
    matrices (bmm), a concatenation beside the features, and an attention mask. `same` makes every row of the
    tensor the first one's (the fast path's case). The table's rows differ only in the middle of a batch of five.
    Also a trainable embedding looked up with ids sliced to the batch's length ("lookup", which the embedding rule
    adds itself), and a mask made of a random draw and the table's rows together ("drawn and placed")."""

    def __init__(self, kind, same):
        super().__init__()
        torch.manual_seed(46)
        self.a, self.b, self.kind, self.same = nn.Linear(4, 6), nn.Linear(6, 3), kind, same
        if kind == "lookup":  # a trainable table, looked up with ids of the batch's size
            self.embed = nn.Embedding(4, 6)
            ids = torch.zeros(8, dtype=torch.long)
            ids[2:4] = torch.tensor([1, 3])  # rows 2 and 3 differ, as in the table below
            self.register_buffer("ids", ids)
        # a buffer (a constant to the trace) whose rows 2 and 3 differ from the others: the first two examples and the
        # last (rows 0, 1 and 4 of five) agree together and alone, so only the trace's comparison of rows sees it
        table = torch.randn(6).repeat(8, 1)
        table[2:4] = torch.randn(2, 6)
        self.register_buffer("table", table)
        self.double()

    def forward(self, x):
        h, n = torch.tanh(self.a(x)), x.shape[0]
        table = self.table[:1].expand(n, 6).clone() if self.same else self.table[:n]
        if self.kind == "added":
            h = h + table
        elif self.kind == "bmm":
            h = torch.bmm(h[:, None, :], torch.diag_embed(table)).squeeze(1)
        elif self.kind == "cat":
            h = torch.cat([h[:, :3], table[:, :3]], 1)
        elif self.kind == "lookup":  # the embedding rule's own addition of a lookup (token type ids, say)
            h = h + self.embed(self.ids[:1].expand(n).clone() if self.same else self.ids[:n])
        elif self.kind == "drawn and placed":  # a random draw that keeps everything, and a factor by position
            keep = (torch.rand(n, 1) >= 0) & ((table[:, :1] == table[:1, :1]) if not self.same else torch.ones(n, 1, dtype=torch.bool))
            h = h * keep
        else:  # attention of two tokens per example, the mask from the table's signs
            q = h.view(n, 1, 2, 3)
            mask = (table[:, None, :2, None] > 0) | torch.eye(2, dtype=torch.bool)  # every token sees itself
            h = F.scaled_dot_product_attention(q, q, q, attn_mask=mask).reshape(n, 6)
        return self.b(h)


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # vmap's fallback for CPU attention: a note
@pytest.mark.parametrize("recipe", list(PER_EXAMPLE))
@pytest.mark.parametrize("kind", ["added", "bmm", "cat", "attention", "lookup", "drawn and placed"])
def test_a_tensor_of_the_batch_size_made_without_the_examples_keeps_off_the_fast_path(recipe, kind):
    """Each operation the trace lets example data meet a constant in: where the constant's rows differ, the
    examples' positions change their results, and the fast path (which computed the batch's rows) steps aside to
    vmap, which equals the loop; where they are the same, the fast path runs and equals the loop. An adversarial
    review found the lookup (0.15 off on per_sample_grads) and the mask with a draw in it (0.19: a tensor made from
    a draw was let through whatever else went into it)."""
    model = _PerPosition(kind, same=False)
    expected = flat(PER_EXAMPLE[recipe](model, CE, X, T, path="loop"))
    result, report = PER_EXAMPLE[recipe](model, CE, X, T, report=True)
    assert torch.allclose(flat(result), expected, rtol=1e-10, atol=1e-12)
    assert report.path == "vmap" and "whose rows differ from one example to the next" in report.reason
    same = _PerPosition(kind, same=True)
    expected = flat(PER_EXAMPLE[recipe](same, CE, X, T, path="loop"))
    result, report = PER_EXAMPLE[recipe](same, CE, X, T, report=True)
    assert report.path == "fast" and torch.allclose(flat(result), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("recipe", [name for name in PER_EXAMPLE if name != "output_jacobian"])
@pytest.mark.parametrize("in_place", ["relu", "div"])
def test_a_loss_that_changes_the_output_in_place_equals_the_loop(recipe, in_place):
    """A loss_fn that changes the model's output in place (F.relu(o, inplace=True), o.div_(temperature)) changed
    the last layer's recorded output after the trace had checked it, and the fast path took the gradient at the
    changed tensor for the layer's: wrong per-example gradients, norms and clipped sums. The fast path now checks
    the recorded tensors after the loss too, and steps aside."""
    model = model_and_loss()
    change = {"relu": lambda o: F.relu(o, inplace=True), "div": lambda o: o.div_(0.5)}[in_place]
    loss = lambda out, t: CE(change(out), t)  # noqa: E731
    expected = flat(PER_EXAMPLE[recipe](model, loss, X, T, path="loop"))
    result, report = PER_EXAMPLE[recipe](model, loss, X, T, report=True)
    assert torch.allclose(flat(result), expected, rtol=1e-10, atol=1e-12)
    assert report.path == "vmap" and "the loss changed the input or output of the layer" in report.reason


@pytest.mark.parametrize("recipe", ["per_sample_grads", "per_sample_grad_norms", "clipped_grad_sum"])
def test_a_gradient_hook_the_forward_pass_registers_keeps_off_the_fast_path(recipe):
    """A parameter hook registered lazily by the first forward pass (a gradient scale set up on first use): the
    screen had looked for hooks before the check of examples apart ran the model and registered it, so the first
    call took the fast path, which leaves parameter hooks out (0.24 off). The trace now looks again after its
    forward pass; the hook sends the call to the loop, which runs it."""
    def build():
        torch.manual_seed(44)
        layers = nn.ModuleList([nn.Linear(4, 6), nn.Linear(6, 3)]).double()

        def forward(self, x):
            if not self.hooked:
                layers[0].weight.register_hook(lambda g: 0.5 * g)
                self.hooked = True
            return layers[1](torch.tanh(layers[0](x)))

        model = type("LazyHook", (nn.Module,), {"forward": forward})()
        model.layers, model.hooked = layers, False
        return model

    expected = flat(PER_EXAMPLE[recipe](build(), CE, X, T, path="loop"))
    result, report = PER_EXAMPLE[recipe](build(), CE, X, T, report=True)
    assert torch.allclose(flat(result), expected, rtol=1e-10, atol=1e-12)
    assert report.path == "loop"


class KeptView(nn.Module):
    """model_and_loss()'s layers, the last one's weight also used through its transpose kept as an attribute, made
    in __init__: with its autograd graph (how="graph"), detached, or under torch.no_grad(); how="inside" makes it
    inside forward, detached, as the two constant ones mean."""

    def __init__(self, how):
        super().__init__()
        self.body, self.head, self.how = model_and_loss()[:2], model_and_loss()[2], how
        if how == "graph":
            self.w_t = self.head.weight.t()
        elif how == "detached":
            self.w_t = self.head.weight.t().detach()
        elif how == "no_grad":
            with torch.no_grad():
                self.w_t = self.head.weight.t()

    def forward(self, x):
        h = self.body(x)
        w_t = self.head.weight.t().detach() if self.how == "inside" else self.w_t
        return self.head(h) + 0.01 * (h @ w_t)


@pytest.mark.parametrize("recipe", list(ALL))
def test_a_tensor_made_from_a_parameter_before_the_call_is_refused_on_every_path(recipe):
    """A view of a weight kept as an attribute (self.w_t = self.head.weight.t() in __init__) carries autograd's
    graph back to the weight, so the loop's gradients flow through it; but the trace took it for a constant (the
    fast path 0.24 off on per-example gradients), and vmap and the curvature recipes swap copies of the weight
    into the model, which the view does not follow. Every path now refuses it, naming the parameter; made without
    a graph (detached, or under no_grad) it is a constant for autograd too, and answers as a model detaching it
    inside forward."""
    message = r"^the forward pass uses a tensor computed from parameter head.weight before the call"
    with pytest.raises(ValueError, match=message):
        ALL[recipe](KeptView("graph"), CE, X, T)
    if recipe in PER_EXAMPLE:
        for path in ("vmap", "loop"):
            with pytest.raises(ValueError, match=message):
                PER_EXAMPLE[recipe](KeptView("graph"), CE, X, T, path=path)
    expected = flat(ALL[recipe](KeptView("inside"), CE, X, T))
    for how in ("detached", "no_grad"):
        assert torch.allclose(flat(ALL[recipe](KeptView(how), CE, X, T)), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("recipe", [name for name in ALL if name != "output_jacobian"])
def test_a_loss_using_a_view_of_a_parameter_made_before_the_call_is_refused(recipe):
    """A loss_fn reading a parameter itself is refused (a penalty inside the loss counts on some paths only); one
    reading a view of it made beforehand was not, and the fast path and vmap left its share out."""
    model = model_and_loss()
    w = model[2].weight.view(3, 6)
    loss = lambda out, t: CE(out, t) + 0.1 * (out @ w).square().sum()  # noqa: E731
    with pytest.raises(ValueError, match=r"^loss_fn uses a tensor computed from parameter 2.weight before the call"):
        ALL[recipe](model, loss, X, T)


@pytest.mark.parametrize(("recipe", "which"), [(recipe, which) for which in ("inputs", "targets") for recipe in ALL
                                               if (recipe, which) != ("output_jacobian", "targets")])  # it takes no targets
def test_inputs_or_targets_computed_from_the_model_with_their_graph_are_refused(recipe, which):
    """Inputs or targets computed from the model's own parameters without detaching them: the loop's gradients
    flowed through them too, the other paths' did not. Every path refuses them; detached, they answer."""
    model, mse = model_and_loss(), F.mse_loss
    inputs, targets = (X + 0 * model[0].bias.sum(), torch.zeros(5, 3, dtype=torch.float64)) if which == "inputs" else (X, 0.5 * model(X))
    names = "0.bias" if which == "inputs" else "0.weight, 0.bias, 2.weight and more"
    with pytest.raises(ValueError, match=rf"^the inputs or targets were computed from parameter {names} with their autograd graph"):
        ALL[recipe](model, mse, inputs, targets)
    ALL[recipe](model, mse, inputs.detach(), targets.detach())


def test_a_weight_parametrize_caches_is_refused_after_a_call_without_the_cache():
    """Inside torch.nn.utils.parametrize.cached() a parametrized weight (weight_norm's) is computed once and then
    reused: a tensor made before the pass, which the copies vmap swaps in never reach. The check that sees it was
    remembered from a call outside cached(), so vmap and the loop went on, 0.84 off. Whether cached() is on is now
    part of the call signature the checks are remembered by."""
    torch.manual_seed(45)
    model = nn.Sequential(torch.nn.utils.parametrizations.weight_norm(nn.Linear(4, 6)), nn.Tanh(), nn.Linear(6, 3)).double()
    expected = tfr.per_sample_grads(model, CE, X, T, path="loop")
    assert same(tfr.per_sample_grads(model, CE, X, T), expected)
    with torch.nn.utils.parametrize.cached():
        for path in ("auto", "vmap", "loop"):
            with pytest.raises(ValueError, match=r"^the forward pass uses a tensor computed from parameter 0.parametrizations"):
                tfr.per_sample_grads(model, CE, X, T, path=path)
    assert same(tfr.per_sample_grads(model, CE, X, T), expected)


class BackwardHook(nn.Module):
    """model_and_loss()'s layers with something hung on the backward pass by the forward pass: a gradient hook on the
    hidden activation that divides by the norm of the gradient it is given ("tensor hook"), the same as a pre-hook
    of the activation's grad_fn ("node prehook"), saved-tensor hooks that quantise each saved tensor with one scale
    ("saved tensors", 8-bit activation compression), or a hook that only looks ("observer", returning None)."""

    def __init__(self, how):
        super().__init__()
        self.first, self.rest, self.how = model_and_loss()[0], model_and_loss()[1:], how

    def forward(self, x):
        if self.how == "saved tensors":
            def unpack(t):
                scale = t.abs().max() / 127
                return (t / scale).round() * scale

            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
                return self.rest(self.first(x))
        h = self.first(x)
        if h.requires_grad:
            if self.how == "tensor hook":
                h.register_hook(lambda g: g / g.norm())
            elif self.how == "node prehook":
                h.grad_fn.register_prehook(lambda gs: (gs[0] / gs[0].norm(),))
            else:
                h.register_hook(lambda g: None)
        return self.rest(h)


@pytest.mark.parametrize("recipe", list(PER_EXAMPLE))
@pytest.mark.parametrize("how", ["tensor hook", "node prehook", "saved tensors"])
def test_a_backward_pass_that_mixes_the_examples_keeps_off_the_fast_path(recipe, how):
    """What the forward pass hangs on the backward pass runs, on the fast path, on the whole batch's gradient at once;
    vmap and the loop run it on each example's. A hook dividing by the gradient's norm made the fast path 0.41 off
    (output_jacobian), the grad_fn pre-hook 0.28 off, and quantising saved tensors with one scale for the batch
    1.4e-3 off (clipped_grad_sum). The fast path's first and last examples are now compared with those examples
    alone; where they differ its answer is set aside, remembered, and `path="fast"` refuses."""
    expected = flat(PER_EXAMPLE[recipe](BackwardHook(how), CE, X, T, path="loop"))
    model = BackwardHook(how)
    for _ in range(2):  # the second call goes off the fast path at once, for the remembered reason
        result, report = PER_EXAMPLE[recipe](model, CE, X, T, report=True)
        assert torch.allclose(flat(result), expected, rtol=1e-10, atol=1e-12)
        assert report.path != "fast"
        assert how == "saved tensors" or "the backward pass mixes the examples" in report.reason
    with pytest.raises(ValueError, match=r"the fast path does not apply: example 0's (gradient|squared norm of its gradient|weighted sum of Jacobian rows) "
                                         r"in the batch of 5 differs from its .* alone: the backward pass mixes the examples"):
        PER_EXAMPLE[recipe](BackwardHook(how), CE, X, T, path="fast")


class MixesAFewPercent(nn.Module):
    """float64, a gradient hook that mixes the examples by 5% (g + 0.05 g.mean(0)), and beside it one of two
    things that once switched the comparison of the end examples' gradients off or widened it: a mask made in
    bfloat16 and cast back ("bfloat16 mask": the tolerance was 16 bfloat16 roundings, 0.125, for every pass), or a
    random draw that changes nothing ("idle draw", stochastic depth with a drop rate of 0: the lone passes drew, so
    nothing was compared)."""

    def __init__(self, how):
        super().__init__()
        torch.manual_seed(48)
        self.first, self.head, self.how = nn.Linear(4, 6).double(), nn.Linear(6, 3).double(), how

    def forward(self, x):
        h = torch.tanh(self.first(x))
        if self.how == "bfloat16 mask":
            h = h * torch.ones(x.shape[0], 1, dtype=torch.bfloat16).to(x.dtype)
        elif torch.rand(()) < 0.0:  # never taken
            h = torch.zeros_like(h)
        if h.requires_grad:
            h.register_hook(lambda g: g + 0.05 * g.mean(0, keepdim=True))
        return self.head(h)


@pytest.mark.parametrize("recipe", list(PER_EXAMPLE))
@pytest.mark.parametrize("how", ["bfloat16 mask", "idle draw"])
def test_a_side_tensor_or_an_idle_draw_leaves_the_backward_check_on(recipe, how):
    """An adversarial review: with a bfloat16 mask beside a 5% mixing, the fast path was 2.6e-2 off (per_sample_grads),
    since the tolerance followed the coarsest dtype any torch function returned; with an idle draw and a hook that
    normalises the batch's gradient, 0.49 off, since lone passes that draw were not compared. The tolerance now
    follows the results autograd records, and lone passes that draw are compared where a second pass, with other
    draws, gives exactly the same. Each call now equals the loop, off the fast path (vmap, or the loop where vmap
    cannot branch on the draw), but for output_jacobian, whose rows this mixing leaves exact."""
    expected = flat(PER_EXAMPLE[recipe](MixesAFewPercent(how), CE, X, T, path="loop"))
    result, report = PER_EXAMPLE[recipe](MixesAFewPercent(how), CE, X, T, report=True)
    assert torch.allclose(flat(result), expected, rtol=1e-10, atol=1e-12)
    if recipe == "output_jacobian":
        return
    if how == "bfloat16 mask":
        assert report.path == "vmap" and "the backward pass mixes the examples" in report.reason
    else:  # the check set the fast path aside; vmap then raised on the draw's branch
        assert report.path == "loop"
        with pytest.raises(ValueError, match="the backward pass mixes the examples"):
            PER_EXAMPLE[recipe](MixesAFewPercent(how), CE, X, T, path="fast")


class ClampsOneExample(nn.Module):
    """A gradient hook that clamps the hidden activation's gradient, which bites only for example 2 (its target is
    far off): per-row, so it keeps the examples apart, but it is not linear in the gradient it is given."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(46)
        self.first, self.head = nn.Linear(4, 6).double(), nn.Linear(6, 2).double()

    def forward(self, x):
        h = torch.tanh(self.first(x))
        if h.requires_grad:
            h.register_hook(lambda g: g.clamp(-0.5, 0.5))
        return self.head(h)


class SmallLayerMixed(nn.Module):
    """float32: a gradient hook on the first layer's output that divides by the norm of the gradient it is given
    (the whole batch's on the fast path, each example's under vmap and on the loop) and scales it to 1e-5, so that
    the first layer's gradients are about 1e-5 of the head's."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(47)
        self.first, self.head = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x):
        h = self.first(x)
        if h.requires_grad:
            h.register_hook(lambda g: 1e-5 * g / g.norm())
        return self.head(torch.tanh(h))


@pytest.mark.parametrize("recipe", ["per_sample_grads", "output_jacobian"])
def test_a_mixing_on_a_layer_with_small_gradients_keeps_off_the_fast_path_in_float32(recipe):
    """The comparison of the end examples' gradients allowed 1e-4 of the example's largest entry over all its
    tensors in float32: a mixing on a layer whose gradients are 1e-5 of the head's went unseen, and the fast path
    was 0.55 off on that layer. Each tensor is now compared to its own scale, floored at 1e-3 of the largest
    (_trace._SCALE_FLOOR); the call goes to vmap, which equals the loop. (The norms, and the clipped sums that
    reuse their check, are not compared per tensor: the layer's share of the squared norm is 1e-10.)"""
    model, x = SmallLayerMixed(), X.float()
    expected = PER_EXAMPLE[recipe](model, CE, x, T, path="loop")
    result, report = PER_EXAMPLE[recipe](model, CE, x, T, report=True)
    assert report.path == "vmap" and "the backward pass mixes the examples" in report.reason
    pairs = list(zip(result.values(), expected.values())) if isinstance(result, dict) else [(result, expected)]
    for got, want in pairs:  # each tensor to 1e-5 of its own largest entry: float32 roundings in another order
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("norms_given", [False, True])
@pytest.mark.parametrize("recipe", ["clipped_grad_sum", "clipped_noisy_gradient"])
def test_a_clipped_sum_sees_a_mixing_on_a_layer_with_small_gradients_in_float32(recipe, norms_given):
    """The clipped sums' fast path was checked through the norms: the first layer's share of the squared norm is
    1e-10, so a mixing there went unseen, and the sums were 0.67 off on that layer (relative to its own largest
    entry), with norms given or not. The end examples' gradients, from the same output gradients as the sum, are now
    compared with theirs alone, parameter by parameter: the call goes to vmap and equals the definition."""
    model, x = SmallLayerMixed(), X.float()
    each = tfr.per_sample_grads(model, CE, x, T, path="loop")
    norms = torch.cat([g.flatten(1) for g in each.values()], dim=1).double().norm(dim=1)
    factors = (0.5 / (norms + 1e-6)).clamp(max=1).float()
    expected = {name: torch.tensordot(factors, g, dims=1) for name, g in each.items()}
    given = {"norms": norms.float()} if norms_given else {}
    for _ in range(2):  # the second call goes off the fast path at once, for the remembered reason
        if recipe == "clipped_grad_sum":
            result, report = tfr.clipped_grad_sum(model, CE, x, T, max_norm=0.5, report=True, **given)
        else:  # noise_multiplier 0: the mean of the clipped sum
            result, report = tfr.clipped_noisy_gradient(model, CE, x, T, max_norm=0.5, noise_multiplier=0.0,
                                                        expected_batch_size=1, report=True, **given)
        assert report.path == "vmap" and "the backward pass mixes the examples" in report.reason
        for name, want in expected.items():  # each tensor to 1e-5 of its own largest entry (float32 roundings)
            assert torch.allclose(result[name], want, rtol=1e-5, atol=1e-5 * want.abs().max().item()), name


@pytest.mark.parametrize("how", ["tensor hook", "node prehook", "saved tensors", "observer", "clamp"])
@pytest.mark.parametrize("path", ["auto", "vmap", "loop"])
def test_a_clipped_sum_with_norms_given_weights_the_gradients_not_the_losses(how, path):
    """With norms given, clipped_grad_sum weighted each example's loss by its clip factor and ran one backward pass:
    that weights the gradients only where the backward pass is linear in the weights and keeps the examples apart. A
    hook dividing by the norm of the gradient it is given undid the weights (and on the fast path and under vmap,
    where one backward pass runs on every example's rows, mixed them): 1.37 times the largest entry off on the fast
    path, 0.67 under vmap, 4.9 on the loop; saved-tensor hooks quantising with one scale for the batch, 2.8e-3 on the
    fast path and under vmap; a clamp that bites only for a middle example, 1.22 on every path (an adversarial review
    found it: a check of the end examples alone does not see it). The clip factors now weight each example's
    gradient: on the fast path each layer's output gradient, as with norms=None; elsewhere each chunk's per-example
    gradients. A backward pass that mixes the examples is found on the first call by comparing the end examples'
    gradients (from the sum's own output gradients) with theirs alone."""
    model = ClampsOneExample() if how == "clamp" else BackwardHook(how)
    mse = lambda out, t: F.mse_loss(out, t)  # noqa: E731
    targets = torch.zeros(5, 2, dtype=torch.float64).index_fill_(0, torch.tensor([2]), 20.0) if how == "clamp" else T
    loss = mse if how == "clamp" else CE
    each = tfr.per_sample_grads(model, loss, X, targets, path="loop")
    norms = torch.cat([g.flatten(1) for g in each.values()], dim=1).norm(dim=1)
    factors = (0.5 / (norms + 1e-6)).clamp(max=1)
    assert how != "clamp" or factors[2] < 1 and torch.all(factors[[0, 1, 3, 4]] == 1)  # only example 2 is clipped
    expected = flat({name: torch.tensordot(factors, g, dims=1) for name, g in each.items()})
    if how == "saved tensors" and path == "vmap":  # torch.func refuses saved-tensor hooks: an error, not an answer
        with pytest.raises(RuntimeError, match="saved tensor hooks"):
            tfr.clipped_grad_sum(model, loss, X, targets, max_norm=0.5, norms=norms, path=path)
        return
    for _ in range(2):  # the second call takes the remembered way at once
        result, report = tfr.clipped_grad_sum(model, loss, X, targets, max_norm=0.5, norms=norms, path=path, report=True)
        assert torch.allclose(flat(result), expected, rtol=1e-10, atol=1e-12)
        if path == "auto":
            mixes = how in ("tensor hook", "node prehook", "saved tensors")
            assert (report.path != "fast") == mixes
            assert how == "saved tensors" or not mixes or "the backward pass mixes the examples" in report.reason
    noisy = tfr.clipped_noisy_gradient(model, loss, X, targets, max_norm=0.5, norms=norms, noise_multiplier=0.0,
                                       expected_batch_size=1, path=path)
    assert torch.allclose(flat(noisy), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("recipe", list(PER_EXAMPLE))
def test_a_hook_that_only_looks_keeps_the_fast_path_and_the_checks_run_once(recipe):
    """A gradient hook that returns None changes nothing (FlopCounterMode's module tracker hangs such hooks on every
    module's output): the fast path stays. The comparison with the end examples alone, like the other checks, runs
    on the first call of a call signature only: later calls run the model once."""
    model = BackwardHook("observer")
    expected = flat(PER_EXAMPLE[recipe](model, CE, X, T, path="loop"))
    passes = []
    model.first.register_forward_pre_hook(lambda module, args: passes.append(args[0].shape[0]))
    counts = []
    for _ in range(3):
        passes.clear()
        result, report = PER_EXAMPLE[recipe](model, CE, X, T, report=True)
        assert report.path == "fast" and torch.allclose(flat(result), expected, rtol=1e-10, atol=1e-12)
        counts.append(passes.copy())
    assert counts[0].count(1) == 4  # the end examples alone: for their outputs, then for their gradients
    assert counts[1] == counts[2] == [5]  # the batch, traced


def test_output_jacobians_check_of_the_backward_pass_costs_one_backward_pass_per_example():
    """output_jacobian compares the fast path's end examples with those examples alone through one weighted sum of
    their Jacobian rows: one backward pass each, whatever Y is (their whole Jacobians would take Y each, and a
    select makes the comparison run on every call)."""
    torch.manual_seed(49)
    body, head = nn.Linear(4, 6).double(), nn.Linear(6, 20).double()
    seen = []

    def forward(self, x):
        h = torch.tanh(body(x))
        if h.requires_grad:
            h.register_hook(lambda g: seen.append(g.shape[0]))  # only looks
        return head(h)

    model = type("Wide", (nn.Module,), {"forward": forward})()
    model.body, model.head = body, head
    for _ in range(2):
        seen.clear()
        result, report = tfr.output_jacobian(model, X, select=lambda out: out[:, :15], report=True)
        assert report.path == "fast" and result.shape == (5, 15, 4 * 6 + 6 + 6 * 20 + 20)
        assert seen.count(1) == 2  # the two lone examples' backward passes


class Bag(nn.Module):
    """Token ids averaged through an embedding, sparse or dense, then a linear layer."""

    def __init__(self, sparse):
        super().__init__()
        torch.manual_seed(46)
        self.embed, self.head = nn.Embedding(10, 4, sparse=sparse).double(), nn.Linear(4, 3).double()

    def forward(self, ids):
        return self.head(self.embed(ids).mean(1))


@pytest.mark.parametrize("recipe", list(PER_EXAMPLE))
@pytest.mark.parametrize("path", ["auto", "loop"])
def test_a_sparse_embedding_answers_as_a_dense_one(recipe, path):
    """nn.Embedding(sparse=True) gets sparse gradients from autograd: the loop failed writing them into its result
    ("copy_() between dense and sparse Tensors", "reshape is not implemented for sparse tensors"), and the fast
    path's comparison with the end examples alone failed comparing them. Every path now densifies them, as the
    fast path's products are, and answers as the same model with a dense embedding."""
    ids = torch.randint(0, 10, (5, 3), generator=torch.Generator().manual_seed(47))
    expected = flat(PER_EXAMPLE[recipe](Bag(sparse=False), CE, ids, T, path=path))
    assert torch.allclose(flat(PER_EXAMPLE[recipe](Bag(sparse=True), CE, ids, T, path=path)), expected, rtol=1e-12, atol=1e-14)


def test_a_failed_trace_is_run_once_per_call_signature(monkeypatch):
    """The trace of a model the fast path refuses (an in-place ReLU on a recorded output) runs once for a call
    signature, not once a step, and again for another signature (another batch size, another mode); the
    answers stay the loop's. Without the memory the count below would be 3, then 5."""
    import torch_func_recipes._trace as trace

    runs = []
    run = trace._run_trace
    monkeypatch.setattr(trace, "_run_trace", lambda *args: (runs.append(1), run(*args))[1])
    torch.manual_seed(38)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(inplace=True), nn.Linear(6, 3)).double()
    expected = flat(tfr.per_sample_grads(model, CE, X, T, path="loop"))
    for _ in range(3):
        assert torch.allclose(flat(tfr.per_sample_grads(model, CE, X, T)), expected, rtol=1e-10)
    assert len(runs) == 1
    tfr.per_sample_grads(model, CE, X[:3], T[:3])
    tfr.per_sample_grads(model.eval(), CE, X, T)
    assert len(runs) == 3


@pytest.mark.parametrize("path", ["fast", "vmap", "loop"])
def test_an_out_whose_memory_is_shared_is_refused_and_a_strided_one_answers(path):
    """out= was checked for shape, dtype and device only: an expanded buffer (one row of memory for every example)
    made vmap and the fast path raise torch's overlap error, and the loop return the last example in every row
    (2.35 off). Out tensors sharing memory with each other or with a parameter are refused likewise; a strided view
    with memory of its own is written."""
    model = model_and_loss()
    expected = tfr.per_sample_grads(model, CE, X, T, path="loop")
    shared = {n: torch.zeros(1, *g.shape[1:], dtype=g.dtype).expand_as(g) for n, g in expected.items()}
    with pytest.raises(ValueError, match=r"^out\['0.weight'\] has elements that share memory"):
        tfr.per_sample_grads(model, CE, X, T, out=shared, path=path)
    pool = torch.zeros(2 * sum(g.numel() for g in expected.values()), dtype=torch.float64)
    aliased = {n: pool[:g.numel()].view(g.shape) for n, g in expected.items()}  # every name at the pool's start
    with pytest.raises(ValueError, match=r"^out\['0.weight'\] shares memory with out\['0.bias'\]"):
        tfr.per_sample_grads(model, CE, X, T, out=aliased, path=path)
    inside_a_weight = model[0].weight.detach().view(-1)[:15].view(len(X), 3)  # 15 of 0.weight's 24 numbers
    with pytest.raises(ValueError, match=r"^out\['2.bias'\] shares memory with parameter 0.weight"):
        tfr.per_sample_grads(model, CE, X, T, out={**{n: torch.empty_like(g) for n, g in expected.items()}, "2.bias": inside_a_weight},
                             path=path)
    strided = {n: torch.zeros(*g.shape, 2, dtype=g.dtype)[..., 0] for n, g in expected.items()}
    got = tfr.per_sample_grads(model, CE, X, T, out=strided, path=path)
    assert all(got[n] is strided[n] and torch.allclose(got[n], expected[n], rtol=1e-12) for n in expected)
    jacobian = tfr.output_jacobian(model, X)
    with pytest.raises(ValueError, match="^out has elements that share memory"):
        tfr.output_jacobian(model, X, out=torch.zeros(1, *jacobian.shape[1:], dtype=jacobian.dtype).expand_as(jacobian), path=path)


@pytest.mark.parametrize("recipe", [name for name in ALL if name != "output_jacobian"])  # it takes no loss
def test_a_loss_that_reads_a_parameter_is_refused(recipe):
    """A weight-decay term inside loss_fn: functional_call swaps the parameters in the model's forward pass only, so
    param_hvp left the term's curvature out (0.79 off the full Hessian, the top eigenvalue 2.47 for 3.47), and the
    per-example paths disagreed (the loop counts the term, vmap and the fast path do not). Every recipe refuses it,
    naming the parameter; a loss that reads none answers as before."""
    model = model_and_loss()
    with pytest.raises(ValueError, match="^loss_fn reads parameter 0.weight of the model"):
        ALL[recipe](model, lambda out, t: CE(out, t) + 0.1 * model[0].weight.pow(2).sum(), X, T)
    ALL[recipe](model, lambda out, t: CE(out, t) + 0.1 * out.pow(2).mean(), X, T)


def spectral_in_training():
    """spectral_norm (the parametrization) in training mode: every forward pass runs a step of power iteration,
    writing its vectors (buffers) in place, and uses them."""
    torch.manual_seed(47)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    nn.utils.parametrizations.spectral_norm(model[0])
    return model.train()


def on_a_fresh_copy(model, f):
    """f(copy): f on a copy of the model as given, so that its one forward pass starts from the given buffers."""
    return f(copy.deepcopy(model))


@pytest.mark.parametrize(("recipe", "path"), [(recipe, path) for recipe in ("per_sample_grads", "per_sample_grad_norms", "clipped_grad_sum")
                                              for path in ("auto", "vmap", "loop")] + [("param_hvp", None)])
def test_every_pass_runs_the_model_as_given_when_its_forward_writes_its_buffers(recipe, path):
    """The recipes run the model several times (the checks, the trace, each example of the loop): spectral_norm's
    power iteration in training mode moved its vectors on every pass, so each pass saw another weight, 8e-4 off on
    the loop (an adversarial review found it; per_sample_grad_norms 1.3e-4, clipped_grad_sum 7.5e-4; a 6x6 model was
    refused instead, as if it mixed its examples). Every pass now starts from the buffers as given: the reference is
    each example (or the batch, for the Hessian) on a fresh copy of the model."""
    model = spectral_in_training()
    params = lambda m: [p for p in m.parameters() if p.requires_grad]  # noqa: E731
    each = torch.stack([on_a_fresh_copy(model, lambda m, n=n: torch.cat([g.flatten() for g in torch.autograd.grad(
        CE(m(X[n:n + 1]), T[n:n + 1]), params(m))])) for n in range(5)])
    if recipe == "param_hvp":
        vector = {name: torch.ones_like(p) for name, p in model.named_parameters()}

        def hvp(m):
            g = torch.autograd.grad(CE(m(X), T), params(m), create_graph=True)
            return torch.cat([h.flatten() for h in torch.autograd.grad(sum((a * torch.ones_like(a)).sum() for a in g), params(m))])
        assert torch.allclose(flat(tfr.param_hvp(model, CE, X, T, vector)), on_a_fresh_copy(model, hvp), rtol=1e-10, atol=1e-12)
        return
    norms = each.norm(dim=1)
    expected = {"per_sample_grads": each, "per_sample_grad_norms": norms,
                "clipped_grad_sum": ((0.5 / (norms + 1e-6)).clamp(max=1)[:, None] * each).sum(0)}[recipe]
    kwargs = {"max_norm": 0.5} if recipe == "clipped_grad_sum" else {}
    result = getattr(tfr, recipe)(model, CE, X, T, path=path, **kwargs)
    got = torch.cat([g.flatten(1) for g in result.values()], dim=1) if recipe == "per_sample_grads" else flat(result)
    assert torch.allclose(got.reshape(expected.shape), expected, rtol=1e-10, atol=1e-12)
