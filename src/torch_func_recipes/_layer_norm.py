"""The fast path's rule for nn.LayerNorm's weight and bias (every recipe with a fast path).

Each example's gradient of the weight is the sum over its positions of g * x_hat, of the bias the sum
of g, where x_hat is the input normalised within each row. Registered in _layers; also copied,
without this docstring, into the notebook cells tagged `shared-package` by
scripts/build_shared.py: edit it here.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._layers import _LayerRule, _register, _times


class _LayerNormRule(_LayerRule):
    kind = "layer_norm"
    modules = (nn.LayerNorm,)
    ops = frozenset({torch.ops.aten.native_layer_norm.default})

    def record(self, trace, func, args, kwargs, result, r, params, transposed):
        if not params or transposed:
            return NotImplemented  # a LayerNorm without trainable parameters: the trace's general rule
        values = trace.values_of(func, args, kwargs)
        x, shape, w, b = values["input"], values["normalized_shape"], values["weight"], values["bias"]
        if trace.r_of(x) is None or trace.r_of(w) is not None or trace.r_of(b) is not None or len(shape) >= x.dim():
            trace.fail(f"{func}: only the input may carry example data, normalised within each row")
        trace.layers.append(dict(kind=self.kind, weight=trace.use(trace.param_of(w), func, self),
                                 bias=trace.use(trace.param_of(b), func, self), a=x, z=result[0], r=trace.r_of(x),
                                 shape=list(shape), eps=values["eps"], versions=(x._version, result[0]._version)))
        return trace.r_of(x)

    def per_example_grads(self, layer, delta, out):
        size = math.prod(layer["shape"])
        batch = layer["a"].shape[0] // layer["r"]
        g = delta.reshape(batch, -1, size)
        if layer["weight"] is not None:
            x_hat = F.layer_norm(layer["a"].detach(), layer["shape"], eps=layer["eps"]).reshape(batch, -1, size)
            torch.sum(_times(x_hat, g), dim=1, out=out[layer["weight"]].view(batch, size))
        if layer["bias"] is not None:
            torch.sum(g, dim=1, out=out[layer["bias"]].view(batch, size))

    def jacobian_rows(self, layer, delta, columns):
        size, n_out = math.prod(layer["shape"]), delta.shape[0]
        batch = layer["a"].shape[0] // layer["r"]
        g = delta.reshape(n_out, batch, -1, size)  # (Y, B, positions, size)
        if layer["weight"] is not None:
            x_hat = F.layer_norm(layer["a"].detach(), layer["shape"], eps=layer["eps"]).reshape(batch, -1, size)
            columns[layer["weight"]].copy_((g * x_hat).sum(2).transpose(0, 1).reshape(columns[layer["weight"]].shape))
        if layer["bias"] is not None:
            columns[layer["bias"]].copy_(g.sum(2).transpose(0, 1).reshape(columns[layer["bias"]].shape))

    def weighted_sum(self, layer, g):
        size, found = math.prod(layer["shape"]), {}
        g = g.reshape(-1, size)
        if layer["weight"] is not None:
            x_hat = F.layer_norm(layer["a"].detach(), layer["shape"], eps=layer["eps"]).reshape(-1, size)
            found[layer["weight"]] = _times(x_hat, g).sum(0).view(layer["shape"])
        if layer["bias"] is not None:
            found[layer["bias"]] = g.sum(0).view(layer["shape"])
        return found

    def squared_norms(self, layer, g, batch):
        size = math.prod(layer["shape"])
        x_hat = F.layer_norm(layer["a"].detach(), layer["shape"], eps=layer["eps"]).reshape(batch, -1, size)
        g = g.reshape(batch, -1, size)
        found = []
        if layer["weight"] is not None:
            found.append((layer["weight"], _times(x_hat, g).sum(1).square().sum(1), "direct"))
        if layer["bias"] is not None:
            found.append((layer["bias"], g.sum(1).square().sum(1), "direct"))
        return found


_register(_LayerNormRule())
