"""The recipes on a CUDA device: what the CPU tests check, where the device changes something the package does.

A model on a GPU draws its random numbers from that GPU's generator, not the CPU's, so the check of the first two
examples together and alone must watch (and leave as it was) the GPU's generator too; the DP step's noise is drawn
where its generator lives; and the adversarial models of tests/test_adversarial_models.py must take the same paths
and give the loop's answers there. Float64, as on the CPU. Skipped without a CUDA device: the CUDA workflow
(.github/workflows/nbval-cuda.yml) runs this file; it needs neither this folder's conftest.py nor the book's tools
(`pytest --noconftest tests/test_cuda.py` runs it on a machine with torch, pytest and the package alone).
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_func_recipes as tfr
from test_adversarial_models import CASES, INPUTS, TARGETS, X, functional_dropout, net, noise_from_its_own_generator
from test_recipes import close, loop_output_jacobian, loop_per_sample
from torch_func_recipes._batch import _as_batch, _check_examples_apart

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the CUDA workflow runs these")
CUDA = torch.device("cuda")
# NumPy holds no CUDA tensor: this model's forward raises on a GPU before any recipe runs (the same error alone)
CPU_ONLY = {"example data through NumPy"}


def on_gpu(name):
    model, path = CASES[name]
    return copy.deepcopy(model).double().to(CUDA), INPUTS.get(name, X).to(CUDA), TARGETS.to(CUDA), path


@pytest.mark.parametrize("name", [n for n in CASES if n not in CPU_ONLY])
def test_the_adversarial_models_on_a_gpu(name):
    """Each model takes the path it takes on the CPU and equals the loop, or is refused as mixing its examples."""
    model, x, t, expected_path = on_gpu(name)
    if expected_path == "refused":
        with pytest.raises(ValueError, match="depends on the other examples of the batch"):
            tfr.per_sample_grads(model, F.cross_entropy, x, t)
        return
    expected = loop_per_sample(model, x, t)
    got, report = tfr.per_sample_grads(model, F.cross_entropy, x, t, report=True)
    assert report.path == expected_path, report.reason
    assert all(got[k].device.type == "cuda" and close(got[k], expected[k]) for k in expected)
    jacobian, report = tfr.output_jacobian(model, x, report=True)
    assert report.path == expected_path and close(jacobian, loop_output_jacobian(model, x)), report.reason
    norms = tfr.per_sample_grad_norms(model, F.cross_entropy, x, t)
    assert close(norms, torch.cat([g.flatten(1) for g in expected.values()], 1).norm(dim=1))


def test_randomness_on_a_gpu_is_seen_and_the_generators_left_alone():
    """F.dropout and noise by hand on a GPU draw from the GPU's generator (the CPU's does not move): the check sees
    the draw there and leaves the model to the recipes, restoring both generators; norms given from another forward
    pass are refused. Were the GPU's generator not watched, the check would compare two passes with different masks
    and refuse the model as mixing its examples."""
    model = net(functional_dropout).double().to(CUDA).train()
    x, t = X.to(CUDA), TARGETS.to(CUDA)
    cpu, gpu = torch.get_rng_state(), torch.cuda.get_rng_state()
    _check_examples_apart(model, _as_batch(x, t, (), {}))
    assert torch.equal(torch.get_rng_state(), cpu) and torch.equal(torch.cuda.get_rng_state(), gpu)
    grads, report = tfr.per_sample_grads(model, F.cross_entropy, x, t, report=True)
    assert report.path == "fast" and grads["a.weight"].shape == (6, 8, 6), report.reason
    norms = tfr.per_sample_grad_norms(model, F.cross_entropy, x, t)
    with pytest.raises(ValueError, match="norms were given, but the model's forward pass draws random numbers"):
        tfr.clipped_grad_sum(model, F.cross_entropy, x, t, max_norm=1.0, norms=norms)


def test_a_generator_of_the_models_own_on_a_gpu():
    """Noise from a CUDA generator the model holds: the check sees the draw (not refused), leaves the generator as
    it was, and the per-example gradients add up to the batch gradient with the same draws."""
    model = net(noise_from_its_own_generator, g=torch.Generator(CUDA).manual_seed(3)).double().to(CUDA).train()
    x, t, seed = X.to(CUDA), TARGETS.to(CUDA), model.g.get_state()
    grads, report = tfr.per_sample_grads(model, F.cross_entropy, x, t, report=True)
    assert report.path == "fast", report.reason
    model.g.set_state(seed)
    total = torch.autograd.grad(F.cross_entropy(model(x), t, reduction="sum"), list(model.parameters()))
    assert all(close(grads[name].sum(0), g) for (name, _), g in zip(model.named_parameters(), total))


def test_a_gpu_model_that_mixes_examples_is_refused_and_the_generators_left_alone():
    model = net(lambda m, x: m.b(torch.tanh(m.a(x)) / x.shape[0])).double().to(CUDA)
    cpu, gpu = torch.get_rng_state(), torch.cuda.get_rng_state()
    with pytest.raises(ValueError, match="depends on the other examples of the batch"):
        tfr.per_sample_grad_norms(model, F.cross_entropy, X.to(CUDA), TARGETS.to(CUDA))
    assert torch.equal(torch.get_rng_state(), cpu) and torch.equal(torch.cuda.get_rng_state(), gpu)


def test_the_dp_steps_noise_comes_from_the_generator_given():
    """A CPU generator gives a GPU model the CPU model's step (the noise drawn on the CPU, then moved); a generator
    on the GPU draws there: the step is (clipped sum + sigma C z) / B with z = torch.randn from that generator."""
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    gpu_model = copy.deepcopy(model).to(CUDA)
    x, t, gx, gt = X, TARGETS, X.to(CUDA), TARGETS.to(CUDA)
    step = lambda m, a, b, g: tfr.clipped_noisy_gradient(m, F.cross_entropy, a, b, max_norm=0.1, noise_multiplier=2.0,  # noqa: E731
                                                         generator=g)
    on_cpu = step(model, x, t, torch.Generator().manual_seed(5))
    moved = step(gpu_model, gx, gt, torch.Generator().manual_seed(5))
    assert all(moved[k].device.type == "cuda" and close(moved[k].cpu(), on_cpu[k]) for k in on_cpu)
    total = tfr.clipped_grad_sum(gpu_model, F.cross_entropy, gx, gt, max_norm=0.1)
    got = step(gpu_model, gx, gt, torch.Generator(CUDA).manual_seed(5))
    g = torch.Generator(CUDA).manual_seed(5)
    expected = {k: (v + 2.0 * 0.1 * torch.randn(v.shape, generator=g, device=CUDA, dtype=v.dtype)) / 6 for k, v in total.items()}
    assert all(close(got[k], expected[k]) for k in expected)
    assert not close_enough(got, on_cpu)  # the GPU's stream is not the CPU's: the test above can tell them apart


def close_enough(a, b):
    return all(torch.allclose(a[k].cpu(), b[k], rtol=1e-6) for k in a)


def test_convolutions_each_way_on_a_gpu():
    """On a GPU each example's convolution weights come by im2col, and a depthwise layer's by a forward convolution
    (_weight_way; the batch kernel with the examples as groups launches once per group there): a single input
    channel, a strided dense layer and a depthwise one with two outputs per channel equal the loop, gradients and
    norms."""
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Tanh(), nn.Conv2d(4, 4, 3, stride=2, padding=1), nn.Tanh(),
                          nn.Conv2d(4, 8, 5, padding=2, groups=4), nn.Flatten(), nn.Linear(8 * 6 * 6, 3)).double().to(CUDA)
    x, t = torch.randn(6, 1, 13, 13, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(CUDA), TARGETS.to(CUDA)
    layers = [m for m in model if isinstance(m, nn.Conv2d)]
    ways = [tfr._layer_conv._weight_way(dict(weight_shape=m.weight.shape, groups=m.groups), x, 36) for m in layers]
    assert ways == ["im2col", "im2col", "forward"]
    expected = loop_per_sample(model, x, t)
    got, report = tfr.per_sample_grads(model, F.cross_entropy, x, t, report=True)
    assert report.path == "fast" and all(close(got[k], expected[k]) for k in expected), report.reason
    norms = tfr.per_sample_grad_norms(model, F.cross_entropy, x, t)
    assert close(norms, torch.cat([g.flatten(1) for g in expected.values()], 1).norm(dim=1))
