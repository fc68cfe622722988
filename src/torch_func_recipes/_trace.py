"""The fast path's trace, shared by the per-sample gradients, the output Jacobians and the norms.

_BatchTrace follows the examples through every ATen operation of one forward pass and records the
linear and convolution layers whose per-example products give the gradients; PathReport says which
path a recipe call took. Also copied, without this docstring, into the notebook cells tagged
`shared-package` by scripts/build_shared.py: edit it here.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from torch._C import _WeakTensorRef  # type: ignore[attr-defined]
from torch.func import vmap
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ._batch import (
    _Batch,
    _batch_made_with,
    _call_signature,
    _check_examples_apart,
    _cuda_devices,
    _dense_grads,
    _detached,
    _generator_states,
    _generators_kept,
    _GeneratorWatch,
    _graph_reaches,
    _held_generators,
    _hooked_parameters,
    _module_backward_hook,
    _outputs_agree,
    _per_model,
    _remembered_draws,
    _scalar_loss,
    _set_generator_states,
)
from ._layers import _LayerRule, _rule_of, _rules_for


class PathReport(NamedTuple):
    """Which path a recipe call took ("fast", "vmap", "unroll", "loop", or "none" for an empty batch), and
    why. per_sample_grad_norms also says how it got each parameter's share of the norms (None elsewhere):
    ghost, weights by pairs of tokens; direct, weights by their per-example product, and biases; streamed,
    every other parameter, by its per-example gradient.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from torch_func_recipes import PathReport, per_sample_grad_norms, per_sample_grads
        >>> _ = torch.manual_seed(0)
        >>> model, loss_fn = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double(), nn.functional.mse_loss
        >>> x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
        >>> _, report = per_sample_grads(model, loss_fn, x, y, report=True)
        >>> isinstance(report, PathReport), report.path
        (True, 'fast')
        >>> per_sample_grads(model, loss_fn, x, y, path="loop", report=True)[1]
        PathReport(path='loop', reason="path='loop' was asked for", ghost=None, direct=None, streamed=None)
        >>> per_sample_grad_norms(model, loss_fn, x, y, report=True)[1].direct  # the biases' shares, from their per-example products
        ['0.bias', '2.bias']
    """
    path: str
    reason: str
    ghost: list | None = None
    direct: list | None = None
    streamed: list | None = None


_PATHS = ("auto", "fast", "vmap", "unroll", "loop")
# the autograd node of a custom torch.autograd.Function: autograd differentiates through its own backward, not the
# operations its forward ran (with gradients off, or on a graph of its own under enable_grad), so the trace stops
_CUSTOM = torch.autograd.function.BackwardCFunction


def _check_path(path: str) -> None:
    """The one check of every recipe's path argument: "auto" (the recipe chooses), or a path to take as
    asked, or raise: "fast", "vmap" (plain vmap), "unroll" (vmap, recurrent layers step by step), "loop"."""
    if not isinstance(path, str) or path not in _PATHS:
        raise ValueError(f"path must be one of {', '.join(map(repr, _PATHS))}, got {path!r}")


def _tensors_in(values) -> list:
    """The tensors among an ATen operator's arguments or results: tensors, and lists or tuples of them (Tensor[],
    Tensor?[]); ATen nests no deeper. A plain loop: the trace runs it for every operation, where a pytree walk costs
    several times more."""
    found = []
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            found += [t for t in v if isinstance(t, torch.Tensor)]
    return found


_SCHEMAS: dict = {}  # operator -> [(argument name, has a default, the default)], for _values_of


def _values_of(func, args, kwargs):
    """{argument name: value} of one call, defaults filled in (the schema read once per operator)."""
    schema = _SCHEMAS.get(func)
    if schema is None:
        schema = _SCHEMAS[func] = [(a.name, a.has_default_value(), a.default_value if a.has_default_value() else None)
                                   for a in func._schema.arguments]
    values = {}
    for i, (name, has_default, default) in enumerate(schema):
        if i < len(args):
            values[name] = args[i]
        elif name in kwargs:
            values[name] = kwargs[name]
        elif has_default:
            values[name] = default
    return values


def _writes(func) -> tuple:
    """(position, name) of each argument the operator writes into, from its schema: an in-place operation's self,
    or an out= tensor (keyword-only in the schema, so the trace meets it among the keyword arguments)."""
    return tuple((i, a.name) for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write)


def _memory_of(t) -> int:
    """Where a tensor's storage starts in memory (0 for none: an empty tensor, or a sparse one)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


def _pointwise(func) -> bool:
    return torch.Tag.pointwise in func.tags


class _OpPlan(NamedTuple):
    """What _BatchTrace does with one operator: the arguments it writes into (_writes), the layer rules whose
    operations include it, its general case in _BatchTrace.rule (_BatchTrace.category_of), whether its results
    have memory of their own (no view or in-place result: a storage the trace has not met), and whether it draws
    random numbers (torch's nondeterministic_seeded tag)."""
    func: object
    writes: tuple
    rules: tuple
    category: str | None
    allocates: bool
    draws: bool


class _NotPerExample(Exception):
    """Raised inside the trace at the first operation the fast path cannot vouch for."""


class _BatchTrace(TorchDispatchMode):
    """Follows the examples through every ATen operation of one forward pass.

    A tensor is 'batched' with r rows per example when its dimension 0 has B*r rows and rows
    [n*r, (n+1)*r) are computed from example n alone. Every operation must keep that true (an
    allow-list of rules, below); anything else stops the trace. Every use of a trainable parameter must be
    an operation that the layer rule of a module registering it recognises (the registry in _layers, one
    module per layer kind), which records the operation's input and output for the per-example
    products; a second use is allowed as `use` says. need: what the caller asks of the rules ("grads", "jacobian" or "norms");
    only rules that provide it are used. owners: {parameter name: the rules of the modules that register it},
    from _owner_rules; None skips that check (for tests that drive the trace by hand).

    Which tensor is which. The maps are keyed by the C++ tensor (`t._cdata`, the address of its TensorImpl),
    not by the Python object: PyTorch may free a tensor's Python object while the C++ tensor lives on (a view
    keeps its base, autograd its saved tensors) and hand it back later as a new object, at a new id. Every
    tensor the trace meets gets a weak reference to its C++ tensor (torch._C._WeakTensorRef), which keeps
    that address from being reused for the trace's lifetime without keeping the data (a tensor's memory is
    freed when its last strong reference goes). A tensor no operation of the trace made (a buffer, a
    constant from outside the forward pass) is admitted as a constant unless its storage starts where a
    live storage of example data starts: a tensor made without an operation the trace sees can share
    example data's memory (an output autograd saved and handed back; `torch.from_numpy(h.detach().numpy())`),
    and is refused. Not followed: a copy of that kind that starts inside example data's memory (from a slice),
    and Python values read out of a tensor (`.tolist()`), which bypass every dispatch mode; vmap refuses the
    latter too."""

    aten = torch.ops.aten
    ROW_PRESERVING = {  # reshapes and copies: the logical order of elements is kept
        aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten._reshape_alias.default,
        aten.flatten.using_ints, aten.unflatten.int, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
        aten.unsqueeze.default, aten.alias.default, aten.detach.default, aten.clone.default,
        aten.contiguous.default, aten._to_copy.default, aten.lift_fresh.default}
    PER_ROW = {  # operations that treat every row of dimension 0 on its own
        aten.max_pool1d.default, aten.max_pool2d.default, aten.max_pool2d_with_indices.default,
        aten.max_pool3d_with_indices.default, aten.avg_pool1d.default, aten.avg_pool2d.default,
        aten.avg_pool3d.default, aten._adaptive_avg_pool2d.default, aten.adaptive_max_pool2d.default,
        aten.native_dropout.default, aten.reflection_pad1d.default, aten.reflection_pad2d.default,
        aten.replication_pad1d.default, aten.replication_pad2d.default, aten.upsample_nearest2d.default,
        aten.upsample_bilinear2d.default}
    BY_DIM = {  # operations along `dim`, which must not be the batch dimension
        aten._softmax.default, aten._safe_softmax.default, aten._log_softmax.default, aten.sum.dim_IntList, aten.mean.dim, aten.amax.default,
        aten.amin.default, aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default,
        aten.logsumexp.default, aten.var.correction, aten.std.correction, aten.var_mean.correction,
        aten.prod.dim_int, aten.linalg_vector_norm.default, aten.cumsum.default, aten.select.int,
        aten.slice.Tensor, aten.narrow.default, aten.index_select.default, aten.split.Tensor,
        aten.split_with_sizes.default, aten.unbind.int, aten.cat.default, aten.stack.default, aten.gather.default,
        aten.sort.default, aten.topk.default, aten.transpose.int, aten.permute.default}
    # scaled_dot_product_attention's fused kernels (those this release has): attention over dimensions 2 and 3 of
    # (batch, heads, tokens, features) query, key and value, each batch row on its own; the mask likewise.
    ATTENTION = {aten._scaled_dot_product_flash_attention_for_cpu.default, *(getattr(torch.ops.aten, name).default for name in (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_fused_attention_overrideable") if hasattr(torch.ops.aten, name))}
    CONSTANT_RESULT = {  # results that do not depend on the values of their tensor arguments
        aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default,
        aten.rand_like.default, aten.randn_like.default, aten.new_zeros.default, aten.new_ones.default,
        aten.new_empty.default, aten.new_full.default}

    # What the trace does with each operator, worked out once per operator and set of rules (an operator's hash is
    # a Python call, and the trace meets a few hundred operations per forward pass): {rules: {id(operator):
    # _OpPlan}}. Operators are never freed, so their ids stay theirs; the plan keeps the operator to be sure.
    _PLANS: dict = {}

    def plan_of(self, func):
        plan = self.plans.get(id(func))
        if plan is None or plan.func is not func:
            plan = self.plans[id(func)] = _OpPlan(func, _writes(func), tuple(r for r in self.rules if func in r.ops),
                                                  self.category_of(func), all(a.alias_info is None for a in func._schema.returns),
                                                  torch.Tag.nondeterministic_seeded in func.tags)
        return plan

    @classmethod
    def category_of(cls, func):
        """Which of rule()'s general cases the operator falls in, tested in rule()'s order (None: none of them)."""
        aten = cls.aten
        if func in cls.CONSTANT_RESULT:
            return "constant"
        if func in cls.PER_ROW or _pointwise(func):
            return "per_row"
        if func in cls.ROW_PRESERVING:
            return "row_preserving"
        if func is aten.expand.default:
            return "expand"
        if func is aten.constant_pad_nd.default:
            return "pad"
        if func in cls.BY_DIM:
            return "by_dim"
        if func in (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default):
            return "matmul"
        if func is aten.native_layer_norm.default:
            return "layer_norm"
        if func is aten.native_group_norm.default or func is aten._native_batch_norm_legit_no_training.default:
            return "own_rows"
        if "batch_norm" in func.name():
            return "batch_norm"
        if func is aten.embedding.default:
            return "own_rows"
        if func in cls.ATTENTION:
            return "attention"
        return None

    def __init__(self, batch, inputs, trainable, need="grads", owners=None):
        super().__init__()
        self.rules, self.owners, self.need = _rules_for(need), owners, need
        self.plans = self._PLANS.setdefault(self.rules, {})
        # inputs: the tensors with examples; they and the parameters stay alive through the call (keep)
        self.batch, self.rows, self.keep = batch, {x._cdata: 1 for x in inputs}, [*inputs, *trainable.values()]
        self.trainable = {p._cdata: name for name, p in trainable.items()}
        self.by_id = {id(p): name for name, p in trainable.items()}  # for _graph_reaches, as autograd's nodes hold them
        # key of every tensor met -> a weak reference that keeps the key its own (class docstring); keeping the tensors
        # would hold every intermediate of the forward pass (on a small Llama, half a batch gradient's memory more)
        self.refs = dict.fromkeys([*self.rows, *self.trainable])
        self.memory = {}  # where a storage that holds example data starts -> a weak reference to it (hold_memory)
        for x in inputs:
            self.hold_memory(x)
        self.transposed = {}  # key(weight.t()) -> name of the weight
        self.shared = {}      # key(a tensor every example shares, made from a parameter) -> what a layer rule needs of it
        self.layers = []      # dicts: kind, weight, bias (names or None), a, z, r, conv arguments
        self.used = {}        # name of a parameter used -> the rule of its first use
        self.failure = None
        self.met_higher_order = False  # _run_trace then mends the process (torch.compiler.reset)
        self.unknown = set()
        self.fresh = {}       # key(a layer's output no operation has read yet) -> that layer
        self.drawn = set()    # keys of tensors made from random draws (_same_for_each lets their rows differ)

    def hold_memory(self, t):
        """t holds example data: remember where its storage starts, with a weak reference to the storage that says
        whether that memory still is the storage's (once the storage is freed, the address may be reused)."""
        start = _memory_of(t)
        if start:
            ref = self.memory.get(start)
            if ref is None or ref.expired():
                self.memory[start] = StorageWeakRef(t.untyped_storage())

    def admit(self, func, t):
        """A tensor no operation of the trace made, met as an argument of func: a constant from outside the forward
        pass, unless its memory is example data's (class docstring)."""
        ref = self.memory.get(_memory_of(t))
        if ref is not None and not ref.expired():
            self.fail(f"{func} uses a tensor that shares memory with example data but was made by no operation the trace "
                      "saw (through .numpy() and torch.from_numpy, say, or a tensor autograd saved)")
        if t.grad_fn is not None and _graph_reaches([t], self.by_id):
            self.fail(f"{func} uses a tensor computed from a trainable parameter before the call (a view of a weight "
                      "kept as an attribute, say), whose share of the gradient no layer rule sees")
        self.refs[t._cdata] = _WeakTensorRef(t)

    def share(self, t, info):
        """Record what a layer rule needs of t, a tensor every example shares, made from a parameter."""
        self.shared[t._cdata] = info

    def shared_of(self, t):
        return self.shared.get(t._cdata) if isinstance(t, torch.Tensor) and self.shared else None

    def mark_transposed(self, t, name):
        """t is parameter `name` transposed (weight.t() on its way to a linear layer)."""
        self.transposed[t._cdata] = name

    def transposed_of(self, t):
        return self.transposed.get(t._cdata) if isinstance(t, torch.Tensor) else None

    def fail(self, why):
        self.failure = why
        raise _NotPerExample(why)

    def r_of(self, t):
        return self.rows.get(t._cdata) if isinstance(t, torch.Tensor) else None

    def param_of(self, t):
        return self.trainable.get(t._cdata) if isinstance(t, torch.Tensor) else None

    def use(self, name, func, rule):
        """Mark parameter `name` as used by `func`, recognised by `rule`, which must be the rule of a module that
        registers it (a tied weight has one per module). A parameter used by several operations gets each one's
        share of its gradient added up (gradients and Jacobians add over uses); the norms also need the cross terms
        between uses, which only some rules give (_LayerRule.outer_factors): for them a second use by any other
        rule is refused."""
        if name is None:
            return None
        if name in self.used and self.need == "norms" and not (rule.has_outer_factors() and self.used[name].has_outer_factors()):
            self.fail(f"parameter {name} is used twice (by {func} again)")
        if self.owners is not None and rule not in (self.owners.get(name) or ()):
            owners = self.owners.get(name)
            self.fail(f"parameter {name} is used by {func} under the {rule.kind} rule, but its module's rule is "
                      + (" or ".join(owner.kind for owner in owners) if owners else "none"))
        self.used.setdefault(name, rule)
        return name

    # Higher-order operators (torch.cond; torch's while_loop, map, scan) come to __torch_dispatch__ too, rather than
    # raising inside torch for want of a rule: the trace cannot follow the examples into their subgraphs, so it
    # stops. Running one under a dispatch mode has broken the operator for the rest of the process (torch 2.13):
    # _run_trace mends it.
    supports_higher_order_operators = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        plan = self.plans.get(id(func))  # run for every operation: kept lean (each key read once, tensors passed on)
        if plan is None or plan.func is not func:
            if isinstance(func, torch._ops.HigherOrderOperator):
                self.met_higher_order = True
                self.fail(f"{func.name()} is a higher-order operator, which the fast path does not follow")
            plan = self.plan_of(func)
        kwargs = kwargs or {}
        flat_args = _tensors_in(args) + _tensors_in(kwargs.values()) if kwargs else _tensors_in(args)
        ids = [a._cdata for a in flat_args]  # the tensors' keys (class docstring)
        refs = self.refs
        for i, a in zip(ids, flat_args):
            if i not in refs:
                self.admit(func, a)
        result = func(*args, **kwargs)
        outs = [result] if isinstance(result, torch.Tensor) else _tensors_in((result,))
        for t in outs:  # reserve the results' keys (class docstring); an in-place result is its input, met before
            if t._cdata not in refs:
                refs[t._cdata] = _WeakTensorRef(t)
        if plan.draws or self.drawn and not self.drawn.isdisjoint(ids) and _only_drawn(self, flat_args, outs):
            self.drawn.update(t._cdata for t in outs)
        if self.unknown and not self.unknown.isdisjoint(ids):
            self.fail(f"{func} uses a side result whose rows are not the examples")
        if self.fresh and not self.fresh.keys().isdisjoint(ids):  # follow_fresh has nothing to do otherwise
            self.follow_fresh(func, args, ids)
        rows, trainable = self.rows, self.trainable
        rs = {rows[i] for i in ids if i in rows}
        params = [trainable[i] for i in ids if i in trainable]
        transposed = [self.transposed[i] for i in ids if i in self.transposed] if self.transposed else []
        shared = self.shared and not self.shared.keys().isdisjoint(ids)
        for index, name in plan.writes:
            value = args[index] if index < len(args) else kwargs.get(name)
            if isinstance(value, torch.Tensor):
                if self.param_of(value) is not None:
                    self.fail(f"{func} writes into parameter {self.param_of(value)}")
                if rs and self.r_of(value) is None:
                    self.fail(f"{func} writes example data into a tensor that held none")
        if not rs and not params and not transposed and not shared:
            return result  # nothing to do with the examples or the trainable parameters
        if any(isinstance(a.grad_fn, _CUSTOM) for a in flat_args) or not torch.is_grad_enabled() and any(a.requires_grad for a in flat_args):
            self.fail(f"{func} meets a custom autograd.Function's output, or runs with gradients off: autograd differentiates another thing")
        if len(rs) > 1:
            self.fail(f"{func} combines tensors with different numbers of rows per example")
        r = rs.pop() if rs else None
        out_r = self.rule(func, args, kwargs, result, r, params, transposed, plan, flat_args, outs)
        for t in outs:
            if r is not None and plan.allocates:  # new memory made from example data (a view's is its base's)
                self.hold_memory(t)
            if out_r is not None:
                if t.dim() == 0 or t.shape[0] != self.batch * out_r:
                    self.unknown.add(t._cdata)  # a side result (e.g. saved statistics): must not be used
                else:
                    rows[t._cdata] = out_r
        return result

    # In-place additions whose gradient with respect to the tensor they change is the identity: a residual added
    # into a layer's output (`h += shortcut`, transformers' ResNet) leaves that layer's output gradient unchanged.
    SHIFTS = {aten.add_.Tensor, aten.add_.Scalar, aten.sub_.Tensor, aten.sub_.Scalar}

    def follow_fresh(self, func, args, ids):
        """A layer's output changed in place by an addition before anything read it: the gradient autograd gives
        for the changed tensor is the gradient of the output the layer computed, so the layer keeps its place
        (its recorded version moves on). Any other use of a fresh output ends its freshness, and a later change
        in place is then refused (_run_trace compares versions)."""
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if func in self.SHIFTS and target is not None and target._cdata in self.fresh and ids.count(target._cdata) == 1:
            layer = self.fresh[target._cdata]
            if layer["a"] is not target:  # autograd counts the change once this call returns: one more version
                layer["versions"] = (layer["versions"][0], target._version + 1)
                return
        for i in ids:
            self.fresh.pop(i, None)

    def rule(self, func, args, kwargs, result, r, params, transposed, plan=None, tensors=None, out=None):
        """The rows per example of func's results (None: none), or fail; tensors, out: its tensor arguments and results."""
        B = self.batch
        plan = plan or self.plan_of(func)
        for layer_rule in plan.rules:  # operations that use a layer's parameters: the registry's rules (_layers)
            count = len(self.layers)
            out_r = layer_rule.record(self, func, args, kwargs, result, r, params, transposed)
            if out_r is not NotImplemented:
                for layer in self.layers[count:]:
                    self.fresh[layer["z"]._cdata] = layer
                return out_r
        if func is self.aten._to_copy.default and len(params) == 1 and r is None and not transposed:
            if self.follow_cast(args, kwargs, result, params[0]):
                return None
        if params or transposed:
            self.fail(f"{func} uses parameter {(params + transposed)[0]} in a way the fast path does not know")
        tensors = _tensors_in(args) + _tensors_in(kwargs.values()) if tensors is None else tensors
        if self.shared and any(a._cdata in self.shared for a in tensors):  # a tensor every example shares, made from a parameter
            if func is self.aten.detach.default:
                return None  # a constant from here on: no gradient flows back through it
            if func in self.ROW_PRESERVING and len(tensors) == 1:  # reshaped or copied: follow it further
                for t in _tensors_in((result,)):
                    self.shared[t._cdata] = self.shared[tensors[0]._cdata]
                return None
            self.fail(f"{func} uses a tensor made from a parameter for every example in a way the fast path does not know")
        if r is None:  # derived from constants only
            return None
        out = _tensors_in((result,)) if out is None else out
        category = plan.category
        if category == "constant":
            for t in out:
                if isinstance(t, torch.Tensor):
                    self.rows.pop(t._cdata, None)
            return None
        if category == "per_row":
            ndim, known = out[0].dim(), self.rows
            for a in tensors:
                if a._cdata in known and a.dim() != ndim:
                    self.fail(f"{func} broadcasts example data along another dimension")
            _same_for_each(self, func, tensors, ndim, r)
            return r
        if category == "row_preserving":
            t = out[0]
            if t.numel() != args[0].numel() or t.dim() == 0 or t.shape[0] % B:
                self.fail(f"{func} reshapes the batch dimension away")
            return t.shape[0] // B
        if category == "pad":  # F.pad's (left, right) pairs from the last dimension back: the batch's pair must be empty
            pad, ndim = list(args[1]), args[0].dim()
            if any(pad[2 * (ndim - 1):2 * ndim]):
                self.fail(f"{func} pads along the batch dimension")
            return r
        if category == "expand":
            if args[0].dim() != out[0].dim() or out[0].shape[0] != args[0].shape[0]:
                self.fail(f"{func} expands along the batch dimension")
            return r
        if category == "by_dim":
            dims = self.dims_of(func, args, kwargs)
            if dims is None or 0 in dims:
                self.fail(f"{func} works along the batch dimension (dim={dims})")
            if func is self.aten.index_select.default:  # one index for every row: it must not come from example data
                self.only_in(func, tensors, args[0])
            _same_for_each(self, func, tensors, max(a.dim() for a in tensors if a._cdata in self.rows), r)
            return r
        if category == "matmul":
            mats = args[1:3] if func in (self.aten.addmm.default, self.aten.baddbmm.default) else args[:2]
            if func in (self.aten.mm.default, self.aten.addmm.default) and self.r_of(mats[1]) is not None:
                self.fail(f"{func} multiplies by a matrix that holds example data")
            if func in (self.aten.addmm.default, self.aten.baddbmm.default) and self.r_of(args[0]) is not None and args[0].dim() != out[0].dim():
                self.fail(f"{func} broadcasts example data")
            if self.r_of(mats[0]) is None and func in (self.aten.mm.default, self.aten.addmm.default):
                self.fail(f"{func} multiplies example data from the right")
            # the batched products' dimension 0 and a bias of addmm's rows are the examples' (a weight's rows are not)
            _same_for_each(self, func, tensors if func in (self.aten.bmm.default, self.aten.baddbmm.default) else [args[0]], out[0].dim(), r)
            return r
        if category == "layer_norm":
            if len(args[1]) >= args[0].dim():
                self.fail(f"{func} normalises over the batch dimension")
            self.only_in(func, tensors, args[0])
            return r
        if category == "own_rows":  # a lookup keeps the rows of its indices, a table with example data mixes them
            self.only_in(func, tensors, args[1] if func is self.aten.embedding.default else args[0])
            return r
        if category == "batch_norm" and self.values_of(func, args, kwargs).get("training") is False:
            self.only_in(func, tensors, args[0])
            return r  # running statistics: each example normalised on its own
        if category == "attention":
            query = args[0]
            rows = [a for a in tensors if self.r_of(a) is not None]
            if self.r_of(query) is None or query.dim() != 4 or any(a.dim() != 4 or a.shape[0] != query.shape[0] for a in rows):
                self.fail(f"{func} attends across the batch dimension")
            _same_for_each(self, func, tensors, 4, r)  # a mask, or a key and value every example is to share
            return r
        self.fail(f"{func} is not on the fast path's list of operations")

    def only_in(self, func, tensors, carrier):
        """Stop unless carrier is the one argument of func that holds example data (the input of a normalisation, the
        indices of a lookup): a weight, a table, running statistics or an index with example data in them would
        apply one example's values to the other examples' rows. tensors: func's tensor arguments."""
        if sum(self.r_of(a) is not None for a in tensors) > (self.r_of(carrier) is not None):
            self.fail(f"{func} takes example data in an argument other than its input")

    def follow_cast(self, args, kwargs, result, name):
        """A parameter copied into another floating dtype on its own device (autocast's bfloat16 copy of a float32
        weight, or a model's own weight.to(x.dtype)): the copy stands for the parameter from here on, so its uses
        are the parameter's (the gradient flows back through the copy, cast to the parameter's dtype). False where
        the copy changes anything but the dtype."""
        (source,) = _tensors_in(args)
        if not (isinstance(result, torch.Tensor) and source.is_floating_point() and result.is_floating_point()
                and result.device == source.device and result.layout == source.layout and result.shape == source.shape
                and set(kwargs) <= {"dtype", "device", "layout", "memory_format", "non_blocking", "pin_memory"}
                and not kwargs.get("pin_memory")):
            return False
        self.trainable[result._cdata] = name
        return True

    values_of = staticmethod(_values_of)  # for the layer rules: trace.values_of(func, args, kwargs)

    @classmethod
    def dims_of(cls, func, args, kwargs):
        self = cls
        values = cls.values_of(func, args, kwargs)
        # cat and stack: the widest tensor (cat skips an empty 1-D tensor, such as an empty cache)
        first = values["self"] if "self" in values else max(values["tensors"], key=lambda t: t.dim())
        ndim = first.dim() + (1 if func is self.aten.stack.default else 0)
        if func is self.aten.permute.default:
            return [0] if values["dims"][0] % ndim else [1]  # only moving dimension 0 matters
        if func is self.aten.transpose.int:
            return [values["dim0"] % ndim, values["dim1"] % ndim]
        dims = values.get("dim")
        if dims is None:
            return None
        dims = [dims] if isinstance(dims, int) else list(dims)
        return [d % ndim for d in dims] or None  # an empty list reduces over every dimension


def _same_for_each(trace, func, tensors, ndim, r):
    """Stop the trace (a _BatchTrace) where a tensor made without example data (a constant to it) lines up its
    dimension 0 with the examples' (ndim dimensions, B*r rows) and holds other values for one example than for
    another: the examples' positions in the batch then change their results (x * (torch.arange(len(x)) == 2), a
    table of a batch's size added row by row), where vmap and the loop, which see each example alone, give each its
    own. A mask of ones made for the batch (transformers' attention mask when none is given), or one expanded along
    dimension 0, has the same rows and passes, and so does one made from random draws (a dropout mask drawn for the
    batch by torch.rand: each example gets draws of its own, as in the loop), unless a tensor of the batch's size
    whose rows differ went into it too (_only_drawn). Cost: _rows_differ on each such constant."""
    B = trace.batch
    if B < 2:
        return
    for a in tensors:
        if a._cdata in trace.rows or a.dim() != ndim or a.shape[0] != B * r or a._cdata in trace.drawn:
            continue
        if _rows_differ(a, B):
            trace.fail(f"{func} combines example data with a tensor whose rows differ from one example to the next "
                       "(made from the batch's size, say): the examples' positions in the batch change their results")


setattr(_BatchTrace, "same_for_each", _same_for_each)  # for the layer rules: trace.same_for_each(func, tensors, ndim, r)


def _only_drawn(trace, tensors, outs):
    """Whether the results of an operation on a random draw (trace.drawn) are made of draws only, as far as the
    examples' positions go: False where it also takes a tensor made without the examples whose rows (along the
    results' dimension 0) differ, such as a position mask (torch.rand(B, 1) < p) & (torch.arange(B)[:, None] != 2),
    whose results _same_for_each must then compare. Reads the values of such a tensor only (rare: a dropout mask
    meets numbers and example data)."""
    out = outs[0] if outs else None
    for a in tensors:
        if out is None or a._cdata in trace.drawn or a._cdata in trace.rows or a.dim() != out.dim() or a.dim() == 0:
            continue
        if a.shape[0] == out.shape[0] > 1 and _rows_differ(a, a.shape[0]):
            return False
    return True


def _rows_differ(a, groups):
    """Whether a tensor's dimension 0, cut into `groups` equal parts (the examples' rows), holds other values in one
    part than in the first. Reads its values (a synchronisation on a GPU), but not for a tensor expanded along
    dimension 0 (stride 0), whose parts are the same memory."""
    rows = a.detach().unflatten(0, (groups, -1))
    return rows.stride(0) != 0 and not torch.equal(rows, rows[:1].expand_as(rows))


def _losses_of_each(loss_fn, predictions: torch.Tensor, batch: _Batch) -> torch.Tensor:
    """loss_fn on every example as a batch of one, as a (B,) tensor (the recipes' loss_fn contract): predictions
    are the model's output on the batch (a tensor, or a pytree of them such as a ModelOutput), whose targets are
    batch.targets."""
    outputs = _Batch((predictions,), {}, batch.targets, (True,), {}, len(batch))
    loss_of_one, in_dims, values = outputs.per_example(lambda _, one: _scalar_loss(one.loss(loss_fn, one.args[0])))
    try:
        losses = vmap(loss_of_one, in_dims=(None, *in_dims))(None, *values)
    except RuntimeError:  # a loss vmap cannot batch (it calls .item(), say): one call per example
        losses = torch.stack([loss_of_one(None, *[v[n] if d == 0 else v for v, d in zip(values, in_dims)]) for n in range(len(predictions))])
    return losses


def _owner_rules(model: nn.Module, trainable: dict[str, nn.Parameter], need: str) -> dict[str, tuple[_LayerRule, ...] | None]:
    """{name: the rules that cover the parameter in the modules that register it (as their weight or bias, or a
    bare parameter; a tied weight has two)} (None where a module registers it that no rule providing `need`
    covers), for every trainable parameter."""
    rules = _rules_for(need)
    places: dict[int, list] = {}
    for module in model.modules():
        for short, p in module._parameters.items():
            if p is not None:
                places.setdefault(id(p), []).append((module, short))
    found: dict[str, tuple[_LayerRule, ...] | None] = {}
    for name, p in trainable.items():
        covering = [_rule_of(module, rules, short) for module, short in places[id(p)]]
        found[name] = tuple(dict.fromkeys(r for r in covering if r is not None)) if None not in covering else None
    return found


def _fast_path_screen(model: nn.Module, trainable: dict[str, nn.Parameter], need: str, path: str, batch: _Batch,
                      variant: Any = None) -> tuple[str | None, dict[str, tuple[_LayerRule, ...] | None] | None]:
    """Whether the fast path may apply, as far as is known before its trace: (None, owners) if it may, owners
    being _owner_rules(model, trainable, need), which the trace then checks every use against (so they are worked
    out once per call); otherwise (the reason, None): another path was asked for, a parameter belongs to a module
    no layer rule covers, a backward hook is registered, or a parameter has a gradient hook. need: what the caller
    asks of the layer rules ("grads", "jacobian" or "norms"). Where the fast path may apply, a model whose output
    for one example depends on the other examples of the batch is refused here, as off the fast path
    (_batch._check_examples_apart, remembered per call signature): the trace sees every operation but not the
    Python numbers a forward pass reads from a tensor, such as the batch's size (`h / x.shape[0]`) or `.tolist()`
    of its values; a model that runs on each example alone and on the batch, but not on two examples together,
    depends on the batch's size, and the fast path steps aside (the reason returned); so does one whose backward
    pass _end_gradients_alone found mixing the examples for this call signature (variant: output_jacobian's select)."""
    if path in ("vmap", "unroll", "loop"):
        return f"path={path!r} was asked for", None
    owners = _owner_rules(model, trainable, need)
    for name, rules in owners.items():
        if rules is None:
            rules_ = _rules_for(need)  # the module that registers it without a rule (of a tied weight's, the one not covered)
            module = next(m for m in model.modules() for short, p in m._parameters.items()
                          if p is trainable[name] and _rule_of(m, rules_, short) is None)
            kinds = ", ".join(r.kind for r in rules_)
            return f"parameter {name} belongs to {type(module).__name__}, not to a layer the fast path covers ({kinds})", None
    hooked_module = _module_backward_hook(model)
    if hooked_module:
        return hooked_module, None
    hooked = _hooked_parameters(model)
    if hooked:
        return f"parameter {hooked[0]} has a gradient hook (Tensor.register_hook), which only the loop runs", None
    size_read = _check_examples_apart(model, batch)
    if size_read:
        return size_read, None
    failed = _FAILED.get(model)  # the key (a call signature) is worked out only where something failed before
    mixed = failed.get(_backward_key(model, batch, trainable, need, variant)) if failed else None
    if failed and not mixed and need == "norms":  # the clipped sums' comparison of gradients (per_sample)
        mixed = failed.get(_backward_key(model, batch, trainable, "weighted sum", variant))
    if mixed:  # _end_gradients_alone found the backward pass mixing the examples
        return mixed, None
    return None, owners


# Traces that failed, remembered per model: {model: {call signature: reason}}. A failed trace is a whole
# forward pass wasted, every call of a training loop; remembering only failures can never make a result
# wrong (a wrongly remembered one costs a fast path, not correctness). A model that is freed takes its
# entry with it.
_FAILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _traced_forward(model, batch, trainable, need="grads", owners=None, memo=None, variant=None):
    """Runs the model (or a function calling it) on a _Batch under the trace. Returns (output, layers, None)
    or (None, None, reason). need: what the caller asks of the layer rules ("grads", "jacobian", "norms");
    owners: from _owner_rules on the model. A trace that failed for this model and call signature before is
    not run again: its reason is returned at once. memo: the model whose memory that is kept in (default: model;
    output_jacobian passes its model, where `model` is a new function of it on every call); variant: what else
    the traced function depends on (output_jacobian's select: a failure with one select is not another's). For a model known to
    draw random numbers (_batch._remembered_draws), a trace that fails or raises leaves every generator it drew
    from as it found it (the default ones, those the model holds, any other it passed to a torch function)."""
    memo = model if memo is None else memo
    if _batch_made_with(batch, trainable) is not None:  # every path refuses it (_check_parameters_reached says why)
        return None, None, "the batch was computed from trainable parameters, with their autograd graph"
    failed = _per_model(_FAILED, memo, dict)
    signature = _call_signature(memo, batch)  # shapes, dtypes, devices, other arguments, modes, grad mode
    key = None if signature is None else (need, tuple(trainable), signature, variant)
    if key is not None and key in failed:
        return None, None, failed[key]
    if not (isinstance(memo, nn.Module) and _remembered_draws(memo, batch)):
        output, layers, reason = _run_trace(model, batch, trainable, need, owners)
    else:  # a trace that fails is undone: the path that runs next, or the refusal, starts from the call's generators
        cuda, held = _cuda_devices(memo, batch), _held_generators(memo)
        before, watch = _generator_states(cuda, held), _GeneratorWatch()
        try:
            with watch:
                output, layers, reason = _run_trace(model, batch, trainable, need, owners)
        except BaseException:
            reason = "raised"
            raise
        finally:
            if reason is not None:
                _set_generator_states(before, cuda, held)
                watch.restore(held)
    if reason is None:
        reason = _end_rows_alone(model, memo, batch, output, key)
        if reason is not None:
            output = layers = None
    if reason is not None and key is not None:
        failed[key] = reason
    return output, layers, reason


# Call signatures whose traced output was compared with its end examples' alone (_end_rows_alone), per model:
# {model: {key}}; a model that is freed takes its entry with it.
_ROW_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _end_rows_alone(model, memo, batch, output, key):
    """None, or the reason the fast path steps aside: the traced output's first and last rows must agree with those
    examples' outputs alone (_batch._outputs_agree, output tensors with a row per example of the batch). The trace
    sees every operation, but not a Python number the forward pass reads from a tensor: a model that divides by
    max(x.shape[0], 2) agrees between one and two examples (_batch._check_examples_apart), and gave the batch's
    rows where vmap and the loop, which see each example alone, give the example's own. (A tensor made from the
    batch's size, torch.arange(x.shape[0]) >= 2, is the trace's to see: _same_for_each.) Not seen: a
    number so read that leaves the first and last rows as they are alone. Cost: two forward
    passes of one example, in the caller's autocast (then to 16 roundings of its dtype at least), with gradients
    on; once per model and call signature (key, as for _FAILED: a chunk of another size is checked again), but on
    every call with output_jacobian's select (the key's variant), which is known by its id alone, and an id a
    freed function had may be another function's. Left undone, and remembered, where a pass of one example raises
    (the recipe's other paths meet the error) or draws random numbers (it cannot be compared); the generators are
    left as they were found (as in _batch._check_examples_apart)."""
    checked = _per_model(_ROW_CHECKED, memo, set)
    if len(batch) < 2 or key is not None and key in checked:
        return None
    ends = (0, len(batch) - 1)
    alone: list = []
    try:
        with torch.enable_grad(), _generators_kept(memo, batch) as drew:
            alone = [_detached(batch.rows(slice(n, n + 1)).call(model)) for n in ends]
            if drew() and not _same_again(alone, lambda: [_detached(batch.rows(slice(n, n + 1)).call(model)) for n in ends]):
                alone = []  # random draws that change the result: nothing to compare
    except Exception:  # noqa: BLE001 (any error, no message read: the recipe's other paths meet it)
        alone = []
    together = _detached(output)
    slack = _autocast_slack(batch)
    for n, one in zip(ends, alone):
        if len(one) != len(together):
            continue
        pairs = [(t[n:n + 1], a) for t, a in zip(together, one) if isinstance(t, torch.Tensor) and isinstance(a, torch.Tensor)
                 and t.dim() >= 1 and t.shape[0] == len(batch) and a.shape == (1, *t.shape[1:])]
        if pairs and not _outputs_agree([t for t, _ in pairs], [a for _, a in pairs], slack):
            return (f"example {n}'s output in the batch of {len(batch)} differs from its output alone, though two examples "
                    "agree: the forward pass reads a number from the whole batch (its size, say) that the trace cannot see, "
                    "or its output is a difference of far larger numbers, which round otherwise in a batch of another size")
    if key is not None and key[-1] is None:  # no select
        checked.add(key)
    return None


def _same_again(first, again):
    """Whether again() (the same lone passes, run on from where the first ones left the generators, so with other
    draws) gives exactly first: then the draws change nothing (stochastic depth with a drop rate of 0, a branch no
    draw takes) and the passes can be compared with the batch's; else (dropout) they cannot."""
    second = again()
    flat = lambda runs: [t for run in runs for t in tree_flatten(run)[0] if isinstance(t, torch.Tensor)]  # noqa: E731
    return len(flat(first)) == len(flat(second)) and all(
        a.shape == b.shape and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)) for a, b in zip(flat(first), flat(second)))


def _autocast_slack(batch):
    """The tolerance a comparison between batch sizes allows under autocast: low-precision kernels round differently
    between batch sizes (a bfloat16 Llama's logits, upcast to float32, 3e-3 apart between one example and two), so
    16 roundings of the autocast dtype, as for its own outputs; 0.0 without autocast."""
    low = [torch.get_autocast_dtype(d) for d in {t.device.type for t in batch.tensors()} | {"cpu"} if torch.is_autocast_enabled(d)]
    return max((16 * torch.finfo(dtype).eps for dtype in low), default=0.0)


# Call signatures whose fast per-example gradients (or norms) were compared with their end examples' alone
# (_end_gradients_alone), per model: {model: {key}}.
_GRADS_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# The per-example gradients' comparison allows 1e-4 of the largest entry of the example's gradient in float32 (scaled
# by the rounding unit of the coarsest dtype the pass computed in: float64's, or 16 roundings of a narrower one;
# under autocast, _autocast_slack). Measured on the six families of scripts/gpu_table.py (B = 16, T = 32, CPU), the
# batched and the lone passes' gradients, norms and Jacobians differ by at most 4e-7 of that entry in float32, and
# 3.4e-3 under bfloat16 autocast (allowed 0.125).
# A backward pass that mixes the examples changes them by far more (a hook dividing by the batch's norm: 0.4).
_GRADIENT_TOLERANCE = 1e-4
# Each tensor is compared relative to its own largest entry, but never to less than this share of the example's
# largest entry over all its tensors: a gradient that is zero but for rounding (an attention key's bias, which
# softmax ignores: 1e-20 in one pass, 5e-20 in the other, 2e-9 of the largest) must not count as a difference, and
# a mixing on a layer whose gradients are 1e-5 of another layer's (0.49 off there) must (relative to the largest
# entry over all tensors it passed). Measured as above, the differences relative to that scale were at most 9.7e-7
# in float32 (ViT's key bias; 9.7e-6 with a share of 1e-4) and 1.1e-2 under bfloat16 autocast.
_SCALE_FLOOR = 1e-3


def _gradient_tolerance(eps):
    """_GRADIENT_TOLERANCE for a rounding unit: scaled by it for float32's and finer, 16 roundings if coarser."""
    single = torch.finfo(torch.float32).eps
    return _GRADIENT_TOLERANCE * eps / single if eps <= single else 16 * eps


class _CoarsestRounding(TorchFunctionMode):
    """Notes the largest rounding unit among the floating results of the torch functions it sees that autograd
    records: the precision a pass's gradients were computed in (a float64 model that casts to float32 inside
    computes in float32); a tensor off the gradient's way (a mask made in bfloat16, then cast) is left out, since
    it would widen the tolerance to bfloat16's for a float64 gradient."""

    def __init__(self):
        super().__init__()
        self.eps = 0.0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in result if isinstance(result, (list, tuple)) else (result,):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad:
                self.eps = max(self.eps, torch.finfo(t.dtype).eps)
        return result


def _backward_key(model, batch, trainable, need, variant=None):
    """The key a failed comparison of per-example gradients is remembered by in _FAILED (None: not remembered)."""
    signature = _call_signature(model, batch)
    return None if signature is None else (need + " backward", tuple(trainable), signature, variant)


def _example_gradients(model, loss_fn, trainable, norms=False):
    """The loop's step: a function of one example (a _Batch of one) giving its gradients by autograd, one per trainable
    parameter, or (norms=True) their squared norm, (1,). The per-example loops and _end_gradients_alone use it."""
    params = list(trainable.values())

    def alone(one):
        loss = _scalar_loss(one.loss(loss_fn, one.call(model)))
        grads = _dense_grads(torch.autograd.grad(loss, params, allow_unused=True), params)
        return [sum((g.square().sum() for g in grads), loss.new_zeros(())).reshape(1)] if norms else grads

    return alone


def _gradients_checked(model, batch, trainable, need, variant=None):
    """Whether _end_gradients_alone has nothing to do for this call: a batch of one, or a call signature it
    compared before (and remembered)."""
    key = _backward_key(model, batch, trainable, need, variant)
    return len(batch) < 2 or key is not None and key in _per_model(_GRADS_CHECKED, model, set)


def _end_gradients_alone(model, batch, trainable, need, found, alone, variant=None, covers=()):
    """None, or the reason the fast path's answer is set aside: its first and last examples' gradients (or squared
    norms, or Jacobian rows weighted and summed) must agree with those examples' alone. found(n), alone(example n as a
    batch of one): the fast path's and the lone example's, as lists of tensors (_example_gradients, or
    output_jacobians._weighted_row). Why: the trace follows the forward pass, but the backward pass also runs what
    the forward pass hung on it, on the whole batch's gradient at once, where vmap and the loop run it on each
    example's: a gradient hook on an activation that mixes the examples (h.register_hook(lambda g: g / g.norm())), a
    hook on a grad_fn. Compared to _GRADIENT_TOLERANCE (more under autocast, as in _end_rows_alone). Cost: a forward
    and backward pass of each of two examples, once per model and call signature, or on every call with
    output_jacobian's select (variant, its id: as in _end_rows_alone). Where they differ, the reason is remembered
    (_FAILED, _backward_key) and later calls go to the other paths at once (_fast_path_screen). Left undone, and remembered,
    where a pass of one example raises or draws random numbers, as in _end_rows_alone. Not seen: a mixing that
    leaves the end examples as they are alone, one on a tensor whose entries are below _SCALE_FLOOR of the largest,
    or, for the norms, one that moves them by less than the tolerance (saved-tensor hooks that quantise with one
    scale for the whole batch: 1e-4 of the squared norms; a layer whose gradients are 1e-5 of another's, whose share
    of the squared norm is 1e-10). covers: other needs a passed comparison also counts as done for (the clipped sums'
    comparison of gradients, for the norms of the same call signature)."""
    checked = _per_model(_GRADS_CHECKED, model, set)
    key = _backward_key(model, batch, trainable, need, variant)
    if len(batch) < 2 or key is not None and key in checked:
        return None
    ends, lone, rounding = (0, len(batch) - 1), [], _CoarsestRounding()
    try:
        with torch.enable_grad(), _generators_kept(model, batch) as drew, rounding:
            lone = [alone(batch.example(n)) for n in ends]
            if drew() and not _same_again(lone, lambda: [alone(batch.example(n)) for n in ends]):
                lone = []  # random draws that change the result: nothing to compare
    except Exception:  # noqa: BLE001 (any error, no message read: the recipe's other paths meet it)
        lone = []
    tolerance = max(_gradient_tolerance(rounding.eps), _autocast_slack(batch))
    for n, one in zip(ends, lone):
        fast = [t.detach() for t in found(n)]
        largest = [t.abs().nan_to_num(0.0, 0.0).max().item() if t.numel() else 0.0 for t in fast]  # finite entries
        floor = _SCALE_FLOOR * max(largest, default=0.0)  # each tensor to its own scale, with a floor (_SCALE_FLOOR)
        if len(one) != len(fast) or not all(
                a.shape == t.shape and torch.allclose(t, a.detach().to(t.dtype), rtol=tolerance, atol=tolerance * max(own, floor), equal_nan=True)
                for t, a, own in zip(fast, one, largest)):
            what = {"norms": "squared norm of its gradient", "jacobian": "weighted sum of Jacobian rows"}.get(need, "gradient")
            reason = (f"example {n}'s {what} in the batch of {len(batch)} differs from its {what} alone: the backward pass "
                      "mixes the examples (a gradient hook on an activation, say), which vmap and the loop run on each "
                      "example's gradient alone")
            if key is not None:
                _per_model(_FAILED, model, dict)[key] = reason
            return reason
    if key is not None and variant is None:
        checked.add(key)
        checked.update(k for k in (_backward_key(model, batch, trainable, other) for other in covers) if k is not None)
    return None


def _run_trace(model, batch, trainable, need, owners):
    if owners is None and isinstance(model, nn.Module):
        owners = _owner_rules(model, trainable, need)
    tracer = _BatchTrace(len(batch), batch.tensors(), trainable, need, owners)
    # autocast keeps the low-precision copy of each parameter it casts, for the rest of its region: a copy made
    # before the trace (an earlier forward pass in the same region) would reach the trace unannounced, as a
    # constant. With the cache off, every cast is an operation the trace sees (follow_cast).
    cache = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        with tracer:
            output = batch.call(model)
    except _NotPerExample as stop:
        return None, None, str(stop)
    finally:
        torch.set_autocast_cache_enabled(cache)
        if tracer.met_higher_order:
            # torch 2.13 runs a higher-order operator in eager mode by compiling it, and one compiled under a dispatch
            # mode fails in every later call (Dynamo's "torch.* op returned non-Tensor"), the user's own included:
            # clearing the compiler's caches mends that. The user's compiled functions then compile again on their
            # next call. Once per model and call signature: the failed trace is remembered.
            torch.compiler.reset()
    if getattr(tracer, "failure", None):  # the model's forward caught the trace's exception
        return None, None, tracer.failure
    leaves = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
    if not leaves or any(tracer.r_of(t) != 1 for t in leaves):  # a tensor, or a pytree of them (a ModelOutput)
        return None, None, "the model's output is not made of tensors with the examples along dimension 0"
    if any(isinstance(t.grad_fn, _CUSTOM) for t in leaves):
        return None, None, "the model's output comes from a custom autograd.Function, whose backward the trace cannot see"
    hooked = _hooked_parameters(trainable)  # registered by the forward pass itself (once, lazily, or on every call)
    if hooked:
        return None, None, f"parameter {hooked[0]} has a gradient hook (Tensor.register_hook), which only the loop runs"
    unused = [name for name in trainable if name not in tracer.used]
    unused += [info["weight"] for info in tracer.shared.values() if not info["added"]]
    if unused:
        kinds = " or ".join(rule.kind for rule in tracer.rules)
        return None, None, f"parameter {unused[0]} is not used by an operation its layer's rule ({kinds}) recognises"
    moved = _moved_layer(tracer.layers)
    if moved is not None:
        return None, None, f"an in-place operation changed the input or output of the layer of {moved}"
    for layer in tracer.layers:
        if not layer["z"].requires_grad:  # made with gradients on, then detached (a custom Function's forward returned it)
            return None, None, f"the output of the layer of {layer['weight'] or layer['bias']} was detached after the layer ran"
    for layer in tracer.layers:
        _in_parameter_dtype(layer, trainable)
    return output, tracer.layers, None


def _moved_layer(layers) -> str | None:
    """The name (weight, else bias) of the first traced layer whose recorded input or output an in-place operation
    changed since the trace recorded it (its version counter moved past layer["versions"]), else None. Asked after
    the forward pass (_run_trace) and again after the loss (_changed_by_loss: a loss_fn that calls
    F.relu(out, inplace=True) or out.div_(temperature) on the model's output, which is the last layer's):
    autograd's gradient at a changed tensor is the changed tensor's, not that of the output the layer computed,
    so the per-example products from it would be wrong, and the fast path steps aside."""
    for layer in layers:
        if (layer["a"]._version, layer["z"]._version) != layer["versions"]:
            return layer["weight"] or layer["bias"]
    return None


def _changed_by_loss(layers) -> str | None:
    """None, or why the fast path steps aside: the loss changed a traced layer's input or output in place
    (_moved_layer, asked once the losses are computed)."""
    moved = _moved_layer(layers)
    return None if moved is None else (f"the loss changed the input or output of the layer of {moved} in place "
                                       "(out.div_(t), or an in-place activation on the model's output)")


def _in_parameter_dtype(layer, trainable):
    """Autocast runs a layer in a lower precision than its parameters (bfloat16 operands for float32 weights;
    the trace follows the cast copy as the parameter, _BatchTrace.follow_cast). Autograd accumulates a
    parameter's gradient in the parameter's dtype; so do the per-example products: layer["dtype"] names that
    dtype, and the consumers cast the layer's recorded tensors and its output gradient to it one layer at a
    time, as they use them (_layers._in_dtype, _layers._delta_in_dtype), so that no second copy of every
    layer's input is held. A layer that ran in its parameters' dtype is left as it is."""
    name = layer.get("weight") or layer.get("bias")
    dtype = trainable[name].dtype if name is not None else None
    if dtype is not None and layer["z"].dtype != dtype and dtype.is_floating_point and layer["z"].is_floating_point():
        layer["dtype"] = dtype
