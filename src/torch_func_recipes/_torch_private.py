"""The private PyTorch APIs the package relies on, each listed once with the reason.

Policy. The recipes use a private torch name (a module path with a `_` component, a class, function
or attribute whose name starts with `_`, an ATen operator whose name starts with `_`) only where no
public API does the job, or where the public one is newer than the oldest torch the package
supports. Every such use is an entry of PRIVATE_APIS below, with the recipes that depend on it, why,
and the public API to move to where torch has one. tests/test_torch_private.py enforces the register
both ways:

- every entry still resolves in the installed torch (one test per entry, named after the API), so a
  torch release that removes or renames one fails a test that names it and the recipes affected;
- an ast scan of the package's source finds exactly the names listed here, used exactly where
  `where_used` says: a new private use must be added, and an entry the code no longer needs removed.

The other modules do not import this one: their code is the chapters' code, identical to the cells
tagged `recipe` (tests/test_package.py), so they keep their own imports and this module is the
register the tests read. It defines no function or class (tests/test_package.py would look for one
in the chapters). No torch error message appears here: the package reads none (the fall-back from
vmap to the loop follows any exception, _vmap_gaps._with_fallbacks).

Entry fields: `name`, how the test resolves it, by kind:

- "import" (imported from a private module) and "module attribute" (a private name reached
  through a module): a dotted path, imported and then followed attribute by attribute;
- "aten operator": torch.ops.aten.<name>.<overload>, followed from torch;
- "object attribute": Class._attr, checked with hasattr on the object `owner()` makes.

`where_used`: the package's functions and classes that use it (module.qualified_name); `reason`:
why a public API does not do, in one sentence; `public_alternative`: where torch has one, or None.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn as nn

PrivateAPI = NamedTuple("PrivateAPI", [
    ("name", str),
    ("kind", str),  # "import", "module attribute", "object attribute" or "aten operator"
    ("where_used", tuple[str, ...]),
    ("reason", str),
    ("public_alternative", str | None),
    ("owner", Callable[[], object] | None),  # makes the object an "object attribute" belongs to
])

_DISPATCH_ALIAS = ("the public op dispatches to it, so it is the name the fast path's TorchDispatchMode sees and must allow; "
                   "a dispatch mode sees ATen operators, never the Python-level function")
_TRACE = ("_trace._BatchTrace",)
_SCREEN = ("_batch._module_backward_hook",)

PRIVATE_APIS: tuple[PrivateAPI, ...] = (
    PrivateAPI("torch._ops", "module attribute", ("_trace._BatchTrace.__torch_dispatch__",),
               "its HigherOrderOperator is the type of torch.cond's operator: the trace, which supports them so that "
               "torch does not raise inside the model, stops at one (and then mends the process, which running one "
               "under a dispatch mode breaks in torch 2.13)",
               None, None),
    PrivateAPI("torch.utils._python_dispatch.TorchDispatchMode", "import", _TRACE,
               "only a dispatch mode sees every ATen operation of the forward pass with its schema, which the fast "
               "path's trace must check; torch.overrides.TorchFunctionMode sees Python calls before decomposition",
               None, None),
    PrivateAPI("torch.utils._pytree.tree_flatten", "import", ("_batch._Batch._leaves", "_batch._Batch.loss", "_batch._Batch.tensors", "_batch._as_batch",
                                                               "_batch._check_parameters_reached", "_batch._detached",
                                                               "_batch._gradients_enabled.run",
                                                               "_trace._run_trace", "_trace._same_again", "output_jacobians._check_select_apart"),
               "flattens an operator's nested arguments and results, a batch's nested inputs and targets, and a model's "
               "nested outputs, as torch's own dispatch code and vmap do, and torch has no public pytree module",
               None, None),
    PrivateAPI("torch.utils._pytree.tree_unflatten", "import", ("_batch._Batch._rebuild", "_batch._Batch.per_example.g",
                                                                 "_batch._gradients_enabled.run", "output_jacobians._check_select_apart"),
               "rebuilds a batch's nested inputs and targets from the leaves tree_flatten gave (one example's rows, or "
               "vmap's slices), and a model output from its rows, and torch has no public pytree module",
               None, None),
    PrivateAPI("torch.nn.utils.parametrize._cache_enabled", "module attribute", ("_batch._call_signature",),
               "whether torch.nn.utils.parametrize.cached() is on: a parametrized weight is then computed once and reused "
               "as a tensor made before the pass, so a check that passed outside it does not hold inside; torch has no "
               "public query",
               None, None),
    PrivateAPI("torch.nn.modules.dropout._DropoutNd", "module attribute", ("_batch",),
               "the one base class of Dropout, Dropout1d/2d/3d, AlphaDropout and FeatureAlphaDropout (and third-party "
               "subclasses), the modules that draw random numbers in training mode; they share no public base",
               None, None),
    PrivateAPI("torch.nn.modules.batchnorm._BatchNorm", "module attribute", ("_batch._check_model", "_layer_batch_norm._BatchNormRule"),
               "the one base class of BatchNorm1d/2d/3d, their Lazy variants, SyncBatchNorm and third-party subclasses; "
               "the public classes share no public base",
               None, None),
    PrivateAPI("torch.nn.modules.module._global_backward_hooks", "module attribute", _SCREEN,
               "no public API says whether a global module backward hook is registered, and the fast path, which "
               "skips module backward hooks, and the curvature recipes, whose products it changes, must refuse when "
               "one is",
               None, None),
    PrivateAPI("torch.nn.modules.module._global_backward_pre_hooks", "module attribute", _SCREEN,
               "no public API says whether a global module backward pre-hook is registered, and the fast path, "
               "which skips them, and the curvature recipes must refuse when one is",
               None, None),
    PrivateAPI("Module._parameters", "object attribute", ("_batch._model_kept", "_batch._refuse_lazy", "_trace._fast_path_screen", "_trace._owner_rules",
                                                          "per_sample._covered_linear_layers"),
               "maps each module's own parameters by their short names, a parameter registered under two names "
               "included, which named_parameters(recurse=False) would drop as a duplicate; read in one walk of the "
               "modules, it costs a quarter of named_parameters()",
               "module.named_parameters(recurse=False, remove_duplicate=False)", lambda: nn.Linear(1, 1)),
    PrivateAPI("Module._buffers", "object attribute", ("_batch._model_kept",),
               "maps each module's own buffers (None included) by their short names: the ones whose values are "
               "copied on the way in and compared on the way out; read in one walk of the modules, it costs a fifth of named_buffers(recurse=False) per module",
               "module.named_buffers(recurse=False, remove_duplicate=False)", lambda: nn.BatchNorm1d(1)),
    PrivateAPI("torch._C._functions", "import", ("curvature._differentiable_backward.check.hook",),
               "autograd's node types; its Error is the node a once_differentiable backward hangs its gradients "
               "off: they require grad, but a second "
               "backward pass never reaches the error it raises, so without this type the curvature recipes "
               "could not tell such a gradient from one in the graph",
               None, None),
    PrivateAPI("BackwardCFunction._forward_cls", "object attribute", ("curvature._differentiable_backward",),
               "the autograd.Function class a custom node belongs to: the one way to tell a higher-order operator's "
               "node (its class is defined in torch._higher_order_ops), whose second derivatives torch 2.13 gets "
               "wrong, from a user's Function",
               None, lambda: type("Same", (torch.autograd.Function,), {  # a node of a Function made on the spot
                   "forward": staticmethod(lambda ctx, x: x.clone()), "backward": staticmethod(lambda ctx, g: g),
               }).apply(torch.ones(1, requires_grad=True)).grad_fn),  # type: ignore[attr-defined]
    PrivateAPI("Module._compiled_call_impl", "object attribute", ("_batch._compiled",),
               "module.compile() keeps the compiled call here, and no public API says whether a module was compiled "
               "so, nor with which options: one compiled with fullgraph=True fails inside torch.func's transforms, "
               "and the recipes refuse it by name instead",
               None, lambda: nn.Linear(1, 1)),
    PrivateAPI("Module._modules", "object attribute", ("_vmap_gaps._unrolled_stand_in",),
               "the unroll's stand-in gives each copied module dicts of its own for its submodules (and, in "
               "_shallow_copy, by key, for its parameters and buffers) and puts the copied child there, so "
               "nothing is written to the user's module; register_module would go through __setattr__'s checks "
               "and is a public way to add, not to replace in a private copy",
               None, lambda: nn.Sequential(nn.Linear(1, 1))),
    PrivateAPI("Module._forward_hooks", "object attribute", ("per_sample._covered_linear_layers",),
               "no public API says whether a module has forward hooks, which may change its output and so rule "
               "out the direct per-example product",
               None, lambda: nn.Linear(1, 1)),
    PrivateAPI("Module._forward_pre_hooks", "object attribute", ("per_sample._covered_linear_layers",),
               "no public API says whether a module has forward pre-hooks, which may change its input and so "
               "rule out the direct per-example product",
               None, lambda: nn.Linear(1, 1)),
    PrivateAPI("Module._backward_hooks", "object attribute", (*_SCREEN, "_batch._hooked_parameters", "_batch._model_kept"),
               "no public API says whether a module has backward hooks, which the fast path would skip and the "
               "curvature recipes refuse, nor whether a "
               "parameter has gradient hooks of its own (Tensor.register_hook keeps them in its _backward_hooks too), "
               "which the fast path and vmap would skip",
               None, lambda: nn.Linear(1, 1)),
    PrivateAPI("Tensor._post_accumulate_grad_hooks", "object attribute", ("_batch._model_kept",),
               "no public API lists or removes a parameter's post-accumulate-grad hooks, which a forward pass may "
               "register on every call and which would then be left behind",
               None, lambda: nn.Parameter(torch.zeros(1))),
    PrivateAPI("Module._backward_pre_hooks", "object attribute", _SCREEN,
               "no public API says whether a module has backward pre-hooks, which the fast path would skip and the "
               "curvature recipes refuse",
               None, lambda: nn.Linear(1, 1)),
    PrivateAPI("RNNBase._flat_weights_names", "object attribute", ("_vmap_gaps._unrolled_forward",),
               "the names of every layer's and direction's weights in the fused kernel's order (projections and "
               "bias=False included), read by name so that functional_call's tensors are the ones used",
               None, lambda: nn.LSTM(1, 2, num_layers=2, bidirectional=True, proj_size=1)),
    PrivateAPI("OpOverload._schema", "object attribute", ("_trace._BatchTrace.plan_of", "_trace._values_of", "_trace._writes"),
               "the operator's schema names its arguments with their defaults and says which ones it writes into; "
               "the public OpOverload attributes (name(), tags) do not",
               None, lambda: torch.ops.aten.add_.Tensor),
    PrivateAPI("Tensor._version", "object attribute", ("_batch._as_found", "_batch._model_kept", "_layer_batch_norm._BatchNormRule.record",
                                                       "_layer_conv._ConvRule.record",
                                                       "_layer_embedding._EmbeddingRule._record_broadcast",
                                                       "_layer_embedding._EmbeddingRule.record", "_layer_group_norm._GroupNormRule.record",
                                                       "_layer_hf_conv1d._HFConv1DRule.record",
                                                       "_layer_linear._LinearRule.record", "_layer_norm._LayerNormRule.record",
                                                       "_layer_parameter._ParameterRule._record_cat", "_layer_parameter._ParameterRule._record_scale",
                                                       "_layer_parameter._ParameterRule.record",
                                                       "_layer_rms_norm._RMSNormRule.record", "_trace._BatchTrace.follow_fresh",
                                                       "_trace._moved_layer"),
               "the version counter is the only record that an in-place operation changed a layer's input or output "
               "after the trace saved it (one more per in-place operation, which an addition into a layer's fresh "
               "output is allowed), or a buffer during a recipe (which is then put back)",
               None, lambda: torch.zeros(1)),
    PrivateAPI("Tensor._cdata", "object attribute", tuple(f"_trace._BatchTrace.{m}" for m in (
                   "__init__", "__torch_dispatch__", "admit", "follow_cast", "follow_fresh", "mark_transposed", "param_of", "r_of", "rule",
                   "share", "shared_of", "transposed_of")) + ("_trace._same_for_each", "_trace._only_drawn"),
               "the address of the C++ tensor, the one identity a tensor keeps while PyTorch frees and remakes its "
               "Python object (a view's base, a saved tensor); id() names the Python object only",
               None, lambda: torch.zeros(1)),
    PrivateAPI("torch._C._WeakTensorRef", "import", ("_trace._BatchTrace.__torch_dispatch__", "_trace._BatchTrace.admit"),
               "a weak reference to the C++ tensor keeps its address (the trace's key) from reuse without keeping its "
               "memory; weakref.ref follows the Python object, which PyTorch may free while the C++ tensor lives",
               None, None),
    PrivateAPI("torch.ops.aten._unsafe_view.default", "aten operator", _TRACE,
               "reshape (where it must copy) and matmul's reshapes dispatch to it; " + _DISPATCH_ALIAS, None, None),
    PrivateAPI("torch.ops.aten._reshape_alias.default", "aten operator", _TRACE,
               "reshape can dispatch to it (older releases, some backends); " + _DISPATCH_ALIAS, None, None),
    PrivateAPI("torch.ops.aten._to_copy.default", "aten operator", ("_trace._BatchTrace", "_trace._BatchTrace.rule"),
               "Tensor.to, type conversions and autocast's casts dispatch to it (the trace follows a parameter's cast copy "
               "as the parameter); " + _DISPATCH_ALIAS, None, None),
    PrivateAPI("torch.ops.aten._adaptive_avg_pool2d.default", "aten operator", _TRACE,
               "F.adaptive_avg_pool2d dispatches to it; " + _DISPATCH_ALIAS, None, None),
    PrivateAPI("torch.ops.aten._softmax.default", "aten operator", _TRACE,
               "F.softmax dispatches to it; " + _DISPATCH_ALIAS, None, None),
    PrivateAPI("torch.ops.aten._log_softmax.default", "aten operator", _TRACE,
               "F.log_softmax and F.cross_entropy dispatch to it; " + _DISPATCH_ALIAS, None, None),
    PrivateAPI("torch.ops.aten._safe_softmax.default", "aten operator", _TRACE,
               "F.scaled_dot_product_attention's decomposition (with a mask) dispatches to it; " + _DISPATCH_ALIAS, None, None),
    PrivateAPI("torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default", "aten operator", _TRACE,
               "F.scaled_dot_product_attention dispatches to it on the CPU (its other fused kernels, "
               "_scaled_dot_product_flash_attention, _efficient_attention, _cudnn_attention and "
               "_fused_attention_overrideable, are looked up by name where the release has them); " + _DISPATCH_ALIAS, None, None),
    PrivateAPI("torch.ops.aten._native_batch_norm_legit_no_training.default", "aten operator", ("_layer_batch_norm._BatchNormRule",
                                                                                                  "_trace._BatchTrace.category_of"),
               "F.batch_norm with running statistics in eval mode can dispatch to it rather than to native_batch_norm; " + _DISPATCH_ALIAS, None, None),
)
