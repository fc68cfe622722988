"""The fast path's rule for nn.GroupNorm's weight and bias.

GroupNorm normalises each row of its input on its own (over its channels' groups and positions), then
y = x_hat * w + b per channel, so each example's gradient of w is the sum of g * x_hat over its positions,
of b the sum of g, as for BatchNorm in eval mode. Registered in _layers; also copied, without this
docstring, into the notebook cells tagged `shared-package` by scripts/build_shared.py: edit it here.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._layer_batch_norm import _BatchNormRule, _by_example
from ._layers import _register


class _GroupNormRule(_BatchNormRule):
    kind = "group_norm"
    modules = (nn.GroupNorm,)
    ops = frozenset({torch.ops.aten.native_group_norm.default})

    def record(self, trace, func, args, kwargs, result, r, params, transposed):
        if not params or transposed:
            return NotImplemented  # no trainable affine parameters: the trace's general rule
        values = trace.values_of(func, args, kwargs)
        x, w, b = values["input"], values["weight"], values["bias"]
        if trace.r_of(x) is None or trace.r_of(w) is not None or trace.r_of(b) is not None:
            trace.fail(f"{func}: only the input may carry example data")
        trace.layers.append(dict(kind=self.kind, weight=trace.use(trace.param_of(w), func, self),
                                 bias=trace.use(trace.param_of(b), func, self), a=x, z=result[0], r=trace.r_of(x),
                                 groups=values["group"], eps=values["eps"], versions=(x._version, result[0]._version)))
        return trace.r_of(x)

    def _centred(self, layer, batch):  # each example's groups normalised with their own statistics
        return _by_example(F.group_norm(layer["a"].detach(), layer["groups"], eps=layer["eps"]), batch), None


_register(_GroupNormRule())
