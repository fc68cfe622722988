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
