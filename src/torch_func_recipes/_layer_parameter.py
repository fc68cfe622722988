"""The fast path's rule for a bare parameter every example receives whole: a learned position embedding
added to each example (x + p, ViT's position_embeddings), a token put in front of each (ViT's cls_token,
p.expand(B, ...) then concatenated with the example data), or a scale per feature (p * x, ConvNeXt's
layer_scale_parameter).

The parameter p, of shape (1, ...), reaches each example's output unchanged, so each example's gradient of p
is that example's slice of the gradient at the addition's (or the concatenation's) output. A scale p of
shape (features,) multiplies the last dimension of the example data x, so each example's gradient is the sum
over its positions of g * x, as for an RMSNorm weight. The trace confirms the pattern at run time: the
addition without any other broadcast, the expansion along the batch followed by one concatenation along
another dimension, or the product along the last dimension; any other use (scaled, used twice, added to
the wrong shape, a scale of another shape) stops the fast path. It covers parameters not named weight or bias
of the model's own modules (not of torch.nn's layers: an RNN's weight_ih_l0 is not such a parameter).
Registered in _layers; also copied, without this docstring, into the notebook cells tagged
`shared-package` by scripts/build_shared.py: edit it here.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ._layer_rms_norm import _RMSNormRule
from ._layers import _LayerRule, _register

_aten = torch.ops.aten


class _ParameterRule(_LayerRule):
    kind = "parameter"
    ops = frozenset({_aten.add.Tensor, _aten.expand.default, _aten.cat.default, _aten.mul.Tensor})

    def covers_parameter(self, module: nn.Module, short: str) -> bool:
        # a parameter of a model's own module (not a torch.nn layer's, whose parameters its layer kind covers or not)
        return short not in ("weight", "bias") and not type(module).__module__.startswith("torch.nn.")

    def record(self, trace, func, args, kwargs, result, r, params, transposed):
        if func is _aten.cat.default:
            return self._record_cat(trace, func, args, kwargs, result, r)
        mine = [p for p in params if trace.owners is None or self in (trace.owners.get(p) or ())]
        if not mine:
            return NotImplemented
        if len(params) != 1 or transposed or kwargs.get("alpha", 1) != 1 or any(not isinstance(v, torch.Tensor) and v != 1 for v in args[2:]):
            trace.fail(f"{func} uses parameter {mine[0]} in a way the fast path does not know")
        if func is _aten.mul.Tensor:
            return self._record_scale(trace, func, args, result, mine[0])
        p = args[0] if trace.param_of(args[0]) is not None else args[1]
        if p.dim() == 0 or p.shape[0] != 1:
            trace.fail(f"{func}: parameter {mine[0]} does not have one row every example shares")
        if func is _aten.expand.default:  # expanded along the batch: follow it to its concatenation
            if r is not None or result.shape[0] != trace.batch or tuple(result.shape[1:]) != tuple(p.shape[1:]):
                trace.fail(f"{func} expands parameter {mine[0]} other than along the batch")
            trace.share(result, dict(weight=trace.use(mine[0], func, self), added=False, expanded=True))
            return None
        x = args[1] if p is args[0] else args[0]
        if trace.r_of(x) != 1 or tuple(x.shape) != tuple(result.shape) or tuple(p.shape[1:]) != tuple(result.shape[1:]):
            trace.fail(f"{func} adds parameter {mine[0]} to example data of another shape")
        trace.layers.append(dict(kind=self.kind, weight=trace.use(mine[0], func, self), bias=None, a=x, z=result, r=1,
                                 part=None, versions=(x._version, result._version)))
        return 1

    def _record_scale(self, trace, func, args, result, name):
        w, x = (args[0], args[1]) if trace.param_of(args[0]) is not None else (args[1], args[0])
        if (not isinstance(x, torch.Tensor) or trace.r_of(x) is None or w.dim() != 1 or x.dim() < 2
                or x.shape[-1] != w.shape[0] or result.shape != x.shape):
            trace.fail(f"{func} scales example data by parameter {name} other than feature by feature along the last dimension")
        trace.layers.append(dict(kind=self.kind, weight=trace.use(name, func, self), bias=None, a=x, z=result,
                                 r=trace.r_of(x), part=None, scale=True, versions=(x._version, result._version)))
        return trace.r_of(x)

    def _record_cat(self, trace, func, args, kwargs, result, r):
        values = trace.values_of(func, args, kwargs)
        tensors, dim = list(values["tensors"]), values["dim"] % result.dim()
        shared = [k for k, t in enumerate(tensors) if (trace.shared_of(t) or {}).get("expanded")]
        if not shared:
            return NotImplemented
        if len(shared) != 1 or dim == 0 or r != 1 or any(trace.r_of(t) != 1 for k, t in enumerate(tensors) if k != shared[0]):
            trace.fail(f"{func} joins an expanded parameter with example data unusually")
        info = trace.shared_of(tensors[shared[0]])
        if info["added"]:
            trace.fail(f"{func}: the expanded parameter {info['weight']} is used twice")
        info["added"] = True
        start = sum(t.shape[dim] for t in tensors[:shared[0]])
        trace.layers.append(dict(kind=self.kind, weight=info["weight"], bias=None, a=result, z=result, r=1,
                                 part=(dim, start, tensors[shared[0]].shape[dim]), versions=(result._version, result._version)))
        return 1

    @staticmethod
    def _each(layer, delta, lead=0):
        """Each example's gradient of the parameter, from the gradient at the output: (*lead dims, B, ...)."""
        if layer["part"] is not None:
            dim, start, length = layer["part"]
            delta = delta.narrow(dim + lead, start, length)
        return delta

    def per_example_grads(self, layer, delta, out):
        target = out[layer["weight"]]
        each = _RMSNormRule._per_example(layer, delta) if layer.get("scale") else self._each(layer, delta)
        target.copy_(each.reshape(target.shape))

    def jacobian_rows(self, layer, delta, columns):
        target = columns[layer["weight"]]  # (B, Y, *p.shape)
        if layer.get("scale"):
            each = _RMSNormRule._per_example(layer, delta, (delta.shape[0],))  # (Y, B, features)
        else:
            each = self._each(layer, delta, 1)
        target.copy_(each.transpose(0, 1).reshape(target.shape))

    def weighted_sum(self, layer, g):
        if layer.get("scale"):
            return {layer["weight"]: _RMSNormRule._per_example(layer, g).sum(0)}
        return {layer["weight"]: self._each(layer, g).sum(0, keepdim=True)}

    def squared_norms(self, layer, g, batch):
        each = _RMSNormRule._per_example(layer, g) if layer.get("scale") else self._each(layer, g)
        return [(layer["weight"], each.reshape(batch, -1).square().sum(1), "direct")]

    shares_whole = True

    def outer_factors(self, layer, g, batch):
        if g is None:
            return {"share": None, "bias": None}
        return {"share": _RMSNormRule._per_example(layer, g) if layer.get("scale") else self._each(layer, g), "bias": None}


_register(_ParameterRule())
