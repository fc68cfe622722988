"""Any model the loop can run gets the loop's answer (issue 25, item 3): a forward that decides in Python on
the data, as Hugging Face models do with a 2-D attention mask (`if not mask.all(): ...`), cannot run under
vmap, which refuses data-dependent control flow; every per-example recipe then runs the loop, says so, and
equals the per-example loop in float64."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_func_recipes as tfr


class MaskedMean(nn.Module):
    """Token features, a mask applied only when some token is padding (a Python `if` on the data), a
    LayerNorm and a linear head on the masked mean."""

    def __init__(self):
        super().__init__()
        self.embed, self.norm, self.head = nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 3)

    def forward(self, x, attention_mask):
        h = self.norm(torch.tanh(self.embed(x)))
        if not attention_mask.all():  # data-dependent control flow
            h = h * attention_mask[..., None]
        return self.head(h.sum(1) / attention_mask.sum(1, keepdim=True))


def batch():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 6, 4, generator=g, dtype=torch.float64)
    mask = torch.ones(5, 6, dtype=torch.float64)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    return x, mask, torch.randint(3, (5,), generator=g)


def loop_grads(model, x, mask, y):
    params = [p for p in model.parameters() if p.requires_grad]
    return [torch.autograd.grad(F.cross_entropy(model(x[n:n + 1], mask[n:n + 1]), y[n:n + 1]), params) for n in range(len(x))]


@pytest.fixture
def model():
    torch.manual_seed(0)
    return MaskedMean().double()


def test_vmap_refuses_the_model_and_the_loop_runs_it(model):
    x, mask, y = batch()
    params = {n: p.detach() for n, p in model.named_parameters()}
    loss = lambda p, x1, m1, y1: F.cross_entropy(torch.func.functional_call(model, p, (x1[None], m1[None])), y1[None])
    with pytest.raises(RuntimeError):  # the plain transform cannot run it: what the recipes must get past
        torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0, 0))(params, x, mask, y)
    assert len(loop_grads(model, x, mask, y)) == 5


def test_every_per_example_recipe_equals_the_loop(model):
    x, mask, y = batch()
    rows = loop_grads(model, x, mask, y)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    expected = {name: torch.stack([row[i] for row in rows]) for i, name in enumerate(names)}
    grads, how = tfr.per_sample_grads(model, F.cross_entropy, (x, mask), y, report=True)
    assert how.path == "loop" and how.reason.startswith("vmap raised RuntimeError")
    assert all(torch.allclose(grads[k], expected[k], rtol=1e-12, atol=0) for k in expected)

    norms_expected = torch.stack([torch.cat([g.flatten() for g in row]).norm() for row in rows])
    norms, how = tfr.per_sample_grad_norms(model, F.cross_entropy, (x, mask), y, report=True)
    assert how.path == "loop" and torch.allclose(norms, norms_expected, rtol=1e-12, atol=0)

    C = norms_expected.median().item()
    scale = (C / (norms_expected + 1e-6)).clamp(max=1.0)
    clipped_expected = {k: (scale.view(-1, *[1] * (v.dim() - 1)) * v).sum(0) / 5 for k, v in expected.items()}
    step, how = tfr.clipped_noisy_gradient(model, F.cross_entropy, (x, mask), y, max_norm=C, noise_multiplier=0.0, report=True)
    assert how.path == "loop" and all(torch.allclose(step[k], clipped_expected[k], rtol=1e-12, atol=1e-15) for k in step)

    J, how = tfr.output_jacobian(model, (x, mask), report=True)
    params = [p for p in model.parameters() if p.requires_grad]
    J_expected = torch.stack([torch.stack([torch.cat([g.flatten() for g in torch.autograd.grad(out[k], params, retain_graph=True)])
                                           for k in range(3)]) for out in (model(x[n:n + 1], mask[n:n + 1])[0] for n in range(5))])
    assert how.path == "loop" and torch.allclose(J, J_expected, rtol=1e-12, atol=1e-15)


def test_the_comparison_catches_a_wrong_example(model):
    """The check above can fail: the loop's gradients with one example's mask dropped differ from the recipe's."""
    x, mask, y = batch()
    grads = tfr.per_sample_grads(model, F.cross_entropy, (x, mask), y)
    wrong = loop_grads(model, x, torch.ones_like(mask), y)  # example 1 and 3 without their padding
    assert not torch.allclose(grads["head.weight"][1], wrong[1][-2])
