"""Every recipe in the recipe box, exercised on models beyond its chapter's example (linear, 1-D and
2-D convolutions, an embedding, LayerNorm, GroupNorm, a small attention block, a model with buffers
in eval mode), in float64 on the CPU, against plain loops."""
import copy

import jupytext
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from bookcheck import BOOK

BOX = BOOK / "08_recipe_box.md"


@pytest.fixture(scope="module")
def recipes():
    namespace = {}
    cells = [c for c in jupytext.read(BOX).cells if c.cell_type == "code"]
    for cell in cells:  # the import cell, then every recipe
        exec(compile(cell.source, str(BOX), "exec"), namespace)
    return namespace


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    return True


class AttentionBlock(nn.Module):
    """A small self-attention block on (B, T, E) sequences, then a linear head on the mean token."""

    def __init__(self):
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.norm, self.head = nn.LayerNorm(8), nn.Linear(8, 3)

    def forward(self, x):
        h = self.norm(x + self.attention(x, x, x, need_weights=False)[0])
        return self.head(h.mean(dim=1))


def zoo():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    bn = nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 6 * 6, 3))
    bn(torch.randn(8, 1, 8, 8, generator=g))
    bn.eval()
    models = {
        "linear": (nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)), torch.randn(5, 6, generator=g)),
        "conv1d": (nn.Sequential(nn.Conv1d(2, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 9, 3)),
                   torch.randn(5, 2, 9, generator=g)),
        "conv2d": (nn.Sequential(nn.Conv2d(1, 4, 3, stride=2), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 3 * 3, 3)),
                   torch.randn(5, 1, 8, 8, generator=g)),
        "embedding": (nn.Sequential(nn.Embedding(11, 4), nn.Flatten(), nn.Linear(12, 3)), torch.randint(11, (5, 3), generator=g)),
        "LayerNorm": (nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3)), torch.randn(5, 6, generator=g)),
        "GroupNorm": (nn.Sequential(nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)),
                      torch.randn(5, 1, 8, 8, generator=g)),
        "attention": (AttentionBlock(), torch.randn(5, 4, 8, generator=g)),
        "buffers, eval mode": (bn, torch.randn(5, 1, 8, 8, generator=g)),
    }
    return {name: (model.double(), x.double() if x.is_floating_point() else x) for name, (model, x) in models.items()}


ZOO = zoo()
TARGETS = torch.randint(3, (5,), generator=torch.Generator().manual_seed(2))


def loop_per_sample(model, x, t):
    params = [p for p in model.parameters() if p.requires_grad]
    rows = [torch.autograd.grad(F.cross_entropy(model(xi[None]), ti[None]), params) for xi, ti in zip(x, t)]
    return {n: torch.stack([r[i] for r in rows]) for i, (n, _) in enumerate(m for m in model.named_parameters() if m[1].requires_grad)}


def loop_output_jacobian(model, x):
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for xi in x:
        out = model(xi[None])[0]
        rows.append(torch.stack([torch.cat([g.flatten() for g in torch.autograd.grad(out[j], params, retain_graph=True)])
                                 for j in range(out.shape[0])]))
    return torch.stack(rows)


@pytest.mark.parametrize("name", list(ZOO))
def test_per_sample_grads(recipes, name):
    model, x = ZOO[name]
    expected = loop_per_sample(model, x, TARGETS)
    got = recipes["per_sample_grads"](model, F.cross_entropy, x, TARGETS)
    assert all(close(got[k], expected[k]) for k in expected)
    general = recipes["per_sample_grads"](model, F.cross_entropy, x, TARGETS, path="general")
    assert all(close(general[k], expected[k]) for k in expected)
    chunked = recipes["per_sample_grads"](model, F.cross_entropy, x, TARGETS, chunk_size=2)
    assert all(close(chunked[k], expected[k]) for k in expected)


@pytest.mark.parametrize("name", list(ZOO))
def test_output_jacobians_and_ntk(recipes, name):
    model, x = ZOO[name]
    expected = loop_output_jacobian(model, x)
    assert close(recipes["output_jacobian"](model, x), expected)
    assert close(recipes["output_jacobian"](model, x, chunk_size=2), expected)
    assert close(recipes["output_jacobian"](model, x, path="general"), expected)
    pieces = recipes["split_by_parameter"](expected, model)
    assert list(pieces) == [n for n, p in model.named_parameters() if p.requires_grad]
    assert all(piece.shape[2:] == p.shape for piece, p in zip(pieces.values(), model.parameters()))
    ntk = recipes["empirical_ntk"](model, x[:3], x[3:])
    assert close(ntk, torch.einsum("aip,bjp->abij", expected[:3], expected[3:]))


@pytest.mark.parametrize("name", list(ZOO))
def test_stack_models(recipes, name):
    model, x = ZOO[name]
    members = [copy.deepcopy(model) for _ in range(3)]
    for k, member in enumerate(members):  # make the members differ
        with torch.no_grad():
            for p in member.parameters():
                p.add_(0.1 * k)
    forward, params, buffers = recipes["stack_models"](members)
    assert close(forward(params, buffers, x), torch.stack([m(x) for m in members]))


def test_clip_and_noise(recipes):
    model, x = ZOO["conv2d"]
    per_sample = loop_per_sample(model, x, TARGETS)
    norms = torch.stack([torch.cat([g[i].flatten() for g in per_sample.values()]).norm() for i in range(len(x))])
    max_norm = norms.median().item()
    got = recipes["clip_and_noise"](per_sample, max_norm, 0.0)
    scale = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    assert all(close(got[k], sum(scale[i] * g[i] for i in range(len(x))) / len(x)) for k, g in per_sample.items())


def test_pairwise_jacobian_hvp(recipes):
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(4, 6, generator=g, dtype=torch.float64), torch.randn(5, 6, generator=g, dtype=torch.float64)
    cosine = lambda u, v: torch.dot(u, v) / (u.norm() * v.norm())
    assert close(recipes["pairwise"](cosine)(a, b), torch.stack([torch.stack([cosine(u, v) for v in b]) for u in a]))
    f = lambda m: torch.tanh(m @ m.T).sum(dim=0)  # a matrix in, a vector out
    m = torch.randn(3, 4, generator=g, dtype=torch.float64)
    assert close(recipes["jacobian_via_vjp"](f, m), torch.autograd.functional.jacobian(f, m))
    assert close(recipes["jacobian_via_vjp"](f, m, chunk_size=2), torch.autograd.functional.jacobian(f, m))
    scalar = lambda m: torch.logsumexp(f(m), dim=0)
    v = torch.randn(3, 4, generator=g, dtype=torch.float64)
    hessian = torch.autograd.functional.hessian(scalar, m).reshape(12, 12)
    assert close(recipes["hvp"](scalar, m, v), (hessian @ v.reshape(12)).reshape(3, 4))


def ensemble_members(name, count=3):
    """`count` copies of a zoo model whose floating-point parameters differ."""
    model, _ = ZOO[name]
    members = [copy.deepcopy(model) for _ in range(count)]
    for k, member in enumerate(members):
        with torch.no_grad():
            for p in member.parameters():
                p.add_(0.1 * k)
    return members


@pytest.mark.parametrize("name", list(ZOO))
def test_stack_models_one_batch_per_model(recipes, name):
    """in_dims=(0, 0, 0): model i sees its own batch xs[i]."""
    _, x = ZOO[name]
    members = ensemble_members(name)
    xs = torch.stack([x.roll(k, dims=0) for k in range(len(members))])
    forward, params, buffers = recipes["stack_models"](members)
    assert close(forward(params, buffers, xs, per_model_batches=True), torch.stack([m(xi) for m, xi in zip(members, xs)]))


@pytest.mark.parametrize("name", list(ZOO))
def test_stack_models_gradients(recipes, name):
    """The gradient of the summed per-model losses, sliced at model i, is model i's own gradient."""
    _, x = ZOO[name]
    members = ensemble_members(name)
    forward, params, buffers = recipes["stack_models"](members)
    trainable = {n: p for n, p in params.items() if p.requires_grad}
    losses = torch.vmap(F.cross_entropy, in_dims=(0, None))(forward(params, buffers, x), TARGETS)
    stacked = dict(zip(trainable, torch.autograd.grad(losses.sum(), list(trainable.values()))))
    for i, member in enumerate(members):
        named = [(n, p) for n, p in member.named_parameters() if p.requires_grad]
        own = torch.autograd.grad(F.cross_entropy(member(x), TARGETS), [p for _, p in named])
        assert all(close(stacked[n][i], g) for (n, _), g in zip(named, own))


def test_stack_models_ignores_later_changes_to_model_zero(recipes):
    """The ensemble keeps the mode the models had when stacked: model 0 switched to train mode
    afterwards (BatchNorm would then use batch statistics) does not change its output."""
    _, x = ZOO["buffers, eval mode"]
    members = ensemble_members("buffers, eval mode")
    forward, params, buffers = recipes["stack_models"](members)
    before = forward(params, buffers, x)
    members[0].train()
    assert torch.equal(forward(params, buffers, x), before)
    members[0].eval()
    assert close(before, torch.stack([m(x) for m in members]))


def test_stack_models_refuses_mixed_modes(recipes):
    members = ensemble_members("buffers, eval mode")
    members[1].train()
    with pytest.raises(ValueError, match="train/eval mode"):
        recipes["stack_models"](members)
