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


def own_models():
    """Models whose parameters a layer-by-layer method could miscount, a custom forward and BatchNorm1d."""
    torch.manual_seed(0)
    batchnorm = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 3))
    batchnorm(torch.randn(16, 6, generator=torch.Generator().manual_seed(12)))
    models = {"custom forward": Model(residual, inp=nn.Linear(6, 5), norm=nn.LayerNorm(5), hidden=nn.Linear(5, 5),
                                      out=nn.Linear(5, 3)),
              "BatchNorm1d, eval mode": batchnorm.eval(),
              **{name: CASES[name][0] for name in ["frozen parameters", "one layer used twice", "a weight used outside its layer"]}}
    return {name: (model.double(), X) for name, model in models.items()}


MODELS = {**ZOO, **own_models()}
# The estimators' tests solve for every eigenvalue (iterations = P): models with P below about 150.
SMALL = ["linear", "conv1d", "LayerNorm", *list(MODELS)[len(ZOO):]]
GENERAL = ["one layer used twice", "a weight used outside its layer"]  # ggn_diagonal cannot use the layers' products


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
    """The layer-by-layer path serves ordinary models; a layer called twice or a weight used outside its module
    sends the call to the vmap path (shown by making that path fail), and both paths agree with dense G above."""
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
