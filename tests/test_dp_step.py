"""The DP step keeps its clipping bound on a model that is random in training mode (issue 25, item 1).

DP-SGD's privacy rests on one fact: each example adds at most max_norm to the clipped sum. With dropout in
training mode, an example's gradient depends on the mask its forward pass drew; if the norm came from one
forward pass and the reweighted gradient from another, the weight min(1, C / n_i) would belong to another
mask, and the contribution could exceed C (on the package before this test, by up to 36% with B = 1). So
clipped_grad_sum and clipped_noisy_gradient take each example's norm and gradient from one forward pass,
on every path, and refuse norms= from elsewhere on such a model.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_func_recipes as tfr

PATHS = ["auto", "vmap", "loop"]
C = 1e-3  # far below any example's gradient norm here, so every example is clipped


def dropout_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 3)).double()


def data(batch, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 10, generator=g, dtype=torch.float64), torch.randint(3, (batch,), generator=g)


def flat_norm(grads):
    return torch.cat([g.flatten() for g in grads.values()]).norm().item()


@pytest.mark.parametrize("path", PATHS)
def test_one_clipped_example_has_norm_max_norm_whatever_the_mask(path):
    """B = 1: the clipped sum is that example's gradient scaled to norm C (times n / (n + 1e-6)), for every draw."""
    model, (x, y) = dropout_model(), data(1)
    seen = []
    for draw in range(6):
        torch.manual_seed(100 + draw)  # another mask on each call
        clipped, how = tfr.clipped_grad_sum(model, F.cross_entropy, x, y, max_norm=C, path=path, report=True)
        norm = flat_norm(clipped)
        assert C * (1 - 1e-5) <= norm <= C * (1 + 1e-12), (draw, norm)
        seen.append(how.path)
    assert seen == [{"auto": "fast"}.get(path, path)] * 6  # the fast path covers Dropout: the check is of the trace, too


@pytest.mark.parametrize("path", PATHS)
def test_every_example_adds_at_most_max_norm(path):
    """B = 8, one example at a time made the only one with a loss (the others weighted by 0): the sum is then
    that example's clipped contribution, drawn with the whole batch's masks, and its norm is at most C."""
    model, (x, y) = dropout_model(), data(8)
    weighted = lambda out, targets: targets[1].to(out.dtype).squeeze() * F.cross_entropy(out, targets[0])
    for k in range(8):
        only_k = (torch.arange(8) == k).double()
        for draw in range(3):
            torch.manual_seed(10 * k + draw)
            clipped = tfr.clipped_grad_sum(model, weighted, x, (y, only_k), max_norm=C, path=path)
            assert flat_norm(clipped) <= C * (1 + 1e-12), (k, draw, flat_norm(clipped))


def test_the_noisy_step_keeps_the_bound_and_equals_the_loop_without_randomness():
    """With the noise off and B = 1, the step's norm is C / B; and on the same model in eval mode (no randomness),
    every path gives the loop's clipped mean."""
    model, (x, y) = dropout_model(), data(1)
    for draw in range(4):
        torch.manual_seed(draw)
        step = tfr.clipped_noisy_gradient(model, F.cross_entropy, x, y, max_norm=C, noise_multiplier=0.0)
        assert C * (1 - 1e-5) <= flat_norm(step) <= C * (1 + 1e-12)
    model.eval()
    x, y = data(6)
    names, params = zip(*model.named_parameters())
    rows = [torch.autograd.grad(F.cross_entropy(model(x[n:n + 1]), y[n:n + 1]), params) for n in range(6)]
    norms = torch.stack([torch.cat([g.flatten() for g in row]).norm() for row in rows])
    scale = (0.05 / (norms + 1e-6)).clamp(max=1.0)
    expected = {name: sum(s * row[i] for s, row in zip(scale, rows)) / 6 for i, name in enumerate(names)}
    for path in PATHS:
        got = tfr.clipped_noisy_gradient(model, F.cross_entropy, x, y, max_norm=0.05, noise_multiplier=0.0, path=path)
        assert all(torch.allclose(got[k], expected[k], rtol=1e-10, atol=1e-14) for k in expected), path
        chunked = tfr.clipped_grad_sum(model, F.cross_entropy, x, y, max_norm=0.05, path=path, chunk_size=4)
        assert all(torch.allclose(chunked[k] / 6, expected[k], rtol=1e-10, atol=1e-14) for k in expected), path


def test_norms_from_another_pass_are_refused_on_a_random_model():
    model, (x, y) = dropout_model(), data(4)
    norms = tfr.per_sample_grad_norms(model, F.cross_entropy, x, y)
    with pytest.raises(ValueError, match=r"norms were given, but 2 \(Dropout\) is random in training mode"):
        tfr.clipped_grad_sum(model, F.cross_entropy, x, y, max_norm=C, norms=norms)
    model.eval()  # no randomness: the norms of another pass are this pass's
    tfr.clipped_grad_sum(model, F.cross_entropy, x, y, max_norm=C, norms=tfr.per_sample_grad_norms(model, F.cross_entropy, x, y))


def test_the_bound_check_catches_norms_from_another_forward_pass():
    """What the tests above guard against, shown to be caught: the weights of one forward pass applied to the
    gradient of another (the package before this change) break the bound for some draw."""
    model, (x, y) = dropout_model(), data(1)
    worst = 0.0
    for draw in range(6):
        torch.manual_seed(100 + draw)
        norm = tfr.per_sample_grad_norms(model, F.cross_entropy, x, y)  # one forward pass
        loss = F.cross_entropy(model(x), y)  # another forward pass: another mask
        grads = torch.autograd.grad(loss, list(model.parameters()))
        scale = (C / (norm + 1e-6)).clamp(max=1.0)
        worst = max(worst, scale.item() * torch.cat([g.flatten() for g in grads]).norm().item())
    assert worst > C * 1.01


def test_the_step_keeps_a_layers_per_example_gradients_when_they_are_no_larger_than_its_output_gradient(monkeypatch):
    """A linear layer on T = d_in tokens has per-example weight gradients exactly as large as its output gradient:
    the step keeps them (one product, then a weighted sum: 1/T of the weight product more) rather than the output
    gradient and pairs of tokens (which cost 1.25 times the product on ConvNeXt's pointwise layers). The bias's
    share, 1/T of the output gradient, is not held against it: counting it too, this layer kept its output gradient.
    The clipped sum equals the loop's either way."""
    from torch_func_recipes import per_sample

    kept = []
    small_shares = per_sample._small_shares
    monkeypatch.setattr(per_sample, "_small_shares", lambda *args: kept.append(small_shares(*args)) or kept[-1])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x, y = torch.randn(5, 6, 6, dtype=torch.float64), torch.randint(3, (5,), generator=torch.Generator().manual_seed(1))
    loss = lambda out, t: F.cross_entropy(out.mean(1), t)  # noqa: E731
    clipped, how = tfr.clipped_grad_sum(model, loss, x, y, max_norm=C, report=True)
    assert how.path == "fast" and kept == [None, ["0.weight", "0.bias"]]  # the hooks run from the output back
    expected = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for i in range(5):
        grads = torch.autograd.grad(loss(model(x[i:i + 1]), y[i:i + 1]), list(model.parameters()))
        scale = min(1.0, C / (torch.cat([g.flatten() for g in grads]).norm().item() + 1e-6))
        for (n, _), g in zip(model.named_parameters(), grads):
            expected[n] += scale * g
    assert all(torch.allclose(clipped[n], expected[n], rtol=1e-10, atol=1e-15) for n in expected)
