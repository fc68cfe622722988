import os
import platform
import warnings
from collections.abc import Callable, Iterable, Sequence  # noqa: F401 (the recipes' type hints)
from typing import Any  # noqa: F401

import torch

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# TensorFloat-32 would round float32 matrix products on recent GPUs to about 3 digits; the book's float32
# checks need full float32 (no effect on a CPU).
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
# Messages PyTorch prints about its own set-up, dropped by their exact text so nothing else is hidden:
# the first backward pass on a GPU sets up cuBLAS's context; torch 2.14 says, on the first forward-mode
# call, that it uses the deprecated torch.jit.script inside.
warnings.filterwarnings("ignore", message="Attempting to run cuBLAS, but there was no current CUDA context")
warnings.filterwarnings("ignore", message="`torch.jit.script` is deprecated")


def make(*shape, seed, dtype=torch.float64):
    """Standard-normal data drawn on the CPU from its own seeded generator, then moved to `device`.

    float64 by default, so that checks against a loop can use tight tolerances; benchmarks ask for
    float32 explicitly.
    """
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator, dtype=dtype).to(device)


def matches(actual, expected, *, rtol=1e-12, atol=1e-12):
    """True when two results have the same shape and dtype and agree to rtol (atol near zero).

    The default 1e-12 is for float64: a batched kernel may add numbers in another order than the
    loop, which moves the last bits (about 1e-16 relative), while a real mistake is far larger.
    Use it as `assert matches(...)` or print it; it returns False rather than raising.
    """
    return (actual.shape == expected.shape and actual.dtype == expected.dtype
            and torch.allclose(actual, expected, rtol=rtol, atol=atol))


def hardware():
    """A short name for the machine this notebook's timings were taken on."""
    if device.type == "cuda":
        return torch.cuda.get_device_name()
    name = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):  # Linux names the CPU model here
        with open("/proc/cpuinfo") as cpuinfo:
            name = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), name)
    return f"{name}, {torch.get_num_threads()} threads"
