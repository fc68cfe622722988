"""The fast path's rule for RMSNorm's weight (nn.RMSNorm, and the RMSNorm classes of transformers' models).

Such a layer ends with one elementwise product w * h of its weight (one number per feature) and the
normalised input h; each example's weight gradient is the sum over its positions of g * h, g being the
gradient of the product. The trace confirms that product at run time (the weight a vector along the
last dimension, the other factor example data, nothing else done with the weight), so a class named
RMSNorm that does something else (Gemma's 1 + w, say) is refused by the trace, not trusted. Registered in
_layers; also copied, without this docstring, into the notebook cells tagged `shared-package` by
scripts/build_shared.py: edit it here.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ._layers import _LayerRule, _register

_aten = torch.ops.aten


class _RMSNormRule(_LayerRule):
    kind = "rms_norm"
    modules = (nn.RMSNorm,)
    ops = frozenset({_aten.mul.Tensor})

    def covers(self, module: nn.Module) -> bool:
        cls = type(module)  # transformers defines one class per model (LlamaRMSNorm, MistralRMSNorm, ...)
        return isinstance(module, nn.RMSNorm) or (cls.__name__.endswith("RMSNorm") and cls.__module__.startswith("transformers."))

    def record(self, trace, func, args, kwargs, result, r, params, transposed):
        if not params or transposed or trace.owners is not None and any(self not in (trace.owners.get(p) or ()) for p in params):
            return NotImplemented  # no parameter of an RMSNorm: the trace's general rules
        a, b = args[0], args[1]
        w, h = (a, b) if trace.param_of(a) is not None else (b, a)
        if (kwargs or len(params) != 1 or trace.param_of(w) is None or not isinstance(h, torch.Tensor) or trace.r_of(h) is None
                or w.dim() != 1 or h.dim() < 2 or h.shape[-1] != w.shape[0] or result.shape != h.shape):
            trace.fail(f"{func} uses parameter {params[0]} in a way the fast path does not know")
        trace.layers.append(dict(kind=self.kind, weight=trace.use(trace.param_of(w), func, self), bias=None, a=h, z=result,
                                 r=trace.r_of(h), versions=(h._version, result._version)))
        return trace.r_of(h)

    @staticmethod
    def _per_example(layer, delta, lead=()):
        h = layer["a"].detach()
        size, batch = h.shape[-1], h.shape[0] // layer["r"]
        return (delta.reshape(*lead, batch, -1, size) * h.reshape(batch, -1, size)).sum(-2)  # (*lead, B, size)

    def per_example_grads(self, layer, delta, out):
        out[layer["weight"]].copy_(self._per_example(layer, delta))

    def jacobian_rows(self, layer, delta, columns):
        columns[layer["weight"]].copy_(self._per_example(layer, delta, (delta.shape[0],)).transpose(0, 1))

    def weighted_sum(self, layer, g):
        return {layer["weight"]: self._per_example(layer, g).sum(0)}

    def squared_norms(self, layer, g, batch):
        return [(layer["weight"], self._per_example(layer, g).square().sum(1), "direct")]

    shares_whole = True

    def outer_factors(self, layer, g, batch):
        return {"share": None if g is None else self._per_example(layer, g), "bias": None}


_register(_RMSNormRule())
