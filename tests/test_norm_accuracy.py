"""Per-example norms are as accurate in float32 on a CPU as the arithmetic allows.

torch.linalg.vector_norm's CPU kernel accumulates each row in a few float32 numbers (pytorch#169237), so a
row of millions of entries gets a norm off by far more than rounding (4e-5 at 1.7M entries, 0.5% at 40M,
measured on the 2-core CI machine); torch.sum's cascade summation is off by about 1e-7. The clip factors of a
DP step are max_norm / norm, so that error goes straight into the step. The package sums squared norms of
4,096-entry blocks (_batch._row_squares). Each check here compares with float64 arithmetic on the same
float32 numbers, at 1e-6: sixteen float32 roundings (6e-8 each), where vector_norm's error is 20 to 100
times larger at these sizes: with vector_norm in place of _row_squares at any of the three uses, these tests
fail under torch 2.13. They do not assert the bug itself, so a release that fixes it still passes.
"""
import pytest
import torch
import torch.nn as nn

import torch_func_recipes as tfr
from torch_func_recipes._batch import _row_squares

ROWS, ENTRIES = 3, 6_000_000  # 72 MB of float32: big enough for vector_norm's error to show


def rows(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(ROWS, ENTRIES, generator=g) + 0.5  # positive entries: the sum grows, as a norm's does


def relative(a, b):
    return ((a.double() - b).abs() / b.abs()).max().item()


def test_row_squares_match_float64():
    x = rows()
    exact = x.double().square().sum(1)
    assert relative(_row_squares(x), exact) < 1e-6
    assert relative(_row_squares(x[:, :4097]), x[:, :4097].double().square().sum(1)) < 1e-6  # a partial block
    assert relative(_row_squares(x[:, :100]), x[:, :100].double().square().sum(1)) < 1e-6  # no whole block


def test_clip_and_noise_clips_by_accurate_norms():
    per_sample = {"w": rows(1), "b": rows(2)[:, :10]}
    norms = torch.cat([v.double() for v in per_sample.values()], 1).norm(dim=1)
    max_norm = 0.5 * norms.min().item()  # every example clipped: the step depends on every norm
    step = tfr.clip_and_noise(per_sample, max_norm, 0.0)
    for name, g in per_sample.items():
        expected = torch.einsum("b,b...->...", (max_norm / (norms + 1e-6)).clamp(max=1), g.double()) / ROWS
        assert relative(step[name], expected) < 1e-6, name


class Scaled(nn.Module):
    """An elementwise scale of ENTRIES numbers: asked for path="vmap", its per-example gradients are formed."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.full((ENTRIES,), 0.5))

    def forward(self, x):
        return (x * self.scale).reshape(len(x), -1, 1000).sum(-1)


def test_norms_and_clipped_sum_off_the_fast_path_are_accurate():
    model, x = Scaled(), rows(3)
    loss = lambda out: out.square().sum()  # noqa: E731
    grads = 2 * (x.double() * 0.5).reshape(ROWS, -1, 1000).sum(-1).repeat_interleave(1000, dim=1) * x.double()
    exact = grads.norm(dim=1)  # d/d scale of sum_k (sum_{j in k} x_j s_j)^2, in float64
    norms, report = tfr.per_sample_grad_norms(model, loss, x, path="vmap", report=True)
    assert report.path == "vmap" and report.streamed == ["scale"], report
    assert relative(norms, exact) < 1e-6
    max_norm = 0.5 * exact.min().item()
    total = tfr.clipped_grad_sum(model, loss, x, max_norm=max_norm, path="vmap")
    assert relative(total["scale"], torch.einsum("b,bp->p", max_norm / (exact + 1e-6), grads)) < 1e-6


# Ghost norms (pairs of rows) where an example's rows cancel. For a linear layer used on T rows per example,
# ||sum_t g_t a_t^T||^2 = sum_{s,t} (a_s . a_t)(g_s . g_t): that sum rounds on the scale of its terms, so where the
# rows' gradients cancel it is mostly rounding, often negative, and a norm of 0 then left the example unclipped in a
# DP step (1.79 off in float32, 2.08 under bfloat16 autocast, before _layers._ghost_squares). Here examples 1 to
# B - 2 have two rows that agree to GAP and whose output gradients are opposite; examples 0 and B - 1 (which the fast
# path's checks compare alone) do not cancel. The reference is the float64 loop on the same float32 numbers. Their
# gradients are differences of rows that agree to GAP, so float32 keeps about u / GAP = 6e-4 of them, in the loop as
# on the fast path: the tolerance is 2e-3 (both measured within 4e-4).
B, T, D, GAP = 6, 4, 8, 1e-4


class Difference(nn.Module):
    """Row 0 minus row 1 of a linear layer (or a convolution along the rows, or a table look-up) on T rows."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.layer = {"linear": lambda: nn.Linear(D, D, bias=False), "conv": lambda: nn.Conv1d(D, 2 * D, 2, bias=False),
                      "embedding": lambda: nn.Embedding(10, D), "twice": lambda: nn.Linear(D, D, bias=False)}[kind]()

    def forward(self, x):
        if self.kind == "conv":  # x (B, D, T + 1): output positions 0 and 1 see patches that agree to GAP
            h = self.layer(x)
            return h[:, :, 0] - h[:, :, 1]
        if self.kind == "twice":  # x (B, 2, T, D): one layer on two inputs that agree to GAP, so its uses cancel
            return (self.layer(x[:, 0]) - self.layer(x[:, 1])).sum(1)
        h = self.layer(x)  # (B, T, D): rows 0 and 1 agree to GAP (linear), or look up the same id (embedding)
        return h[:, 0] - (1 - GAP if self.kind == "embedding" else 1) * h[:, 1]


def cancelling_batch(kind, gap=GAP):
    g = torch.Generator().manual_seed(0)
    if kind == "embedding":  # ids 0 and 1 equal in the middle examples: their row gets GAP g_0 from them
        ids = torch.randint(0, 10, (B, T), generator=g)
        ids[:, 1] = (ids[:, 0] + 1) % 10
        ids[1:-1, 1] = ids[1:-1, 0]
        return ids, torch.randn(B, D, generator=g)
    if kind == "conv":
        x = torch.randn(B, D, 1, generator=g).expand(-1, -1, T + 1).clone()  # every position the same, but for GAP
        x[[0, -1]] = torch.randn(2, D, T + 1, generator=g)
        return x + gap * torch.randn(B, D, T + 1, generator=g), torch.randn(B, 2 * D, generator=g)
    x = torch.randn(B, 2, T, D, generator=g)
    x[1:-1, 1] = x[1:-1, 0] + gap * torch.randn(B - 2, T, D, generator=g)
    if kind == "twice":
        return x, torch.randn(B, D, generator=g)
    x = x[:, 0].clone()  # (B, T, D): rows 0 and 1 of the middle examples agree to GAP
    x[1:-1, 1] = x[1:-1, 0] + gap * torch.randn(B - 2, D, generator=g)
    return x, torch.randn(B, D, generator=g)


def float64_loop(model, x, y, max_norm):
    """Norms and clipped sum of the float64 copy of the model on the same float32 numbers, example by example."""
    twin = Difference(model.kind).double()
    twin.load_state_dict(model.state_dict())
    inputs = x if not x.is_floating_point() else x.double()
    grads = [torch.autograd.grad(nn.functional.mse_loss(twin(inputs[i:i + 1]), y[i:i + 1].double()), twin.layer.weight)[0]
             for i in range(B)]
    norms = torch.stack([g.norm() for g in grads])
    return norms, sum(min(1.0, max_norm / (n.item() + 1e-6)) * g for n, g in zip(norms, grads))


@pytest.mark.parametrize("kind", ["linear", "conv", "embedding", "twice"])
def test_norms_where_rows_cancel_are_the_loops(kind):
    """Each rule's pairs of rows, and the cross terms of a layer used twice, on examples whose rows cancel: the norms
    and both clipped sums match the float64 loop; a layer used twice whose uses cancel steps off the fast path."""
    torch.manual_seed(0)
    model = Difference(kind)
    x, y = cancelling_batch(kind)
    exact, _ = float64_loop(model, x, y, 1.0)
    max_norm = 0.5 * exact[1:-1].min().item()  # every middle example clipped: the sums depend on their norms
    _, clipped = float64_loop(model, x, y, max_norm)
    norms, report = tfr.per_sample_grad_norms(model, nn.functional.mse_loss, x, y, report=True)
    if kind == "twice":
        assert report.path == "vmap" and "nearly cancel for example 1" in report.reason, report
    else:
        assert report.path == "fast" and report.ghost == ["layer.weight"], report
    assert relative(norms, exact) < 2e-3
    if kind == "linear":  # path="vmap" covers a linear layer by the same token pairs
        vmapped, how = tfr.per_sample_grad_norms(model, nn.functional.mse_loss, x, y, path="vmap", report=True)
        assert how.ghost == ["layer.weight"] and relative(vmapped, exact) < 2e-3, how
    for recipe in (tfr.clipped_grad_sum, tfr.clipped_noisy_gradient):
        found, how = recipe(model, nn.functional.mse_loss, x, y, max_norm=max_norm, report=True,
                            **({"noise_multiplier": 0.0} if recipe is tfr.clipped_noisy_gradient else {}))
        assert how.path == report.path, how
        scale = B if recipe is tfr.clipped_noisy_gradient else 1
        assert ((found["layer.weight"] * scale).double() - clipped).norm() < 2e-3 * clipped.norm()


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_norms_where_rows_cancel_under_autocast(kind):
    """Under bfloat16 autocast the pairs' products ran in bfloat16 (every middle example's norm came out 0, and the
    clipped sum 2.08 off); the norms now run with autocast off, in the parameters' float32. Rows that agree to 1e-2
    (bfloat16 keeps 2^-8 = 3.9e-3 of a number): compared with the loop under the same autocast, whose products round
    to bfloat16, at 1e-2 (measured within 8e-4)."""
    torch.manual_seed(0)
    model = Difference(kind)
    x, y = cancelling_batch(kind, gap=1e-2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        norms, report = tfr.per_sample_grad_norms(model, nn.functional.mse_loss, x, y, report=True)
        loop = tfr.per_sample_grad_norms(model, nn.functional.mse_loss, x, y, path="loop")
        max_norm = 0.5 * loop[1:-1].min().item()
        clipped, how = tfr.clipped_grad_sum(model, nn.functional.mse_loss, x, y, max_norm=max_norm, report=True)
        expected = tfr.clipped_grad_sum(model, nn.functional.mse_loss, x, y, max_norm=max_norm, path="loop")
    assert report.path == how.path == "fast" and report.ghost == ["layer.weight"], (report, how)
    assert relative(norms, loop.double()) < 1e-2
    assert (clipped["layer.weight"] - expected["layer.weight"]).norm() < 1e-2 * expected["layer.weight"].norm()


class Siamese(nn.Module):
    """One encoder on two inputs, compared by their difference: its last bias's two shares cancel exactly."""

    def __init__(self):
        super().__init__()
        self.f = nn.Sequential(nn.Linear(D, 16), nn.ReLU(), nn.Linear(16, 16))

    def forward(self, x1, x2):
        return self.f(x1) - self.f(x2)


def test_uses_that_cancel_in_a_small_share_keep_the_fast_path():
    """The cross terms' rounding is judged against each example's whole squared norm (what its clip factor reads):
    a siamese model's last bias gets exactly 0, its uses cancelling in every example, yet the norms are exact, and
    stepping aside would stream every parameter of the encoder through vmap on every call (it did, per parameter)."""
    torch.manual_seed(0)
    model = Siamese()
    g = torch.Generator().manual_seed(1)
    x1, x2, y = torch.randn(B, D, generator=g), torch.randn(B, D, generator=g), torch.rand(B, generator=g)
    loss = lambda diff, y: ((diff.square().sum(1) - y) ** 2).mean()  # noqa: E731
    norms, report = tfr.per_sample_grad_norms(model, loss, (x1, x2), y, report=True)
    assert report.path == "fast", report
    assert relative(norms, tfr.per_sample_grad_norms(model, loss, (x1, x2), y, path="loop").double()) < 1e-5


def test_a_bfloat16_tied_table_keeps_the_fast_path():
    """A bfloat16 model's cross terms run in float32 (as its own shares do): in bfloat16 their rounding, 4e-3 of the
    terms, was above the margin for every example, and a tied table always left the fast path."""
    torch.manual_seed(0)
    model = TiedLookup().bfloat16()
    ids = torch.randint(1, 10, (B, T), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 10, (B,), generator=torch.Generator().manual_seed(2))
    norms, report = tfr.per_sample_grad_norms(model, nn.functional.cross_entropy, ids, y, report=True)
    assert report.path == "fast", report
    loop = tfr.per_sample_grad_norms(model, nn.functional.cross_entropy, ids, y, path="loop")
    assert relative(norms.float(), loop.double()) < 2e-2  # bfloat16 keeps 2^-8 = 3.9e-3 of each number


class TiedLookup(nn.Module):
    """A table that is also the output layer's weight (as in GPT-2)."""

    def __init__(self):
        super().__init__()
        self.table, self.head = nn.Embedding(10, D), nn.Linear(D, 10, bias=False)
        self.head.weight = self.table.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.table(ids)).mean(1))
