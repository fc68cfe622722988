"""Per-sample gradients and DP-SGD steps.

"Per-sample gradients" (book/03): per_sample_grads (the fast path where a trace shows it exact, else vmap(grad), the unroll
or the loop) and clip_and_noise. "Real models" (book/11): per_sample_grad_norms (the norms without the (B, P)
gradients) and clipped_noisy_gradient (the DP-SGD step from those norms).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import grad, vmap
from torch.overrides import TorchFunctionMode

from ._batch import (
    _as_batch,
    _as_found,
    _check_chunk_size,
    _check_model,
    _check_out_memory,
    _clip_factors,
    _cuda_devices,
    _dense_grads,
    _drew_random_numbers,
    _generator_states,
    _GeneratorWatch,
    _Grads,
    _graph_nodes,
    _held_generators,
    _Inputs,
    _LossFn,
    _model_kept,
    _random_modules,
    _remembered_draws,
    _row_squares,
    _scalar_loss,
    _seen_deterministic,
    _set_generator_states,
    _Unbatched,
)
from ._layers import _autocast_off, _CrossTerms, _delta_in_dtype, _ghost_squares, _in_dtype, _rule_named, _write_or_add
from ._trace import (
    PathReport,
    _changed_by_loss,
    _check_path,
    _end_gradients_alone,
    _example_gradients,
    _fast_path_screen,
    _gradients_checked,
    _losses_of_each,
    _traced_forward,
)
from ._vmap_gaps import _with_fallbacks


def _per_example_products(layer, delta, out, done=None):
    """Writes one traced layer's per-example weight and bias gradients into out[name], by its kind's rule (_layers);
    done: as in _write_or_add."""
    _write_or_add(_rule_named(layer["kind"]).per_example_grads, _in_dtype(layer), _delta_in_dtype(layer, delta.detach()), out, done)


def per_sample_grads(model: nn.Module, loss_fn: _LossFn, inputs: _Inputs | None = None, targets: Any = None, *, unbatched: _Unbatched = (),
                     chunk_size: int | None = None, out: _Grads | None = None, path: str = "auto",
                     report: bool = False, **keyword_inputs: Any) -> _Grads | tuple[_Grads, PathReport]:
    r"""The gradient of each example's own loss, for every parameter that requires grad.

    Args:
        model (nn.Module): the model; it is never modified (parameters, their ``.grad``, buffers, methods, hooks):
            its buffers are copied on the way in, and any buffer its forward pass or hooks write into is put back.
        loss_fn (Callable): ``loss_fn(output, targets)``, or ``loss_fn(output)`` when ``targets`` is None:
            receives the model's output (whatever it returns) and the targets of one example as a batch of
            one, and returns that example's loss as a 0-d tensor.
        inputs (Tensor, tuple or dict): what the model is called with: ``model(inputs)``,
            ``model(*inputs)`` or ``model(**inputs)`` (a Hugging Face batch). Every tensor in it holds the
            examples along dimension 0, except those named in ``unbatched``.
        targets (Tensor, tuple, dict or None): what ``loss_fn`` takes besides the output, examples along
            dimension 0.
        unbatched (int, str or a tuple of them): positions or keys of ``inputs`` that every example
            receives whole (a shared mask, say).
        chunk_size (int, optional): process this many examples at a time, to bound the memory of
            intermediates.
        out (dict, optional): ``{name: (B, *param.shape)}`` tensors to write the result into (and return); the
            fast path writes a non-contiguous one through a contiguous copy of its size.
        path (str): ``"auto"`` (the fast path where a trace of this call establishes that it applies, else
            ``vmap(grad(...))`` with any ``nn.RNN``/``GRU``/``LSTM`` computed step by step, else, where
            that raised, the loop), or a path taken as asked: ``"fast"``, ``"vmap"``, ``"unroll"`` (each
            raises where it does not apply) or ``"loop"`` (one autograd call per example).
        report (bool): also return a :class:`PathReport` saying which path ran and why.
        **keyword_inputs: the model's keyword arguments, in place of ``inputs`` (``targets=labels, **batch``).

    Returns:
        ``{name: Tensor (B, *param.shape)}``, with ``report=True`` a pair ``(grads, PathReport)``. Memory:
        the result (B x P numbers), plus one chunk's intermediates.

    Raises:
        ValueError, TypeError: for the cases in ``_batch``'s table (an empty batch gives empty results).

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from torch_func_recipes import per_sample_grads
        >>> _ = torch.manual_seed(0)
        >>> model, loss_fn = nn.Linear(3, 2).double(), nn.functional.mse_loss
        >>> x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
        >>> grads = per_sample_grads(model, loss_fn, x, y)
        >>> grads["weight"].shape  # (B, *weight.shape)
        torch.Size([4, 2, 3])
        >>> loop = [torch.autograd.grad(loss_fn(model(x[i:i + 1]), y[i:i + 1]), model.weight)[0] for i in range(4)]
        >>> torch.allclose(grads["weight"], torch.stack(loop))
        True
    """
    trainable = _check_model(model)
    batch = _as_batch(inputs, targets, unbatched, keyword_inputs)
    _check_chunk_size(chunk_size)
    _check_path(path)
    size = len(batch)
    if out is not None:
        if not isinstance(out, dict):
            raise TypeError(f"out must be a dict {{name: tensor (B, *param.shape)}}, like the result, got {type(out).__name__}")
        for name, p in trainable.items():
            given = out.get(name)
            if given is None or given.shape != (size, *p.shape) or given.dtype != p.dtype or given.device != p.device:
                raise ValueError(f"out[{name!r}] must be a {p.dtype} tensor of shape {(size, *p.shape)} on {p.device}")
        _check_out_memory({f"out[{name!r}]": out[name] for name in trainable},
                          {**{f"parameter {n}": p for n, p in trainable.items()},
                           **{f"input {k}": t for k, t in enumerate(batch.tensors())}})
    with torch.inference_mode(False), torch.enable_grad(), _model_kept(model):
        batch = batch.usable_outside_inference_mode()
        if size == 0:
            result = out or {name: p.new_empty((0, *p.shape)) for name, p in trainable.items()}
            return (result, PathReport("none", "the batch is empty")) if report else result
        reason, owners = _fast_path_screen(model, trainable, "grads", path, batch)
        if reason is None:
            # the layer rules write through views of each result: a non-contiguous out is written through a copy
            result = {name: p.new_empty((size, *p.shape)) if out is None else out[name] if out[name].is_contiguous()
                      else torch.empty_like(out[name], memory_format=torch.contiguous_format) for name, p in trainable.items()}
            step = chunk_size or size
            for start in range(0, size, step):
                rows = slice(start, start + step)
                reason = _fast_chunk(model, trainable, loss_fn, batch.rows(rows), {n: t[rows] for n, t in result.items()}, owners)
                if reason is not None:
                    break
            if reason is None:  # the backward pass may still mix the examples: compared once per call signature
                reason = _end_gradients_alone(model, batch, trainable, "grads", lambda n: [t[n] for t in result.values()],
                                              _example_gradients(model, loss_fn, trainable))
            if reason is None:
                if out is not None:
                    for name, t in result.items():
                        if t is not out[name]:
                            out[name].copy_(t)
                    result = out
                report_ = PathReport("fast", "a trace of the forward pass showed every operation keeps the examples apart "
                                     "and every use of a trainable parameter is an operation its layer's rule covers")
                return (result, report_) if report else result
        if path == "fast":
            raise ValueError(f"the fast path does not apply: {reason}")

        def run_vmap(module):  # the model, or the unroll's stand-in for it
            grads = _vmap_grad(module, trainable, loss_fn, batch, chunk_size)
            if out is None:
                return grads
            for name, g in grads.items():
                out[name].copy_(g)
            return out

        run_loop = lambda: _loop_grads(model, trainable, loss_fn, batch, out)
        grads, report_ = _with_fallbacks(model, batch, path, run_vmap, run_loop, reason)  # vmap, the unroll, or the loop
        return (grads, report_) if report else grads


def _loop_grads(model, trainable, loss_fn, batch, out):
    """One forward and backward pass per example, each written into its row of the result."""
    result = out if out is not None else {name: p.new_empty((len(batch), *p.shape)) for name, p in trainable.items()}
    alone = _example_gradients(model, loss_fn, trainable)
    for n in range(len(batch)):
        for name, g in zip(trainable, alone(batch.example(n))):
            result[name][n] = g
    return result


def _fast_chunk(model, trainable, loss_fn, batch, out, owners):
    output, layers, reason = _traced_forward(model, batch, trainable, "grads", owners)
    if reason is not None:
        return reason
    total = _losses_of_each(loss_fn, output, batch).sum()
    if (changed := _changed_by_loss(layers)) is not None:
        return changed
    deltas = torch.autograd.grad(total, [layer["z"] for layer in layers], allow_unused=True)
    done: set = set()
    for layer, delta in zip(layers, deltas):
        _per_example_products(layer, torch.zeros_like(layer["z"]) if delta is None else delta, out, done)
    return None


def _vmap_grad(model, trainable, loss_fn, batch, chunk_size):
    """vmap(grad(...)) of one example's loss: the transform's own result, no copy."""
    detached = {name: p.detach() for name, p in trainable.items()}
    loss_of_one, in_dims, values = batch.per_example(lambda params, one: _scalar_loss(one.loss(loss_fn, one.call(model, params))))
    _as_found()
    return vmap(grad(loss_of_one), in_dims=(None, *in_dims), randomness="different", chunk_size=chunk_size)(detached, *values)


def clip_and_noise(per_sample: _Grads, max_norm: float, noise_multiplier: float, generator: torch.Generator | None = None, *,
                   expected_batch_size: int | float | None = None) -> _Grads:
    r"""The DP-SGD gradient from per-sample gradients.

    Clips each example's whole gradient to norm ``max_norm``, sums, adds ``N(0, (noise_multiplier * max_norm)^2)``
    noise to every entry, and divides by ``expected_batch_size``. This is the arithmetic of one step; a
    privacy guarantee also needs Poisson sampling, a privacy accountant and a cryptographically secure
    noise source, which Opacus provides.

    Args:
        per_sample (dict): ``{name: (B, *shape)}`` per-example gradients.
        max_norm (float): the clipping norm C.
        noise_multiplier (float): sigma; the noise's standard deviation is ``sigma * C``.
        generator (torch.Generator, optional): as in :func:`noised_mean`: a CPU generator (then moved), so a
            seeded call gives the same step on any device, or one on the gradients' device; fresh noise on
            their device if None.
        expected_batch_size (int or float, optional): the divisor (with Poisson sampling, the expected batch
            size); B if None.

    Returns:
        ``{name: tensor of shape *shape}``.

    Example::

        >>> import torch
        >>> from torch_func_recipes import clip_and_noise
        >>> _ = torch.manual_seed(0)
        >>> per_sample = {"weight": torch.randn(4, 2, 3, dtype=torch.float64), "bias": torch.randn(4, 2, dtype=torch.float64)}
        >>> norms = torch.cat([per_sample["weight"].flatten(1), per_sample["bias"]], dim=1).norm(dim=1)  # each example's whole gradient
        >>> scale = (0.5 / (norms + 1e-6)).clamp(max=1)  # clipped to norm 0.5
        >>> step = clip_and_noise(per_sample, max_norm=0.5, noise_multiplier=0.0)  # no noise: the clipped mean
        >>> torch.allclose(step["weight"], (scale[:, None, None] * per_sample["weight"]).sum(0) / 4)
        True
        >>> noisy = [clip_and_noise(per_sample, 0.5, 1.1, torch.Generator().manual_seed(7))["bias"] for _ in range(2)]
        >>> torch.equal(*noisy), noisy[0].shape  # one seed, one step
        (True, torch.Size([2]))
    """
    if not isinstance(per_sample, dict) or not per_sample:
        raise ValueError("per_sample must be a non-empty dict {name: tensor (B, *shape)}")
    batch_sizes = {g.shape[0] for g in per_sample.values()}
    if len(batch_sizes) != 1:
        raise ValueError(f"per-sample gradients disagree on the batch size: {sorted(batch_sizes)}")
    if not max_norm > 0:
        raise ValueError(f"max_norm must be positive, got {max_norm}")
    if not noise_multiplier >= 0:
        raise ValueError(f"noise_multiplier must be non-negative, got {noise_multiplier}")
    (batch,) = batch_sizes
    divisor = batch if expected_batch_size is None else expected_batch_size
    if not divisor > 0:
        raise ValueError(f"expected_batch_size must be positive, got {expected_batch_size}")
    norms = torch.stack([_row_squares(g) for g in per_sample.values()]).sum(0).sqrt()
    scale = _clip_factors(norms, max_norm)
    private = {}
    for name, g in per_sample.items():
        clipped_sum = torch.einsum("b,b...->...", scale.to(g.dtype), g)
        private[name] = _noisy_mean(clipped_sum, noise_multiplier * max_norm, divisor, generator)
    return private


def _noisy_mean(total: torch.Tensor, std: float, divisor: int | float, generator: torch.Generator | None) -> torch.Tensor:
    """(total + std * z) / divisor in a new tensor, z standard normal noise shaped like total, drawn where the
    generator lives and moved to total's device: a CPU generator gives the same noise on any device; one on total's
    device, or None (fresh noise), draws it there, without a copy from the host (on a GPU, drawing a large model's
    noise on the CPU costs more than the rest of a DP step). The noise is drawn already scaled by std / divisor
    (normal_ takes the same draws from the generator as torch.randn) and total added in the same buffer: one pass over
    the result, where scaling, adding and dividing in turn took three."""
    where = total.device if generator is None else generator.device
    noise = torch.empty(total.shape, dtype=total.dtype, device=where).normal_(0.0, std / divisor, generator=generator)
    return noise.to(total.device).add_(total, alpha=1 / divisor)


def noised_mean(clipped_sum: _Grads, *, max_norm: float, noise_multiplier: float, expected_batch_size: int | float,
                generator: torch.Generator | None = None) -> _Grads:
    r"""The last step of DP-SGD: ``(clipped_sum + N(0, (noise_multiplier * max_norm)^2)) / expected_batch_size``.

    Args:
        clipped_sum (dict): ``{name: tensor}``, the sum of the clipped per-example gradients of one logical
            batch (from :func:`clipped_grad_sum`, summed over its micro-batches).
        max_norm (float): the clipping norm C; the noise's standard deviation is ``noise_multiplier * C``.
        noise_multiplier (float): sigma, non-negative.
        expected_batch_size (int or float): the divisor (with Poisson sampling, the expected batch size).
        generator (torch.Generator, optional): the generator the noise is drawn from, parameter by parameter
            in the dict's order: a CPU generator (the noise is then moved to each tensor's device, so a seeded
            call gives the same step on any device) or one on the tensors' device (faster on a GPU); None
            draws fresh noise on each tensor's device.

    Returns:
        ``{name: tensor}`` shaped like ``clipped_sum``.

    Example::

        >>> import torch
        >>> from torch_func_recipes import noised_mean
        >>> clipped_sum = {"weight": torch.ones(2, 3, dtype=torch.float64)}
        >>> step = noised_mean(clipped_sum, max_norm=0.5, noise_multiplier=2.0, expected_batch_size=8,
        ...                    generator=torch.Generator().manual_seed(0))
        >>> noise = torch.randn(2, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        >>> torch.allclose(step["weight"], (clipped_sum["weight"] + 2.0 * 0.5 * noise) / 8)
        True
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm must be positive, got {max_norm}")
    if not noise_multiplier >= 0:
        raise ValueError(f"noise_multiplier must be non-negative, got {noise_multiplier}")
    if isinstance(expected_batch_size, bool) or not expected_batch_size > 0:
        raise ValueError(f"the batch is empty or expected_batch_size is not positive ({expected_batch_size})")
    private = {}
    for name, total in clipped_sum.items():  # (total + sigma C noise) / B, in the noise's own buffer: no other copy
        private[name] = _noisy_mean(total, noise_multiplier * max_norm, expected_batch_size, generator)
    return private


class _ParameterUses(TorchFunctionMode):
    """Records, for one forward pass, every torch call that takes a trainable parameter."""

    def __init__(self, trainable):
        super().__init__()
        self.names = {id(p): n for n, p in trainable.items()}
        self.uses: dict[str, list] = {n: [] for n in trainable}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for value in list(args) + list(kwargs.values()):
            if isinstance(value, torch.Tensor) and id(value) in self.names:
                self.uses[self.names[id(value)]].append(func)
        return func(*args, **kwargs)


def _covered_linear_layers(model, batch, trainable):
    """{name: (module, {param name: param}, output shape of one example)} for the nn.Linear layers whose
    trainable parameters are used exactly once, by the layer's own F.linear call, found by one forward pass of one
    example; a layer whose parameters another module also registers (a tied weight) is never a candidate, and a model
    with no candidate is not run."""
    calls: dict[str, list] = {}
    handles = []
    places: dict[int, int] = {}  # id(parameter) -> how many modules register it: a tied weight is never covered
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                places[id(p)] = places.get(id(p), 0) + 1
    for name, module in model.named_modules():
        registered = [p for p in module._parameters.values() if p is not None]
        if (isinstance(module, nn.Linear) and not (module._forward_hooks or module._forward_pre_hooks)
                and any(p.requires_grad for p in registered) and all(places[id(p)] == 1 for p in registered)):
            handles.append(module.register_forward_hook(lambda m, a, z, name=name: calls.setdefault(name, []).append(z.shape)))
    if not handles:  # no layer could be covered: no forward pass is needed to find that out
        return {}
    uses = _ParameterUses(trainable)
    try:
        with torch.enable_grad(), uses:  # gradients on, as in the pass that follows (so no mode-dependent branch or warning differs)
            batch.example(0).call(model)  # one example shows which calls the forward makes
    finally:
        for handle in handles:
            handle.remove()
    layers = {}
    for name, shapes in calls.items():
        module = model.get_submodule(name)
        own = {uses.names[id(p)]: p for p in module._parameters.values() if p is not None and id(p) in uses.names}
        if len(shapes) == 1 and own and all(uses.uses[n] == [F.linear] for n in own):
            layers[name] = (module, own, shapes[0])
    return layers


def per_sample_grad_norms(model: nn.Module, loss_fn: _LossFn, inputs: _Inputs | None = None, targets: Any = None, *,
                          unbatched: _Unbatched = (), chunk_size: int | None = None, path: str = "auto",
                          report: bool = False, **keyword_inputs: Any) -> torch.Tensor | tuple[torch.Tensor, PathReport]:
    r"""The norm of each example's whole gradient (every parameter that requires grad), without holding
    the (B, P) per-example gradients.

    Args:
        model, loss_fn, inputs, targets, unbatched, chunk_size, keyword_inputs: as in :func:`per_sample_grads`.
        path (str): ``"auto"`` (the fast path, one batched forward and backward pass, where a trace of
            this call shows it exact; else ``vmap``, with any recurrent layer unrolled; where that raised,
            the loop), or ``"fast"``, ``"vmap"``, ``"unroll"`` or ``"loop"``, taken as asked.
        report (bool): also return a :class:`PathReport` with how each parameter's share of the norm was
            found (its ``ghost``, ``direct`` and ``streamed`` lists).

    Returns:
        A (B,) tensor without autograd graph, with ``report=True`` a pair ``(norms, PathReport)``. Memory beyond
        the model's own forward and backward pass: on the fast path, each covered layer's input and output,
        kept from the forward pass, and each layer's share reduced as the backward pass reaches it (per chunk of
        ``chunk_size`` examples); for a parameter two layers use (a tied weight), until the second is reached,
        a (B, T, T) matrix of products between their rows and the first one's output gradient where that is a
        factor of the cross term (a linear layer used twice; a table tied to an output layer keeps only the
        matrix); elsewhere, ``chunk_size`` examples' gradients of
        the streamed parameters and their intermediates, the whole batch's when ``chunk_size`` is None
        (``tests/test_norms_memory.py`` measures it).

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from torch_func_recipes import per_sample_grad_norms
        >>> _ = torch.manual_seed(0)
        >>> model, loss_fn = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double(), nn.functional.mse_loss
        >>> x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
        >>> norms = per_sample_grad_norms(model, loss_fn, x, y)
        >>> norms.shape
        torch.Size([5])
        >>> each = [torch.autograd.grad(loss_fn(model(x[i:i + 1]), y[i:i + 1]), list(model.parameters())) for i in range(5)]
        >>> torch.allclose(norms, torch.stack([torch.cat([g.flatten() for g in grads]).norm() for grads in each]))
        True
    """
    trainable = _check_model(model)
    batch = _as_batch(inputs, targets, unbatched, keyword_inputs)
    _check_chunk_size(chunk_size)
    _check_path(path)
    with torch.inference_mode(False), torch.enable_grad(), _model_kept(model):
        batch = batch.usable_outside_inference_mode()
        if len(batch) == 0:
            norms = next(iter(trainable.values())).new_zeros(0)
            return (norms, PathReport("none", "the batch is empty", [], [], [])) if report else norms
        reason, owners = _fast_path_screen(model, trainable, "norms", path, batch)
        if reason is None:
            found, reason = _squared_norms_checked(model, loss_fn, batch, trainable, chunk_size, owners)
            if found is not None:
                squares, ghost, direct, _ = found
                why = "a trace of the forward pass showed every operation keeps the examples apart"
                norms = squares.clamp(min=0).sqrt()
                return (norms, PathReport("fast", why, ghost, direct, [])) if report else norms
        if path == "fast":
            raise ValueError(f"the fast path does not apply: {reason}")
        layers = {} if path == "loop" else _covered_linear_layers(model, batch, trainable)
        streamed = [n for n in trainable if all(n not in own for _, own, _ in layers.values())]
        # per_sample_grads' driver: the path asked for, or recurrent layers step by step under vmap; where vmap raises, the loop
        (squares, ghost, direct), how = _with_fallbacks(
            model, batch, path, lambda module: _squared_norms_by_vmap(module, loss_fn, batch, layers, streamed, chunk_size),
            lambda: (_squared_norms_by_loop(model, loss_fn, batch, trainable), [], []), reason)
        path, reason = how.path, how.reason
        streamed = list(trainable) if path == "loop" else streamed
        norms = squares.clamp(min=0).sqrt()  # inside the block: an ordinary tensor, also under inference_mode
    return (norms, PathReport(path, reason, ghost, direct, streamed)) if report else norms


def _layer_squares(layer, g, batch):
    """[(parameter name, (batch,) squared norms of its per-example gradients, "ghost" or "direct")] for one
    traced layer, from its input and the gradient g of the summed loss with respect to its output, by its
    kind's rule (_layers), with autocast off: under it, the rule's products would run in bfloat16, 4e-3 of each
    term, and a sum of products loses more where its terms cancel (the recorded tensors are cast to the
    parameters' dtype, _in_dtype)."""
    with _autocast_off(g.device.type):
        return _rule_named(layer["kind"]).squared_norms(_in_dtype(layer), g.detach(), batch)


def _lowest_layers(layers):
    """Indices of the layers with no other layer's output below theirs in the autograd graph. Asking
    autograd for their output gradients alone runs the backward pass through every other layer's output."""
    nodes = {layer["z"].grad_fn for layer in layers} - {None}
    lowest = []
    for k, layer in enumerate(layers):
        if layer["z"].grad_fn is None:  # computed without autograd (under torch.no_grad, say): no gradient reaches it
            continue
        if not any(node in nodes for node in _graph_nodes(n for n, _ in layer["z"].grad_fn.next_functions)):
            lowest.append(k)
    return lowest


def _small_shares(layer, g, trainable, batch):
    """The names of the layer's own parameters where the DP step keeps their per-example gradients instead of the
    layer's output gradient g: where the largest of them (the weight's) takes no more memory than g (a
    normalisation layer's scale and shift, a convolution with few weights and many positions, a linear layer on
    at least d_in tokens), so that forming them once serves both the norms and the clipped sum. None elsewhere.
    The bias's share, 1/T of g for T positions, is not counted against it: counting it turned away ConvNeXt's
    pointwise layers (d_in = T = 64), whose pairs of positions then cost 1.25 times the weight product, where
    keeping the product costs it once (it stands in for the weighted sum's) plus 1/T to weight it. Forming the
    shares costs no more than the norms' other ways: a product over the positions whose result is no larger than
    its input."""
    own = [name for name in (layer["weight"], layer["bias"]) if name is not None]
    if not own or not _rule_named(layer["kind"]).supports("grads"):
        return None
    largest = max(trainable[name].numel() for name in own)  # the weight's, where the layer has one
    return own if batch * largest <= g.numel() else None


def _clipped_from_outputs(layers, kept, shares, weights, trainable, in_place=True):
    """[sum_i w_i g_i for each trainable parameter], from the traced layers alone: each layer's output gradient
    (kept: {layer index: gradient of the summed losses at its output}) weighted by its example's w_i, pulled back
    to that layer's own parameters only: by the rule's own formula (weighted_sum: a linear layer's g^T a, one
    matrix product), or else by autograd, which walks only the layer's own operation where the parameter has that
    one use (its input's gradient is not asked for); or, for a layer whose per-example gradients were kept
    (shares: {layer index: {name: (n, *shape)}}, _small_shares), their sum weighted by w. A parameter several
    layers use gets their shares added. in_place=False leaves the kept gradients as they are (for another weighting)."""
    found: dict[str, torch.Tensor | None] = {}
    uses: dict[str, int] = {}

    def add(direct):  # a parameter several layers use (a tied weight): their shares add up
        for name, value in direct.items():
            before = found.get(name)
            found[name] = value if before is None else before if value is None else before + value

    for layer in layers:
        for name in (layer["weight"], layer["bias"]):
            if name is not None:
                uses[name] = uses.get(name, 0) + 1
    for each in shares.values():
        add({name: torch.tensordot(weights.to(e.dtype), e, dims=1) for name, e in each.items()})
    # a kept gradient whose memory no other kept gradient shares (autograd hands one tensor to both inputs of an
    # addition) is reweighted in place: it is not used again, and a fresh copy per layer costs page faults
    memory = Counter(g.untyped_storage().data_ptr() for g in kept.values())
    for k, layer in enumerate(layers):
        own = [name for name in (layer["weight"], layer["bias"]) if name is not None]
        if not own or k not in kept:
            continue
        rule = _rule_named(layer["kind"])
        g = _delta_in_dtype(layer, kept[k]) if rule.has_weighted_sum() else kept[k]  # autograd takes the output's dtype
        per_row = weights.to(g.dtype).repeat_interleave(g.shape[0] // len(weights)).view(-1, *[1] * (g.dim() - 1))
        if rule.has_weighted_sum():  # the layer's own formula (the graph was not kept for these)
            alone = g is not kept[k] or in_place and memory[g.untyped_storage().data_ptr()] == 1 and g.is_contiguous()
            direct = rule.weighted_sum(_in_dtype(layer), g.mul_(per_row) if alone else g * per_row)
            if direct is None:
                raise RuntimeError(f"the {rule.kind} rule defines weighted_sum but gave no answer")
        else:
            if any(uses[name] > 1 for name in own):  # autograd would also walk back through the parameter's other uses
                raise RuntimeError(f"the {rule.kind} rule has no weighted_sum, and a parameter of its layer has other uses")
            got = torch.autograd.grad(layer["z"], [trainable[name] for name in own], g * per_row, retain_graph=True,
                                      allow_unused=True)
            direct = dict(zip(own, got))
        add(direct)
    return [found.get(name) for name in trainable]


def _squared_norms_checked(model, loss_fn, batch, trainable, chunk_size, owners, max_norm=None, weights=None):
    """_squared_norms_fast, then its first and last examples compared with those examples alone, once per model and
    call signature (_end_gradients_alone: a backward pass that mixes the examples keeps the call off the fast path).
    For the norms alone, their squared norms; for a weighted sum (max_norm or weights), their gradients, taken from
    the same output gradients as the sum, parameter by parameter: a mixing on a layer whose gradients are 1e-5 of
    another's moves the squared norm by 1e-10, but that layer's share of the sum by as much as the mixing.
    Returns (found, None), or (None, the reason the fast path steps aside)."""
    book = max_norm is not None or weights is not None
    ends = book and not _gradients_checked(model, batch, trainable, "weighted sum")
    found, reason = _squared_norms_fast(model, loss_fn, batch, trainable, chunk_size, owners, max_norm, weights, ends)
    if found is not None and not book:
        reason = _end_gradients_alone(model, batch, trainable, "norms", lambda n: [found[0][n:n + 1]],
                                      _example_gradients(model, loss_fn, trainable, norms=True))
    elif found is not None and ends:
        reason = _end_gradients_alone(model, batch, trainable, "weighted sum", lambda n: found[4][n],
                                      _example_gradients(model, loss_fn, trainable), covers=("norms",))
    return (found, None) if found is not None and reason is None else (None, reason)


def _squared_norms_fast(model, loss_fn, batch, trainable, chunk_size, owners, max_norm=None, weights=None, ends=False):
    """On the batched forward and backward pass, where a trace shows each example's rows stay its own:
    ((B,) squared norms, ghost names, direct names, clipped sum or None), or None and the reason it does
    not apply. Each layer's output gradient is reduced to its share of the norms by a hook as soon as the
    backward pass reaches it, so they are never all held at once. With max_norm, the book-keeping of Bu et
    al. (2023): each layer's output gradient is kept (as large as its output), and once the norms are known,
    sum_i min(1, max_norm / n_i) g_i comes from each layer's own parameters alone, the gradient of its output
    weighted row by row by the clip factors: no second backward pass through the model, no per-example
    gradient larger than its layer's output gradient (a layer whose per-example gradients are no larger, a
    normalisation's scale and shift, keeps those instead: _small_shares), and the same forward pass (so the
    same dropout masks). With weights (a (B,) tensor, in place of the clip factors), that weighted sum without the
    norms: the squares returned are then zeros. ends=True (with max_norm or weights) adds a fifth item: {n: the
    gradients of example n} for the first and last examples, from the same output gradients (what
    _squared_norms_checked compares with those examples alone)."""
    squares, how, end_grads = [], {}, {}
    book = max_norm is not None or weights is not None
    clipped: list[torch.Tensor | None] | None = [None] * len(trainable) if book else None
    step = chunk_size or len(batch)
    for start in range(0, len(batch), step):
        part = batch.rows(slice(start, start + step))
        output, layers, reason = _traced_forward(model, part, trainable, "norms", owners)
        if reason is not None:
            return None, reason
        losses = _losses_of_each(loss_fn, output, part)
        if (changed := _changed_by_loss(layers)) is not None:
            return None, changed
        total = losses.sum()
        chunk, done = losses.new_zeros(len(part), dtype=next(iter(trainable.values())).dtype), set()
        kept: dict[int, torch.Tensor] = {}
        shares: dict[int, dict[str, torch.Tensor]] = {}
        cross = _CrossTerms(layers, len(part))  # a parameter two layers use (a tied weight): their inner products
        if cross.mixed:
            name, first, second = cross.mixed[0]
            return None, (f"parameter {name} is used by a {layers[first]['kind']} layer and a {layers[second]['kind']} "
                          "layer whose shares of its gradient the norms cannot combine")

        def take(k, g):
            layer = layers[k]  # noqa: F821 (ruff: `del layers` below; take runs before it)
            small = _small_shares(layer, g, trainable, len(part)) if book else None
            if book and small is None:
                kept[k] = g.detach()  # noqa: F821 (as above); in the output's dtype, cast where used
            g = _delta_in_dtype(layer, g)
            if small is not None:  # the per-example gradients themselves, for the norms and the clipped sum
                each = {name: g.new_empty((len(part), *trainable[name].shape), dtype=trainable[name].dtype) for name in small}
                _per_example_products(layer, g, each)
                shares[k] = each  # noqa: F821 (as above)
                for name, e in each.items() if weights is None else ():
                    chunk.add_(_row_squares(e))
                    how[name] = "direct"
            elif weights is None:
                for name, s, kind in _layer_squares(layer, g, len(part)):
                    chunk.add_(s)
                    how[name] = kind
            if cross.pairs and weights is None:
                between = cross.take(k, g)
                if between is not None:
                    chunk.add_(between)
            done.add(k)

        lowest = _lowest_layers(layers) if total.requires_grad else []
        handles = [layer["z"].register_hook(lambda g, k=k: take(k, g)) for k, layer in enumerate(layers)
                   if k not in lowest and layer["z"].grad_fn is not None]
        try:
            # the graph outlives this pass only for a clipped sum that some layer's rule leaves to autograd
            asks_autograd = clipped is not None and any(not _rule_named(layer["kind"]).has_weighted_sum() for layer in layers)
            deltas = torch.autograd.grad(total, [layers[k]["z"] for k in lowest], allow_unused=True,
                                         retain_graph=asks_autograd) if lowest else []
        finally:
            for handle in handles:
                handle.remove()
        for k, delta in zip(lowest, deltas):
            take(k, torch.zeros_like(layers[k]["z"]) if delta is None else delta)
        for k in set(range(len(layers))) - done:  # outputs the loss does not depend on: a share of zero
            take(k, torch.zeros_like(layers[k]["z"]))
        if cross.pairs and weights is None and (unsure := cross.unsure(chunk, start)) is not None:
            return None, unsure
        squares.append(chunk)
        for n in (0, len(batch) - 1) if ends and clipped is not None and total.requires_grad else ():
            if start <= n < start + len(part):  # example n's gradient: the output gradients weighted by a one-hot
                one_hot = chunk.new_zeros(len(part)).index_fill_(0, torch.tensor([n - start], device=chunk.device), 1.0)
                end_grads[n] = _clipped_from_outputs(layers, kept, shares, one_hot, trainable, in_place=False)
        if clipped is not None and total.requires_grad:  # book-keeping: each layer's output gradient, reweighted
            factors = _clip_factors(chunk.clamp(min=0).sqrt(), max_norm) if weights is None else weights[start:start + len(part)]
            grads = _clipped_from_outputs(layers, kept, shares, factors, trainable)
            clipped = [g if c is None else (c if g is None else c + g) for c, g in zip(clipped, grads)]
        del output, layers, deltas, kept, shares, losses, total
    result = None if clipped is None else {name: torch.zeros_like(p) if g is None else g
                                           for (name, p), g in zip(trainable.items(), clipped)}
    found: tuple = (torch.cat(squares), sorted(n for n, k in how.items() if k == "ghost"),
                    sorted(n for n, k in how.items() if k == "direct"), result)
    if ends:
        params = list(trainable.values())
        found += ({n: _dense_grads(end_grads.get(n, [None] * len(params)), params) for n in (0, len(batch) - 1)},)
    return found, None


def _squared_norms_by_vmap(model, loss_fn, batch, layers, streamed, chunk_size):
    """(B,) squared norms, ghost names, direct names, under vmap: the streamed parameters' per-example
    gradients, and each covered layer's share from its input and the gradient of a zero probe added to its
    output. Every parameter enters detached (the covered ones as constants), so no autograd graph outlives a
    chunk: memory is one chunk's per-example gradients and intermediates."""
    rest = {n: p.detach() for n, p in model.named_parameters() if n in streamed}
    fixed = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad and n not in streamed}

    def loss_of_one(rest, probes, one):
        captured, handles = [], []
        for (module, _, _), probe in zip(layers.values(), probes):
            def hook(m, args, z, probe=probe):
                captured.append(args[0].detach().clone())  # the layer's input, safe from later in-place changes
                return z + probe  # d loss / d probe is d loss / d z
            handles.append(module.register_forward_hook(hook))
        try:
            loss = _scalar_loss(one.loss(loss_fn, one.call(model, {**fixed, **rest})))
        finally:
            for handle in handles:
                handle.remove()
        return loss, captured

    first = next(iter(model.parameters()))
    dtype, device = first.dtype, first.device
    squares = torch.zeros(len(batch), dtype=dtype, device=device)
    ghost: set[str] = set()
    direct: set[str] = set()
    step = chunk_size or len(batch)
    for start in range(0, len(batch), step):
        rows = slice(start, start + step)
        part = batch.rows(rows)
        n = len(part)
        of_one, in_dims, values = part.per_example(lambda extra, one: loss_of_one(extra[0], extra[1], one))
        _as_found()
        per_example = vmap(grad(lambda rest, probes, *v: of_one((rest, probes), *v), argnums=(0, 1), has_aux=True),
                           in_dims=(None, 0, *in_dims), randomness="different")
        probes = [torch.zeros((n, *shape), dtype=dtype, device=device) for _, _, shape in layers.values()]
        (rest_grads, output_grads), layer_inputs = per_example(rest, probes, *values)
        with _autocast_off(device.type):  # as on the fast path (_layer_squares)
            _add_squares(squares, rows, rest_grads, layers, layer_inputs, output_grads, n, ghost, direct)
    return squares, sorted(ghost), sorted(direct)


def _add_squares(squares, rows, rest_grads, layers, layer_inputs, output_grads, n, ghost, direct):
    """_squared_norms_by_vmap's sum for one chunk: the streamed parameters' squared norms, and each covered layer's
    share from its input and output gradient, into squares[rows]; the covered names into ghost and direct."""
    if rest_grads:  # one norm per parameter and example, then one sum: a few operations per parameter, no copy
        squares[rows] += torch.stack([_row_squares(g) for g in rest_grads.values()]).sum(0)
    for (module, own, _), a, g in zip(layers.values(), layer_inputs, output_grads):
        a, g = a.reshape(n, -1, a.shape[-1]), g.reshape(n, -1, g.shape[-1])  # (n, T, d_in), (n, T, d_out)
        for name, p in own.items():
            if p is module.bias:
                squares[rows] += g.sum(1).square().sum(1)
                direct.add(name)
            elif a.shape[1] ** 2 <= a.shape[2] * g.shape[2]:  # token pairs cost less than the product
                squares[rows] += _ghost_squares(a, g)
                ghost.add(name)
            else:
                squares[rows] += (g.transpose(1, 2) @ a).square().sum((1, 2))
                direct.add(name)


def _squared_norms_by_loop(model, loss_fn, batch, trainable):
    alone = _example_gradients(model, loss_fn, trainable, norms=True)
    return torch.cat([alone(batch.example(n))[0] for n in range(len(batch))])


def clipped_noisy_gradient(model: nn.Module, loss_fn: _LossFn, inputs: _Inputs | None = None, targets: Any = None, *, max_norm: float,
                           noise_multiplier: float, generator: torch.Generator | None = None,
                           expected_batch_size: int | float | None = None, norms: torch.Tensor | None = None,
                           unbatched: _Unbatched = (), chunk_size: int | None = None, path: str = "auto",
                           report: bool = False, **keyword_inputs: Any) -> _Grads | tuple[_Grads, PathReport]:
    r"""One DP-SGD step's gradient in one call, without any ``(B, *shape)`` tensor:
    ``(sum_i min(1, max_norm / (n_i + 1e-6)) * g_i + N(0, (noise_multiplier * max_norm)^2)) / B``,
    the arithmetic of :func:`clip_and_noise`.

    The clipped sum is :func:`clipped_grad_sum`'s (each example's norm and gradient from the same forward
    pass, so dropout's masks agree and each example adds at most ``max_norm``), then the noise
    (:func:`noised_mean`). To accumulate micro-batches, add up :func:`clipped_grad_sum` over them and call
    :func:`noised_mean` once. Memory: as :func:`clipped_grad_sum`.

    Args:
        model, loss_fn, inputs, targets, unbatched, chunk_size, path, keyword_inputs: as in :func:`per_sample_grad_norms`.
        max_norm (float): the clipping norm C.
        noise_multiplier (float): sigma; the noise's standard deviation is ``sigma * C``.
        generator (torch.Generator, optional): the noise's generator, as in :func:`noised_mean`.
        expected_batch_size (int or float, optional): B (with Poisson sampling); the batch's size if None.
        norms (Tensor, optional): the (B,) gradient norms, when already computed on this model and batch.
        report (bool): also return the clipped sum's :class:`PathReport`.

    Returns:
        ``{name: tensor shaped like the parameter}``, with ``report=True`` a pair ``(gradient, PathReport)``.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from torch_func_recipes import clipped_grad_sum, clipped_noisy_gradient
        >>> _ = torch.manual_seed(0)
        >>> model, loss_fn = nn.Linear(3, 2).double(), nn.functional.mse_loss
        >>> x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
        >>> step = clipped_noisy_gradient(model, loss_fn, x, y, max_norm=0.1, noise_multiplier=1.0, generator=torch.Generator().manual_seed(0))
        >>> total = clipped_grad_sum(model, loss_fn, x, y, max_norm=0.1)
        >>> noise = torch.randn(2, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)  # drawn for weight first
        >>> torch.allclose(step["weight"], (total["weight"] + 1.0 * 0.1 * noise) / 4)
        True
    """
    batch = _as_batch(inputs, targets, unbatched, keyword_inputs)
    divisor = len(batch) if expected_batch_size is None else expected_batch_size
    clipped, how = cast(tuple[_Grads, PathReport], clipped_grad_sum(
        model, loss_fn, inputs, targets, max_norm=max_norm, norms=norms, unbatched=unbatched, chunk_size=chunk_size, path=path,
        report=True, **keyword_inputs))
    with torch.inference_mode(False):  # ordinary tensors, also when called under inference_mode
        result = noised_mean(clipped, max_norm=max_norm, noise_multiplier=noise_multiplier, expected_batch_size=divisor,
                             generator=generator)
    return (result, how) if report else result


def clipped_grad_sum(model: nn.Module, loss_fn: _LossFn, inputs: _Inputs | None = None, targets: Any = None, *, max_norm: float,
                     norms: torch.Tensor | None = None, unbatched: _Unbatched = (), chunk_size: int | None = None,
                     path: str = "auto", report: bool = False, **keyword_inputs: Any) -> _Grads | tuple[_Grads, PathReport]:
    r"""``sum_i min(1, max_norm / (n_i + 1e-6)) * g_i``: the examples' gradients, each clipped to norm
    ``max_norm``, summed, without noise (the part of a DP-SGD step that micro-batches add up).

    Each example's norm ``n_i`` and gradient ``g_i`` come from the same forward pass, so a model that is
    random in training mode (dropout) uses the same masks in both, and each example's contribution has norm
    at most ``max_norm``. Where a trace shows it exact (``"fast"``): per chunk, one batched forward pass and
    one backward pass to the layers' outputs, which gives the norms; then, by book-keeping (Bu et al., 2023),
    each layer's output gradient, weighted row by row by its example's ``min(1, max_norm / n_i)``, is pulled
    back to that layer's own parameters only, with no second pass through the model (a layer whose
    per-example gradients take no more memory than its output gradient, a normalisation's scale and shift,
    keeps those instead, from the norms, and weights them); memory: the layers' output gradients, as large
    as their outputs, and no ``(B, *shape)`` tensor larger than its layer's output gradient; on the first call of a
    call signature also the first and last examples' gradients (two parameter-sized sets), taken from the same
    output gradients and compared with those examples alone, so that a backward pass that mixes the examples (a
    gradient hook on an activation) keeps the call off the fast path. Elsewhere
    (``"vmap"``, ``"unroll"``, else ``"loop"``, one example at a time) each chunk's per-example gradients are
    clipped and summed: memory ``chunk_size`` examples' gradients, the whole batch's when ``chunk_size`` is None.
    With ``norms`` given, the same on a new forward pass, with the clip factors from ``norms`` (the norms are not
    computed again; the first call of a call signature is checked as above): pass ``norms`` only for a model
    without randomness, whose forward passes agree (a forward pass that draws random numbers is refused). The factors weight each example's
    gradient, never its loss: weighting the losses would weight the gradients only where the backward pass is linear
    in the weights, and a gradient hook that clamps or normalises what it is given is not.

    Args:
        model, loss_fn, inputs, targets, unbatched, chunk_size, path, keyword_inputs: as in :func:`per_sample_grad_norms`.
        max_norm (float): the clipping norm C.
        norms (Tensor, optional): each example's gradient norm, a (B,) tensor from
            :func:`per_sample_grad_norms` on the same model and batch, for a model without randomness;
            computed here, on the same forward pass as the sum, when None.
        report (bool): also return a :class:`PathReport`.

    Returns:
        ``{name: tensor shaped like the parameter}``, with ``report=True`` a pair ``(sum, PathReport)``.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from torch_func_recipes import clipped_grad_sum
        >>> _ = torch.manual_seed(0)
        >>> model, loss_fn = nn.Linear(3, 2).double(), nn.functional.mse_loss
        >>> x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
        >>> total = clipped_grad_sum(model, loss_fn, x, y, max_norm=0.1)
        >>> each = [torch.autograd.grad(loss_fn(model(x[i:i + 1]), y[i:i + 1]), [model.weight, model.bias]) for i in range(4)]
        >>> scale = [(0.1 / (torch.cat([w.flatten(), b]).norm() + 1e-6)).clamp(max=1) for w, b in each]
        >>> torch.allclose(total["weight"], sum(s * w for s, (w, _) in zip(scale, each)))
        True
    """
    trainable = _check_model(model)
    batch = _as_batch(inputs, targets, unbatched, keyword_inputs)
    _check_chunk_size(chunk_size)
    _check_path(path)
    if not max_norm > 0:
        raise ValueError(f"max_norm must be positive, got {max_norm}")
    if norms is not None and (not isinstance(norms, torch.Tensor) or norms.shape != (len(batch),)):
        raise ValueError(f"norms must be a ({len(batch)},) tensor, one norm per example")
    if norms is not None and len(batch) and bool((~(norms >= 0)).any()):  # one check for NaN and negative norms
        raise ValueError("norms must be non-negative numbers (a negative norm would flip its example's gradient, a NaN "
                         "one make the whole sum NaN); pass per_sample_grad_norms' result")
    random = _random_modules(model)
    if norms is not None and random:
        raise ValueError(f"norms were given, but {random[0][0]} ({type(random[0][1]).__name__}) is random in training "
                         "mode: norms from another forward pass do not match this pass's random draws, and the clipping "
                         "bound could break; leave norms=None to get both from one forward pass")
    with torch.inference_mode(False), torch.enable_grad(), _model_kept(model):
        batch = batch.usable_outside_inference_mode()
        if len(batch) == 0:
            zeros = {name: torch.zeros_like(p) for name, p in trainable.items()}
            return (zeros, PathReport("none", "the batch is empty")) if report else zeros
        if norms is None:  # norms and sum from one forward pass per example: the same dropout masks in both
            result, how = _clipped_sum_one_pass(model, loss_fn, batch, trainable, max_norm, chunk_size, path)
            return (result, how) if report else result
        weights = _clip_factors(norms.detach().clone(), max_norm)  # clone: norms made under inference_mode
        cuda, held = _cuda_devices(model, batch), _held_generators(model)
        before = _generator_states(cuda, held)  # a forward pass that draws random numbers is not the one the norms came from
        with _GeneratorWatch() as watch:  # the generators drawn from that the states do not cover (held deeper, global)
            reason, owners = _fast_path_screen(model, trainable, "norms", path, batch)
            if reason is None:  # book-keeping with the given weights: each layer's output gradient, weighted
                found, reason = _squared_norms_checked(model, loss_fn, batch, trainable, chunk_size, owners, weights=weights)
                if found is not None:
                    total, how = found[3], PathReport("fast", "a trace of the forward pass showed every operation keeps the examples apart")
            if reason is not None:
                if path == "fast":
                    raise ValueError(f"the fast path does not apply: {reason}")
                total, how = _weighted_sum_of_examples(model, loss_fn, batch, trainable, chunk_size, path, reason, weights=weights)
            grads = [total[name] for name in trainable]
        # a generator the states do not cover was drawn from: a draw, unless the examples' check ran this signature
        # twice and found it deterministic (a generator the model makes and seeds in forward)
        unknown = bool(watch.others(held)) and not _seen_deterministic(model, batch)
        if _drew_random_numbers(before, cuda, held) or unknown or _remembered_draws(model, batch):
            _set_generator_states(before, cuda, held)  # a refused call leaves every generator it drew from as it was
            watch.restore(held)
            raise ValueError("norms were given, but the model's forward pass draws random numbers (F.dropout, a dropout "
                             "rate, noise): the norms came from other draws, so the clipping bound would not hold; "
                             "leave norms out (one forward pass then gives both) or call model.eval()")
    result = dict(zip(trainable, _dense_grads(grads, list(trainable.values()))))
    return (result, how) if report else result


def _clipped_sum_one_pass(model, loss_fn, batch, trainable, max_norm, chunk_size, path):
    """sum_i min(1, max_norm / (n_i + 1e-6)) g_i and its PathReport, each example's norm n_i and gradient g_i
    from the same forward pass (so the same dropout masks, and the clipping bound holds): on the fast path,
    two backward passes of one batched forward pass per chunk; elsewhere, each chunk's per-example gradients
    (vmap, with recurrent layers unrolled; where that raised, one example at a time), clipped and summed."""
    reason, owners = _fast_path_screen(model, trainable, "norms", path, batch)
    if reason is None:
        found, reason = _squared_norms_checked(model, loss_fn, batch, trainable, chunk_size, owners, max_norm)
        if found is not None:
            return found[3], PathReport("fast", "a trace of the forward pass showed every operation keeps the examples apart")
    if path == "fast":
        raise ValueError(f"the fast path does not apply: {reason}")
    return _weighted_sum_of_examples(model, loss_fn, batch, trainable, chunk_size, path, reason, max_norm=max_norm)


def _weighted_sum_of_examples(model, loss_fn, batch, trainable, chunk_size, path, reason, max_norm=None, weights=None):
    """sum_i w_i g_i and its PathReport from each chunk's per-example gradients (vmap, with recurrent layers unrolled;
    where that raised, one example at a time): w_i = min(1, max_norm / (n_i + 1e-6)) from each example's own
    gradient, or the weights given (a (B,) tensor)."""

    def weigh_and_add(total, grads, start):  # grads: {name: (n, *shape)}, the gradients of examples start, start + 1, ...
        if weights is None:
            squares = torch.stack([_row_squares(g) for g in grads.values()]).sum(0)
            factors = _clip_factors(squares.sqrt(), max_norm)
        else:
            factors = weights[start:start + len(next(iter(grads.values())))]
        return {name: total[name] + torch.tensordot(factors.to(g.dtype), g, dims=1) for name, g in grads.items()}

    def run_vmap(module):  # the model, or the unroll's stand-in for it: chunk_size examples' gradients at a time
        total = {name: torch.zeros_like(p) for name, p in trainable.items()}
        step = chunk_size or len(batch)
        for start in range(0, len(batch), step):
            total = weigh_and_add(total, _vmap_grad(module, trainable, loss_fn, batch.rows(slice(start, start + step)), None), start)
        return total

    def run_loop():
        total = {name: torch.zeros_like(p) for name, p in trainable.items()}
        alone = _example_gradients(model, loss_fn, trainable)
        for n in range(len(batch)):
            total = weigh_and_add(total, {name: g[None] for name, g in zip(trainable, alone(batch.example(n)))}, n)
        return total
    return _with_fallbacks(model, batch, path, run_vmap, run_loop, reason)
