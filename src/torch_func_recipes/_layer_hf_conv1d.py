"""The fast path's rule for transformers' Conv1D (GPT-2's projections): y = a W + b, the weight stored (in, out).

The trace sees it as addmm(b, a, W) (or mm(a, W)) with the weight itself, not its transpose, as the right
matrix; each example's weight gradient is a^T delta summed over its rows, the transpose of a linear layer's,
and its norms are a linear layer's. The module type is looked up in transformers only when transformers is
already imported (the package does not import it). Registered in _layers; also copied, without this
docstring, into the notebook cells tagged `shared-package` by scripts/build_shared.py: edit it here.
"""

from __future__ import annotations

import sys

import torch

from ._layer_linear import _LinearRule
from ._layers import _register

_aten = torch.ops.aten


class _HFConv1DRule(_LinearRule):
    kind = "hf_conv1d"
    ops = frozenset({_aten.addmm.default, _aten.mm.default})

    @property
    def modules(self):  # type: ignore[override]
        utils = sys.modules.get("transformers.pytorch_utils")
        conv1d = getattr(utils, "Conv1D", None)
        return (conv1d,) if isinstance(conv1d, type) else ()

    def record(self, trace, func, args, kwargs, result, r, params, transposed):
        bias_arg, a, w = (args[0], args[1], args[2]) if func is _aten.addmm.default else (None, args[0], args[1])
        weight = trace.param_of(w)
        if weight is None or transposed:
            return NotImplemented
        bias = trace.param_of(bias_arg)
        if trace.r_of(a) is None or w.dim() != 2 or (bias_arg is not None and (bias is None or bias_arg.dim() != 1)):
            trace.fail(f"{func} uses parameter {weight} in a way the fast path does not know")
        if kwargs or any(not (isinstance(v, (int, float)) and v == 1) for v in args[3:]):
            trace.fail(f"{func} scales its terms unusually")
        trace.layers.append(dict(kind=self.kind, weight=trace.use(weight, func, self), bias=trace.use(bias, func, self),
                                 a=a, z=result, r=trace.r_of(a), versions=(a._version, result._version)))
        return trace.r_of(a)

    def per_example_grads(self, layer, delta, out):
        a, r, weight, bias = layer["a"].detach(), layer["r"], layer["weight"], layer["bias"]
        batch = a.shape[0] // r
        if r == 1:
            torch.mul(a[:, :, None], delta[:, None, :], out=out[weight])
        else:
            torch.bmm(a.view(batch, r, -1).transpose(1, 2), delta.view(batch, r, -1), out=out[weight])
        if bias is not None:
            torch.sum(delta.view(batch, r, -1), dim=1, out=out[bias])

    def weighted_sum(self, layer, g):
        found = super().weighted_sum(layer, g)
        found[layer["weight"]] = found[layer["weight"]].t()  # stored (in, out): the linear layer's transpose
        return found

    def outer_factors(self, layer, g, batch):
        found = super().outer_factors(layer, g, batch)  # stored (in, out): the linear layer's factors swapped
        found["u"], found["v"] = found["v"], found["u"]
        return found

    def jacobian_rows(self, layer, delta, columns):
        a, r, weight, bias = layer["a"].detach(), layer["r"], layer["weight"], layer["bias"]
        n_out, batch = delta.shape[0], a.shape[0] // r
        per_example = delta.view(n_out, batch, r, -1).permute(1, 0, 2, 3)  # (B, Y, r, out)
        columns[weight].copy_(torch.matmul(a.view(batch, 1, r, -1).transpose(2, 3), per_example))
        if bias is not None:
            columns[bias].copy_(per_example.sum(dim=2))


_register(_HFConv1DRule())
