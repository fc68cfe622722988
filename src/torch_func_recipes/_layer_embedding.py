"""The fast path's rule for nn.Embedding's weight (every recipe with a fast path).

Each example's gradient of the table adds the output gradients of its positions row by row (ids
that repeat add up), so its squared norm sums g_s . g_t over the pairs of positions s, t with the
same id; the padding row gets no gradient. Only the ids may carry example data. A table looked up with
ids every example shares (position embeddings) gives a tensor every example shares; the fast path follows
it to the one addition that broadcasts it over the batch (x + e, nothing else), whose output gradient is
then each example's gradient of e; ids of the batch's size (a buffer sliced to its length) must be the same for
every example (_trace._same_for_each), else the examples' positions would choose their lookups. Any other use
of it stops the fast path. Registered in _layers; also copied, without this docstring, into the notebook cells
tagged `shared-package` by scripts/build_shared.py: edit it here.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ._layers import _LayerRule, _register


class _EmbeddingRule(_LayerRule):
    kind = "embedding"
    modules = (nn.Embedding,)
    ops = frozenset({torch.ops.aten.embedding.default, torch.ops.aten.add.Tensor})

    def record(self, trace, func, args, kwargs, result, r, params, transposed):
        if func is torch.ops.aten.add.Tensor:
            return self._record_broadcast(trace, func, args, kwargs, result, r)
        if not params or transposed:
            return NotImplemented  # a frozen table: the trace's general rule
        values = trace.values_of(func, args, kwargs)
        w, ids = values["weight"], values["indices"]
        if trace.param_of(w) is None or values["scale_grad_by_freq"]:
            trace.fail(f"{func}: only the indices may carry example data, without scale_grad_by_freq")
        if trace.r_of(ids) is None:  # ids every example shares: follow the result to its broadcast
            trace.share(result, dict(weight=trace.use(trace.param_of(w), func, self), ids=ids,
                                     padding_idx=values["padding_idx"], added=False, table_shape=tuple(w.shape)))
            return None
        trace.layers.append(dict(kind=self.kind, weight=trace.use(trace.param_of(w), func, self), bias=None, a=ids, z=result,
                                 r=trace.r_of(ids), padding_idx=values["padding_idx"], table_shape=tuple(w.shape),
                                 versions=(ids._version, result._version)))
        return trace.r_of(ids)

    def per_example_grads(self, layer, delta, out):
        table = out[layer["weight"]]  # (B, rows of the table, width)
        batch, rows = table.shape[0], table.shape[1]
        ids = self._ids(layer, batch)
        g = delta.reshape(batch * ids.shape[1], -1)
        where = (ids + rows * torch.arange(batch, device=ids.device)[:, None]).reshape(-1)  # row of the (B * rows) table
        if layer["padding_idx"] >= 0:  # PyTorch gives the padding row no gradient
            real = ids.reshape(-1) != layer["padding_idx"]
            where, g = where[real], g[real]
        table.zero_()
        table.view(batch * rows, -1).index_add_(0, where, g.to(table.dtype))

    def jacobian_rows(self, layer, delta, columns):
        table = columns[layer["weight"]]  # (B, Y, rows of the table, width)
        batch, n_out, rows = table.shape[:3]
        ids = self._ids(layer, batch)  # (B, positions)
        g = delta.reshape(n_out, batch, ids.shape[1], -1).transpose(0, 1)  # (B, Y, positions, width)
        where = (torch.arange(batch * n_out, device=ids.device).view(batch, n_out, 1) * rows + ids[:, None, :]).expand(-1, n_out, -1)
        where, g = where.reshape(-1), g.reshape(where.numel(), -1)
        if layer["padding_idx"] >= 0:
            real = ids[:, None, :].expand(-1, n_out, -1).reshape(-1) != layer["padding_idx"]
            where, g = where[real], g[real]
        summed = table.new_zeros(batch * n_out * rows, table.shape[-1])  # the columns may be a strided view
        table.copy_(summed.index_add_(0, where, g.to(table.dtype)).view(table.shape))

    def _record_broadcast(self, trace, func, args, kwargs, result, r):
        shared = [a for a in args[:2] if isinstance(a, torch.Tensor) and "ids" in (trace.shared_of(a) or ())]
        if not shared:
            return NotImplemented
        e = shared[0]
        x = args[1] if e is args[0] else args[0]
        info = trace.shared_of(e)
        per_example_shape = tuple(result.shape[1:])
        # e broadcast over the batch (one lookup for all), or one row of lookups per example (ids of the batch's size)
        how = ("broadcast" if tuple(e.shape) in (per_example_shape, (1, *per_example_shape)) else
               "rows" if tuple(e.shape) == tuple(result.shape) and info["ids"].shape[:1] == result.shape[:1] else None)
        if (how is None or len(shared) > 1 or trace.r_of(x) is None or r != 1 or tuple(x.shape) != tuple(result.shape)
                or kwargs.get("alpha", 1) != 1 or any(v != 1 for v in args[2:])):
            trace.fail(f"{func} combines a table lookup every example shares with example data unusually")
        if info["added"]:
            trace.fail(f"{func}: the table lookup of {info['weight']} is used twice")
        if how == "rows":  # ids of the batch's size, made without the examples: the same for each, or refused
            trace.same_for_each(func, [info["ids"]], info["ids"].dim(), 1)
        info["added"] = True
        trace.layers.append(dict(kind=self.kind, weight=info["weight"], bias=None, a=info["ids"], z=result, r=1,
                                 padding_idx=info["padding_idx"], shared=how, table_shape=info["table_shape"],
                                 versions=(info["ids"]._version, result._version)))
        return r

    @staticmethod
    def _ids(layer, batch):
        """(B, positions) ids of each example: its own, or the ones every example shares."""
        return layer["a"].reshape(1, -1).expand(batch, -1) if layer.get("shared") == "broadcast" else layer["a"].reshape(batch, -1)

    def weighted_sum(self, layer, g):
        ids = self._ids(layer, g.shape[0] // layer["r"]).reshape(-1)  # the batch gradient's own arithmetic: rows added up
        g = g.reshape(ids.numel(), -1)
        if layer["padding_idx"] >= 0:  # PyTorch gives the padding row no gradient
            real = ids != layer["padding_idx"]
            ids, g = ids[real], g[real]
        return {layer["weight"]: g.new_zeros(layer["table_shape"]).index_add_(0, ids, g)}

    def outer_factors(self, layer, g, batch):
        ids, e = self._ids(layer, batch), None  # a one-hot row per position, times that position's gradient
        if g is not None:
            e = g.reshape(batch, ids.shape[1], -1)
            if layer["padding_idx"] >= 0:  # PyTorch gives the padding row no gradient
                e = e * (ids != layer["padding_idx"])[:, :, None].to(e.dtype)
        return {"u": ("ids", ids), "v": ("dense", e), "bias": None}

    def squared_norms(self, layer, g, batch):
        ids = self._ids(layer, batch)
        g = g.reshape(batch, ids.shape[1], -1)
        same = ids[:, :, None] == ids[:, None, :]
        if layer["padding_idx"] >= 0:  # PyTorch gives the padding row no gradient
            real = ids != layer["padding_idx"]
            same &= real[:, :, None] & real[:, None, :]
        # position s's row of the example's gradient, the sum of the gradients at the positions with its id, counted
        # once per id: sum_s |row_s|^2 / (how often id_s occurs). From pairs of positions like a ghost norm, but each
        # row is added up before it is squared, so rows that cancel leave no rounding of their size behind
        work = torch.promote_types(g.dtype, torch.float32)  # autocast is off (per_sample._layer_squares)
        same = same.to(work)
        rows = torch.linalg.vector_norm(same @ g.to(work), dim=2).square()
        return [(layer["weight"], (rows / same.sum(2).clamp(min=1)).sum(1), "ghost")]


_register(_EmbeddingRule())
