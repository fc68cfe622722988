"""named_like_parameters ("Migrating from functorch"), from functorch's tuple of tensors to the dict torch.func uses."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn


def named_like_parameters(model: nn.Module, tensors: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    r"""Name a functorch-style tuple of tensors with the names of ``model.named_parameters()``.

    Args:
        model (nn.Module): the model whose ``parameters()`` order the tuple follows.
        tensors (sequence of Tensor): one tensor per parameter, in that order.

    Returns:
        ``{name: tensor}``, the dict ``functional_call`` and ``torch.func.grad`` use.

    Raises:
        ValueError: if the count or any shape differs (a shifted tuple would be matched to the wrong parameters).

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from torch_func_recipes import named_like_parameters
        >>> model, x = nn.Linear(3, 2).double(), torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64)
        >>> grads = torch.autograd.grad(model(x).sum(), tuple(model.parameters()))  # functorch's style: a tuple
        >>> named = named_like_parameters(model, grads)
        >>> {name: tuple(g.shape) for name, g in named.items()}
        {'weight': (2, 3), 'bias': (2,)}
        >>> torch.equal(named["weight"], x.expand(2, 3)), torch.equal(named["bias"], torch.ones(2, dtype=torch.float64))
        (True, True)
        >>> named_like_parameters(model, grads[::-1])  # a tuple in the wrong order is refused
        Traceback (most recent call last):
            ...
        ValueError: tensor for weight has shape (2,), the parameter has (2, 3)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"named_like_parameters needs an nn.Module, got {type(model).__name__}")
    if isinstance(tensors, dict):
        raise TypeError("named_like_parameters needs a tuple or list of tensors (a dict is already named)")
    tensors = list(tensors)  # once: a generator is read here
    odd = next((k for k, t in enumerate(tensors) if not isinstance(t, torch.Tensor)), None)
    if odd is not None:
        raise TypeError(f"named_like_parameters needs a tuple or list of tensors, but entry {odd} is "
                        + ("None (torch.autograd.grad gives None for a parameter the output does not use: pass "
                           "allow_unused=True, materialize_grads=True for zeros)" if tensors[odd] is None else type(tensors[odd]).__name__))
    named = list(model.named_parameters())
    if len(tensors) != len(named):
        raise ValueError(f"the model has {len(named)} parameters, the tuple has {len(tensors)} tensors")
    for (name, p), t in zip(named, tensors):
        if t.shape != p.shape:
            raise ValueError(f"tensor for {name} has shape {tuple(t.shape)}, the parameter has {tuple(p.shape)}")
    return {name: t for (name, _), t in zip(named, tensors)}
