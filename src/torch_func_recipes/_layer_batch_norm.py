"""The fast path's rule for BatchNorm's affine weight and bias in eval mode (running statistics).

In eval mode each example is normalised with the running mean and variance alone, y = x_hat * w + b with
x_hat = (x - mean) / sqrt(var + eps) per channel, so each example's gradient of w is the sum of g * x_hat
over its positions, of b the sum of g. In training mode the statistics are the batch's: the examples mix,
and the trace refuses before this rule is asked. Registered in _layers; also copied, without this
docstring, into the notebook cells tagged `shared-package` by scripts/build_shared.py: edit it here.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ._layers import _LayerRule, _register, _times

_aten = torch.ops.aten


def _by_example(t, batch):
    """(N*r, C, *positions) -> (N, C, r * positions): each of N examples' rows and positions, channel by channel."""
    return t.reshape(batch, -1, t.shape[1], *t.shape[2:]).transpose(1, 2).reshape(batch, t.shape[1], -1)


def _centred(layer, batch):
    """The input minus the running mean, (B, C, positions), in new memory, and the scale that normalises it, (C,)."""
    a = layer["a"].detach()
    shape = (1, -1) + (1,) * (a.dim() - 2)
    return _by_example(a - layer["mean"].view(shape), batch), torch.rsqrt(layer["var"] + layer["eps"])


class _BatchNormRule(_LayerRule):
    kind = "batch_norm"
    modules: tuple[type[nn.Module], ...] = (nn.modules.batchnorm._BatchNorm,)
    ops = frozenset({_aten.native_batch_norm.default, _aten._native_batch_norm_legit_no_training.default,
                     _aten.cudnn_batch_norm.default})

    def record(self, trace, func, args, kwargs, result, r, params, transposed):
        if not params or transposed:
            return NotImplemented  # no trainable affine parameters: the trace's general rule
        values = trace.values_of(func, args, kwargs)
        x, w, b = values["input"], values["weight"], values["bias"]
        mean, var = values["running_mean"], values["running_var"]
        if values.get("training", False) or mean is None or var is None:  # cudnn_batch_norm names eps "epsilon"
            trace.fail(f"{func}: batch statistics mix the examples (call model.eval())")
        if trace.r_of(x) is None or any(trace.r_of(t) is not None for t in (w, b, mean, var)) or x.dim() < 2:
            trace.fail(f"{func}: only the input may carry example data")
        trace.layers.append(dict(kind=self.kind, weight=trace.use(trace.param_of(w), func, self),
                                 bias=trace.use(trace.param_of(b), func, self), a=x, z=result[0], r=trace.r_of(x),
                                 mean=mean.detach().clone(), var=var.detach().clone(), eps=values.get("eps", values.get("epsilon")),
                                 versions=(x._version, result[0]._version)))
        return trace.r_of(x)

    def _shares(self, layer, g, batch):
        """(weight, bias) gradients of each example, (B, C) each, from the output gradient g (B*r, C, ...): the
        weight's is each channel's sum over positions of g times the normalised input, formed in the centred
        input's own memory (_times: no temporary as large as g beyond it) and scaled after. An einsum of the two
        (a batched product of B*C dot products) took 2.0 times as long on 2 CPU cores at ResNet's first layer."""
        g = _by_example(g, batch)
        x, scale = self._centred(layer, batch)
        weight = _times(x, g).sum(2)
        return weight if scale is None else weight * scale, g.sum(2)

    def _centred(self, layer, batch):
        """The layer's input, centred, (B, C, positions), and the (C,) scale that normalises it (None: none). The input
        is in new memory, which _shares overwrites."""
        return _centred(layer, batch)

    def _normalised(self, layer, batch):
        """The normalised input, (B, C, positions)."""
        x, scale = self._centred(layer, batch)
        return x if scale is None else x * scale[:, None]

    def per_example_grads(self, layer, delta, out):
        weight, bias = self._shares(layer, delta, layer["a"].shape[0] // layer["r"])
        if layer["weight"] is not None:
            out[layer["weight"]].copy_(weight)
        if layer["bias"] is not None:
            out[layer["bias"]].copy_(bias)

    def jacobian_rows(self, layer, delta, columns):
        batch, n_out = layer["a"].shape[0] // layer["r"], delta.shape[0]
        g = _by_example(delta.reshape(-1, *delta.shape[2:]), n_out * batch).view(n_out, batch, delta.shape[2], -1)
        if layer["weight"] is not None:
            columns[layer["weight"]].copy_((g * self._normalised(layer, batch)).sum(3).transpose(0, 1))
        if layer["bias"] is not None:
            columns[layer["bias"]].copy_(g.sum(3).transpose(0, 1))

    def weighted_sum(self, layer, g):
        weight, bias = self._shares(layer, g, layer["a"].shape[0] // layer["r"])
        found = {}
        if layer["weight"] is not None:
            found[layer["weight"]] = weight.sum(0)
        if layer["bias"] is not None:
            found[layer["bias"]] = bias.sum(0)
        return found

    def squared_norms(self, layer, g, batch):
        weight, bias = self._shares(layer, g, batch)
        found = []
        if layer["weight"] is not None:
            found.append((layer["weight"], weight.square().sum(1), "direct"))
        if layer["bias"] is not None:
            found.append((layer["bias"], bias.square().sum(1), "direct"))
        return found


_register(_BatchNormRule())
