"""Chapter 10's curvature recipes, as the package ships them (torch_func_recipes.curvature), in float64 on
the CPU against dense matrices built by loops of autograd calls: on every model of test_recipes.py's zoo, on models whose
parameters a layer-by-layer method could miscount (frozen parameters, a layer called twice, a weight
used outside its layer, from test_adversarial_models.py), under other losses, and on their errors."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import torch_func_recipes.curvature
from test_adversarial_models import CASES, mixing
from test_recipes import TARGETS, ZOO, Model, close, grad_rows

X = torch.randn(5, 6, generator=torch.Generator().manual_seed(11), dtype=torch.float64)


def residual(m, x):
    """A custom forward: a skip connection around a LayerNorm'd hidden layer."""
    h = m.norm(torch.tanh(m.inp(x)))
    return m.out(h + torch.sin(m.hidden(h)))


class SequenceFirst(nn.Module):
    """A linear layer on positions first, (T, B, d) with T = B: its input has a row per example but the rows are
    positions, so ggn_diagonal's per-layer path, which squares each row's gradient as one example's, must not take it."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(2, 4), nn.Linear(4, 3)

    def forward(self, x):  # x: (B, T, 2)
        return self.out(torch.tanh(self.inp(x.transpose(0, 1))).mean(0))


def own_models():
    """Models whose parameters a layer-by-layer method could miscount, a custom forward and BatchNorm1d."""
    torch.manual_seed(0)
    batchnorm = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 3))
    batchnorm(torch.randn(16, 6, generator=torch.Generator().manual_seed(12)))
    models = {"custom forward": Model(residual, inp=nn.Linear(6, 5), norm=nn.LayerNorm(5), hidden=nn.Linear(5, 5),
                                      out=nn.Linear(5, 3)),
              "BatchNorm1d, eval mode": batchnorm.eval(),
              **{name: CASES[name][0] for name in ["frozen parameters", "one layer used twice", "a weight used outside its layer"]}}
    sequences = torch.randn(5, 5, 2, generator=torch.Generator().manual_seed(13), dtype=torch.float64)  # T = B = 5
    return {**{name: (model.double(), X) for name, model in models.items()},
            "a sequence-first layer, T = B": (SequenceFirst().double(), sequences)}


MODELS = {**ZOO, **own_models()}
# The estimators' tests solve for every eigenvalue (iterations = P): models with P below about 150.
SMALL = ["linear", "conv1d", "LayerNorm", *list(MODELS)[len(ZOO):]]
# ggn_diagonal cannot use the layers' products
GENERAL = ["one layer used twice", "a weight used outside its layer", "a sequence-first layer, T = B"]


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def flat(d):
    return torch.cat([t.reshape(-1) for t in d.values()])


def unflat(vector, model):
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return {n: piece.view(p.shape) for (n, p), piece in zip(named, vector.split([p.numel() for _, p in named]))}


def gradient(model, x, t, loss=F.cross_entropy):
    """The loss's gradient in every trainable parameter, flat, with its graph (for second derivatives)."""
    return torch.cat([a.reshape(-1) for a in torch.autograd.grad(loss(model(x), t), trainable(model), create_graph=True)])


def gauss_newton(model, x, t, loss=F.cross_entropy):
    """J (a row per output entry), the loss's Hessian H_L in the outputs, G = J^T H_L J, and the
    per-example gradients g (a row per example), by loops of autograd calls."""
    out = model(x)
    J = grad_rows(out, model)
    H_L = torch.autograd.functional.hessian(lambda o: loss(o.view(out.shape), t), out.detach().reshape(-1))
    g = torch.cat([grad_rows(loss(model(x[i:i + 1]), t[i:i + 1]), model) for i in range(len(x))])
    return J, H_L, J.T @ H_L @ J, g


def check_products(recipes, model, x, t, loss):
    """param_hvp against a double backward pass, ggn_vp and ggn_diagonal against G, on a random vector."""
    v = torch.randn(sum(p.numel() for p in trainable(model)), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    _, _, G, g = gauss_newton(model, x, t, loss)
    hv = recipes["param_hvp"](model, loss, x, t, unflat(v, model))
    assert list(hv) == [n for n, p in model.named_parameters() if p.requires_grad]
    assert close(flat(hv), grad_rows(gradient(model, x, t, loss) @ v, model)[0])
    assert close(flat(recipes["ggn_vp"](model, loss, x, t, unflat(v, model))), G @ v)
    assert close(flat(recipes["ggn_diagonal"](model, loss, x, t)), G.diagonal())
    return v, g


@pytest.mark.parametrize("name", list(MODELS))
def test_products(recipes, name):
    """The fused CPU attention kernel has no second derivative ("derivative for
    aten::_scaled_dot_product_flash_attention_for_cpu_backward is not implemented"): the math kernel has."""
    model, x = MODELS[name]
    with sdpa_kernel(SDPBackend.MATH):
        v, g = check_products(recipes, model, x, TARGETS, F.cross_entropy)
        fisher = recipes["empirical_fisher_vp"](model, F.cross_entropy, x, TARGETS, unflat(v, model))
        assert close(flat(fisher), g.T @ (g @ v) / len(x))


# Cross-entropy summed (the closed form's other weight), a loss the recipes cannot recognise (so the output Hessian
# comes from autograd and eigh), and label smoothing; class weights and ignored targets are refused (test_errors).
LOSSES = {
    "sum": (nn.CrossEntropyLoss(reduction="sum"), TARGETS),
    "a function of its own": (lambda o, t: F.cross_entropy(o, t), TARGETS),
    "label smoothing": (nn.CrossEntropyLoss(label_smoothing=0.1), TARGETS),
}


@pytest.mark.parametrize("loss_name", list(LOSSES))
def test_other_losses(recipes, loss_name):
    loss, t = LOSSES[loss_name]
    model, x = MODELS["custom forward"]
    v, g = check_products(recipes, model, x, t, loss)
    if loss_name == "sum":
        assert close(flat(recipes["empirical_fisher_vp"](model, loss, x, t, unflat(v, model))), g.T @ (g @ v))


@pytest.mark.parametrize("name", SMALL)
def test_estimators_eigenvalues_ggn_shares_gauss_newton_step_and_influence(recipes, name):
    model, x = MODELS[name]
    H = grad_rows(gradient(model, x, TARGETS), model)
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    probes = recipes["_rademacher"](params, 16, torch.Generator().manual_seed(4))
    V = torch.cat([probes[n].flatten(1) for n in params], dim=1)  # the same probes the estimators draw
    trace = recipes["hessian_trace"](model, F.cross_entropy, x, TARGETS, samples=16, generator=torch.Generator().manual_seed(4))
    assert close(torch.tensor(trace, dtype=torch.float64), torch.einsum("sp,pq,sq->s", V, H, V).mean())
    diagonal = recipes["hessian_diagonal"](model, F.cross_entropy, x, TARGETS, samples=16, chunk_size=5,
                                           generator=torch.Generator().manual_seed(4))
    assert close(flat(diagonal), (V * (V @ H)).mean(dim=0))
    top = recipes["top_hessian_eigenvalues"](model, F.cross_entropy, x, TARGETS, k=3, iterations=H.shape[0],
                                             generator=torch.Generator().manual_seed(5))
    assert close(top.values, torch.linalg.eigvalsh(H).flip(0)[:3], rtol=1e-9)
    assert top.vectors is None and (top.residuals < 1e-9 * top.values.abs().max()).all()
    J, H_L, G, g = gauss_newton(model, x, TARGETS)
    P, Y = H.shape[0], 3
    shares = recipes["ggn_diagonal"](model, F.cross_entropy, x, TARGETS, per_sample=True)
    loop = torch.stack([(J[Y * n:Y * n + Y].T @ H_L[Y * n:Y * n + Y, Y * n:Y * n + Y] @ J[Y * n:Y * n + Y]).diagonal()
                        for n in range(len(x))])
    assert close(torch.cat([s.flatten(1) for s in shares.values()], dim=1), loop)
    step = recipes["gauss_newton_step"](model, F.cross_entropy, x, TARGETS, damping=0.5)
    assert close(flat(step), -torch.linalg.solve(G + 0.5 * torch.eye(P, dtype=torch.float64), g.mean(dim=0)), rtol=1e-9)
    damping = max(0.0, -torch.linalg.eigvalsh(H)[0].item()) + 1.0
    x_test, t_test = x[:2] + 0.5, TARGETS[:2].flip(0)
    g_test = grad_rows(F.cross_entropy(model(x_test), t_test), model)[0]
    expected = g @ torch.linalg.solve(H + damping * torch.eye(P, dtype=torch.float64), g_test) / len(x)
    scores = recipes["influence_scores"](model, F.cross_entropy, x, TARGETS, x_test, t_test, damping=damping, tol=1e-13)
    assert close(scores, expected, rtol=1e-8)


def test_ggn_diagonal_takes_the_general_path_exactly_where_the_layers_cannot_rebuild(recipes, monkeypatch):
    """The layer-by-layer path serves ordinary models; a layer called twice, a weight used outside its module or a
    layer whose rows are not the examples sends the call to the vmap path (shown by making that path fail), and both paths agree with dense G above."""
    def refuse(*args):
        raise AssertionError("general path taken")

    monkeypatch.setattr(torch_func_recipes.curvature, "_ggn_diagonal_by_vmap", refuse)  # what ggn_diagonal calls
    for name in SMALL:
        model, x = MODELS[name]
        if name in GENERAL:
            with pytest.raises(AssertionError, match="general path taken"):
                recipes["ggn_diagonal"](model, F.cross_entropy, x, TARGETS)
        else:
            recipes["ggn_diagonal"](model, F.cross_entropy, x, TARGETS)  # no AssertionError: the layers path


def test_errors(recipes):
    model, x = MODELS["linear"]
    v = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    r, ce, not_scalar = recipes, F.cross_entropy, nn.CrossEntropyLoss(reduction="none")
    training_bn = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Linear(5, 3)).double()
    linear, concave = nn.Linear(6, 3).double(), lambda o, t: -(o**2).mean()  # a negative definite Hessian
    calls = [
        (lambda: r["param_hvp"](model, ce, x, TARGETS, {k: t for k, t in v.items() if k != "2.bias"}), "missing"),
        (lambda: r["ggn_vp"](model, ce, x, TARGETS, {**v, "extra": torch.zeros(1, dtype=torch.float64)}), "unexpected"),
        (lambda: r["param_hvp"](model, ce, x, TARGETS, {**v, "0.weight": torch.zeros(6, 5, dtype=torch.float64)}),
         r"vector\['0.weight'\] must be a \(5, 6\)"),
        (lambda: r["param_hvp"](model, ce, x, TARGETS, {**v, "0.bias": torch.zeros(5)}), "float64"),
        (lambda: r["param_hvp"](model, not_scalar, x, TARGETS, v), "scalar"),
        (lambda: r["ggn_vp"](model, not_scalar, x, TARGETS, v), "scalar"),
        (lambda: r["hessian_trace"](model, not_scalar, x, TARGETS, samples=2), "scalar"),
        (lambda: r["top_hessian_eigenvalues"](training_bn, ce, x, TARGETS), "BatchNorm in training mode"),
        (lambda: r["ggn_diagonal"](model, lambda o, t: ce(o, t) ** 2, x, TARGETS), "mean or a sum"),
        (lambda: r["ggn_diagonal"](model, nn.CrossEntropyLoss(weight=torch.rand(3, dtype=torch.float64) + 0.5), x, TARGETS),
         "mean or a sum"),
        (lambda: r["ggn_diagonal"](model, ce, x, torch.tensor([0, 2, -100, 1, 2])), "mean or a sum"),
        (lambda: r["ggn_diagonal"](mixing(lambda h: h - h.mean(0)).double(), ce, x, TARGETS), "mixes the examples"),
        (lambda: r["influence_scores"](linear, concave, x, TARGETS, x[:2], TARGETS[:2], damping=0.0), "non-positive curvature"),
        (lambda: r["hessian_trace"](model, ce, x, TARGETS, samples=0), "samples"),
        (lambda: r["top_hessian_eigenvalues"](model, ce, x, TARGETS, k=0), "k must be"),
        (lambda: r["gauss_newton_step"](model, ce, x, TARGETS, damping=0), "damping"),
        (lambda: r["param_hvp"](nn.Linear(6, 3).double().requires_grad_(False), ce, x, TARGETS, {}), "no parameters that require grad"),
    ]
    for call, message in calls:
        with pytest.raises(ValueError, match=message):
            call()
    with pytest.raises(TypeError, match="dict"):
        r["param_hvp"](model, ce, x, TARGETS, list(v.values()))


def test_conjugate_gradient_answers_when_its_last_iteration_reaches_tol_and_checks_its_arguments(recipes):
    """Exact arithmetic solves an n x n system in n iterations: with max_iterations = n the residual reached tol on
    the last one, which was never checked (a RuntimeError said tol was not reached). A tol below 0 made the target
    (tol |b|)^2 > 0 anyway, and with -1 the first check returned x = 0."""
    cg = recipes["conjugate_gradient"]
    A = torch.tensor([[4.0, 1.0], [1.0, 3.0]], dtype=torch.float64)
    b = torch.tensor([1.0, 2.0], dtype=torch.float64)
    assert close(cg(lambda v: A @ v, b, max_iterations=2), torch.linalg.solve(A, b))
    assert close(cg(lambda v: 2 * v, b, max_iterations=1), b / 2)
    with pytest.raises(RuntimeError, match="did not reach tol=1e-10 in 1 iterations"):
        cg(lambda v: A @ v, b, max_iterations=1)
    for tol in (-1.0, float("nan"), "1e-10", True):
        with pytest.raises(ValueError, match="tol must be a number >= 0"):
            cg(lambda v: A @ v, b, tol=tol)
    for limit in (-5, 1.5, True):
        with pytest.raises(ValueError, match="max_iterations must be an int >= 0 or None"):
            cg(lambda v: A @ v, b, max_iterations=limit)


def signed_squares(o, t):
    """A sum of per-example losses, each ||o_n - t_n||^2 signed by t_n's last entry: two copies of one example with
    opposite signs give two losses that add up to exactly zero."""
    return (t[:, -1] * ((o - t[:, :-1]) ** 2).sum(1)).sum()


def test_a_sum_whose_losses_add_up_to_zero_is_told_from_a_mean_by_its_gradients(recipes):
    """Mean or sum was read off the loss's value alone; with the examples' losses adding up to zero both fit, and
    the mean was taken: the empirical Fisher, ggn_diagonal and influence scores came out 1/B of the right ones. The
    loss's gradient in the outputs tells them apart."""
    model, x = MODELS["custom forward"]
    x = torch.cat([x[:1], x[:1]])
    t = torch.randn(1, 4, generator=torch.Generator().manual_seed(14), dtype=torch.float64).repeat(2, 1)
    t[:, -1] = torch.tensor([1.0, -1.0])
    assert signed_squares(model(x), t).item() == 0
    v, g = check_products(recipes, model, x, t, signed_squares)
    assert close(flat(recipes["empirical_fisher_vp"](model, signed_squares, x, t, unflat(v, model))), g.T @ (g @ v))


def test_the_reduction_comes_from_the_first_batch_that_tells_and_else_is_refused(recipes):
    """A squared hinge met by every example of the first batch: its losses and their gradients are all zero, so it
    cannot tell a sum from a mean, and the mean was taken (param_hvp, ggn_vp and ggn_diagonal half the right ones
    on two batches). The next batch tells; a batch that cannot tell on its own is refused where the weight of each
    example matters (ggn_vp and param_hvp of one batch need none)."""
    model, x = MODELS["custom forward"]

    def hinge(o, t):  # sum over the examples of the squared margins short of 10 (own class against the others)
        own = o.gather(1, t[:, None])
        return (torch.relu(10 - (own - o)) ** 2).scatter(1, t[:, None], 0.0).sum()

    with torch.no_grad():
        logits = model(x)
    met = logits.argmax(1)  # targets every example meets by any margin: scaled up, by more than 10
    scaled = Model(lambda m, x: 1e3 * m.inner(x), inner=model)
    assert hinge(scaled(x), met).item() == 0 and hinge(scaled(x), TARGETS).item() > 0
    data = [(x, met), (x, TARGETS)]
    both = (torch.cat([x, x]), torch.cat([met, TARGETS]))
    _, _, G, _ = gauss_newton(scaled, *both, loss=hinge)
    v = torch.randn(G.shape[0], generator=torch.Generator().manual_seed(15), dtype=torch.float64)
    assert close(flat(recipes["param_hvp"](scaled, hinge, data, None, unflat(v, scaled))),
                 grad_rows(gradient(scaled, *both, loss=hinge) @ v, scaled)[0])
    assert close(flat(recipes["ggn_vp"](scaled, hinge, data, None, unflat(v, scaled))), G @ v)
    assert close(flat(recipes["ggn_diagonal"](scaled, hinge, data, None)), G.diagonal())
    for call in (lambda: recipes["ggn_diagonal"](scaled, hinge, x, met),
                 lambda: recipes["empirical_fisher_vp"](scaled, hinge, [(x, met)], None, unflat(v, scaled))):
        with pytest.raises(ValueError, match="cannot tell whether loss_fn averages or sums"):  # the weight of each example
            call()


def test_eigenvalues_by_blocks_with_a_parameter_the_loss_does_not_reach(recipes):
    """A trainable parameter the loss does not use (or reads under no_grad): a batched backward pass with
    materialize_grads gave its zero product without the batch dimension, and Lanczos with k >= 2 (or block_size
    >= 2) failed inside torch ("mat1 and mat2 shapes cannot be multiplied"). Its row and column of H are zero."""
    model, x = MODELS["linear"]
    model = Model(lambda m, x: m.inner(x), inner=model, unused=nn.Linear(2, 2).double())
    H = torch.autograd.functional.hessian(lambda v: F.cross_entropy(torch.func.functional_call(model, unflat(v, model), (x,)), TARGETS),
                                          flat({n: p.detach() for n, p in model.named_parameters()}))
    found = recipes["top_hessian_eigenvalues"](model, F.cross_entropy, x, TARGETS, k=2)
    assert close(found.values, torch.linalg.eigvalsh(H).flip(0)[:2], rtol=1e-8)


def test_a_tuple_output_and_a_shuffled_loader_are_refused_where_they_would_fail_or_mislead(recipes):
    """The recipes that work in the outputs' space failed inside torch or Python on a model returning a tuple or a
    dict ("zeros_like(): argument 'input' must be Tensor, not tuple", "KeyError: None"); they say what they need,
    while param_hvp, which needs only the loss, answers. A DataLoader with shuffle=True gave influence scores in the
    last pass's order (1.45 off the data's order): refused where the answer has a row per example."""
    model, x = MODELS["linear"]
    pair = Model(lambda m, x: (m.inner(x), None), inner=model)
    first = lambda out, t: F.cross_entropy(out[0], t)  # noqa: E731
    v = {n: torch.ones_like(p) for n, p in pair.named_parameters()}
    calls = {"ggn_vp": lambda: recipes["ggn_vp"](pair, first, x, TARGETS, v),
             "empirical_fisher_vp": lambda: recipes["empirical_fisher_vp"](pair, first, x, TARGETS, v),
             "ggn_diagonal": lambda: recipes["ggn_diagonal"](pair, first, x, TARGETS),
             "gauss_newton_step": lambda: recipes["gauss_newton_step"](pair, first, x, TARGETS, damping=1.0),
             "influence_scores": lambda: recipes["influence_scores"](pair, first, x, TARGETS, x, TARGETS, damping=1.0)}
    for name, call in calls.items():
        with pytest.raises(ValueError, match=f"^{name} needs a model whose output is one tensor, .* returns a tuple"):
            call()
    plain = {n: torch.ones_like(p) for n, p in model.named_parameters()}
    assert close(flat(recipes["param_hvp"](pair, first, x, TARGETS, v)), flat(recipes["param_hvp"](model, F.cross_entropy, x, TARGETS, plain)))
    data = torch.utils.data.TensorDataset(x, TARGETS)
    shuffled = torch.utils.data.DataLoader(data, batch_size=2, shuffle=True)
    with pytest.raises(ValueError, match="draws them in a random order"):
        recipes["influence_scores"](model, F.cross_entropy, shuffled, None, x, TARGETS, damping=1.0)
    with pytest.raises(ValueError, match="draws them in a random order"):
        recipes["ggn_diagonal"](model, F.cross_entropy, shuffled, None, per_sample=True)
    in_order = torch.utils.data.DataLoader(data, batch_size=2)
    assert close(recipes["influence_scores"](model, F.cross_entropy, in_order, None, x, TARGETS, damping=1.0),
                 recipes["influence_scores"](model, F.cross_entropy, x, TARGETS, x, TARGETS, damping=1.0))
    assert close(flat(recipes["ggn_diagonal"](model, F.cross_entropy, shuffled, None)), flat(recipes["ggn_diagonal"](model, F.cross_entropy, x, TARGETS)))


def test_a_bfloat16_model_gets_its_eigenvalues_step_and_diagonal(recipes):
    """torch's eigh, qr and solve take no bfloat16 or float16 ("linalg_eigh_cpu" not implemented for 'BFloat16'):
    top_hessian_eigenvalues, gauss_newton_step and ggn_diagonal raised that from inside for a bfloat16 model. Their
    small dense linear algebra (the Lanczos basis and T, the output-space system, each example's output Hessian)
    now runs in float32. Each answer is within 2**-5 (eight bfloat16 roundings of 2**-8) of the same computation
    on the same weights and inputs in float64: the products themselves round in bfloat16 through the forward and
    both backward passes (0.2% to 1.1% seen)."""
    import copy

    torch.manual_seed(40)
    low = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(torch.bfloat16)
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(41)).to(torch.bfloat16)
    t = torch.randint(3, (16,), generator=torch.Generator().manual_seed(42))
    high = copy.deepcopy(low).double()
    loss = lambda o, t: F.cross_entropy(o.float() if o.dtype == torch.bfloat16 else o, t)  # noqa: E731
    calls = {
        "top_hessian_eigenvalues": lambda m, x: recipes["top_hessian_eigenvalues"](m, loss, x, t, k=3, generator=torch.Generator().manual_seed(0)).values,
        "gauss_newton_step": lambda m, x: recipes["gauss_newton_step"](m, loss, x, t, damping=0.1),
        "ggn_diagonal": lambda m, x: recipes["ggn_diagonal"](m, loss, x, t),
    }
    for name, call in calls.items():
        got, expected = call(low, x), call(high, x.double())
        if isinstance(got, dict):
            assert all(v.dtype == torch.bfloat16 for v in got.values()), name
            got, expected = (torch.cat([v.double().flatten() for v in r.values()]) for r in (got, expected))
        assert got.dtype in (torch.bfloat16, torch.float64)
        assert ((got.double() - expected).norm() / expected.norm()).item() < 2**-5, name
