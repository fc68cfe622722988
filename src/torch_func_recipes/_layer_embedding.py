"""The fast path's rule for nn.Embedding's weight (per_sample_grad_norms).

Each example's gradient of the table adds the output gradients of its positions row by row (ids
that repeat add up), so its squared norm sums g_s . g_t over the pairs of positions s, t with the
same id; the padding row gets no gradient. Registered in _layers; also copied, without this
docstring, into the notebook cells tagged `shared-package` by scripts/build_shared.py:
edit it here.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ._layers import _LayerRule, _register


class _EmbeddingRule(_LayerRule):
    kind = "embedding"
    modules = (nn.Embedding,)
    ops = frozenset({torch.ops.aten.embedding.default})

    def record(self, trace, func, args, kwargs, result, r, params, transposed):
        if not params or transposed:
            return NotImplemented  # a frozen table: the trace's general rule
        values = trace.values_of(func, args, kwargs)
        w, ids = values["weight"], values["indices"]
        if trace.param_of(w) is None or trace.r_of(ids) is None or values["scale_grad_by_freq"]:
            trace.fail(f"{func}: only the indices may carry example data, without scale_grad_by_freq")
        trace.layers.append(dict(kind=self.kind, weight=trace.use(trace.param_of(w), func, self), bias=None, a=ids, z=result,
                                 r=trace.r_of(ids), padding_idx=values["padding_idx"], versions=(ids._version, result._version)))
        return trace.r_of(ids)

    def squared_norms(self, layer, g, batch):
        ids = layer["a"].reshape(batch, -1)
        g = g.reshape(batch, ids.shape[1], -1)
        same = ids[:, :, None] == ids[:, None, :]
        if layer["padding_idx"] >= 0:  # PyTorch gives the padding row no gradient
            real = ids != layer["padding_idx"]
            same &= real[:, :, None] & real[:, None, :]
        return [(layer["weight"], (same.to(g.dtype) * (g @ g.transpose(1, 2))).sum((1, 2)), "ghost")]


_register(_EmbeddingRule())
