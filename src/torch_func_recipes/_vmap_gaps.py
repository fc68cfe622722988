"""vmap's known gaps and what stands in for it, shared by Chapters 3, 4 and 11.

_unsupported_by_vmap recognises the errors of vmap's known gaps; _recurrent_unrolled computes
nn.RNN/GRU/LSTM layers step by step under vmap; _with_fallbacks is the one driver that picks vmap,
the unroll or the loop. Also copied, without this docstring and the relative import, into the
notebook cells tagged `shared-vmap_gaps` by scripts/build_shared.py: edit it here.
"""

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._trace import PathReport


def _unsupported_by_vmap(error: BaseException, model: nn.Module) -> str | None:
    """Why vmap could not run the model, for the errors of its known gaps (None for any other error)."""
    message = str(error)
    if "don't yet support saved tensor hooks" in message:
        return "torch.func does not support saved tensor hooks (torch.utils.checkpoint, activation offloading)"
    if message.startswith("You tried to vmap over _NoopSaveInputs"):  # torch 2.11's words for the same gap
        return "torch.utils.checkpoint's internal autograd Function has no vmap rule"
    if "escaped from inside a function being vmapped" in message:  # a checkpoint recomputing after vmap returned
        return "a tensor made under vmap was used after vmap returned (torch.utils.checkpoint recomputes in the backward pass)"
    if message.startswith("Batching rule not implemented for"):  # "We could not generate a fallback", or out=/view ops
        return message.split(".")[0].split(";")[0]
    recurrent = [name for name, m in model.named_modules() if isinstance(m, nn.RNNBase)]
    if recurrent and "doesn't match the broadcast shape" in message:
        return f"the recurrent layer {recurrent[0] or 'model'} ({message}): its fused kernel writes in place under vmap"
    return None


class _CannotUnroll(Exception):
    """The step-by-step forward refuses an input it would not compute exactly as the fused kernel does."""


def _gru_cell(gi, h, c, w):
    """PyTorch's GRU step, gates in its order (r, z, n), written as its fused CPU kernel writes it
    (few, wide operations: under vmap each one costs a dispatch, forward and backward)."""
    gh = F.linear(h, w["weight_hh"], w.get("bias_hh"))
    size = h.shape[-1]
    r, z = torch.sigmoid(gh[..., : 2 * size] + gi[..., : 2 * size]).chunk(2, dim=-1)
    n = torch.tanh(gi[..., 2 * size :] + gh[..., 2 * size :] * r)
    return (h - n) * z + n, None


def _lstm_cell(gi, h, c, w):
    """PyTorch's LSTM step, gates in its order (i, f, g, o), then the projection where proj_size > 0."""
    gates = F.linear(h, w["weight_hh"], w.get("bias_hh")) + gi
    i, f, _, o = torch.sigmoid(gates).chunk(4, dim=-1)  # one sigmoid for all; g takes tanh instead
    c = f * c + i * torch.tanh(gates[..., 2 * c.shape[-1] : 3 * c.shape[-1]])
    h = o * torch.tanh(c)
    return (h if "weight_hr" not in w else F.linear(h, w["weight_hr"])), c


def _rnn_cell(activation):
    def cell(gi, h, c, w):
        return activation(F.linear(h, w["weight_hh"], w.get("bias_hh")) + gi), None
    return cell


_CELLS = {"GRU": _gru_cell, "LSTM": _lstm_cell, "RNN_TANH": _rnn_cell(torch.tanh), "RNN_RELU": _rnn_cell(torch.relu)}
_RECURRENT = (nn.RNN, nn.GRU, nn.LSTM)


def _unrollable(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) for every nn.RNN, nn.GRU or nn.LSTM in the model whose forward is the class's own
    (a subclass that overrides forward, or an instance with its own forward, computes something else)."""
    found = []
    for name, module in model.named_modules():
        kind = next((k for k in _RECURRENT if isinstance(module, k)), None)
        if kind is not None and type(module).forward is kind.forward and "forward" not in vars(module):
            found.append((name, module))
    return found


def _unrolled_forward(module, input, hx=None):
    """What module.forward returns, computed one time step at a time from the module's current
    parameters (read by name, so functional_call's tensors are the ones used), out of operations that
    have batching rules. Argument checks are the module's own."""
    kind = type(module).__name__
    if isinstance(input, nn.utils.rnn.PackedSequence):
        raise _CannotUnroll(f"{kind} was given a PackedSequence, which the step-by-step forward does not handle")
    if module.mode not in _CELLS:
        raise _CannotUnroll(f"{kind} has mode {module.mode!r}, which the step-by-step forward does not know")
    lstm, directions = module.mode == "LSTM", 2 if module.bidirectional else 1
    if not isinstance(input, torch.Tensor) or input.dim() not in (2, 3):
        raise ValueError(f"{kind}: Expected input to be 2D or 3D, got {getattr(input, 'ndim', type(input).__name__)}D instead")
    batched = input.dim() == 3
    if not batched:
        input = input.unsqueeze(0 if module.batch_first else 1)
    hidden_size = module.proj_size if lstm and module.proj_size > 0 else module.hidden_size
    if hx is None:
        batch = input.shape[0 if module.batch_first else 1]
        zeros = lambda size: input.new_zeros(module.num_layers * directions, batch, size)
        hx = (zeros(hidden_size), zeros(module.hidden_size)) if lstm else zeros(hidden_size)
    else:
        states = hx if lstm else (hx,)
        if any(s.dim() != (3 if batched else 2) for s in states):
            raise RuntimeError(f"For {'batched 3-D' if batched else 'unbatched 2-D'} input, hx should also be "
                               f"{3 if batched else 2}-D but got {', '.join(f'{s.dim()}-D' for s in states)} tensors")
        if not batched:
            hx = tuple(s.unsqueeze(1) for s in hx) if lstm else hx.unsqueeze(1)
    module.check_forward_args(input, hx, None)
    h0, c0 = hx if lstm else (hx, None)

    names = module._flat_weights_names
    per_group = len(names) // (module.num_layers * directions)
    cell = _CELLS[module.mode]
    layer_input = input.transpose(0, 1) if module.batch_first else input  # (time, batch, features)
    final_h, final_c = [], []
    for layer in range(module.num_layers):
        outputs = []
        for direction in range(directions):
            index = layer * directions + direction
            group = names[index * per_group : (index + 1) * per_group]
            w = {name.rsplit("_l", 1)[0]: getattr(module, name) for name in group}
            h, c = h0[index], None if c0 is None else c0[index]
            steps = F.linear(layer_input, w["weight_ih"], w.get("bias_ih")).unbind(0)  # all input products at once
            order = range(len(steps)) if direction == 0 else range(len(steps) - 1, -1, -1)
            hs = [None] * len(steps)
            for t in order:
                h, c = cell(steps[t], h, c, w)
                hs[t] = h
            outputs.append(torch.stack(hs))
            final_h.append(h)
            final_c.append(c)
        layer_input = outputs[0] if directions == 1 else torch.cat(outputs, dim=-1)
        if module.dropout > 0 and module.training and layer < module.num_layers - 1:
            layer_input = F.dropout(layer_input, module.dropout, training=True)
    output = layer_input.transpose(0, 1) if module.batch_first else layer_input
    h_n = torch.stack(final_h)
    c_n = torch.stack(final_c) if lstm else None
    if not batched:
        output, h_n = output.squeeze(0 if module.batch_first else 1), h_n.squeeze(1)
        c_n = None if c_n is None else c_n.squeeze(1)
    return (output, (h_n, c_n)) if lstm else (output, h_n)


@contextlib.contextmanager
def _recurrent_unrolled(model):
    """Within the block, every recurrent layer _unrollable finds runs _unrolled_forward (an instance
    forward, so hooks still run); yields the list of (name, module). Restored on exit, error or not."""
    layers = _unrollable(model)
    try:
        for _, module in layers:
            module.forward = lambda *args, module=module, **kwargs: _unrolled_forward(module, *args, **kwargs)
        yield layers
    finally:
        for _, module in layers:
            vars(module).pop("forward", None)


def _with_fallbacks(model, path, run_vmap, run_loop, reason):
    """Run run_vmap(), or what can stand in for it: returns (result, PathReport).

    path "general": run_vmap() alone, errors raised. "loop": run_loop() alone. "unroll": run_vmap()
    with the model's nn.RNN/GRU/LSTM layers computed step by step (_recurrent_unrolled); a ValueError
    if there are none or they refuse the input. "auto": the unroll where the model has such layers
    (their fused kernels fail under vmap, so plain vmap is not tried), else plain vmap; where either
    hits one of vmap's known gaps (_unsupported_by_vmap) or the unroll refuses, the loop. Any other
    error is raised unchanged. reason: why no faster path ran, kept in the report of the general path.
    """
    if path == "loop":
        return run_loop(), PathReport("loop", reason)
    layers = _unrollable(model) if path in ("auto", "unroll") else []
    if path == "unroll" and not layers:
        raise ValueError("path='unroll' needs an nn.RNN, nn.GRU or nn.LSTM whose forward is the class's own; the model has none")
    try:
        if not layers:
            return run_vmap(), PathReport("general", reason)
        with _recurrent_unrolled(model):
            result = run_vmap()
        names = ", ".join(f"{type(m).__name__} {n or '(the model)'}" for n, m in layers)
        return result, PathReport("unroll", f"computed step by step under vmap, which cannot run the fused recurrent kernel: {names}")
    except _CannotUnroll as refusal:
        if path == "unroll":
            raise ValueError(f"the unroll does not apply: {refusal}") from None
        reason = f"the unroll cannot run this model: {refusal}"
    except RuntimeError as error:
        why = _unsupported_by_vmap(error, model)
        if why is None or path in ("general", "unroll"):
            raise  # not one of vmap's known gaps: the model's own error, shown as it is
        reason = f"vmap cannot run this model{' (its recurrent layers unrolled)' if layers else ''}: {why}"
    return run_loop(), PathReport("loop", reason)
