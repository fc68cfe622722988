import logging

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# A CUDA build of torch on a machine without a GPU logs, when torch.utils.benchmark loads, that it
# found no CUDA runtime: a note about the machine, dropped by its exact message.
logging.getLogger("torch.utils.cpp_extension").addFilter(
    lambda record: not record.getMessage().startswith("No CUDA runtime is found"))
from torch.utils.benchmark import Timer  # noqa: E402  (after the filter)


def seconds(fn, *, min_run_time=0.2):
    """Median seconds per call of fn(), from torch.utils.benchmark.Timer.

    Timer warms up, synchronises a GPU around each measurement, and repeats until min_run_time
    seconds have passed; the median is robust to a stray slow run. It runs fn on as many threads
    as torch uses here (the number hardware() prints); Timer's own default is one.
    """
    timer = Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median


class TensorMemory(TorchDispatchMode):
    """Track the peak bytes held by the tensors that operations create while the mode is active.

    It counts tensor storages only (not allocator caches or kernel scratch space) and assumes the
    inputs stay alive. It works the same on the CPU and on a GPU.
    """

    def __init__(self):
        super().__init__()
        self.outside = {}  # storages first seen as inputs: key -> weak reference
        self.alive = {}  # storages created inside: key -> (weak reference, bytes)
        self.peak = 0

    def _forget_freed(self):  # before reading addresses: a freed storage's address can be reused
        self.alive = {key: entry for key, entry in self.alive.items() if not entry[0].expired()}
        self.outside = {key: ref for key, ref in self.outside.items() if not ref.expired()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._forget_freed()
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                if ref.cdata not in self.alive:
                    self.outside.setdefault(ref.cdata, ref)
        out = func(*args, **(kwargs or {}))
        self._forget_freed()
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                if ref.cdata not in self.outside and ref.cdata not in self.alive:
                    self.alive[ref.cdata] = (ref, t.untyped_storage().nbytes())
        self.peak = max(self.peak, sum(nbytes for _, nbytes in self.alive.values()))
        return out


def peak_tensor_memory(fn):
    """Peak bytes held by the tensors fn() creates (the inputs it received are not counted)."""
    with TensorMemory() as tracker:
        fn()
    return tracker.peak
