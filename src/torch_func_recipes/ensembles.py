"""stack_models ("Model ensembling"), M models of one architecture run as one vmapped function."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable

import torch
import torch.nn as nn
from torch.func import functional_call, stack_module_state, vmap


def _state_difference(mine: nn.Module, theirs: nn.Module) -> str | None:
    """What else than parameters, buffers and submodules differs between two modules: their hooks, or an attribute
    of their own (a temperature, a tensor that is not a buffer, a forward method set on the instance), as words;
    None if nothing does."""
    def same(a: object, b: object) -> bool:
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                    and a.dtype == b.dtype and a.device == b.device and bool(torch.equal(a, b)))
        try:
            return a is b or bool(a == b)
        except Exception:  # noqa: BLE001 (a comparison that does not give one bool: an array, say)
            return False

    for hooks in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
        if list(getattr(mine, hooks).values()) != list(getattr(theirs, hooks).values()):
            return f"its {hooks.strip('_').replace('_', ' ')}"
    internals = vars(nn.Module())  # _parameters, _buffers, _modules, training, the hook dicts, ...
    for key in sorted((vars(mine).keys() | vars(theirs).keys()) - internals.keys()):
        if key not in vars(mine) or key not in vars(theirs) or not same(vars(mine)[key], vars(theirs)[key]):
            return f"its attribute {key!r}"
    return None


def stack_models(models: Iterable[nn.Module]) -> tuple[Callable[..., torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    r"""Stack M models of one architecture into one vmapped function.

    Nothing is written back to ``models``, and nothing done to them later (such as ``.eval()``) reaches the
    ensemble: it keeps the mode the models had when stacked.

    Args:
        models (iterable of nn.Module): M models of one class, structure, dtype, device and mode, with the
            same attributes and hooks (model 0's modules run with every model's parameters and buffers), each
            taking one tensor input.

    Returns:
        ``(forward, params, buffers)``: params and buffers hold every tensor with a leading dimension M, and
        ``forward(params, buffers, x)`` runs all M models on one input x; with ``per_model_batches=True``, x
        is (M, B, ...) and model i sees ``x[i]``.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from torch_func_recipes import stack_models
        >>> _ = torch.manual_seed(0)
        >>> models = [nn.Linear(3, 2).double() for _ in range(5)]
        >>> forward, params, buffers = stack_models(models)
        >>> params["weight"].shape  # (M, *weight.shape)
        torch.Size([5, 2, 3])
        >>> x = torch.randn(4, 3, dtype=torch.float64)
        >>> out = forward(params, buffers, x)  # every model on the same x
        >>> out.shape, torch.allclose(out, torch.stack([m(x) for m in models]))
        (torch.Size([5, 4, 2]), True)
    """
    models = list(models)
    if not models or not all(isinstance(m, nn.Module) for m in models):
        raise ValueError("stack_models needs a non-empty list of nn.Module")
    for index, model in enumerate(models):
        if any(nn.parameter.is_lazy(t) for t in (*model.parameters(), *model.buffers())):
            raise ValueError(f"model {index} has lazy parameters not yet initialised (nn.LazyLinear, say): run each "
                             "model once on an input first")
    first = dict(models[0].named_parameters()) | dict(models[0].named_buffers())
    modes = [m.training for m in models[0].modules()]
    for index, model in enumerate(models[1:], start=1):
        other = dict(model.named_parameters()) | dict(model.named_buffers())
        if type(model) is not type(models[0]) or repr(model) != repr(models[0]) or other.keys() != first.keys():
            raise ValueError(f"model {index} has a different structure from model 0:\n{model}\nagainst\n{models[0]}")
        if [m.training for m in model.modules()] != modes:
            raise ValueError(f"model {index} is not in the same train/eval mode as model 0 (call .train() or .eval() on all)")
        for name, tensor in other.items():
            if tensor.shape != first[name].shape or tensor.dtype != first[name].dtype or tensor.device != first[name].device:
                raise ValueError(f"model {index}'s {name} is {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}, "
                                 f"model 0's is {tuple(first[name].shape)} {first[name].dtype} on {first[name].device}")
        for (where, mine), theirs in zip(model.named_modules(), models[0].modules()):
            difference = _state_difference(mine, theirs)
            if difference:
                raise ValueError(f"model {index}'s {where or 'top module'} differs from model 0's in {difference}: the "
                                 "ensemble runs model 0's modules (their attributes and hooks) with each model's "
                                 "parameters and buffers, so the rest must agree")
    params, buffers = stack_module_state(models)
    # The template: a copy of model 0 whose tensors live on the meta device (no data). Passing the
    # replacements through deepcopy's memo keeps tied weights tied; functional_call swaps the
    # stacked slices in for them.
    memo = {}
    for tensor in list(models[0].parameters()) + list(models[0].buffers()):
        on_meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(on_meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else on_meta
    template = copy.deepcopy(models[0], memo)

    def run_one(params, buffers, x):
        return functional_call(template, (params, buffers), (x,))

    def forward(params, buffers, x, *, per_model_batches=False, randomness="error"):
        """All models on x; with per_model_batches=True, x is (M, B, ...) and model i sees x[i].
        randomness is vmap's: "different" gives each model its own dropout masks, "same" one mask."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"forward takes one input tensor, got {type(x).__name__}")
        if per_model_batches and (x.dim() == 0 or x.shape[0] != len(models)):
            raise ValueError(f"per_model_batches needs x of shape (M={len(models)}, B, ...), got {tuple(x.shape)}")
        return vmap(run_one, in_dims=(0, 0, 0 if per_model_batches else None), randomness=randomness)(params, buffers, x)

    return forward, params, buffers
