"""From "`vmap` basics" and "Jacobians and Hessians": pairwise (vmap of vmap), jacobian_via_vjp (vmap over vjp) and hvp (forward-over-reverse)."""

from __future__ import annotations

import numbers
from collections.abc import Callable

import torch
from torch.func import grad, jvp, vjp, vmap


def pairwise(f: Callable[..., torch.Tensor]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    r"""Turn ``f(a, b)`` on single examples into a function of two batches, over all pairs.

    Args:
        f (Callable): a function of two examples.

    Returns:
        A function with ``pairwise(f)(A, B)[i, j] == f(A[i], B[j])``, of shape ``(len(A), len(B), *f(a, b).shape)``.

    Example::

        >>> import torch
        >>> from torch_func_recipes import pairwise
        >>> _ = torch.manual_seed(0)
        >>> A, B = torch.randn(4, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
        >>> distances = pairwise(lambda a, b: (a - b).norm())(A, B)  # distances[i, j] = |A[i] - B[j]|
        >>> distances.shape
        torch.Size([4, 5])
        >>> torch.allclose(distances, torch.cdist(A, B))
        True
    """
    if not callable(f):
        raise TypeError(f"pairwise expects a function of two examples, got {type(f).__name__}")
    over_b = vmap(f, in_dims=(None, 0))  # f(a, B[j]) for every j
    return vmap(over_b, in_dims=(0, None))  # ... for every a in A


def jacobian_via_vjp(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, *, chunk_size: int | None = None) -> torch.Tensor:
    r"""The Jacobian of f at x, from ``vmap`` over vector-Jacobian products.

    One forward pass of f, then batched backward passes over the output basis vectors: all of them at once,
    or ``chunk_size`` at a time (building only that many basis rows) to bound memory.

    Args:
        f (Callable): a function of one real floating-point tensor returning one (real) tensor.
        x (Tensor): the point, of any shape.
        chunk_size (int, optional): basis rows per batched backward pass; all at once if None.

    Returns:
        The Jacobian, of shape ``f(x).shape + x.shape``, like ``torch.func.jacrev(f)(x)``.

    Example::

        >>> import torch
        >>> from torch_func_recipes import jacobian_via_vjp
        >>> _ = torch.manual_seed(0)
        >>> x = torch.randn(2, 3, dtype=torch.float64)
        >>> f = lambda x: x.sin().sum(dim=0) * x.norm()
        >>> J = jacobian_via_vjp(f, x, chunk_size=2)  # f(x).shape + x.shape
        >>> J.shape
        torch.Size([3, 2, 3])
        >>> torch.allclose(J, torch.autograd.functional.jacobian(f, x))
        True
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError("jacobian_via_vjp needs x to be a real floating-point tensor, got "
                        + (f"dtype {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__))
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral)
                                   or chunk_size < 1):
        raise ValueError(f"chunk_size must be None or a positive int, got {chunk_size!r}")
    y, vjp_fn = vjp(f, x)
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"jacobian_via_vjp needs f to return one tensor, got {type(y).__name__}")
    if y.is_complex():
        raise TypeError("f returned a complex tensor; this recipe handles real functions only")
    n = y.numel()
    if n == 0:  # no output entries, no rows to pull back: jacrev's shape, empty
        return y.new_zeros((*y.shape, *x.shape))
    step = n if chunk_size is None else int(chunk_size)
    rows = []
    for start in range(0, n, step):
        stop = min(start + step, n)
        basis = torch.zeros(stop - start, n, dtype=y.dtype, device=y.device)
        basis[torch.arange(stop - start), torch.arange(start, stop)] = 1  # rows start..stop of the identity
        rows.append(vmap(vjp_fn)(basis.reshape(stop - start, *y.shape))[0])
    return (rows[0] if len(rows) == 1 else torch.cat(rows)).reshape(y.shape + x.shape)


def hvp(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    r"""The Hessian-vector product ``H(x) @ v`` of a scalar function f, without building the Hessian.

    Forward-over-reverse: the directional derivative of ``grad(f)`` at x along v. Every operation in f needs
    forward-mode support (a custom ``autograd.Function`` needs a ``jvp``); where one lacks it,
    ``vjp(grad(f), x)[1](v)`` computes the same product in reverse-over-reverse.

    Args:
        f (Callable): a function of x returning a 0-d tensor.
        x (Tensor): the point, of any shape.
        v (Tensor): the direction, of x's shape.

    Returns:
        A tensor of x's shape.

    Example::

        >>> import torch
        >>> from torch_func_recipes import hvp
        >>> _ = torch.manual_seed(0)
        >>> x, v = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
        >>> f = lambda x: x.sin().sum() * x.square().sum()
        >>> H = torch.autograd.functional.hessian(f, x)  # the 4 x 4 matrix hvp never builds
        >>> torch.allclose(hvp(f, x, v), H @ v)
        True
    """
    if not isinstance(x, torch.Tensor) or not isinstance(v, torch.Tensor):
        raise TypeError("hvp needs x and v to be tensors")
    if x.shape != v.shape:
        raise ValueError(f"hvp needs v of the same shape as x: x is {tuple(x.shape)}, v is {tuple(v.shape)}")
    if x.dtype != v.dtype or x.device != v.device:
        raise ValueError(f"hvp needs v of x's dtype and device: x is {x.dtype} on {x.device}, v is {v.dtype} on {v.device}")

    def scalar_f(x):
        out = f(x)
        if not isinstance(out, torch.Tensor) or out.numel() != 1:
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"hvp needs a scalar function, but f returned {shape}; reduce it to one number first")
        if not out.is_floating_point():
            raise ValueError(f"hvp needs f to return a floating-point number, got {out.dtype}: it has no derivative")
        return out.reshape(())

    return jvp(grad(scalar_f), (x,), (v,))[1]
