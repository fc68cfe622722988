from torch.utils._python_dispatch import TorchDispatchMode


class LogOps(TorchDispatchMode):
    """Record the name of every ATen operation (overload dropped: "mm", not "mm.default") run while active."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def logged_ops(fn):
    """The ATen operations fn() runs, in order."""
    with LogOps() as log:
        fn()
    return log.ops
