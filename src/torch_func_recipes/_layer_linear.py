"""The fast path's rule for nn.Linear: y = a W^T + b over rows of a (r rows per example).

The trace sees F.linear as W.t() (recorded here as a transposed parameter), then addmm(b, a, W^T) or
mm(a, W^T); a frozen weight with a trainable bias is addmm(b, a, W^T) with W untracked. Registered in
_layers; also copied, without this docstring, into the notebook cells tagged `shared-package`
by scripts/build_shared.py: edit it here.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ._layers import _ghost_squares, _LayerRule, _register

_aten = torch.ops.aten


class _LinearRule(_LayerRule):
    kind = "linear"
    modules = (nn.Linear,)
    ops = frozenset({_aten.t.default, _aten.transpose.int, _aten.permute.default, _aten.addmm.default, _aten.mm.default})

    def record(self, trace, func, args, kwargs, result, r, params, transposed):
        if func in (_aten.t.default, _aten.transpose.int, _aten.permute.default):
            # weight.t() on the way to a linear layer: only where the two dimensions do swap (transpose(0, -2) of a
            # matrix, or permute(0, 1), leaves it as it is, and is no use this rule knows)
            swaps = func is _aten.t.default or (args[1] % 2 != args[2] % 2 if func is _aten.transpose.int else
                                                [d % 2 for d in args[1]] == [1, 0])
            if params and r is None and len(params) == 1 and args[0].dim() == 2 and swaps:
                trace.mark_transposed(result, params[0])
                return None
            return NotImplemented
        if transposed:
            bias_arg, a, wt = (args[0], args[1], args[2]) if func is _aten.addmm.default else (None, args[0], args[1])
            weight = trace.transposed_of(wt)
            bias = trace.param_of(bias_arg)
            if weight is None or trace.r_of(a) is None or (bias_arg is not None and bias is None and trace.r_of(bias_arg) is not None):
                trace.fail(f"{func} uses a transposed parameter in an unexpected place")
            if func is _aten.addmm.default and bias_arg is not None and (bias_arg.dim() != 1 or kwargs or any(
                    not (isinstance(v, (int, float)) and v == 1) for v in args[3:])):
                trace.fail(f"{func} scales or broadcasts its terms unusually")
            trace.layers.append(dict(kind=self.kind, weight=trace.use(weight, func, self), bias=trace.use(bias, func, self),
                                     a=a, z=result, r=trace.r_of(a), versions=(a._version, result._version)))
            return trace.r_of(a)
        if func is _aten.addmm.default and params == [trace.param_of(args[0])]:
            a = args[1]  # a frozen weight with a trainable bias
            if trace.r_of(a) is None or trace.r_of(args[2]) is not None or args[0].dim() != 1 or kwargs or any(
                    not (isinstance(v, (int, float)) and v == 1) for v in args[3:]):
                trace.fail(f"{func} uses parameter {params[0]} in a way the fast path does not know")
            trace.layers.append(dict(kind=self.kind, weight=None, bias=trace.use(params[0], func, self), a=a, z=result,
                                     r=trace.r_of(a), versions=(a._version, result._version)))
            return trace.r_of(a)
        return NotImplemented

    def per_example_grads(self, layer, delta, out):
        a, r, weight, bias = layer["a"].detach(), layer["r"], layer["weight"], layer["bias"]
        batch = a.shape[0] // r
        if weight is not None:
            if r == 1:
                torch.mul(delta[:, :, None], a[:, None, :], out=out[weight])
            else:
                torch.bmm(delta.view(batch, r, -1).transpose(1, 2), a.view(batch, r, -1), out=out[weight])
        if bias is not None:
            if r == 1:
                out[bias].copy_(delta)
            else:
                torch.sum(delta.view(batch, r, -1), dim=1, out=out[bias])

    def jacobian_rows(self, layer, delta, columns):
        a, r, weight, bias = layer["a"].detach(), layer["r"], layer["weight"], layer["bias"]
        n_out, batch = delta.shape[0], a.shape[0] // r
        per_example = delta.view(n_out, batch, r, -1).permute(1, 0, 2, 3)  # (B, Y, r, out)
        if weight is not None:
            if r == 1:
                torch.mul(per_example[:, :, 0, :, None], a[:, None, None, :], out=columns[weight])
            else:
                columns[weight].copy_(torch.matmul(per_example.transpose(2, 3), a.view(batch, 1, r, -1)))
        if bias is not None:
            columns[bias].copy_(per_example.sum(dim=2))

    def weighted_sum(self, layer, g):
        a, found = layer["a"].detach(), {}
        g2 = g.reshape(-1, g.shape[-1])
        if layer["weight"] is not None:
            found[layer["weight"]] = g2.t() @ a.reshape(-1, a.shape[-1])
        if layer["bias"] is not None:
            found[layer["bias"]] = g2.sum(0)
        return found

    def outer_factors(self, layer, g, batch):
        a = layer["a"].detach()
        a, g = a.reshape(batch, -1, a.shape[-1]), None if g is None else g.reshape(batch, -1, g.shape[-1])
        return {"u": ("dense", g), "v": ("dense", a), "bias": None if g is None or layer["bias"] is None else g.sum(1)}

    def squared_norms(self, layer, g, batch):
        a, found = layer["a"].detach(), []
        a, g = a.reshape(batch, -1, a.shape[-1]), g.reshape(batch, -1, g.shape[-1])  # (B, T, d_in), (B, T, d_out)
        weight, bias = layer["weight"], layer["bias"]
        if a.shape[1] == 1:  # one row per example: the bias's share is ||g||^2, the weight's ||a||^2 ||g||^2
            g_squared = g.square().sum((1, 2))
            if bias is not None:
                found.append((bias, g_squared, "direct"))
            if weight is not None:
                found.append((weight, a.square().sum((1, 2)) * g_squared, "ghost"))
            return found
        if bias is not None:
            found.append((bias, g.sum(1).square().sum(1), "direct"))
        if weight is not None:
            if a.shape[1] ** 2 <= a.shape[2] * g.shape[2]:  # token pairs cost less than the product
                found.append((weight, _ghost_squares(a, g), "ghost"))
            else:
                found.append((weight, (g.transpose(1, 2) @ a).square().sum((1, 2)), "direct"))
        return found


_register(_LinearRule())
