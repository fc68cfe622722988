"""The curvature chapter's recipes (book/10_curvature.md), loaded from the chapter itself (its import cell and its
cells tagged `recipe`), checked in float64 on the CPU on several kinds of model (an MLP, a convolution, LayerNorm,
a custom forward, frozen parameters, buffers in eval mode) against dense matrices built by loops, and on their
error messages."""
import jupytext
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from bookcheck import BOOK

CHAPTER = BOOK / "10_curvature.md"


@pytest.fixture(scope="module")
def recipes():
    namespace = {}
    cells = [c for c in jupytext.read(CHAPTER).cells if c.cell_type == "code"]
    recipe_cells = [c for c in cells if "recipe" in c.metadata.get("tags", [])]
    assert len(recipe_cells) >= 5
    for cell in [cells[0], *recipe_cells]:  # the import cell, then every recipe
        exec(compile(cell.source, str(CHAPTER), "exec"), namespace)
    return namespace


def close(a, b, rtol=1e-10):
    torch.testing.assert_close(a, b, rtol=rtol, atol=1e-12)
    return True


class Residual(nn.Module):
    """A custom forward: a skip connection around a LayerNorm'd hidden layer."""

    def __init__(self):
        super().__init__()
        self.inp, self.norm, self.hidden, self.out = nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 5), nn.Linear(5, 3)

    def forward(self, x):
        h = self.norm(torch.tanh(self.inp(x)))
        return self.out(h + torch.sin(self.hidden(h)))


class SharedLayer(nn.Module):
    """One Linear called twice: the layer-by-layer GGN diagonal must not be used (each module once)."""

    def __init__(self):
        super().__init__()
        self.inp, self.shared, self.out = nn.Linear(6, 4), nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.shared(torch.tanh(self.shared(torch.tanh(self.inp(x)))))))


class TiedOutput(nn.Module):
    """A weight used inside its module and again outside it: the layers' products cannot rebuild the gradient."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(6, 3), nn.Linear(3, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        return self.out(h) + h @ self.inp.weight[:, :3]


def zoo():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    frozen = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4), nn.Sigmoid(), nn.Linear(4, 3))
    frozen[2].weight.requires_grad_(False)
    batchnorm = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 3))
    batchnorm(torch.randn(16, 6, generator=g))
    batchnorm.eval()
    models = {
        "MLP": (nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)), torch.randn(7, 6, generator=g)),
        "conv": (nn.Sequential(nn.Conv2d(1, 2, 3), nn.Tanh(), nn.Flatten(), nn.Linear(2 * 4 * 4, 3)),
                 torch.randn(7, 1, 6, 6, generator=g)),
        "LayerNorm": (nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.GELU(), nn.Linear(5, 3)), torch.randn(7, 6, generator=g)),
        "custom forward": (Residual(), torch.randn(7, 6, generator=g)),
        "frozen params": (frozen, torch.randn(7, 6, generator=g)),
        "BatchNorm, eval mode": (batchnorm, torch.randn(7, 6, generator=g)),
        "shared layer": (SharedLayer(), torch.randn(7, 6, generator=g)),
        "tied weight": (TiedOutput(), torch.randn(7, 6, generator=g)),
    }
    return {name: (model.double(), x.double()) for name, (model, x) in models.items()}


ZOO = zoo()
TARGETS = torch.randint(3, (7,), generator=torch.Generator().manual_seed(2))


def trainable(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def flat(d):
    return torch.cat([t.reshape(-1) for t in d.values()])


def unflat(vector, model):
    out, start = {}, 0
    for name, p in trainable(model):
        out[name], start = vector[start:start + p.numel()].view(p.shape), start + p.numel()
    return out


def dense_hessian(model, x, t):
    params = [p for _, p in trainable(model)]
    g = torch.cat([a.reshape(-1) for a in torch.autograd.grad(F.cross_entropy(model(x), t), params, create_graph=True)])
    return torch.stack([torch.cat([a.reshape(-1) for a in torch.autograd.grad(g[j], params, retain_graph=True,
                                                                             materialize_grads=True)]) for j in range(len(g))])


def dense_ggn(model, x, t):
    params = [p for _, p in trainable(model)]
    out = model(x)
    rows = out.reshape(-1)
    J = torch.stack([torch.cat([a.reshape(-1) for a in torch.autograd.grad(rows[k], params, retain_graph=True,
                                                                          materialize_grads=True)]) for k in range(len(rows))])
    H_L = torch.autograd.functional.hessian(lambda o: F.cross_entropy(o.view(out.shape), t), out.detach().reshape(-1))
    return J, H_L, J.T @ H_L @ J


def per_example_gradients(model, x, t):
    params = [p for _, p in trainable(model)]
    return torch.stack([torch.cat([a.reshape(-1) for a in torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), t[i:i + 1]),
                                                                              params, materialize_grads=True)])
                        for i in range(len(x))])


@pytest.mark.parametrize("name", list(ZOO))
def test_products(recipes, name):
    model, x = ZOO[name]
    H = dense_hessian(model, x, TARGETS)
    _, _, G = dense_ggn(model, x, TARGETS)
    g = per_example_gradients(model, x, TARGETS)
    v = torch.randn(H.shape[0], generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    vector = unflat(v, model)
    hv = recipes["param_hvp"](model, F.cross_entropy, x, TARGETS, vector)
    assert list(hv) == [n for n, _ in trainable(model)]
    assert close(flat(hv), H @ v)
    assert close(flat(recipes["ggn_vp"](model, F.cross_entropy, x, TARGETS, vector)), G @ v)
    assert close(flat(recipes["empirical_fisher_vp"](model, F.cross_entropy, x, TARGETS, vector)), g.T @ (g @ v) / len(x))


@pytest.mark.parametrize("name", list(ZOO))
def test_estimators_and_eigenvalues(recipes, name):
    model, x = ZOO[name]
    H = dense_hessian(model, x, TARGETS)
    P = H.shape[0]
    params = {n: p.detach() for n, p in trainable(model)}
    probes = recipes["_rademacher"](params, 16, torch.Generator().manual_seed(4))
    V = torch.cat([probes[n].flatten(1) for n in params], dim=1)  # the same probes the estimators draw
    trace = recipes["hessian_trace"](model, F.cross_entropy, x, TARGETS, samples=16, generator=torch.Generator().manual_seed(4))
    assert close(torch.tensor(trace, dtype=torch.float64), torch.einsum("sp,pq,sq->s", V, H, V).mean())
    diagonal = recipes["hessian_diagonal"](model, F.cross_entropy, x, TARGETS, samples=16, chunk_size=5,
                                           generator=torch.Generator().manual_seed(4))
    assert close(flat(diagonal), (V * (V @ H)).mean(dim=0))
    top = recipes["top_hessian_eigenvalues"](model, F.cross_entropy, x, TARGETS, k=3, iterations=P,
                                             generator=torch.Generator().manual_seed(5))
    assert close(top, torch.linalg.eigvalsh(H).flip(0)[:3], rtol=1e-9)


@pytest.mark.parametrize("name", list(ZOO))
def test_ggn_diagonal_gauss_newton_step_and_influence(recipes, name):
    model, x = ZOO[name]
    H = dense_hessian(model, x, TARGETS)
    J, H_L, G = dense_ggn(model, x, TARGETS)
    Y = 3
    assert close(flat(recipes["ggn_diagonal"](model, F.cross_entropy, x, TARGETS)), G.diagonal())
    # any loss: the output Hessian from autograd and eigh instead of cross-entropy's closed form
    generic = recipes["ggn_diagonal"](model, lambda o, t: F.cross_entropy(o, t), x, TARGETS)
    assert close(flat(generic), G.diagonal())
    shares = recipes["ggn_diagonal"](model, F.cross_entropy, x, TARGETS, per_sample=True)
    loop = torch.stack([(J[Y * n:Y * n + Y].T @ H_L[Y * n:Y * n + Y, Y * n:Y * n + Y] @ J[Y * n:Y * n + Y]).diagonal()
                        for n in range(len(x))])
    assert close(torch.cat([s.flatten(1) for s in shares.values()], dim=1), loop)
    g = per_example_gradients(model, x, TARGETS)
    P = H.shape[0]
    step = recipes["gauss_newton_step"](model, F.cross_entropy, x, TARGETS, damping=0.5)
    assert close(flat(step), -torch.linalg.solve(G + 0.5 * torch.eye(P, dtype=torch.float64), g.mean(dim=0)), rtol=1e-9)
    damping = max(0.0, -torch.linalg.eigvalsh(H)[0].item()) + 1.0
    x_test, t_test = x[:2] + 0.5, TARGETS[:2].flip(0)
    g_test = torch.cat([a.reshape(-1) for a in torch.autograd.grad(F.cross_entropy(model(x_test), t_test),
                                                                   [p for _, p in trainable(model)], materialize_grads=True)])
    expected = g @ torch.linalg.solve(H + damping * torch.eye(P, dtype=torch.float64), g_test) / len(x)
    scores = recipes["influence_scores"](model, F.cross_entropy, x, TARGETS, x_test, t_test, damping=damping, tol=1e-13)
    assert close(scores, expected, rtol=1e-8)


def test_a_sum_reduced_loss(recipes):
    model, x = ZOO["MLP"]
    summed = lambda o, t: F.cross_entropy(o, t, reduction="sum")
    _, _, G = dense_ggn(model, x, TARGETS)
    v = torch.randn(G.shape[0], generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    g = per_example_gradients(model, x, TARGETS)
    assert close(flat(recipes["ggn_diagonal"](model, summed, x, TARGETS)), len(x) * G.diagonal())
    assert close(flat(recipes["ggn_diagonal"](model, nn.CrossEntropyLoss(reduction="sum"), x, TARGETS)), len(x) * G.diagonal())
    assert close(flat(recipes["empirical_fisher_vp"](model, summed, x, TARGETS, unflat(v, model))), g.T @ (g @ v))


def test_errors(recipes):
    model, x = ZOO["MLP"]
    v = {n: torch.zeros_like(p) for n, p in trainable(model)}
    with pytest.raises(ValueError, match="missing"):
        recipes["param_hvp"](model, F.cross_entropy, x, TARGETS, {k: t for k, t in v.items() if k != "2.bias"})
    with pytest.raises(ValueError, match="unexpected"):
        recipes["ggn_vp"](model, F.cross_entropy, x, TARGETS, {**v, "extra": torch.zeros(1, dtype=torch.float64)})
    with pytest.raises(ValueError, match=r"vector\['0.weight'\] must be a \(5, 6\)"):
        recipes["param_hvp"](model, F.cross_entropy, x, TARGETS, {**v, "0.weight": torch.zeros(6, 5, dtype=torch.float64)})
    with pytest.raises(ValueError, match="float64"):
        recipes["param_hvp"](model, F.cross_entropy, x, TARGETS, {**v, "0.bias": torch.zeros(5)})
    with pytest.raises(TypeError, match="dict"):
        recipes["param_hvp"](model, F.cross_entropy, x, TARGETS, list(v.values()))
    not_scalar = nn.CrossEntropyLoss(reduction="none")
    for call in (lambda: recipes["param_hvp"](model, not_scalar, x, TARGETS, v),
                 lambda: recipes["ggn_vp"](model, not_scalar, x, TARGETS, v),
                 lambda: recipes["hessian_trace"](model, not_scalar, x, TARGETS, samples=2)):
        with pytest.raises(ValueError, match="scalar"):
            call()
    training_bn = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Linear(5, 3)).double()
    with pytest.raises(ValueError, match="BatchNorm in training mode"):
        recipes["top_hessian_eigenvalues"](training_bn, F.cross_entropy, x, TARGETS)
    with pytest.raises(ValueError, match="mean or a sum"):
        recipes["ggn_diagonal"](model, lambda o, t: F.cross_entropy(o, t) ** 2, x, TARGETS)
    linear, concave = nn.Linear(6, 3).double(), lambda o, t: -(o**2).mean()  # a negative definite Hessian
    with pytest.raises(ValueError, match="non-positive curvature"):
        recipes["influence_scores"](linear, concave, x, TARGETS, x[:2], TARGETS[:2], damping=0.0)
    with pytest.raises(ValueError, match="samples"):
        recipes["hessian_trace"](model, F.cross_entropy, x, TARGETS, samples=0)
    with pytest.raises(ValueError, match="k must be"):
        recipes["top_hessian_eigenvalues"](model, F.cross_entropy, x, TARGETS, k=0)
    with pytest.raises(ValueError, match="damping"):
        recipes["gauss_newton_step"](model, F.cross_entropy, x, TARGETS, damping=0)
    frozen = nn.Linear(6, 3).double().requires_grad_(False)
    with pytest.raises(ValueError, match="no parameters that require grad"):
        recipes["param_hvp"](frozen, F.cross_entropy, x, TARGETS, {})


def test_ggn_diagonal_takes_the_general_path_exactly_where_the_layers_cannot_rebuild(recipes, monkeypatch):
    """The layer-by-layer path serves ordinary models; a layer called twice or a weight used outside its module
    sends the call to the vmap path (shown by making that path fail), and both paths agree with dense G."""
    def refuse(*args):
        raise AssertionError("general path taken")

    monkeypatch.setitem(recipes, "_ggn_diagonal_by_vmap", refuse)
    for name in ["MLP", "conv", "LayerNorm", "custom forward", "frozen params", "BatchNorm, eval mode"]:
        model, x = ZOO[name]
        recipes["ggn_diagonal"](model, F.cross_entropy, x, TARGETS)  # no AssertionError: the layers path
    for name in ["shared layer", "tied weight"]:
        model, x = ZOO[name]
        with pytest.raises(AssertionError, match="general path taken"):
            recipes["ggn_diagonal"](model, F.cross_entropy, x, TARGETS)


def test_cross_entropy_closed_form_factors(recipes):
    """S S^T = diag(p) - p p^T (times w) for the closed form, and the same matrices from autograd and eigh."""
    outputs = torch.randn(5, 4, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    targets = torch.tensor([0, 3, 1, 1, 2])
    for loss_fn, w in [(F.cross_entropy, 1 / 5), (nn.CrossEntropyLoss(reduction="sum"), 1.0)]:
        assert recipes["_cross_entropy_reduction"](loss_fn, outputs, targets) is not None
        for fn in (loss_fn, lambda o, t: loss_fn(o, t)):  # the closed form, then the general route
            lam, U = recipes["_output_hessian_factors"](fn, outputs, targets)
            p = torch.softmax(outputs, dim=1)
            for n in range(5):
                expected = w * (torch.diag(p[n]) - torch.outer(p[n], p[n]))
                assert close(torch.einsum("k,ki,kj->ij", lam[:, n], U[:, n], U[:, n]), expected)
    # cross-entropy with label smoothing, class weights or ignored targets is not the closed form's loss
    for other in (nn.CrossEntropyLoss(label_smoothing=0.1), nn.CrossEntropyLoss(weight=torch.ones(4, dtype=torch.float64))):
        assert recipes["_cross_entropy_reduction"](other, outputs, targets) is None
    assert recipes["_cross_entropy_reduction"](F.cross_entropy, outputs, torch.tensor([0, 3, -100, 1, 2])) is None


def test_ggn_diagonal_refuses_a_model_that_mixes_examples(recipes):
    class MinusBatchMean(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 3)

        def forward(self, x):
            return self.lin(x - x.mean(dim=0))

    model, x = MinusBatchMean().double(), ZOO["MLP"][1]
    with pytest.raises(ValueError, match="mixes the examples"):
        recipes["ggn_diagonal"](model, F.cross_entropy, x, TARGETS)
