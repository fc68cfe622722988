"""Chapter 10: curvature of the loss in the parameters, without P x P matrices.

Hessian-, Gauss-Newton- and empirical-Fisher-vector products, the exact Gauss-Newton diagonal,
Hutchinson's trace and diagonal estimates, Lanczos for the top Hessian eigenvalues, a damped
Gauss-Newton step solved in output space, conjugate gradients and influence scores.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, jacrev, vjp, vmap

from ._batch import _as_batch, _check_chunk_size, _check_model, _gradients_enabled


def _trainable(model, inputs, targets):
    """The curvature recipes' one check of the model and the batch (the package's validator, with random
    modules in training mode refused); returns the parameters that require grad, {name: detached tensor},
    in named_parameters() order. One batch of tensors for now: an iterable of batches (a DataLoader) and
    inputs given as a tuple or dict are part of the signature but not implemented yet, and say so."""
    trainable = _check_model(model, deterministic=True)
    if isinstance(inputs, Iterable) and not isinstance(inputs, (torch.Tensor, tuple, list, Mapping)):
        raise NotImplementedError("the curvature of an iterable of batches (a DataLoader) is not implemented yet: "
                                  "pass one batch as inputs, targets")
    batch = _as_batch(inputs, targets)
    if not isinstance(inputs, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise NotImplementedError("the curvature recipes take inputs and targets as tensors; tuples and dicts of them "
                                  "are not implemented yet")
    if len(batch) == 0:
        raise ValueError("the batch is empty: a loss over no examples has no curvature")
    return {name: p.detach() for name, p in trainable.items()}


def _scalar(loss):
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"loss_fn must return a scalar (one number), but returned {shape}: "
                         "reduce it first, e.g. with reduction='mean'")
    return loss.reshape(())


def _loss_of_params(model, loss_fn, inputs, targets):
    """The function params -> loss_fn(model(inputs), targets), checked to be one number."""
    return lambda params: _scalar(loss_fn(functional_call(model, params, (inputs,)), targets))


def _check_vector(vector, params):
    """vector must be a dict with exactly the trainable parameters' names, shapes, dtypes and devices."""
    if not isinstance(vector, dict):
        raise TypeError(f"vector must be a dict name -> tensor shaped like the parameter, got {type(vector).__name__}")
    missing = [name for name in params if name not in vector]
    unexpected = [name for name in vector if name not in params]
    if missing or unexpected:
        raise ValueError(f"vector needs one entry per trainable parameter: missing {missing}, unexpected {unexpected}")
    for name, p in params.items():
        v = vector[name]
        if not isinstance(v, torch.Tensor) or v.shape != p.shape or v.dtype != p.dtype or v.device != p.device:
            got = f"{tuple(v.shape)} {v.dtype} on {v.device}" if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(f"vector[{name!r}] must be a {tuple(p.shape)} {p.dtype} tensor on {p.device}, "
                             f"like the parameter; got {got}")
    return {name: vector[name] for name in params}  # in parameter order


def _leaves(params):
    """Fresh leaf tensors that require grad, with the parameters' values, for plain autograd."""
    return {name: p.detach().requires_grad_(True) for name, p in params.items()}


def _hvp_operator(model, loss_fn, inputs, targets, params):
    """v -> H v on dicts shaped like params (or, with batched=True, dicts of (S, *shape) stacks of S vectors).
    The gradient g is computed once, with its graph kept; each product is then one more backward pass,
    of <g, v> (reverse-over-reverse)."""
    leaves = _leaves(params)
    with torch.enable_grad():  # also inside torch.no_grad()
        loss = _loss_of_params(model, loss_fn, inputs, targets)(leaves)
        g = torch.autograd.grad(loss, list(leaves.values()), create_graph=True, materialize_grads=True)
    live = [k for k, g_k in enumerate(g) if g_k.requires_grad]  # entries of g that depend on the parameters

    def hvp(vector, batched=False):
        if not live:  # the gradient is constant: H = 0
            return {name: torch.zeros_like(vector[name]) for name in params}
        vs = list(vector.values())
        products = torch.autograd.grad([g[k] for k in live], list(leaves.values()), [vs[k] for k in live],
                                       retain_graph=True, is_grads_batched=batched, materialize_grads=True)
        return dict(zip(params, products))

    return hvp


@_gradients_enabled
def param_hvp(model: nn.Module, loss_fn: Callable[..., torch.Tensor], inputs: Any, targets: Any, vector: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    r"""H v for the Hessian H of ``loss_fn(model(inputs), targets)`` in the parameters that require grad.

    Reverse-over-reverse: the gradient g with its graph, then one backward pass of <g, v>. No P x P matrix.

    Args:
        model, loss_fn, inputs, targets: as in :func:`empirical_fisher_vp`.
        vector (dict): ``{name: tensor shaped like the parameter}``.

    Returns:
        ``{name: tensor shaped like the parameter}``.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from torch_func_recipes import param_hvp
        >>> _ = torch.manual_seed(0)
        >>> model, loss_fn = nn.Linear(3, 2, bias=False).double(), nn.functional.cross_entropy
        >>> x, y = torch.randn(8, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1, 0, 0, 1])
        >>> H = torch.autograd.functional.hessian(lambda w: loss_fn(x @ w.T, y), model.weight).reshape(6, 6)
        >>> v = torch.randn(2, 3, dtype=torch.float64)
        >>> Hv = param_hvp(model, loss_fn, x, y, {"weight": v})
        >>> torch.allclose(Hv["weight"], (H @ v.flatten()).view(2, 3))
        True
    """
    params = _trainable(model, inputs, targets)
    vector = _check_vector(vector, params)
    return _hvp_operator(model, loss_fn, inputs, targets, params)(vector)


@_gradients_enabled
def ggn_vp(model: nn.Module, loss_fn: Callable[..., torch.Tensor], inputs: Any, targets: Any, vector: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    r"""G v for the generalised Gauss-Newton matrix ``G = J^T H_L J`` of ``loss_fn(model(inputs), targets)``.

    J is the Jacobian of the outputs in the parameters, H_L the loss's Hessian in the outputs: J v by the
    double-backward trick, H_L J v in output space, then J^T (...), all in reverse mode.

    Args:
        model, loss_fn, inputs, targets: as in :func:`empirical_fisher_vp`.
        vector (dict): ``{name: tensor shaped like the parameter}``.

    Returns:
        ``{name: tensor shaped like the parameter}``.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from torch_func_recipes import ggn_vp
        >>> _ = torch.manual_seed(0)
        >>> model, loss_fn = nn.Linear(3, 2, bias=False).double(), nn.functional.cross_entropy
        >>> x, y = torch.randn(8, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1, 0, 0, 1])
        >>> H = torch.autograd.functional.hessian(lambda w: loss_fn(x @ w.T, y), model.weight).reshape(6, 6)
        >>> v = torch.randn(2, 3, dtype=torch.float64)
        >>> Gv = ggn_vp(model, loss_fn, x, y, {"weight": v})
        >>> torch.allclose(Gv["weight"], (H @ v.flatten()).view(2, 3))  # G = H: the model is linear in its weight
        True
    """
    params = _trainable(model, inputs, targets)
    vector = _check_vector(vector, params)
    leaves = _leaves(params)
    with torch.enable_grad():
        outputs = functional_call(model, leaves, (inputs,))
        u = torch.zeros_like(outputs, requires_grad=True)
        jt_u = torch.autograd.grad(outputs, list(leaves.values()), u, create_graph=True, materialize_grads=True)
        jv = torch.autograd.grad(torch.stack([(a * vector[name]).sum() for name, a in zip(leaves, jt_u)]).sum(), u,
                                 materialize_grads=True)[0]  # J v
        o = outputs.detach().requires_grad_(True)
        loss_gradient = torch.autograd.grad(_scalar(loss_fn(o, targets)), o, create_graph=True)[0]
        if not loss_gradient.requires_grad:  # a loss linear in the outputs: H_L = 0
            return {name: torch.zeros_like(p) for name, p in params.items()}
        h_jv = torch.autograd.grad(loss_gradient, o, jv, materialize_grads=True)[0]  # H_L J v
        return dict(zip(leaves, torch.autograd.grad(outputs, list(leaves.values()), h_jv, materialize_grads=True)))


def _per_example(model, loss_fn, inputs, targets, params):
    """(loss of one example as a function of (params, x, t), w) such that loss_fn(model(inputs), targets)
    equals w times the sum of the per-example losses: w = 1/B for a mean, 1 for a sum; anything else is refused."""

    def loss_of_one(params, x, t):
        return _scalar(loss_fn(functional_call(model, params, (x[None],)), t[None]))

    batch_loss = _loss_of_params(model, loss_fn, inputs, targets)(params)
    each = vmap(loss_of_one, in_dims=(None, 0, 0))(params, inputs, targets)
    for weight in (1 / len(inputs), 1.0):
        if torch.allclose(batch_loss, weight * each.sum(), rtol=1e-5, atol=0):
            return loss_of_one, weight
    raise ValueError(f"loss_fn must be a mean or a sum of per-example losses (like reduction='mean' or 'sum'), but its "
                     f"value {batch_loss.item():.6g} is neither the mean {each.mean().item():.6g} nor the sum "
                     f"{each.sum().item():.6g} of the examples' losses")


@_gradients_enabled
def empirical_fisher_vp(model: nn.Module, loss_fn: Callable[..., torch.Tensor], inputs: Any, targets: Any,
                        vector: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    r"""F v for the empirical Fisher ``F = w * sum_n g_n g_n^T``, without a P x P matrix.

    g_n is the gradient of example n's loss, ``w = 1/B`` for a mean loss (1 for a sum): per-example
    gradients by ``vmap`` of ``grad``, then two contractions.

    Args:
        model (nn.Module): the model; never modified. Random modules must be in eval mode.
        loss_fn (Callable): ``loss_fn(model(inputs), targets)``, a mean or a sum over the examples.
        inputs (Tensor): the batch, examples along dimension 0.
        targets (Tensor): their targets.
        vector (dict): ``{name: tensor shaped like the parameter}`` for every parameter that requires grad.

    Returns:
        ``{name: tensor shaped like the parameter}``. Memory: the B x P per-example gradients.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from torch_func_recipes import empirical_fisher_vp
        >>> _ = torch.manual_seed(0)
        >>> model, loss_fn = nn.Linear(3, 2, bias=False).double(), nn.functional.cross_entropy
        >>> x, y = torch.randn(8, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1, 0, 0, 1])
        >>> H = torch.autograd.functional.hessian(lambda w: loss_fn(x @ w.T, y), model.weight).reshape(6, 6)
        >>> v = torch.randn(2, 3, dtype=torch.float64)
        >>> Fv = empirical_fisher_vp(model, loss_fn, x, y, {"weight": v})
        >>> g = torch.stack([torch.autograd.grad(loss_fn(model(x[n:n + 1]), y[n:n + 1]), model.weight)[0].flatten() for n in range(8)])
        >>> torch.allclose(Fv["weight"], (g.T @ g @ v.flatten() / 8).view(2, 3))  # F = (1/B) sum_n g_n g_n^T for a mean loss
        True
    """
    params = _trainable(model, inputs, targets)
    vector = _check_vector(vector, params)
    loss_of_one, weight = _per_example(model, loss_fn, inputs, targets, params)
    g = vmap(grad(loss_of_one), in_dims=(None, 0, 0))(params, inputs, targets)  # {name: (B, *shape)}
    dots = sum((g[n] * vector[n]).flatten(1).sum(dim=1) for n in params)  # g_n^T v, (B,)
    return {n: weight * torch.einsum("b,b...->...", dots, g[n]) for n in params}


def _loss_weight(loss_fn, outputs, targets):
    """w such that loss_fn(outputs, targets) = w * sum_n loss_fn(outputs[n:n+1], targets[n:n+1]); else an error."""
    batch_loss = _scalar(loss_fn(outputs, targets))
    each = vmap(lambda o, t: _scalar(loss_fn(o[None], t[None])))(outputs, targets)
    for weight in (1 / len(outputs), 1.0):
        if torch.allclose(batch_loss, weight * each.sum(), rtol=1e-5, atol=0):
            return weight
    raise ValueError(f"loss_fn must be a mean or a sum of per-example losses (like reduction='mean' or 'sum'), but its "
                     f"value {batch_loss.item():.6g} is neither the mean {each.mean().item():.6g} nor the sum "
                     f"{each.sum().item():.6g} of the examples' losses")


def _cross_entropy_reduction(loss_fn, outputs, targets):
    """'mean' or 'sum' if loss_fn is plain cross-entropy on (B, C) logits and class indices, else None."""
    plain = dict(weight=None, ignore_index=-100, label_smoothing=0.0)
    if loss_fn is F.cross_entropy:
        reduction = "mean"
    elif type(loss_fn) is nn.CrossEntropyLoss and all(getattr(loss_fn, k) == v for k, v in plain.items()):
        reduction = loss_fn.reduction
    else:
        return None
    ok = (outputs.dim() == 2 and targets.shape == outputs.shape[:1] and not targets.is_floating_point()
          and bool(((targets >= 0) & (targets < outputs.shape[1])).all()))
    return reduction if ok and reduction in ("mean", "sum") else None


def _output_hessian_factors(loss_fn, outputs, targets):
    """lam (Y, B) and cotangents (Y, B, *output) with w * H_n = sum_k lam[k, n] u u^T, u = cotangents[k, n]: each
    example's (weighted) loss Hessian in its Y outputs. For plain cross-entropy the closed form
    H_n = diag(p) - p p^T = S S^T with S = diag(sqrt p) - p sqrt(p)^T (p: the softmax); for any other loss,
    Y double-backward passes in one batch, then eigh."""
    reduction = _cross_entropy_reduction(loss_fn, outputs, targets)
    if reduction is not None:
        p = torch.softmax(outputs, dim=1)  # (B, C)
        root = p.sqrt()
        S = torch.diag_embed(root) - p[:, :, None] * root[:, None, :]  # (B, C, C), column k is the k-th factor
        weight = 1 / len(outputs) if reduction == "mean" else 1.0
        return torch.full((outputs.shape[1], len(outputs)), weight, dtype=p.dtype, device=p.device), S.permute(2, 0, 1)
    weight = _loss_weight(loss_fn, outputs, targets)  # also checks the loss is a mean or sum over examples
    B, Y = len(outputs), outputs[0].numel()
    o = outputs.detach().requires_grad_(True)
    with torch.enable_grad():
        loss_gradient = torch.autograd.grad(_scalar(loss_fn(o, targets)), o, create_graph=True)[0]
        if not loss_gradient.requires_grad:  # a loss linear in the outputs has H_L = 0
            return torch.zeros(Y, B, dtype=o.dtype, device=o.device), torch.zeros(Y, *o.shape, dtype=o.dtype, device=o.device)
        units = torch.eye(Y, dtype=o.dtype, device=o.device).reshape(Y, 1, *o.shape[1:]).expand(Y, *o.shape)
        columns = torch.autograd.grad(loss_gradient, o, units, is_grads_batched=True, materialize_grads=True)[0]
    lam, U = torch.linalg.eigh(columns.reshape(Y, B, Y).permute(1, 2, 0))  # (B, Y), (B, Y, Y): w H_n = U diag(lam) U^T
    return lam.T, U.permute(2, 0, 1).reshape(Y, *o.shape)


@_gradients_enabled
def ggn_diagonal(model: nn.Module, loss_fn: Callable[..., torch.Tensor], inputs: Any, targets: Any, *, per_sample: bool = False) -> dict[str, torch.Tensor]:
    r"""The exact diagonal of the Gauss-Newton matrix G (or each example's share of it).

    For a mean or sum ``w * sum_n`` of per-example losses, with ``H_n = sum_k lam_k u_k u_k^T`` the Hessian of
    example n's loss in its outputs: ``diag G = w * sum_n sum_k lam_k (J_n^T u_k)^2``. One forward pass records
    each parameter's module's input a and output z; Y batched backward passes give dL/dz for the Y cotangents
    u_k; a linear layer's share is then ``sum_k lam_k delta_k^2`` times ``a^2``, any other layer's squares its own
    per-example vjp. A check of every call (the layers' products must rebuild one ordinary vjp) falls back to
    ``vmap`` over examples.

    Args:
        model, loss_fn, inputs, targets: as in :func:`empirical_fisher_vp`.
        per_sample (bool): return each example's share, ``{name: (B, *shape)}``, which sum over B to the diagonal.

    Returns:
        ``{name: tensor shaped like the parameter}`` (``(B, *shape)`` with ``per_sample=True``).

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from torch_func_recipes import ggn_diagonal
        >>> _ = torch.manual_seed(0)
        >>> model, loss_fn = nn.Linear(3, 2, bias=False).double(), nn.functional.cross_entropy
        >>> x, y = torch.randn(8, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1, 0, 0, 1])
        >>> H = torch.autograd.functional.hessian(lambda w: loss_fn(x @ w.T, y), model.weight).reshape(6, 6)
        >>> shares = ggn_diagonal(model, loss_fn, x, y, per_sample=True)
        >>> shares["weight"].shape
        torch.Size([8, 2, 3])
        >>> torch.allclose(shares["weight"].sum(0), H.diagonal().view(2, 3))  # G = H: the model is linear in its weight
        True
    """
    params = _trainable(model, inputs, targets)
    owners = {}  # parameter name -> (the module holding it, its name there)
    for module_name, module in model.named_modules():
        for local, p in module.named_parameters(recurse=False):
            if f"{module_name}.{local}".lstrip(".") in params:
                owners[f"{module_name}.{local}".lstrip(".")] = (module, local)
    modules = list({id(m): m for m, _ in owners.values()}.values())
    calls: dict[int, list] = {id(m): [] for m in modules}
    hooks = [m.register_forward_hook(lambda m, args, out: calls[id(m)].append((args, out))) for m in modules]
    leaves = {name: p.detach().requires_grad_(True) for name, p in params.items()}
    try:
        with torch.enable_grad():
            outputs = functional_call(model, leaves, (inputs,))
    finally:
        for hook in hooks:
            hook.remove()
    with torch.no_grad():
        alone = vmap(lambda x: functional_call(model, params, (x[None],))[0])(inputs)
    scale = outputs.detach().abs().max().item()
    if not torch.allclose(alone, outputs.detach(), rtol=1e-5, atol=1e-5 * scale):
        raise ValueError("the model mixes the examples of a batch (its outputs for an example alone differ from its "
                         "outputs in the batch), so the Gauss-Newton matrix has no per-example diagonal shares")
    lam, cotangents = _output_hessian_factors(loss_fn, outputs.detach(), targets)
    B = len(inputs)
    if all(len(c) == 1 and len(c[0][0]) == 1 and isinstance(c[0][0][0], torch.Tensor) and isinstance(c[0][1], torch.Tensor)
           and c[0][0][0].shape[:1] == (B,) == c[0][1].shape[:1] for c in calls.values()):
        shares = _ggn_diagonal_by_layers(outputs, leaves, owners, modules, calls, lam, cotangents, per_sample)
        if shares is not None:
            return shares
    shares = _ggn_diagonal_by_vmap(model, params, inputs, lam, cotangents)
    return shares if per_sample else {name: s.sum(dim=0) for name, s in shares.items()}


def _ggn_diagonal_by_layers(outputs, leaves, owners, modules, calls, lam, cotangents, per_sample):
    """The diagonal (or per-example shares) from each module's input a and the Y back-propagated dL/dz;
    None if the check fails."""
    deltas = torch.autograd.grad(outputs, [calls[id(m)][0][1] for m in modules], cotangents,
                                 is_grads_batched=True, retain_graph=True, materialize_grads=True)
    Y = len(lam)
    r = torch.linspace(1, 2, Y, dtype=lam.dtype, device=lam.device)  # weights for the check's one combination
    shares, rebuilt = {}, {}
    for m, delta in zip(modules, deltas):
        a = calls[id(m)][0][0][0].detach()
        mine = {local: name for name, (owner, local) in owners.items() if owner is m}
        if type(m) is nn.Linear and a.dim() == 2:  # weight gradient delta a^T, squared: delta^2 (a^2)^T
            D = torch.einsum("kb,kbo->bo", lam, delta**2)
            combined = torch.einsum("k,kbo->bo", r, delta)
            parts = {"weight": (D[:, :, None] * a[:, None, :] ** 2 if per_sample else D.T @ a**2, combined.T @ a),
                     "bias": (D if per_sample else D.sum(0), combined.sum(0))}
        else:  # any other module: its own per-example vjp, for each of the Y cotangents
            local_params = {local: leaves[name].detach() for local, name in mine.items()}
            one = lambda x, d: vjp(lambda p: functional_call(m, p, (x[None],))[0], local_params)[1](d)[0]
            per = vmap(vmap(one), in_dims=(None, 0))(a, delta)  # {local: (Y, B, *shape)}
            parts = {local: (torch.einsum(f"kb,kb...->{'b' if per_sample else ''}...", lam, g**2), torch.einsum("k,kb...->...", r, g))
                     for local, g in per.items()}
        for local, name in mine.items():
            shares[name], rebuilt[name] = parts[local]
    expected = torch.autograd.grad(outputs, list(leaves.values()), torch.einsum("k,k...->...", r, cotangents),
                                   materialize_grads=True)
    tolerance = torch.finfo(lam.dtype).eps ** 0.5
    for name, e in zip(leaves, expected):  # a parameter used outside its module would break the rebuild
        if not torch.allclose(rebuilt[name], e, rtol=tolerance, atol=tolerance * e.abs().max().item()):
            return None
    return {name: shares[name] for name in leaves}


def _ggn_diagonal_by_vmap(model, params, inputs, lam, cotangents):
    """The general path: vmap over examples of vmap over the Y cotangents of the vjp of one example's outputs."""

    def share(x, lam_n, u_n):  # lam_n (Y,), u_n (Y, *output)
        _, vjp_fn = vjp(lambda p: functional_call(model, p, (x[None],))[0], params)
        columns = vmap(vjp_fn)(u_n)[0]  # {name: (Y, *shape)}: J_n^T u_k
        return {name: torch.einsum("k,k...->...", lam_n, c**2) for name, c in columns.items()}

    return vmap(share, in_dims=(0, 1, 1))(inputs, lam, cotangents)


def _rademacher(params, samples, generator):
    """samples random +-1 vectors shaped like params, {name: (samples, *shape)}, drawn on the CPU, then moved."""
    if isinstance(samples, bool) or not isinstance(samples, numbers.Integral) or samples < 1:
        raise ValueError(f"samples must be a positive int, got {samples!r}")
    return {name: (2 * torch.randint(0, 2, (int(samples), *p.shape), generator=generator) - 1).to(p.dtype).to(p.device)
            for name, p in params.items()}


def _hutchinson(model, loss_fn, inputs, targets, samples, generator, chunk_size):
    params = _trainable(model, inputs, targets)
    probes = _rademacher(params, samples, generator)
    _check_chunk_size(chunk_size)
    hvp, step = _hvp_operator(model, loss_fn, inputs, targets, params), chunk_size or int(samples)
    chunks = [hvp({n: t[i:i + step] for n, t in probes.items()}, batched=True) for i in range(0, int(samples), step)]
    return probes, {n: torch.cat([c[n] for c in chunks]) for n in params}


@_gradients_enabled
def hessian_trace(model: nn.Module, loss_fn: Callable[..., torch.Tensor], inputs: Any, targets: Any, *, samples: int, generator: torch.Generator | None = None,
                  chunk_size: int | None = None) -> float:
    r"""Hutchinson's estimate of the trace of the parameter Hessian: the mean of ``v^T H v``.

    Unbiased, with a variance that falls as 1/samples; the probes run through one batched backward pass.

    Args:
        model, loss_fn, inputs, targets: as in :func:`empirical_fisher_vp`.
        samples (int): how many Rademacher vectors v (entries +-1).
        generator (torch.Generator, optional): the CPU generator of the probes.
        chunk_size (int, optional): probes per backward pass; all at once if None.

    Returns:
        A float.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from torch_func_recipes import hessian_trace
        >>> _ = torch.manual_seed(0)
        >>> model, loss_fn = nn.Linear(3, 2, bias=False).double(), nn.functional.cross_entropy
        >>> x, y = torch.randn(8, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1, 0, 0, 1])
        >>> H = torch.autograd.functional.hessian(lambda w: loss_fn(x @ w.T, y), model.weight).reshape(6, 6)
        >>> estimate = hessian_trace(model, loss_fn, x, y, samples=2000, generator=torch.Generator().manual_seed(0))
        >>> isinstance(estimate, float), abs(estimate - H.trace().item()) < 0.05 * H.trace().item()
        (True, True)
    """
    probes, products = _hutchinson(model, loss_fn, inputs, targets, samples, generator, chunk_size)
    return sum((probes[n] * products[n]).flatten(1).sum(dim=1) for n in probes).mean().item()


@_gradients_enabled
def hessian_diagonal(model: nn.Module, loss_fn: Callable[..., torch.Tensor], inputs: Any, targets: Any, *, samples: int,
                     generator: torch.Generator | None = None, chunk_size: int | None = None) -> dict[str, torch.Tensor]:
    r"""Hutchinson's estimate of the diagonal of the parameter Hessian: the mean of ``v * (H v)``.

    Args:
        model, loss_fn, inputs, targets: as in :func:`empirical_fisher_vp`.
        samples, generator, chunk_size: as in :func:`hessian_trace`.

    Returns:
        ``{name: tensor shaped like the parameter}``.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from torch_func_recipes import hessian_diagonal
        >>> _ = torch.manual_seed(0)
        >>> model, loss_fn = nn.Linear(3, 2, bias=False).double(), nn.functional.cross_entropy
        >>> x, y = torch.randn(8, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1, 0, 0, 1])
        >>> H = torch.autograd.functional.hessian(lambda w: loss_fn(x @ w.T, y), model.weight).reshape(6, 6)
        >>> estimate = hessian_diagonal(model, loss_fn, x, y, samples=2000, generator=torch.Generator().manual_seed(0))
        >>> exact = H.diagonal().view(2, 3)
        >>> estimate["weight"].shape, bool((estimate["weight"] - exact).abs().max() < 0.1 * exact.abs().max())
        (torch.Size([2, 3]), True)
    """
    probes, products = _hutchinson(model, loss_fn, inputs, targets, samples, generator, chunk_size)
    return {n: (probes[n] * products[n]).mean(dim=0) for n in probes}


@_gradients_enabled
def top_hessian_eigenvalues(model: nn.Module, loss_fn: Callable[..., torch.Tensor], inputs: Any, targets: Any, k: int = 1, *, iterations: int | None = None,
                            generator: torch.Generator | None = None) -> torch.Tensor:
    r"""The k algebraically largest eigenvalues of the parameter Hessian, largest first.

    Lanczos with full reorthogonalisation on Hessian-vector products, then the eigenvalues of the small
    tridiagonal matrix. With ``iterations = P`` it is exact up to rounding.

    Args:
        model, loss_fn, inputs, targets: as in :func:`empirical_fisher_vp`.
        k (int): how many eigenvalues.
        iterations (int, optional): Hessian-vector products to use; default ``min(P, max(2k + 20, 40))``.
        generator (torch.Generator, optional): the CPU generator of the start vector.

    Returns:
        A 1-d tensor of k eigenvalues. Memory: ``iterations`` vectors of P numbers.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from torch_func_recipes import top_hessian_eigenvalues
        >>> _ = torch.manual_seed(0)
        >>> model, loss_fn = nn.Linear(3, 2, bias=False).double(), nn.functional.cross_entropy
        >>> x, y = torch.randn(8, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1, 0, 0, 1])
        >>> H = torch.autograd.functional.hessian(lambda w: loss_fn(x @ w.T, y), model.weight).reshape(6, 6)
        >>> top = top_hessian_eigenvalues(model, loss_fn, x, y, k=2, generator=torch.Generator().manual_seed(0))
        >>> top.shape, torch.allclose(top, torch.linalg.eigvalsh(H).flip(0)[:2])  # iterations = P = 6 here: exact
        (torch.Size([2]), True)
    """
    params = _trainable(model, inputs, targets)
    total = sum(p.numel() for p in params.values())
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 1 <= k <= total:
        raise ValueError(f"k must be an int from 1 to the number of parameters ({total}), got {k!r}")
    steps = min(total, max(2 * k + 20, 40)) if iterations is None else iterations
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or not k <= steps <= total:
        raise ValueError(f"iterations must be an int from k ({k}) to the number of parameters ({total}), got {steps!r}")
    hvp = _hvp_operator(model, loss_fn, inputs, targets, params)
    sizes, first = [p.numel() for p in params.values()], next(iter(params.values()))

    def matvec(vector):  # flat vector -> flat H v
        pieces = {n: piece.view(p.shape) for (n, p), piece in zip(params.items(), vector.split(sizes))}
        return torch.cat([t.reshape(-1) for t in hvp(pieces).values()])

    start = torch.randn(total, generator=generator, dtype=first.dtype).to(first.device)
    basis, alphas, betas = [start / start.norm()], [], []
    for step in range(int(steps)):
        w = matvec(basis[-1])
        alphas.append(torch.dot(w, basis[-1]))
        Q = torch.stack(basis)
        for _ in range(2):  # full reorthogonalisation, twice ("twice is enough")
            w = w - Q.T @ (Q @ w)
        beta = w.norm()
        if step == steps - 1 or beta <= 1e-12 * max(abs(a.item()) for a in alphas):
            break  # done, or the Krylov space is invariant and the Ritz values are exact
        betas.append(beta)
        basis.append(w / beta)
    tridiagonal = torch.diag(torch.stack(alphas))
    if betas:
        tridiagonal = tridiagonal + torch.diag(torch.stack(betas), 1) + torch.diag(torch.stack(betas), -1)
    ritz = torch.linalg.eigvalsh(tridiagonal).flip(0)  # largest first
    if len(ritz) < k:
        raise ValueError(f"Lanczos stopped in an invariant subspace of dimension {len(ritz)} < k = {k}: "
                         "start from another generator")
    return ritz[:k]


@_gradients_enabled
def gauss_newton_step(model: nn.Module, loss_fn: Callable[..., torch.Tensor], inputs: Any, targets: Any, *, damping: float) -> dict[str, torch.Tensor]:
    r"""The damped Gauss-Newton step ``-(G + damping I)^{-1} g``, solved in output space.

    ``-J^T (damping I + H_L J J^T)^{-1} r``, with J the (B*Y, P) output Jacobian (``vmap`` over examples of
    ``jacrev``), H_L the loss's Hessian in the outputs and r its gradient there: one dense solve of B*Y
    unknowns.

    Args:
        model, loss_fn, inputs, targets: as in :func:`empirical_fisher_vp`.
        damping (float): the damping, positive.

    Returns:
        ``{name: tensor shaped like the parameter}``. Memory: the (B*Y, P) Jacobian.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from torch_func_recipes import gauss_newton_step
        >>> _ = torch.manual_seed(0)
        >>> model, loss_fn = nn.Linear(3, 2, bias=False).double(), nn.functional.cross_entropy
        >>> x, y = torch.randn(8, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1, 0, 0, 1])
        >>> H = torch.autograd.functional.hessian(lambda w: loss_fn(x @ w.T, y), model.weight).reshape(6, 6)
        >>> step = gauss_newton_step(model, loss_fn, x, y, damping=0.1)
        >>> g = torch.autograd.grad(loss_fn(model(x), y), model.weight)[0].flatten()
        >>> expected = -torch.linalg.solve(H + 0.1 * torch.eye(6, dtype=torch.float64), g)  # G = H for this model
        >>> torch.allclose(step["weight"], expected.view(2, 3))
        True
    """
    if isinstance(damping, bool) or not isinstance(damping, numbers.Real) or damping <= 0:
        raise ValueError(f"damping must be a positive number, got {damping!r}")
    params = _trainable(model, inputs, targets)
    outputs = functional_call(model, params, (inputs,))
    blocks = vmap(jacrev(lambda p, x: functional_call(model, p, (x[None],))[0]), in_dims=(None, 0))(params, inputs)
    n = outputs.numel()
    jacobian = torch.cat([blocks[name].reshape(n, -1) for name in params], dim=1)  # (B*Y, P)
    loss_of_outputs = lambda o: _scalar(loss_fn(o, targets))
    residual = grad(loss_of_outputs)(outputs).reshape(n)
    output_hessian = torch.func.hessian(loss_of_outputs)(outputs).reshape(n, n)
    system = damping * torch.eye(n, dtype=outputs.dtype, device=outputs.device) + output_hessian @ (jacobian @ jacobian.T)
    step = -(jacobian.T @ torch.linalg.solve(system, residual))
    sizes = [p.numel() for p in params.values()]
    return {name: piece.view(p.shape) for (name, p), piece in zip(params.items(), step.split(sizes))}


def conjugate_gradient(matvec: Callable[[torch.Tensor], torch.Tensor], b: torch.Tensor, *, tol: float = 1e-10,
                       max_iterations: int | None = None) -> torch.Tensor:
    r"""Solve ``A x = b`` for a symmetric positive definite A given as a matrix-vector product.

    Args:
        matvec (Callable): ``x -> A x`` on flat vectors.
        b (Tensor): the right-hand side, a flat vector.
        tol (float): stop at a relative residual ``|b - A x| <= tol |b|``.
        max_iterations (int, optional): at most this many iterations (default, and when 0: ten times the
            length of b, since rounding can slow convergence past the length that exact arithmetic needs).

    Returns:
        x, shaped like b.

    Raises:
        ValueError: if A shows a direction of non-positive curvature.
        RuntimeError: if the residual is still above ``tol`` after ``max_iterations``.

    Example::

        >>> import torch
        >>> from torch_func_recipes import conjugate_gradient
        >>> _ = torch.manual_seed(0)
        >>> M = torch.randn(5, 5, dtype=torch.float64)
        >>> A, b = M @ M.T + torch.eye(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
        >>> torch.allclose(conjugate_gradient(lambda v: A @ v, b), torch.linalg.solve(A, b))
        True
        >>> conjugate_gradient(lambda v: -v, b)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
            ...
        ValueError: conjugate gradients met non-positive curvature ...
    """
    x, r, p = torch.zeros_like(b), b.clone(), b.clone()
    rr, target, limit = torch.dot(b, b), (tol * b.norm()) ** 2, max_iterations or 10 * b.numel()
    for _ in range(limit):
        if rr <= target:
            return x
        ap = matvec(p)
        curvature = torch.dot(p, ap)
        if curvature <= 0:
            raise ValueError(f"conjugate gradients met non-positive curvature (p^T A p = {curvature.item():.3g}): "
                             "the damped Hessian is not positive definite; increase damping")
        step = rr / curvature
        x, r = x + step * p, r - step * ap
        rr, rr_old = torch.dot(r, r), rr
        p = r + (rr / rr_old) * p
    raise RuntimeError(f"conjugate gradients did not reach tol={tol} in {limit} iterations")


@_gradients_enabled
def influence_scores(model: nn.Module, loss_fn: Callable[..., torch.Tensor], train_inputs: Any, train_targets: Any, test_inputs: Any, test_targets: Any, *,
                     damping: float, tol: float = 1e-10, max_iterations: int | None = None) -> torch.Tensor:
    r"""Each training example's first-order effect on the test loss, ``w * g_test^T (H + damping I)^{-1} g_i``.

    The change of ``loss_fn(model(test_inputs), test_targets)`` when example i's term is removed from the
    training loss: H the Hessian of the training loss, g_i the gradient of example i's own loss, w = 1/N for
    a mean (1 for a sum). Positive: the example helps the test loss. Conjugate gradients on damped
    Hessian-vector products.

    Args:
        model, loss_fn: as in :func:`empirical_fisher_vp`.
        train_inputs, train_targets: the N training examples.
        test_inputs, test_targets: the test batch.
        damping (float): added to H; must make it positive definite.
        tol, max_iterations: as in :func:`conjugate_gradient`.

    Returns:
        A (N,) tensor. Memory: the N x P per-example gradients.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from torch_func_recipes import influence_scores
        >>> _ = torch.manual_seed(0)
        >>> model, loss_fn = nn.Linear(3, 2, bias=False).double(), nn.functional.cross_entropy
        >>> x, y = torch.randn(8, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1, 0, 0, 1])
        >>> H = torch.autograd.functional.hessian(lambda w: loss_fn(x @ w.T, y), model.weight).reshape(6, 6)
        >>> x_test, y_test = torch.randn(3, 3, dtype=torch.float64), torch.tensor([1, 0, 1])
        >>> scores = influence_scores(model, loss_fn, x, y, x_test, y_test, damping=0.1)
        >>> g_test = torch.autograd.grad(loss_fn(model(x_test), y_test), model.weight)[0].flatten()
        >>> g = torch.stack([torch.autograd.grad(loss_fn(model(x[n:n + 1]), y[n:n + 1]), model.weight)[0].flatten() for n in range(8)])
        >>> scores.shape, torch.allclose(scores, g @ torch.linalg.solve(H + 0.1 * torch.eye(6, dtype=torch.float64), g_test) / 8)
        (torch.Size([8]), True)
    """
    if isinstance(damping, bool) or not isinstance(damping, numbers.Real) or damping < 0:
        raise ValueError(f"damping must be a non-negative number, got {damping!r}")
    params = _trainable(model, train_inputs, train_targets)
    _trainable(model, test_inputs, test_targets)
    sizes = [p.numel() for p in params.values()]
    flatten = lambda d: torch.cat([d[n].reshape(-1) for n in params])
    hvp = _hvp_operator(model, loss_fn, train_inputs, train_targets, params)
    test_gradient = flatten(grad(_loss_of_params(model, loss_fn, test_inputs, test_targets))(params))

    def damped_hvp(vector):
        pieces = {n: piece.view(p.shape) for (n, p), piece in zip(params.items(), vector.split(sizes))}
        return flatten(hvp(pieces)) + damping * vector

    solution = conjugate_gradient(damped_hvp, test_gradient, tol=tol, max_iterations=max_iterations)
    loss_of_one, weight = _per_example(model, loss_fn, train_inputs, train_targets, params)
    per_example = vmap(grad(loss_of_one), in_dims=(None, 0, 0))(params, train_inputs, train_targets)
    return weight * torch.cat([per_example[n].flatten(1) for n in params], dim=1) @ solution
