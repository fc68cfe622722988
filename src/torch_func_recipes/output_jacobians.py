"""output_jacobian (B, Y, P), split_by_parameter and the empirical NTK."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.func import jacrev, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from ._batch import (
    _as_batch,
    _as_found,
    _call_signature,
    _check_chunk_size,
    _check_model,
    _check_out_memory,
    _dense_grads,
    _first_other_example,
    _generators_kept,
    _Inputs,
    _model_kept,
    _outputs_agree,
    _per_model,
    _random_modules,
    _remembered_draws,
    _Unbatched,
)
from ._layers import _delta_in_dtype, _in_dtype, _rule_named, _write_or_add
from ._trace import PathReport, _check_path, _end_gradients_alone, _fast_path_screen, _traced_forward
from ._vmap_gaps import _with_fallbacks


def output_jacobian(model: nn.Module, inputs: _Inputs | None = None, *, select: Callable[[Any], torch.Tensor] | None = None,
                    unbatched: _Unbatched = (), chunk_size: int | None = None, out: torch.Tensor | None = None,
                    path: str = "auto", report: bool = False, **keyword_inputs: Any) -> torch.Tensor | tuple[torch.Tensor, PathReport]:
    r"""d outputs / d parameters for every example: a (B, Y, P) tensor for a model whose output is (B, Y),
    the P columns in ``named_parameters()`` order (parameters that require grad).

    Args:
        model (nn.Module): the model; never modified (as in :func:`per_sample_grads`: buffers copied and put back).
        inputs (Tensor, tuple or dict): as in :func:`per_sample_grads`, examples along dimension 0.
        select (Callable, optional): a function of the model's output returning the (B, Y) tensor to
            differentiate (for example ``lambda out: out.logits[:, -1]``); None takes the output as it is.
        unbatched (int, str or a tuple of them): inputs every example receives whole.
        chunk_size (int, optional): process this many examples at a time.
        out (Tensor, optional): a (B, Y, P) tensor to write the result into (and return).
        path (str): ``"auto"``, ``"fast"``, ``"vmap"``, ``"unroll"`` or ``"loop"``, as in
            :func:`per_sample_grads`. The fast path is one forward pass and Y backward passes to the layer
            outputs, batched into one, then per-example products; the vmap path is ``vmap(jacrev(...))``;
            the loop runs Y backward passes per example.
        report (bool): also return a :class:`PathReport`.
        **keyword_inputs: the model's keyword arguments, in place of ``inputs`` (``**batch``).

    Returns:
        The (B, Y, P) tensor (B x Y x P numbers) in the parameters' dtype, with ``report=True`` a pair ``(jacobian, PathReport)``. An
        empty batch gives a (0, Y, P) tensor, Y read from the model's output on it.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from torch_func_recipes import output_jacobian
        >>> _ = torch.manual_seed(0)
        >>> model, x = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double(), torch.randn(5, 3, dtype=torch.float64)
        >>> J = output_jacobian(model, x)
        >>> J.shape  # (B, Y, P), P = 3 * 4 + 4 + 4 * 2 + 2
        torch.Size([5, 2, 26])
        >>> rows = [torch.autograd.grad(model(x[b:b + 1])[0, i], list(model.parameters())) for b in range(5) for i in range(2)]
        >>> torch.allclose(J, torch.stack([torch.cat([g.flatten() for g in row]) for row in rows]).reshape(5, 2, 26))
        True
    """
    trainable = _check_model(model)
    batch = _as_batch(inputs, None, unbatched, keyword_inputs)
    if select is not None and not callable(select):
        raise TypeError(f"select must be a function of the model's output, got {type(select).__name__}")
    _check_chunk_size(chunk_size)
    _check_path(path)
    size = len(batch)
    total = sum(p.numel() for p in trainable.values())
    select = select or _identity
    forward = lambda *args, **kwargs: select(model(*args, **kwargs))  # noqa: E731
    if isinstance(out, torch.Tensor):  # its shape, dtype and device are checked once Y is known (_result_buffer)
        _check_out_memory({"out": out}, {**{f"parameter {n}": p for n, p in trainable.items()},
                                         **{f"input {k}": t for k, t in enumerate(batch.tensors())}})
    with torch.inference_mode(False), torch.enable_grad(), _model_kept(model):
        batch = batch.usable_outside_inference_mode()
        if size == 0:
            try:
                with torch.no_grad():
                    output = batch.call(forward)
            except Exception as error:
                raise ValueError("the batch is empty, and the model cannot run on an empty batch to tell the number of "
                                 "outputs Y") from error
            _output_rows(output, 0)
            result = _result_buffer(out, 0, output.shape[1], total, output, trainable)
            return (result, PathReport("none", "the batch is empty")) if report else result
        step = chunk_size or size
        if select is not _identity:
            _check_select_apart(model, select, batch)
        variant = None if select is _identity else id(select)
        reason, owners = _fast_path_screen(model, trainable, "jacobian", path, batch, variant)
        if reason is None:
            start = 0
            while start < size and reason is None:
                rows = slice(start, start + step)
                # a failed trace is remembered per select (by id: a false match costs the fast path, never correctness)
                out, reason = _fast_jacobian_chunk(forward, model, trainable, batch.rows(rows), out, rows, size, total, owners,
                                                   variant)
                start += step
            if reason is None:  # the backward pass may still mix the examples: compared with the loop's ends
                assert out is not None  # written by the first chunk
                written = out
                weights = torch.linspace(1.0, 2.0, written.shape[1], dtype=written.dtype, device=written.device)
                sizes = [p.numel() for p in trainable.values()]  # compared parameter by parameter (_trace._SCALE_FLOOR)
                reason = _end_gradients_alone(model, batch, trainable, "jacobian", lambda n: list((weights @ written[n]).split(sizes)),
                                              lambda one: list(_weighted_row(forward, trainable, one, weights).split(sizes)), variant)
                if reason is None:
                    report_ = PathReport("fast", "a trace of the forward pass showed every operation keeps the examples apart "
                                         "and every use of a trainable parameter is an operation its layer's rule covers")
                    return (written, report_) if report else written
        if path == "fast":
            raise ValueError(f"the fast path does not apply: {reason}")
        run_vmap = lambda module: _vmap_jacrev(module, select, trainable, batch, chunk_size, out, total)
        run_loop = lambda: _loop_jacobian(forward, trainable, batch, out, total)
        result, report_ = _with_fallbacks(model, batch, path, run_vmap, run_loop, reason)  # vmap, the unroll, or the loop
        return (result, report_) if report else result


def _identity(output):
    return output


# Selects whose check passed, per select and model: {select: {model: {call signature}}}. Weak on both sides: a select
# made anew on every call (a lambda in the call) is checked on every call, and one that is freed takes its entry
# with it, so a new function at a freed one's address is never taken for it.
_SELECT_APART: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _check_select_apart(model, select, batch):
    """Refuses (ValueError) a select that mixes the examples' outputs (`out - out.mean(0)`): the model's output for
    two different examples (the first, and the first that differs from it), selected together and row by row, must
    agree, as _batch._check_examples_apart asks of the model. vmap and the loop select each example's output alone
    (zero here), the fast path the batch's. Left undone for a model that draws random numbers, and where the
    model's output has no tensor with the two examples along dimension 0 or select raises on a row (the recipe's
    path then meets the error). A check passed is remembered per select, model and call signature (one forward
    pass of two examples, paid once in a loop over batches that passes the same select function); a select whose
    result depends on more than its argument (a global it reads) is checked with the values it had then."""
    other = _first_other_example(batch) if len(batch) > 1 else None
    if other is None or _random_modules(model) or _remembered_draws(model, batch):
        return
    signature = _call_signature(model, batch)
    passed = _per_model(_per_model(_SELECT_APART, select, weakref.WeakKeyDictionary), model, set)  # unremembered if unreferenceable
    if signature is not None and signature in passed:
        return
    with _generators_kept(model, batch):
        output = batch.rows(slice(0, other + 1, other)).call(model)
    leaves, spec = tree_flatten(output)
    if not any(isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == 2 for t in leaves):
        return
    try:
        together = select(output)
        alone = [select(tree_unflatten([t[n:n + 1] if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == 2 else t
                                        for t in leaves], spec)) for n in (0, 1)]
    except Exception:  # noqa: BLE001 (any error: the recipe's own path meets it; no message is read)
        return
    if not (isinstance(together, torch.Tensor) and together.dim() >= 1 and together.shape[0] == 2 and together.is_floating_point()
            and all(isinstance(a, torch.Tensor) and a.shape == (1, *together.shape[1:]) for a in alone)):
        return
    if not _outputs_agree([together.detach()], [torch.cat(alone).detach()]):
        raise ValueError("select mixes the examples: on the model's outputs for two examples it gives other rows together "
                         "than for each alone (a mean or another operation across dimension 0), so no example's selected "
                         "output has a Jacobian of its own; select each example's rows on their own")
    if signature is not None:
        passed.add(signature)


def _weighted_row(forward, trainable, one, weights):
    """weights @ (one example's Jacobian, (Y, P)), by one backward pass: what output_jacobian's comparison of the fast
    path's end examples with those examples alone (_trace._end_gradients_alone) compares, at the cost of one backward
    pass whatever Y is. The weights (1 to 2, distinct) leave no column out."""
    params = list(trainable.values())
    output = one.call(forward)
    _output_rows(output, 1)
    if not output.requires_grad:
        return weights.new_zeros(sum(p.numel() for p in params))
    grads = _dense_grads(torch.autograd.grad(output[0] @ weights.to(output.dtype), params, allow_unused=True), params)
    return torch.cat([g.reshape(-1) for g in grads]).to(weights.dtype)


def _loop_jacobian(forward, trainable, batch, out, total):
    """One forward pass and Y backward passes per example, each row written into the result."""
    params = list(trainable.values())
    for n in range(len(batch)):
        output = batch.example(n).call(forward)
        _output_rows(output, 1)
        out = _result_buffer(out, len(batch), output.shape[1], total, output, trainable)
        if not output.requires_grad:  # it depends on no parameter: its rows are zero
            out[n].zero_()
            continue
        for j in range(output.shape[1]):
            grads = _dense_grads(torch.autograd.grad(output[0, j], params, retain_graph=True, allow_unused=True), params)
            torch.cat([g.reshape(-1) for g in grads], out=out[n, j])
    return out


def _output_rows(output, batch):
    if not isinstance(output, torch.Tensor) or output.dim() != 2 or output.shape[0] != batch:
        shape = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
        raise ValueError(f"output_jacobian needs a model whose output is (B, Y); for a batch of {batch} it returned {shape}: "
                         "pass select=, a function of the output that returns the (B, Y) tensor to differentiate "
                         "(for a Hugging Face ModelOutput, say, select=lambda out: out.logits)")


def _result_buffer(out, batch, n_out, total, like, trainable):
    """The (B, Y, P) result: out, checked, or a new tensor on like's device, in the parameters' dtype on every path
    (as autograd gives gradients; under autocast the output may be bfloat16 while the parameters are float32)."""
    dtypes = [p.dtype for p in trainable.values()]
    dtype = functools.reduce(torch.promote_types, dtypes) if dtypes else like.dtype
    if out is None:
        return like.new_empty((batch, n_out, total), dtype=dtype)
    if out.shape != (batch, n_out, total) or out.dtype != dtype or out.device != like.device:
        raise ValueError(f"out must be a {dtype} tensor of shape {(batch, n_out, total)} on {like.device}")
    return out


def _fast_jacobian_chunk(forward, model, trainable, part, out, rows, batch, total, owners, variant=None):
    output, layers, reason = _traced_forward(forward, part, trainable, "jacobian", owners, memo=model, variant=variant)
    if reason is not None:
        return out, reason
    _output_rows(output, len(part))
    n_out = output.shape[1]
    out = _result_buffer(out, batch, n_out, total, output, trainable)
    block = out[rows]
    columns, start = {}, 0
    for name, p in trainable.items():
        columns[name] = block[:, :, start : start + p.numel()].unflatten(2, p.shape)
        start += p.numel()
    # the Y basis cotangents, each spread over the whole chunk: one batched backward pass gives every delta
    basis = torch.eye(n_out, dtype=output.dtype, device=output.device)[:, None, :].expand(n_out, len(part), n_out)
    zs = [layer["z"] for layer in layers]
    if not output.requires_grad:  # an output that depends on no parameter (detached by select, say): J = 0
        block.zero_()
        return out, None

    def backward(v):  # a layer output the model's output does not depend on gets zeros (vmap returns tensors only)
        grads = torch.autograd.grad(output, zs, v, retain_graph=True, allow_unused=True)
        return [torch.zeros_like(z) if g is None else g for z, g in zip(zs, grads)]

    try:
        deltas = vmap(backward)(basis)
    except RuntimeError:  # a backward formula vmap cannot batch (one that asks a strided layout's contiguity, say):
        per_output = [backward(v) for v in basis]  # the same gradients, one output at a time
        deltas = [torch.stack(per_layer) for per_layer in zip(*per_output)]
    done: set = set()
    for layer, delta in zip(layers, deltas):
        _jacobian_products(layer, delta.detach(), columns, done)
    return out, None


def _jacobian_products(layer, delta, columns, done=None):
    """One traced layer's rows of the output Jacobian, by its kind's rule (_layers): delta is (Y, B*r, ...),
    columns[name] is (B, Y, *shape); done: as in _write_or_add."""
    _write_or_add(_rule_named(layer["kind"]).jacobian_rows, _in_dtype(layer), _delta_in_dtype(layer, delta), columns, done)


def _vmap_jacrev(model, select, trainable, batch, chunk_size, out, total):
    detached = {name: p.detach() for name, p in trainable.items()}

    def outputs_of_one(params, one):  # a batch of one
        output = select(one.call(model, params))
        _output_rows(output, 1)
        return output[0]

    of_one, in_dims, values = batch.per_example(outputs_of_one)
    # randomness="different": each example draws its own dropout mask (as on the fast path and in per_sample_grads),
    # which all rows of its Jacobian share (jacrev runs the forward pass once per example)
    _as_found()
    blocks = vmap(jacrev(of_one), in_dims=(None, *in_dims), randomness="different", chunk_size=chunk_size)(detached, *values)
    size, n_out = len(batch), next(iter(blocks.values())).shape[1]
    out = _result_buffer(out, size, n_out, total, next(iter(blocks.values())), trainable)
    torch.cat([blocks[name].reshape(size, n_out, -1) for name in trainable], dim=2, out=out)
    return out


def split_by_parameter(jacobian: torch.Tensor, model: nn.Module) -> dict[str, torch.Tensor]:
    r"""Views of a (B, Y, P) output Jacobian, one per parameter, in ``named_parameters()`` order.

    Args:
        jacobian (Tensor): a (B, Y, P) tensor from :func:`output_jacobian` on ``model``.
        model (nn.Module): the model, whose parameters that require grad give the P columns.

    Returns:
        ``{name: (B, Y, *param.shape)}``, views (no copy).

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from torch_func_recipes import output_jacobian, split_by_parameter
        >>> _ = torch.manual_seed(0)
        >>> model, x = nn.Linear(3, 2).double(), torch.randn(4, 3, dtype=torch.float64)
        >>> blocks = split_by_parameter(output_jacobian(model, x), model)
        >>> {name: tuple(block.shape) for name, block in blocks.items()}
        {'weight': (4, 2, 2, 3), 'bias': (4, 2, 2)}
        >>> torch.equal(blocks["weight"][:, 1, 1], x), torch.equal(blocks["weight"][:, 1, 0], torch.zeros_like(x))  # d out_1 / d W_1k = x_k
        (True, True)
    """
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    total = sum(p.numel() for _, p in params)
    if jacobian.dim() != 3 or jacobian.shape[2] != total:
        raise ValueError(f"expected a (B, Y, {total}) Jacobian for this model, got {tuple(jacobian.shape)}")
    views, start = {}, 0
    for name, p in params:
        views[name] = jacobian[:, :, start : start + p.numel()].unflatten(2, p.shape)
        start += p.numel()
    return views


def empirical_ntk(model: nn.Module, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    r"""The empirical neural tangent kernel of two batches.

    Entry ``[a, b, i, j]`` is the dot product, over all parameters, of ``d output_i(x1[a]) / d params`` and
    ``d output_j(x2[b]) / d params``.

    Args:
        model (nn.Module): a model whose output is (N, Y).
        x1 (Tensor): a batch of N1 inputs.
        x2 (Tensor): a batch of N2 inputs.

    Returns:
        A (N1, N2, Y, Y) tensor.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from torch_func_recipes import empirical_ntk
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Linear(3, 2).double()
        >>> x1, x2 = torch.randn(4, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
        >>> K = empirical_ntk(model, x1, x2)
        >>> K.shape
        torch.Size([4, 5, 2, 2])
        >>> # d out_i / d (W, b) is (e_i x^T, e_i), so J1 J2^T is (x1 . x2 + 1) times the identity in (i, j)
        >>> torch.allclose(K, (x1 @ x2.T + 1)[:, :, None, None] * torch.eye(2, dtype=torch.float64))
        True
    """
    for name, x in (("x1", x1), ("x2", x2)):
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            raise ValueError(f"{name} must be a batch of inputs (a tensor with a batch dimension first), "
                             f"got {tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    j1, j2 = output_jacobian(model, x1), output_jacobian(model, x2)
    return torch.einsum("aip,bjp->abij", j1, j2)
