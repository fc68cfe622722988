"""Chapter 12: named_like_parameters, from functorch's tuple of tensors to the dict torch.func uses."""

from collections.abc import Sequence

import torch
import torch.nn as nn


def named_like_parameters(model: nn.Module, tensors: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Name a functorch-style tuple of tensors, ordered like model.parameters(), with the names of
    model.named_parameters(): the dict functional_call and torch.func.grad use. Raises if the count or
    any shape differs, since a shifted tuple would otherwise be matched to the wrong parameters."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"named_like_parameters needs an nn.Module, got {type(model).__name__}")
    if isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError("named_like_parameters needs a tuple or list of tensors (a dict is already named)")
    named = list(model.named_parameters())
    tensors = list(tensors)
    if len(tensors) != len(named):
        raise ValueError(f"the model has {len(named)} parameters, the tuple has {len(tensors)} tensors")
    for (name, p), t in zip(named, tensors):
        if t.shape != p.shape:
            raise ValueError(f"tensor for {name} has shape {tuple(t.shape)}, the parameter has {tuple(p.shape)}")
    return {name: t for (name, _), t in zip(named, tensors)}
