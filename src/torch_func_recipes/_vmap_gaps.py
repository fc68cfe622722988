"""What stands in for vmap where it cannot run a model, shared by the per-example recipes.

_unrolled_stand_in builds a stand-in for a model whose nn.RNN/GRU/LSTM layers compute step by step
under vmap (the model itself is never written to); _with_fallbacks is the one driver that picks vmap,
the unroll or the loop, from the model's modules before running, and takes the loop only after vmap
raised. Also copied, without this docstring and the relative import, into the notebook cells tagged
`shared-package` by scripts/build_shared.py: edit it here.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._batch import _check_examples_apart, _check_parameters_reached, _hooked_parameters
from ._trace import PathReport


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
    final_h: list = []
    final_c: list = []
    for layer in range(module.num_layers):
        outputs = []
        for direction in range(directions):
            index = layer * directions + direction
            group = names[index * per_group : (index + 1) * per_group]
            w = {name.rsplit("_l", 1)[0]: getattr(module, name) for name in group}
            h, c = h0[index], None if c0 is None else c0[index]
            steps = F.linear(layer_input, w["weight_ih"], w.get("bias_ih")).unbind(0)  # all input products at once
            order = range(len(steps)) if direction == 0 else range(len(steps) - 1, -1, -1)
            hs: list = [None] * len(steps)
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


_UNROLLED_CLASSES: dict[type, type] = {}


def _unrolled_class(cls: type) -> type:
    """A subclass of cls, under the same name, whose forward is _unrolled_forward (one per class, kept)."""
    if cls not in _UNROLLED_CLASSES:
        _UNROLLED_CLASSES[cls] = type(cls.__name__, (cls,), {"forward": _unrolled_forward, "__module__": cls.__module__,
                                                            "__doc__": f"{cls.__name__}, computed step by step."})
    return _UNROLLED_CLASSES[cls]


def _shallow_copy(module: nn.Module, cls: type | None = None) -> nn.Module:
    """A new object of class cls (the module's own by default) sharing the module's attributes, hooks,
    parameters, buffers and submodules, but with dicts of its own to hold the last three: what is set on
    the copy (functional_call's tensors, a submodule replaced) never reaches the module."""
    twin: nn.Module = object.__new__(cls or type(module))  # no __init__ and no __setstate__: nothing runs on the module
    vars(twin).update(vars(module))
    for key in ("_parameters", "_buffers", "_modules"):
        vars(twin)[key] = dict(vars(module)[key])
    return twin


def _unrolled_stand_in(model: nn.Module, layers: list[tuple[str, nn.Module]]) -> nn.Module:
    """A stand-in for the model with the same parameters, buffers and hooks under the same names, whose
    recurrent layers (from _unrollable) run _unrolled_forward: each of those layers, and every module on
    the way to one from the root, is a shallow copy (_shallow_copy); every other module is the model's
    own. Nothing of the model is written to."""
    unrolled = {id(module) for _, module in layers}
    copies: dict[int, nn.Module] = {}  # id(original or copy) -> its copy

    def copy_of(module: nn.Module) -> nn.Module:
        if id(module) not in copies:
            twin = _shallow_copy(module, _unrolled_class(type(module)) if id(module) in unrolled else None)
            copies[id(module)] = copies[id(twin)] = twin
        return copies[id(module)]

    root = copy_of(model)
    for name, module in model.named_modules(remove_duplicate=False):  # every path to a layer shared under two names
        if id(module) in unrolled:
            parent = root
            for part in filter(None, name.split(".")):
                child = copy_of(parent.get_submodule(part))
                parent._modules[part] = child
                parent = child
    return root


def _first_line(error: BaseException) -> str:
    """The exception's type and the first line of its message, for a report."""
    lines = str(error).strip().splitlines()
    return type(error).__name__ + (f": {lines[0]}" if lines else "")


def _with_fallbacks(model, batch, path, run_vmap, run_loop, reason):
    """Run run_vmap(module) on the model, or what stands in for it: returns (result, PathReport).

    Every path off the fast path comes here, so this is where a model that mixes the examples of `batch` is
    refused first (_batch._check_examples_apart): vmap and the loop see each example alone, and would answer.

    path "vmap": run_vmap(model) alone, errors raised (on Python 3.11 on, with a note naming path="unroll" where
    the model has recurrent layers it could unroll). "loop": run_loop() alone. "unroll": run_vmap
    on a stand-in whose nn.RNN/GRU/LSTM layers compute step by step (_unrolled_stand_in; the model
    itself is never changed); a ValueError if there are none or they refuse the input, any other error
    raised. "auto": the path is decided from the model's modules before anything runs: the unroll where the
    model has such layers (their forward makes an unbatched initial state, which fails under vmap on the CPU,
    and cuDNN's kernel fails on a GPU, so plain vmap is not tried), else plain vmap. The loop runs only after
    that raised, whatever the error (no message is inspected), and the report says what was raised; if the
    loop raises too, its error is raised, chained to vmap's (__cause__). reason: why no faster path ran, kept
    in the report of the vmap path. A parameter with a gradient hook of its own (_batch._hooked_parameters) sends
    "auto" to the loop, the one path that runs it, and is refused on "vmap" and "unroll".
    """
    _check_examples_apart(model, batch)
    hooked = _hooked_parameters(model) if isinstance(model, nn.Module) else []
    if hooked and path != "loop":
        if path != "auto":
            raise ValueError(f"parameter {hooked[0]} has a gradient hook (Tensor.register_hook), which {path} would leave out "
                             "(it differentiates a copy of the parameter): path='loop' runs it on each example's gradient")
        path, reason = "loop", f"parameter {hooked[0]} has a gradient hook (Tensor.register_hook), which only the loop runs"
    if path == "loop":
        _check_parameters_reached(model, batch, remember=False)
        return run_loop(), PathReport("loop", reason)
    _check_parameters_reached(model, batch)
    if path == "vmap":
        try:
            return run_vmap(model), PathReport("vmap", reason)
        except Exception as error:
            recurrent = _unrollable(model)
            add_note = getattr(error, "add_note", None)  # Python 3.11 on
            if recurrent and add_note:  # a hint beside torch's error, which names a shape or a kernel, not the layer
                add_note(f"path='vmap' runs {type(recurrent[0][1]).__name__} {recurrent[0][0] or '(the model)'} "
                         "through its own forward, which vmap cannot batch (it makes an unbatched initial "
                         "state): path='unroll' or 'auto' computes it step by step under vmap")
            raise
    layers = _unrollable(model)
    if path == "unroll" and not layers:
        raise ValueError("path='unroll' needs an nn.RNN, nn.GRU or nn.LSTM whose forward is the class's own; the model has none")
    try:
        if not layers:
            return run_vmap(model), PathReport("vmap", reason)
        result = run_vmap(_unrolled_stand_in(model, layers))
        names = ", ".join(f"{type(m).__name__} {n or '(the model)'}" for n, m in layers)
        return result, PathReport("unroll", f"computed step by step under vmap, which cannot run the layer's own forward "
                                   f"(it makes an unbatched initial state): {names}")
    except _CannotUnroll as refusal:
        if path == "unroll":
            raise ValueError(f"the unroll does not apply: {refusal}") from None
        vmap_error: Exception = refusal
        reason = f"the unroll cannot run this model: {refusal}"
    except Exception as error:
        if path == "unroll":
            raise
        vmap_error, reason = error, f"vmap{' (recurrent layers unrolled)' if layers else ''} raised {_first_line(error)}"
    _check_parameters_reached(model, batch, remember=False)  # vmap may have raised for the reason it refuses
    try:
        return run_loop(), PathReport("loop", reason)
    except Exception as loop_error:
        raise loop_error from vmap_error
