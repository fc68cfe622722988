"""Curvature of the loss in the parameters, without P x P matrices.

Hessian-, Gauss-Newton- and empirical-Fisher-vector products, the exact Gauss-Newton diagonal,
Hutchinson's trace and diagonal estimates, block Lanczos for the top Hessian eigenpairs, a damped
Gauss-Newton step solved in output space, conjugate gradients and influence scores.

The data, in every recipe: one batch (``inputs``, ``targets``: tensors, examples along dimension 0), or an
iterable of ``(inputs, targets)`` batches that can be read more than once (a ``DataLoader``, a list) with
``targets=None``. The loss is then the loss of the whole dataset as one batch: the sum of the batches' losses
for ``reduction='sum'``, their mean weighted by batch size (``sum_b (B_b / N) loss_b``) for ``'mean'``; each
product reads the data once more, holding one batch at a time, and the batches' tensors are moved to the
parameters' device. Every forward pass is checked not to draw random numbers (the curvature of a random
function is not defined), and every backward pass that a second one differentiates, not to go through a node
whose backward pass is not differentiable (torch.cond's in torch 2.13, a custom autograd.Function that computes
its gradient outside the graph), whose second derivatives would be missing without a word. Memory is given
in each docstring with B (examples per batch), N (examples in all), Y (outputs per example) and P (trainable
parameters); where it grows with them beyond a few P-vectors, a ``max_memory`` keyword (bytes, default 2 GiB)
refuses a call up front, with the number, or sets the chunks.
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple, cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._C import _functions as _autograd_nodes
from torch.func import functional_call, grad, jacrev, vjp, vmap

from ._batch import (
    _as_batch,
    _as_found,
    _check_chunk_size,
    _check_model,
    _check_parameters_reached,
    _drew_random_numbers,
    _generator_states,
    _GeneratorWatch,
    _gradients_enabled,
    _graph_nodes,
    _held_generators,
    _hooked_parameters,
    _module_backward_hook,
    _set_generator_states,
    _tolerance,
)
from .output_jacobians import output_jacobian
from .per_sample import per_sample_grads

_MAX_MEMORY = 2 * 2**30  # the curvature recipes' default memory budget, in bytes: 2 GiB


def _check_max_memory(max_memory):
    if isinstance(max_memory, bool) or not isinstance(max_memory, numbers.Real) or not float(max_memory) > 0:
        raise ValueError(f"max_memory must be a positive number of bytes, got {max_memory!r}")


def _refuse_above(max_memory, numbers_held, dtype, what, advice):
    """Refuse up front a call that would hold `numbers_held` numbers of `dtype` (what: which tensors), above max_memory."""
    need = numbers_held * dtype.itemsize
    if need > max_memory:
        raise ValueError(f"this call would hold {what}: {need / 2**30:.3g} GiB, above max_memory = "
                         f"{max_memory / 2**30:.3g} GiB; {advice}, or pass a larger max_memory (in bytes)")


@contextlib.contextmanager
def _no_random_draws(device, held=()):
    """Refuse a forward pass (or loss) that draws random numbers: the generators' states must not move (the default
    ones, and `held`, the generators the model holds: _batch._held_generators), and no other generator may be passed
    to a torch function (_batch._GeneratorWatch: one held deeper, made in forward, or global). The check curvlinops'
    check_deterministic makes, by the generators rather than by two calls: it catches randomness written in a forward
    (F.dropout(training=True), torch.randn, noise from any generator), which the check of module types misses, at
    about 6 us per torch call of the pass (measured on 2 CPU cores: 10% of a small BERT's forward pass at B = 16).
    Every generator drawn from is put back before the error. Not caught: draws from Python's or NumPy's
    generators, in another thread, or in the backward pass (_GeneratorWatch). Refused though deterministic: a
    pass that re-seeds a generator it holds and leaves it elsewhere than it found it (the first call), or draws
    from one it makes and seeds (the examples' check runs such a pass twice to tell, which every curvature pass
    would double)."""
    cuda = [device.index or 0] if device.type == "cuda" else []
    before = _generator_states(cuda, held)
    _as_found()  # the pass runs the model as it was given (its buffers as found)
    with _GeneratorWatch() as watch:
        yield
    if _drew_random_numbers(before, cuda, held) or watch.others(held):
        _set_generator_states(before, cuda, held)
        watch.restore(held)
        raise ValueError("the model (or loss_fn) drew random numbers in its forward pass, so the loss is a different "
                         "function on every call and has no curvature to measure: call model.eval(), or take the "
                         "randomness (dropout, noise) out of forward")


@contextlib.contextmanager
def _differentiable_backward(roots):
    """Around a backward pass with create_graph=True from roots (tensors): refuse it where a node that autograd
    does not write itself, a custom autograd.Function or a higher-order operator such as torch.cond, gave one of its
    inputs a gradient outside the graph (one that requires no grad, or hangs off once_differentiable's error node)
    where it should be in it: the gradient it received is in the graph, or a tensor it saved requires grad. Its
    backward pass is then not differentiable, and every second derivative through it would be missing without a
    word (torch.cond's, in torch 2.13). The nodes are found by walking the graph from roots; each gets a hook,
    removed on the way out. A higher-order operator's node is refused outright, before the pass: torch's
    while_loop's backward (torch 2.13) stays in the graph but gives wrong second derivatives. Not seen: a backward
    pass only partly outside the graph, or one that reads a tensor computed in forward (which runs without a graph)
    and saved."""
    custom = []
    for node in _graph_nodes(t.grad_fn for t in roots):
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            custom.append(node)
            if node._forward_cls.__module__.startswith("torch._higher_order_ops"):  # type: ignore[attr-defined]
                raise ValueError(f"the autograd node {type(node).__name__} is a higher-order operator's (torch.cond, torch's "
                                 "while_loop, map, scan): in torch 2.13 their backward passes are not twice "
                                 "differentiable as they should be (torch.cond's leaves the graph; while_loop's gives "
                                 "wrong second derivatives without a word), so second derivatives through it are "
                                 "refused; compute both branches and pick with torch.where, or unroll the loop")
    broken: list[str] = []

    def check(node):
        saved_in_graph = any(t is not None and t.requires_grad for t in node.saved_tensors)

        def hook(grads_out, grads_in):  # the gradients it gives its inputs, and the ones it received
            if not (saved_in_graph or any(g is not None and g.requires_grad for g in grads_in)):
                return  # its gradients may rightly be constants
            for (edge, _), g in zip(node.next_functions, grads_out):
                if edge is not None and g is not None and (not g.requires_grad or isinstance(g.grad_fn, _autograd_nodes.Error)):  # type: ignore[attr-defined]
                    broken.append(type(node).__name__)
                    return
        return hook

    handles = [node.register_hook(check(node)) for node in custom]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
    if broken:
        raise ValueError(f"the autograd node {broken[0]} (a custom autograd.Function, or a higher-order operator such as "
                         "torch.cond) has a backward pass that is not differentiable: with create_graph=True it gave a "
                         "gradient outside the graph, so every second derivative through it would be silently missing; "
                         "write its backward with differentiable operations (and without once_differentiable; return "
                         "None for a derivative that is zero everywhere), or take it out of the model for the curvature")


def _check_loss_twice_differentiable(loss_of_outputs, outputs):
    """Where the loss's second derivatives in the outputs come from torch.func (which autograd's hooks do not
    see): one backward pass of the loss with create_graph=True, under _differentiable_backward."""
    o = outputs.detach().requires_grad_(True)
    with torch.enable_grad():
        loss = loss_of_outputs(o)
        with _differentiable_backward([loss]):
            torch.autograd.grad(loss, o, create_graph=True, allow_unused=True)


def _is_batch_list(inputs, targets):
    """A list or tuple of (inputs, targets) pairs given with targets=None: an iterable of batches (told apart from
    the model's positional inputs by its first item, a pair; every item is checked when read)."""
    return targets is None and isinstance(inputs, (list, tuple)) and len(inputs) > 0 and (
        isinstance(inputs[0], (list, tuple)) and len(inputs[0]) == 2)


def _check_tensor_batch(inputs, targets, where=""):
    batch = _as_batch(inputs, targets)
    if not isinstance(inputs, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise NotImplementedError(f"the curvature recipes take inputs and targets as tensors{where}; tuples and dicts "
                                  "of them are not implemented yet")
    return len(batch)


class _Data:
    """The data a curvature recipe measures (the module docstring): iterating gives (inputs, targets, c), the
    dataset's loss being sum_b c_b loss_fn(model(inputs_b), targets_b). One batch: c = 1, read once, kept as given.
    An iterable: checked, counted (N) and its reduction found on a first pass; every later pass reads it again."""

    source: Any  # the iterable of batches, or None for one batch
    single: tuple[Any, Any] | None  # (inputs, targets) of one batch, or None for an iterable
    first_inputs: Any  # the first batch's inputs
    first_targets: Any  # and targets

    def __init__(self, model, loss_fn, inputs, targets, params, name="inputs"):
        self.model, self.loss_fn, self.params = model, loss_fn, params
        self.device = next(iter(params.values())).device
        if isinstance(inputs, (torch.Tensor, Mapping)) or (isinstance(inputs, (tuple, list)) and not _is_batch_list(inputs, targets)):
            self.source, self.single, self.first_inputs, self.first_targets = None, (inputs, targets), inputs, targets
            self.sizes = [_check_tensor_batch(inputs, targets)]
            if self.sizes[0] == 0:
                raise ValueError("the batch is empty: a loss over no examples has no curvature")
            self.size, self.weights, self.mean = self.sizes[0], [1.0], None
            return
        if not isinstance(inputs, Iterable):
            raise TypeError(f"{name} must be a tensor (one batch) or an iterable of (inputs, targets) batches "
                            f"(a DataLoader), got {type(inputs).__name__}")
        if targets is not None:
            raise TypeError(f"{name} is an iterable of batches, so its targets come in each (inputs, targets) batch: "
                            "pass targets=None")
        if iter(inputs) is inputs:
            raise TypeError(f"{name} is an iterator, which can be read only once, but the curvature recipes read the data "
                            "once per product: pass a DataLoader, a list of (inputs, targets) batches, or another "
                            "iterable that can be read again")
        self.source, self.single, self.sizes = inputs, None, []
        for x, t in self._read():
            if not self.sizes:  # the first batch, kept for _trainable's checks
                self.first_inputs, self.first_targets = x, t
            self.sizes.append(len(x))
        self.size = sum(self.sizes)
        if self.size == 0:
            raise ValueError(f"{name} holds no examples: a loss over no examples has no curvature")
        # one batch: c = 1 whatever the reduction, and its own losses give its w where needed (example_weight)
        self.mean = self._mean() if len(self.sizes) > 1 else None
        self.weights = [b / self.size for b in self.sizes] if self.mean else [1.0] * len(self.sizes)

    def _read(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for k, item in enumerate(self.source):
            if not (isinstance(item, (list, tuple)) and len(item) == 2):
                raise TypeError(f"batch {k} of the data is a {type(item).__name__}, not an (inputs, targets) pair")
            x, t = item
            if _check_tensor_batch(x, t, f" (batch {k} of the data)") > 0:
                yield x.to(self.device), t.to(self.device)

    def _mean(self):
        """Whether loss_fn averages over the examples (else it sums), from the first batch of two or more examples
        that tells (_loss_weight; examples of batches of one are put together in pairs); N = 1: either."""
        if self.size == 1:
            return False
        pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        for x, t in self._read():
            if len(x) == 1:  # two batches of one make a batch of two
                pending.append((x, t))
                if len(pending) < 2:
                    continue
                x, t = torch.cat([pending[0][0], pending[1][0]]), torch.cat([pending[0][1], pending[1][1]])
                pending = []
            with torch.no_grad(), _no_random_draws(self.device, _held_generators(self.model)):
                outputs = functional_call(self.model, self.params, (x,))
            weight = _loss_weight(self.loss_fn, outputs, t, decide=False)
            if weight is not None:
                return weight != 1.0
        raise ValueError("cannot tell whether loss_fn averages or sums over the examples: on every batch of the data "
                         "their losses add up to zero and their gradients in the model's outputs are zero")

    def example_weight(self, batch: int) -> float | None:
        """w of one batch of an iterable, loss_fn(batch) = w * the sum of its examples' losses, as the first pass
        found it for every batch (1/batch for a mean, 1 for a sum); None for data of one batch (its own losses tell)."""
        return None if self.mean is None else 1 / batch if self.mean else 1.0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, float]]:
        if self.single is not None:
            yield (*self.single, 1.0)
            return
        sizes = []
        for k, (x, t) in enumerate(self._read()):
            sizes.append(len(x))
            if k >= len(self.sizes) or len(x) != self.sizes[k]:
                break
            yield x, t, self.weights[k]
        if sizes != self.sizes:
            raise ValueError(f"the data gave batches of {self.sizes} examples on its first pass and {sizes} on a later "
                             "one: the curvature recipes need the same data on every pass")


def _trainable(model, loss_fn, inputs, targets, name="inputs", tensor_output=None):
    """The curvature recipes' one check of the model and the data (the package's validator, with random modules in
    training mode, parameters with a gradient hook, module backward hooks and complex parameters refused): returns
    the parameters that require grad ({name: detached tensor}, in named_parameters() order) and the data as a _Data."""
    trainable = _check_model(model, deterministic=True)
    hooked = _hooked_parameters(model)
    if hooked:  # param_hvp's products ignored it, empirical_fisher_vp's (by the loop) and gauss_newton_step's gradient ran it
        raise ValueError(f"parameter {hooked[0]} has a gradient hook (Tensor.register_hook): it changes the gradients "
                         "autograd gives, not the loss, whose curvature these recipes measure, and some of their products "
                         "would run it and others not; remove it for the call (its handle's .remove()), or freeze the "
                         "parameter (requires_grad_(False))")
    hooked_module = _module_backward_hook(model)
    if hooked_module:  # likewise: every product ran it, on gradients it changes (param_hvp 1.4 off, ggn_vp 0.8)
        raise ValueError(f"{hooked_module} (register_full_backward_hook): it changes the gradients autograd gives, not "
                         "the loss, whose curvature these recipes measure; remove it for the call (its handle's .remove())")
    complex_ = [name for name, p in trainable.items() if p.is_complex()]
    if complex_:  # hessian_trace returned a complex number: real probes see only part of the real 2P x 2P Hessian
        raise ValueError(f"parameter {complex_[0]} is complex: the curvature recipes take real parameters (split it into "
                         "its real and imaginary parts, torch.view_as_real, to measure the curvature in both)")
    params = {name: p.detach() for name, p in trainable.items()}
    data = _Data(model, loss_fn, inputs, targets, params, name)
    # a reentrant checkpoint (its blocks get no curvature), or a tensor computed from the parameters before the call
    _check_parameters_reached(model, _as_batch(data.first_inputs, data.first_targets))
    if len(data.first_inputs):  # a penalty inside loss_fn (weight decay): functional_call swaps the parameters in the
        # model's forward pass only, so its curvature was left out (param_hvp 0.79 off); _Batch.loss refuses it
        with torch.no_grad(), _no_random_draws(data.device, _held_generators(model)):
            first = _as_batch(data.first_inputs[:1], data.first_targets[:1])
            output = first.call(model)
            first.loss(loss_fn, output)
        if tensor_output and not isinstance(output, torch.Tensor):  # the recipes that work in the outputs' space
            raise ValueError(f"{tensor_output} needs a model whose output is one tensor, the one loss_fn takes, but this "
                             f"one returns a {type(output).__name__}: wrap it in a module whose forward returns that tensor "
                             "(out.logits, say)")
    return params, data


def _check_order_kept(source, what):
    """Refuses (ValueError) a DataLoader that draws its examples in a random order (shuffle=True, or another random
    sampler) where the answer has a row per example: each pass over the data has its own order, and the rows came
    in the last pass's, which the caller cannot know."""
    if isinstance(source, torch.utils.data.DataLoader):
        sampler = getattr(source.batch_sampler, "sampler", source.sampler)
        if isinstance(sampler, (torch.utils.data.RandomSampler, torch.utils.data.SubsetRandomSampler,
                                torch.utils.data.WeightedRandomSampler)):
            raise ValueError(f"{what} returns its rows in the order the data gives the examples, but this DataLoader "
                             f"draws them in a random order ({type(sampler).__name__}), another on every pass over it: "
                             "pass one with shuffle=False")


def _scalar(loss):
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"loss_fn must return a scalar (one number), but returned {shape}: "
                         "reduce it first, e.g. with reduction='mean'")
    return loss.reshape(())


def _loss_of_params(model, loss_fn, inputs, targets):
    """The function params -> loss_fn(model(inputs), targets), checked to be one number drawn without randomness."""

    held = _held_generators(model)

    def loss(params):
        with _no_random_draws(inputs.device, held):
            return _scalar(loss_fn(functional_call(model, params, (inputs,)), targets))

    return loss


def _gradient(model, loss_fn, inputs, targets, params):
    """The loss's gradient in the parameters, {name: tensor}, by autograd (which runs torch.cond, where
    torch.func.grad raises inside torch in torch 2.13)."""
    leaves = _leaves(params)
    with torch.enable_grad():
        loss = _loss_of_params(model, loss_fn, inputs, targets)(leaves)
        return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()), materialize_grads=True)))


def _accumulate(total, part, weight):
    """total + weight * part, for dicts of tensors (total None: nothing yet). No copy for a weight of 1 (one batch)."""
    if weight != 1.0:
        part = {n: weight * t for n, t in part.items()}
    return part if total is None else {n: total[n] + part[n] for n in total}


def _check_vector(vector, params):
    """vector must be a dict with exactly the trainable parameters' names, shapes, dtypes and devices."""
    if not isinstance(vector, dict):
        raise TypeError(f"vector must be a dict name -> tensor shaped like the parameter, got {type(vector).__name__}")
    missing = [name for name in params if name not in vector]
    unexpected = [name for name in vector if name not in params]
    if missing or unexpected:
        raise ValueError(f"vector needs one entry per trainable parameter: missing {missing}, unexpected {unexpected}")
    for name, p in params.items():
        v = vector[name]
        if not isinstance(v, torch.Tensor) or v.shape != p.shape or v.dtype != p.dtype or v.device != p.device:
            got = f"{tuple(v.shape)} {v.dtype} on {v.device}" if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(f"vector[{name!r}] must be a {tuple(p.shape)} {p.dtype} tensor on {p.device}, "
                             f"like the parameter; got {got}")
    return {name: vector[name] for name in params}  # in parameter order


def _leaves(params):
    """Fresh leaf tensors that require grad, with the parameters' values, for plain autograd."""
    return {name: p.detach().requires_grad_(True) for name, p in params.items()}


def _hvp_operator(model, loss_fn, inputs, targets, params):
    """v -> H v on dicts shaped like params (or, with batched=True, dicts of (S, *shape) stacks of S vectors).
    The gradient g is computed once, with its graph kept; each product is then one more backward pass,
    of <g, v> (reverse-over-reverse); S products one batched backward pass, or S passes where a backward
    formula of the model cannot be batched (GroupNorm's raises under is_grads_batched in torch 2.13)."""
    leaves = _leaves(params)
    with torch.enable_grad():  # also inside torch.no_grad()
        loss = _loss_of_params(model, loss_fn, inputs, targets)(leaves)
        with _differentiable_backward([loss]):
            g = torch.autograd.grad(loss, list(leaves.values()), create_graph=True, materialize_grads=True)
    live = [k for k, g_k in enumerate(g) if g_k.requires_grad]  # entries of g that depend on the parameters

    def products_of(vs, batched):
        return torch.autograd.grad([g[k] for k in live], list(leaves.values()), [vs[k] for k in live],
                                   retain_graph=True, is_grads_batched=batched, materialize_grads=True)

    def hvp(vector, batched=False):
        if not live:  # the gradient is constant: H = 0
            return {name: torch.zeros_like(vector[name]) for name in params}
        vs = list(vector.values())
        if not batched:
            return dict(zip(params, products_of(vs, False)))
        try:  # the S vectors in one batched backward pass
            products = products_of(vs, True)
            # materialize_grads gives a parameter the products do not reach (unused, or read under no_grad) its zero
            # without the batch dimension (torch 2.13): one zero per vector
            products = tuple(p.expand_as(v).clone() if p.shape == v.shape[1:] else p for p, v in zip(products, vs))
        except Exception:  # a backward formula that cannot be batched (GroupNorm's, torch 2.13): one vector at a time,
            # whatever the error (no message is read); the graph is kept (retain_graph), so the products are the same
            rows = [products_of([v[s] for v in vs], False) for s in range(len(vs[0]))]
            products = tuple(torch.stack(column) for column in zip(*rows))
        return dict(zip(params, products))

    return hvp


def _data_hvp(model, loss_fn, data, params):
    """v -> H v for the Hessian of the data's loss: one batch's operator (its gradient's graph kept between
    products), or, for an iterable, a pass over the batches per product, holding one batch's graph at a time."""
    if data.single is not None:
        inputs, targets = data.single
        return _hvp_operator(model, loss_fn, inputs, targets, params)

    def hvp(vector, batched=False):
        total = None
        for x, t, c in data:
            total = _accumulate(total, _hvp_operator(model, loss_fn, x, t, params)(vector, batched), c)
        return total

    return hvp


@_gradients_enabled
def param_hvp(model: nn.Module, loss_fn: Callable[..., torch.Tensor], inputs: Any, targets: Any, vector: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    r"""H v for the Hessian H of ``loss_fn(model(inputs), targets)`` in the parameters that require grad.

    Reverse-over-reverse: the gradient g with its graph, then one backward pass of <g, v>. No P x P matrix.
    For an iterable of batches, the sum of each batch's product, weighted as the module docstring says.

    Args:
        model, loss_fn, inputs, targets: as in :func:`empirical_fisher_vp`.
        vector (dict): ``{name: tensor shaped like the parameter}``.

    Returns:
        ``{name: tensor shaped like the parameter}``. Memory: a few P-vectors and the graph of one batch's
        gradient (about twice a training step's activations); nothing grows with N.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from torch_func_recipes import param_hvp
        >>> _ = torch.manual_seed(0)
        >>> model, loss_fn = nn.Linear(3, 2, bias=False).double(), nn.functional.cross_entropy
        >>> x, y = torch.randn(8, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1, 0, 0, 1])
        >>> H = torch.autograd.functional.hessian(lambda w: loss_fn(x @ w.T, y), model.weight).reshape(6, 6)
        >>> v = torch.randn(2, 3, dtype=torch.float64)
        >>> Hv = param_hvp(model, loss_fn, x, y, {"weight": v})
        >>> torch.allclose(Hv["weight"], (H @ v.flatten()).view(2, 3))
        True
    """
    params, data = _trainable(model, loss_fn, inputs, targets)
    vector = _check_vector(vector, params)
    return _data_hvp(model, loss_fn, data, params)(vector)


@_gradients_enabled
def ggn_vp(model: nn.Module, loss_fn: Callable[..., torch.Tensor], inputs: Any, targets: Any, vector: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    r"""G v for the generalised Gauss-Newton matrix ``G = J^T H_L J`` of ``loss_fn(model(inputs), targets)``.

    J is the Jacobian of the outputs in the parameters, H_L the loss's Hessian in the outputs: J v by the
    double-backward trick, H_L J v in output space, then J^T (...), all in reverse mode.

    Args:
        model, loss_fn, inputs, targets: as in :func:`empirical_fisher_vp`.
        vector (dict): ``{name: tensor shaped like the parameter}``.

    Returns:
        ``{name: tensor shaped like the parameter}``. Memory: a few P-vectors, B x Y outputs and the graphs of
        one batch's forward and backward passes; nothing grows with N.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from torch_func_recipes import ggn_vp
        >>> _ = torch.manual_seed(0)
        >>> model, loss_fn = nn.Linear(3, 2, bias=False).double(), nn.functional.cross_entropy
        >>> x, y = torch.randn(8, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1, 0, 0, 1])
        >>> H = torch.autograd.functional.hessian(lambda w: loss_fn(x @ w.T, y), model.weight).reshape(6, 6)
        >>> v = torch.randn(2, 3, dtype=torch.float64)
        >>> Gv = ggn_vp(model, loss_fn, x, y, {"weight": v})
        >>> torch.allclose(Gv["weight"], (H @ v.flatten()).view(2, 3))  # G = H: the model is linear in its weight
        True
    """
    params, data = _trainable(model, loss_fn, inputs, targets, tensor_output="ggn_vp")
    vector = _check_vector(vector, params)
    total = None
    for x, t, c in data:
        total = _accumulate(total, _ggn_vp_of_batch(model, loss_fn, x, t, params, vector), c)
    assert total is not None  # the data holds at least one batch
    return total


def _ggn_vp_of_batch(model, loss_fn, inputs, targets, params, vector):
    leaves = _leaves(params)
    with torch.enable_grad(), _no_random_draws(inputs.device, _held_generators(model)):
        outputs = functional_call(model, leaves, (inputs,))
    with torch.enable_grad():
        u = torch.zeros_like(outputs, requires_grad=True)
        with _differentiable_backward([outputs]):
            jt_u = torch.autograd.grad(outputs, list(leaves.values()), u, create_graph=True, materialize_grads=True)
        jv = torch.autograd.grad(torch.stack([(a * vector[name]).sum() for name, a in zip(leaves, jt_u)]).sum(), u,
                                 materialize_grads=True)[0]  # J v
        o = outputs.detach().requires_grad_(True)
        loss = _scalar(loss_fn(o, targets))
        with _differentiable_backward([loss]):
            loss_gradient = torch.autograd.grad(loss, o, create_graph=True)[0]
        if not loss_gradient.requires_grad:  # a loss linear in the outputs: H_L = 0
            return {name: torch.zeros_like(p) for name, p in params.items()}
        h_jv = torch.autograd.grad(loss_gradient, o, jv, materialize_grads=True)[0]  # H_L J v
        return dict(zip(leaves, torch.autograd.grad(outputs, list(leaves.values()), h_jv, materialize_grads=True)))


def _example_weight(model, loss_fn, inputs, targets, params):
    """w such that loss_fn(model(inputs), targets) is w times the sum of the examples' own losses: 1/B for a mean, 1 for
    a sum (anything else is refused), read from the batch's outputs (one forward pass, no model under vmap)."""
    with torch.no_grad(), _no_random_draws(inputs.device, _held_generators(model)):
        outputs = functional_call(model, params, (inputs,))
    return _loss_weight(loss_fn, outputs, targets)


@_gradients_enabled
def empirical_fisher_vp(model: nn.Module, loss_fn: Callable[..., torch.Tensor], inputs: Any, targets: Any,
                        vector: dict[str, torch.Tensor], *, max_memory: float = _MAX_MEMORY) -> dict[str, torch.Tensor]:
    r"""F v for the empirical Fisher ``F = w * sum_n g_n g_n^T``, without a P x P matrix.

    g_n is the gradient of example n's loss, ``w = 1/N`` for a mean loss (1 for a sum): per-example
    gradients by ``vmap`` of ``grad`` for as many examples at a time as ``max_memory`` allows, then two
    contractions.

    Args:
        model (nn.Module): the model; never modified (as in :func:`per_sample_grads`: buffers copied and put
            back). Random modules must be in eval mode.
        loss_fn (Callable): ``loss_fn(model(inputs), targets)``, a mean or a sum over the examples.
        inputs (Tensor or iterable): the batch, examples along dimension 0; or an iterable of
            ``(inputs, targets)`` batches (a ``DataLoader``) for the whole dataset's curvature.
        targets (Tensor or None): their targets; None with an iterable of batches.
        vector (dict): ``{name: tensor shaped like the parameter}`` for every parameter that requires grad.
        max_memory (float): bytes the per-example gradients may hold at once (default 2 GiB): they come in
            chunks of ``max_memory / (2 P)`` numbers' worth of examples; a call where one example's
            gradient does not fit is refused.

    Returns:
        ``{name: tensor shaped like the parameter}``. Memory: per-example gradients of at most
        ``min(B, max_memory / (2 P * itemsize))`` examples at a time, plus a few P-vectors.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from torch_func_recipes import empirical_fisher_vp
        >>> _ = torch.manual_seed(0)
        >>> model, loss_fn = nn.Linear(3, 2, bias=False).double(), nn.functional.cross_entropy
        >>> x, y = torch.randn(8, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1, 0, 0, 1])
        >>> H = torch.autograd.functional.hessian(lambda w: loss_fn(x @ w.T, y), model.weight).reshape(6, 6)
        >>> v = torch.randn(2, 3, dtype=torch.float64)
        >>> Fv = empirical_fisher_vp(model, loss_fn, x, y, {"weight": v})
        >>> g = torch.stack([torch.autograd.grad(loss_fn(model(x[n:n + 1]), y[n:n + 1]), model.weight)[0].flatten() for n in range(8)])
        >>> torch.allclose(Fv["weight"], (g.T @ g @ v.flatten() / 8).view(2, 3))  # F = (1/B) sum_n g_n g_n^T for a mean loss
        True
    """
    params, data = _trainable(model, loss_fn, inputs, targets, tensor_output="empirical_fisher_vp")
    vector = _check_vector(vector, params)
    total = None
    for c, weight, g in _per_example_gradients(model, loss_fn, data, params, max_memory):
        dots = sum((g[n] * vector[n]).flatten(1).sum(dim=1) for n in params)  # g_n^T v, one per example
        total = _accumulate(total, {n: torch.einsum("b,b...->...", dots, g[n]) for n in params}, c * weight)
    assert total is not None  # the data holds at least one example
    return total


def _per_example_gradients(model, loss_fn, data, params, max_memory):
    """For every chunk of examples of the data: (c, w, {name: (chunk, *shape)} gradients of the chunk's examples' own
    losses), chunks of at most max_memory / (2 P) numbers (a gradient and one temporary). The gradients come from
    per_sample_grads, with its fast paths and its fall-backs (a GRU or LSTM unrolled) and its refusal of a model
    that mixes the examples (no example would have a gradient of its own)."""
    _check_max_memory(max_memory)
    first = next(iter(params.values()))
    P = sum(p.numel() for p in params.values())
    _refuse_above(max_memory, 2 * P, first.dtype, f"one example's gradient and a temporary (2 P = {2 * P:,} numbers)",
                  "the model is too large for this budget")
    rows, held = int(max_memory // (2 * P * first.dtype.itemsize)), _held_generators(model)
    for x, t, c in data:
        weight = data.example_weight(len(x))
        if weight is None:
            weight = _example_weight(model, loss_fn, x, t, params)
        for start in range(0, len(x), rows):
            with _no_random_draws(x.device, held):  # its pass, with gradients on, is checked too
                grads = per_sample_grads(model, lambda out, t: _scalar(loss_fn(out, t)), x[start:start + rows], t[start:start + rows])
            yield c, weight, grads


def _loss_weight(loss_fn, outputs, targets, decide=True):
    """w such that loss_fn(outputs, targets) = w * sum_n loss_fn(outputs[n:n+1], targets[n:n+1]) (1/B for a mean,
    1 for a sum); else an error. Told by the values, or, where the examples' losses add up to about zero (a hinge
    loss met by every example, losses of both signs) and both weights fit, by the loss's gradient in the outputs,
    which must be w times each example's own. Where that vanishes too: an error, or None with decide=False (the
    caller tries another batch)."""
    B, tolerance = len(outputs), 1e-5
    batch_loss = _scalar(loss_fn(outputs, targets))
    one = lambda o, t: _scalar(loss_fn(o[None], t[None]))  # noqa: E731
    each = vmap(one)(outputs, targets)
    if not (torch.isfinite(each).all() and torch.isfinite(batch_loss)):
        bad = int((~torch.isfinite(each)).nonzero()[0, 0]) if not torch.isfinite(each).all() else None
        raise ValueError("loss_fn must be a mean or a sum of per-example losses (like reduction='mean' or 'sum'), but "
                         + (f"example {bad}'s own loss is {each[bad].item()} (a target the loss ignores, ignore_index, "
                            "makes a mean over no entries)" if bad is not None else f"its value is {batch_loss.item()}"))
    total, size = each.sum(), each.abs().sum()
    fits = [w for w in (1 / B, 1.0) if torch.allclose(batch_loss, w * total, rtol=tolerance, atol=tolerance * size.item())]
    if len(fits) == 1 or B == 1:
        return fits[0] if fits else _not_a_mean_or_sum(batch_loss, each)
    if not fits:
        _not_a_mean_or_sum(batch_loss, each)
    with torch.enable_grad():  # both fit: the values cannot tell, the gradients in the outputs can
        o = outputs.detach().requires_grad_(True)
        batch_gradient = torch.autograd.grad(_scalar(loss_fn(o, targets)), o, allow_unused=True, materialize_grads=True)[0]
        try:
            own = vmap(grad(one))(outputs.detach(), targets)
        except Exception:  # a loss vmap cannot batch (whatever the error; no message is read): one example at a time
            own = torch.cat([torch.autograd.grad(_scalar(loss_fn(o[n:n + 1], targets[n:n + 1])), o, allow_unused=True,
                                                 materialize_grads=True)[0][n:n + 1] for n in range(B)])
    scale = own.abs().max().item()
    if scale > 0:
        for w in (1 / B, 1.0):
            if torch.allclose(batch_gradient, w * own, rtol=tolerance, atol=tolerance * scale):
                return w
        raise ValueError("loss_fn must be a mean or a sum of per-example losses (like reduction='mean' or 'sum'), but its "
                         "gradient in the outputs is neither the mean's nor the sum's of the examples' own")
    if decide:
        raise ValueError("cannot tell whether loss_fn averages or sums over the examples from this batch: their losses "
                         "add up to zero and their gradients in the model's outputs are zero; pass a batch where they "
                         "are not, or an iterable of batches")
    return None


def _not_a_mean_or_sum(batch_loss, each):
    raise ValueError(f"loss_fn must be a mean or a sum of per-example losses (like reduction='mean' or 'sum'), but its "
                     f"value {batch_loss.item():.6g} is neither the mean {each.mean().item():.6g} nor the sum "
                     f"{each.sum().item():.6g} of the examples' losses")


def _cross_entropy_reduction(loss_fn, outputs, targets):
    """'mean' or 'sum' if loss_fn is plain cross-entropy on (B, C) logits and class indices, else None."""
    plain = dict(weight=None, ignore_index=-100, label_smoothing=0.0)
    if loss_fn is F.cross_entropy:
        reduction = "mean"
    elif type(loss_fn) is nn.CrossEntropyLoss and all(getattr(loss_fn, k) == v for k, v in plain.items()):
        reduction = loss_fn.reduction
    else:
        return None
    ok = (outputs.dim() == 2 and targets.shape == outputs.shape[:1] and not targets.is_floating_point()
          and bool(((targets >= 0) & (targets < outputs.shape[1])).all()))
    return reduction if ok and reduction in ("mean", "sum") else None


def _working_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the recipes' small dense linear algebra (eigh, qr, solve) for tensors of `dtype`: float32 for
    float16 and bfloat16, which torch's linear algebra does not take ("linalg_eigh_cpu" not implemented for
    'BFloat16'), the dtype itself otherwise."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _output_hessian_factors(loss_fn, outputs, targets, weight=None):
    """lam (Y, B) and cotangents (Y, B, *output) with w * H_n = sum_k lam[k, n] u u^T, u = cotangents[k, n]: each
    example's (weighted) loss Hessian in its Y outputs. For plain cross-entropy the closed form
    H_n = diag(p) - p p^T = S S^T with S = diag(sqrt p) - p sqrt(p)^T (p: the softmax); for any other loss,
    Y double-backward passes in one batch, then eigh. weight: w where the caller knows it (a batch of an
    iterable), else _loss_weight finds it from this batch."""
    reduction = _cross_entropy_reduction(loss_fn, outputs, targets)
    if reduction is not None:
        p = torch.softmax(outputs, dim=1)  # (B, C)
        root = p.sqrt()
        S = torch.diag_embed(root) - p[:, :, None] * root[:, None, :]  # (B, C, C), column k is the k-th factor
        weight = 1 / len(outputs) if reduction == "mean" else 1.0
        return torch.full((outputs.shape[1], len(outputs)), weight, dtype=p.dtype, device=p.device), S.permute(2, 0, 1)
    if weight is None:  # a batch of an iterable comes with the weight its first pass found
        weight = _loss_weight(loss_fn, outputs, targets)  # also checks the loss is a mean or sum over examples
    B, Y = len(outputs), outputs[0].numel()
    o = outputs.detach().requires_grad_(True)
    with torch.enable_grad():
        loss = _scalar(loss_fn(o, targets))
        with _differentiable_backward([loss]):
            loss_gradient = torch.autograd.grad(loss, o, create_graph=True)[0]
        if not loss_gradient.requires_grad:  # a loss linear in the outputs has H_L = 0
            return torch.zeros(Y, B, dtype=o.dtype, device=o.device), torch.zeros(Y, *o.shape, dtype=o.dtype, device=o.device)
        units = torch.eye(Y, dtype=o.dtype, device=o.device).reshape(Y, 1, *o.shape[1:]).expand(Y, *o.shape)
        columns = torch.autograd.grad(loss_gradient, o, units, is_grads_batched=True, materialize_grads=True)[0]
    # (B, Y), (B, Y, Y): w H_n = U diag(lam) U^T, in float32 for a half-precision model's outputs
    lam, U = torch.linalg.eigh(columns.reshape(Y, B, Y).permute(1, 2, 0).to(_working_dtype(o.dtype)))
    return lam.T.to(o.dtype), U.permute(2, 0, 1).reshape(Y, *o.shape).to(o.dtype)


@_gradients_enabled
def ggn_diagonal(model: nn.Module, loss_fn: Callable[..., torch.Tensor], inputs: Any, targets: Any, *, per_sample: bool = False,
                 max_memory: float = _MAX_MEMORY) -> dict[str, torch.Tensor]:
    r"""The exact diagonal of the Gauss-Newton matrix G (or each example's share of it).

    For a mean or sum ``w * sum_n`` of per-example losses, with ``H_n = sum_k lam_k u_k u_k^T`` the Hessian of
    example n's loss in its outputs: ``diag G = w * sum_n sum_k lam_k (J_n^T u_k)^2``. One forward pass records
    each parameter's module's input a and output z; Y batched backward passes give dL/dz for the Y cotangents
    u_k; a linear layer's share is then ``sum_k lam_k delta_k^2`` times ``a^2``, any other layer's squares its own
    per-example vjp. A check of every call (the layers' products must rebuild one ordinary vjp) falls back to
    ``vmap`` over examples.

    Args:
        model, loss_fn, inputs, targets: as in :func:`empirical_fisher_vp`.
        per_sample (bool): return each example's share, ``{name: (N, *shape)}``, which sum over N to the diagonal.
        max_memory (float): bytes the call may hold (default 2 GiB); above it, refused up front.

    Returns:
        ``{name: tensor shaped like the parameter}`` (``(N, *shape)`` with ``per_sample=True``). Memory: the
        Y back-propagated outputs of every layer (Y times a batch's activations) and, for a layer other than
        a linear one, Y x B x its parameters; with ``per_sample=True``, N x P more. The general path (a layer
        called twice, a weight used outside its layer) holds Y x P per example, for as many examples at a time
        as ``max_memory`` allows.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from torch_func_recipes import ggn_diagonal
        >>> _ = torch.manual_seed(0)
        >>> model, loss_fn = nn.Linear(3, 2, bias=False).double(), nn.functional.cross_entropy
        >>> x, y = torch.randn(8, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1, 0, 0, 1])
        >>> H = torch.autograd.functional.hessian(lambda w: loss_fn(x @ w.T, y), model.weight).reshape(6, 6)
        >>> shares = ggn_diagonal(model, loss_fn, x, y, per_sample=True)
        >>> shares["weight"].shape
        torch.Size([8, 2, 3])
        >>> torch.allclose(shares["weight"].sum(0), H.diagonal().view(2, 3))  # G = H: the model is linear in its weight
        True
    """
    params, data = _trainable(model, loss_fn, inputs, targets, tensor_output="ggn_diagonal")
    _check_max_memory(max_memory)
    first = next(iter(params.values()))
    P = sum(p.numel() for p in params.values())
    if per_sample:
        _check_order_kept(inputs, "ggn_diagonal with per_sample=True, a row per example,")
        _refuse_above(max_memory, data.size * P, first.dtype, f"the per-example shares, N x P = {data.size:,} x {P:,} numbers",
                      "use per_sample=False, or fewer examples")
    if data.single is not None:  # one batch: its answer as it is (no copy of the N x P shares)
        inputs, targets = data.single
        return _ggn_diagonal_of_batch(model, loss_fn, inputs, targets, params, per_sample, max_memory)
    parts = [{n: c * share for n, share in _ggn_diagonal_of_batch(model, loss_fn, x, t, params, per_sample, max_memory,
                                                                   data.example_weight(len(x))).items()}
             for x, t, c in data]
    if per_sample:
        return {n: torch.cat([part[n] for part in parts]) for n in params}
    return {n: torch.stack([part[n] for part in parts]).sum(dim=0) for n in params}


def _ggn_diagonal_of_batch(model, loss_fn, inputs, targets, params, per_sample, max_memory, weight=None):
    owners = {}  # parameter name -> (the module holding it, its name there)
    for module_name, module in model.named_modules():
        for local, p in module.named_parameters(recurse=False):
            if f"{module_name}.{local}".lstrip(".") in params:
                owners[f"{module_name}.{local}".lstrip(".")] = (module, local)
    modules = list({id(m): m for m, _ in owners.values()}.values())
    calls: dict[int, list] = {id(m): [] for m in modules}
    hooks = [m.register_forward_hook(lambda m, args, out: calls[id(m)].append((args, out))) for m in modules]
    leaves = {name: p.detach().requires_grad_(True) for name, p in params.items()}
    try:
        with torch.enable_grad(), _no_random_draws(inputs.device, _held_generators(model)):
            outputs = functional_call(model, leaves, (inputs,))
    finally:
        for hook in hooks:
            hook.remove()
    # each example alone: by vmap, or by a loop where a recurrent module cannot run under vmap, or where vmap
    # raises, whatever the error (no message is read: a higher-order operator such as torch's map or while_loop)
    def loop():
        outputs = []
        for n in range(len(inputs)):
            _as_found()
            outputs.append(functional_call(model, params, (inputs[n:n + 1],)))
        return torch.cat(outputs)

    def one(x):  # an example alone, and each module's input as that example's call gave it (the per-layer path's check)
        seen: dict[int, list] = {id(m): [] for m in modules}
        handles = [m.register_forward_hook(lambda m, args, out: seen[id(m)].append(args[0] if args else None)) for m in modules]
        try:
            _as_found()
            out = functional_call(model, params, (x[None],))[0]
        finally:
            for handle in handles:
                handle.remove()
        own = [s[0] if len(s) == 1 and isinstance(s[0], torch.Tensor) else None for s in seen.values()]
        single[:] = [t is not None for t in own]
        return out, tuple(out.new_zeros(()) if t is None else t for t in own)

    single: list[bool] = []
    own_inputs = None  # {id(module): (B, *its input for one example)}, where vmap ran
    with torch.no_grad(), _no_random_draws(inputs.device, _held_generators(model)):
        if any(isinstance(m, nn.RNNBase) for m in modules):
            alone = loop()
        else:
            try:
                alone, captured = vmap(one)(inputs)
                own_inputs = {id(m): c for m, c, ok in zip(modules, captured, single) if ok}
            except Exception:
                alone = loop()
    scale, tolerance = outputs.detach().abs().max().item(), _tolerance(outputs)
    if not torch.allclose(alone, outputs.detach(), rtol=tolerance, atol=tolerance * scale):
        raise ValueError("the model mixes the examples of a batch (its outputs for an example alone differ from its "
                         "outputs in the batch), so the Gauss-Newton matrix has no per-example diagonal shares")
    lam, cotangents = _output_hessian_factors(loss_fn, outputs.detach(), targets, weight)
    B, Y, dtype = len(inputs), len(lam), outputs.dtype
    P = sum(p.numel() for p in params.values())
    if all(len(c) == 1 and len(c[0][0]) == 1 and isinstance(c[0][0][0], torch.Tensor) and isinstance(c[0][1], torch.Tensor)
           and c[0][0][0].shape[:1] == (B,) == c[0][1].shape[:1] for c in calls.values()) and _rows_are_examples(calls, own_inputs):
        activations = sum(c[0][1].numel() for c in calls.values())
        recurrent = any(isinstance(m, nn.RNNBase) for m in modules)  # no vmap of a recurrent module alone: general path
        others = sum(p.numel() for name, p in params.items() if type(owners[name][0]) is not nn.Linear)
        _refuse_above(max_memory, Y * (activations + 2 * B * others), dtype,
                      f"Y = {Y} copies of the layers' outputs ({activations:,} numbers) and of the per-example gradients of "
                      f"its layers other than Linear (B x {others:,})", "pass smaller batches (a DataLoader)")
        shares = None if recurrent else _ggn_diagonal_by_layers(outputs, leaves, owners, modules, calls, lam, cotangents, per_sample)
        if shares is not None:
            return shares
    _refuse_above(max_memory, 2 * Y * P, dtype, f"one example's Y x P = {Y} x {P:,} Jacobian rows and their squares",
                  "the model is too large for this budget")
    chunk = int(min(B, max_memory // (2 * Y * P * dtype.itemsize)))
    shares = _ggn_diagonal_by_vmap(model, params, inputs, lam, cotangents, chunk)
    return shares if per_sample else {name: s.sum(dim=0) for name, s in shares.items()}


def _rows_are_examples(calls, own_inputs):
    """Whether row n of every module's input in the batch's forward pass is example n's input to it, as it is with
    the example alone (own_inputs, from vmap: (B, 1, ...) per module; None where vmap did not run): the per-layer
    path squares each row's gradient as one example's. A layer that takes its rows in another order, a
    sequence-first layer with as many positions as examples (T, B, d), say, fails the check by shape or by value,
    and its model takes the general path."""
    if own_inputs is None:
        return False
    for key, ((args, _),) in calls.items():
        a, own = args[0].detach(), own_inputs.get(key)
        if own is None or own.dim() != a.dim() + 1 or own.shape[1] != 1 or own.shape[:1] + own.shape[2:] != a.shape:
            return False
        if not a.is_floating_point() or a.numel() == 0:
            if not torch.equal(own[:, 0], a):
                return False
            continue
        tolerance = _tolerance(a)
        if not torch.allclose(own[:, 0], a, rtol=tolerance, atol=tolerance * a.abs().max().item()):
            return False
    return True


def _ggn_diagonal_by_layers(outputs, leaves, owners, modules, calls, lam, cotangents, per_sample):
    """The diagonal (or per-example shares) from each module's input a and the Y back-propagated dL/dz;
    None if the check fails."""
    layer_outputs = [calls[id(m)][0][1] for m in modules]
    try:  # the Y cotangents in one batched backward pass
        deltas = torch.autograd.grad(outputs, layer_outputs, cotangents, is_grads_batched=True, retain_graph=True,
                                     materialize_grads=True)
    except Exception:  # a backward formula that cannot be batched (torch.cond's, GroupNorm's in torch 2.13): one
        # cotangent at a time, whatever the error (no message is read); the graph is kept, so the products are the same
        rows = [torch.autograd.grad(outputs, layer_outputs, c, retain_graph=True, materialize_grads=True) for c in cotangents]
        deltas = tuple(torch.stack(column) for column in zip(*rows))
    Y = len(lam)
    r = torch.linspace(1, 2, Y, dtype=lam.dtype, device=lam.device)  # weights for the check's one combination
    shares, rebuilt = {}, {}
    for m, delta in zip(modules, deltas):
        a = calls[id(m)][0][0][0].detach()
        mine = {local: name for name, (owner, local) in owners.items() if owner is m}
        if type(m) is nn.Linear and a.dim() == 2:  # weight gradient delta a^T, squared: delta^2 (a^2)^T
            D = torch.einsum("kb,kbo->bo", lam, delta**2)
            combined = torch.einsum("k,kbo->bo", r, delta)
            parts = {"weight": (D[:, :, None] * a[:, None, :] ** 2 if per_sample else D.T @ a**2, combined.T @ a),
                     "bias": (D if per_sample else D.sum(0), combined.sum(0))}
        else:  # any other module: its own per-example vjp, for each of the Y cotangents
            local_params = {local: leaves[name].detach() for local, name in mine.items()}
            one = lambda x, d: vjp(lambda p: functional_call(m, p, (x[None],))[0], local_params)[1](d)[0]
            per = vmap(vmap(one), in_dims=(None, 0))(a, delta)  # {local: (Y, B, *shape)}
            parts = {local: (torch.einsum(f"kb,kb...->{'b' if per_sample else ''}...", lam, g**2), torch.einsum("k,kb...->...", r, g))
                     for local, g in per.items()}
        for local, name in mine.items():
            shares[name], rebuilt[name] = parts[local]
    expected = torch.autograd.grad(outputs, list(leaves.values()), torch.einsum("k,k...->...", r, cotangents),
                                   materialize_grads=True)
    tolerance = torch.finfo(lam.dtype).eps ** 0.5
    for name, e in zip(leaves, expected):  # a parameter used outside its module would break the rebuild
        if not torch.allclose(rebuilt[name], e, rtol=tolerance, atol=tolerance * e.abs().max().item()):
            return None
    return {name: shares[name] for name in leaves}


def _ggn_diagonal_by_vmap(model, params, inputs, lam, cotangents, chunk_size=None):
    """The general path: each example's (Y, P) output Jacobian J_n by output_jacobian (vmap of jacrev, or its
    fall-backs: a GRU or LSTM unrolled, else a loop), chunk_size examples at a time (all if None); then J_n^T u_k for the Y
    cotangents, squared and weighted. Returns each example's share, {name: (B, *shape)}."""
    sizes, shares, chunk_size = [p.numel() for p in params.values()], [], chunk_size or len(inputs)
    for start in range(0, len(inputs), chunk_size):
        rows = slice(start, start + chunk_size)
        with _no_random_draws(inputs.device, _held_generators(model)):
            J = cast(torch.Tensor, output_jacobian(model, inputs[rows], select=lambda out: out.reshape(len(out), -1)))  # (c, Y, P)
        columns = torch.einsum("cyp,kcy->kcp", J, cotangents[:, rows].reshape(len(lam), J.shape[0], -1))  # J_n^T u_k
        shares.append(torch.einsum("kc,kcp->cp", lam[:, rows], columns**2))
    share = torch.cat(shares)
    return {name: piece.reshape(len(inputs), *p.shape) for (name, p), piece in zip(params.items(), share.split(sizes, dim=1))}


def _rademacher_bits(params, samples, generator):
    """samples random bits per parameter entry, {name: (samples, *shape) int8 on the CPU}: one byte per entry."""
    if isinstance(samples, bool) or not isinstance(samples, numbers.Integral) or samples < 1:
        raise ValueError(f"samples must be a positive int, got {samples!r}")
    return {name: torch.randint(0, 2, (int(samples), *p.shape), generator=generator, dtype=torch.int8)
            for name, p in params.items()}


def _signs(bits, params, rows=slice(None)):
    """The +-1 probes of the given rows of bits, in the parameters' dtype and on their device."""
    return {name: (2 * bits[name][rows] - 1).to(p.dtype).to(p.device) for name, p in params.items()}


def _rademacher(params, samples, generator):
    """samples random +-1 vectors shaped like params, {name: (samples, *shape)}, drawn on the CPU, then moved:
    the probes the estimators draw from the same generator."""
    return _signs(_rademacher_bits(params, samples, generator), params)


def _hutchinson(model, loss_fn, inputs, targets, samples, generator, chunk_size, max_memory):
    """The probes v and their products H v, a chunk at a time: yields ({name: (chunk, *shape)}, the same for H v).
    Memory: the probes' bits (samples x P bytes) and, per chunk, its probes, products and the batched backward
    pass's temporaries (counted as 3 x chunk x P numbers)."""
    params, data = _trainable(model, loss_fn, inputs, targets)
    _check_chunk_size(chunk_size)
    _check_max_memory(max_memory)
    bits = _rademacher_bits(params, samples, generator)
    first = next(iter(params.values()))
    P, S, size = sum(p.numel() for p in params.values()), int(samples), first.dtype.itemsize
    room = max_memory - S * P  # the bits take one byte each
    if chunk_size is None:
        chunk_size = int(max(1, min(S, room // (3 * P * size))))
    _refuse_above(max_memory, S * P / size + 3 * min(chunk_size, S) * P, first.dtype,
                  f"{S:,} probes' bits (S x P bytes) and {min(chunk_size, S)} at a time as products (3 x chunk x P numbers)",
                  "use fewer samples or a smaller chunk_size")
    hvp = _data_hvp(model, loss_fn, data, params)
    for start in range(0, S, chunk_size):
        probes = _signs(bits, params, slice(start, start + chunk_size))
        yield probes, hvp(probes, batched=True)


@_gradients_enabled
def hessian_trace(model: nn.Module, loss_fn: Callable[..., torch.Tensor], inputs: Any, targets: Any, *, samples: int, generator: torch.Generator | None = None,
                  chunk_size: int | None = None, max_memory: float = _MAX_MEMORY) -> float:
    r"""Hutchinson's estimate of the trace of the parameter Hessian: the mean of ``v^T H v``.

    Unbiased, with a variance that falls as 1/samples; the probes run through batched backward passes.

    Args:
        model, loss_fn, inputs, targets: as in :func:`empirical_fisher_vp`.
        samples (int): how many Rademacher vectors v (entries +-1).
        generator (torch.Generator, optional): the CPU generator of the probes.
        chunk_size (int, optional): probes per backward pass; if None, as many as ``max_memory`` allows.
        max_memory (float): bytes the probes may hold (default 2 GiB): S x P bytes for all of them (their
            signs) and 3 x chunk_size x P numbers for a chunk's probes, products and temporaries; above it,
            refused up front.

    Returns:
        A float. Memory: as under ``max_memory``, plus the graph of one batch's gradient.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from torch_func_recipes import hessian_trace
        >>> _ = torch.manual_seed(0)
        >>> model, loss_fn = nn.Linear(3, 2, bias=False).double(), nn.functional.cross_entropy
        >>> x, y = torch.randn(8, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1, 0, 0, 1])
        >>> H = torch.autograd.functional.hessian(lambda w: loss_fn(x @ w.T, y), model.weight).reshape(6, 6)
        >>> estimate = hessian_trace(model, loss_fn, x, y, samples=2000, generator=torch.Generator().manual_seed(0))
        >>> isinstance(estimate, float), abs(estimate - H.trace().item()) < 0.05 * H.trace().item()
        (True, True)
    """
    total = 0.0
    for probes, products in _hutchinson(model, loss_fn, inputs, targets, samples, generator, chunk_size, max_memory):
        total += sum((probes[n] * products[n]).sum() for n in probes).item()
    return total / samples


@_gradients_enabled
def hessian_diagonal(model: nn.Module, loss_fn: Callable[..., torch.Tensor], inputs: Any, targets: Any, *, samples: int,
                     generator: torch.Generator | None = None, chunk_size: int | None = None,
                     max_memory: float = _MAX_MEMORY) -> dict[str, torch.Tensor]:
    r"""Hutchinson's estimate of the diagonal of the parameter Hessian: the mean of ``v * (H v)``.

    Args:
        model, loss_fn, inputs, targets: as in :func:`empirical_fisher_vp`.
        samples, generator, chunk_size, max_memory: as in :func:`hessian_trace`.

    Returns:
        ``{name: tensor shaped like the parameter}``. Memory: as in :func:`hessian_trace`.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from torch_func_recipes import hessian_diagonal
        >>> _ = torch.manual_seed(0)
        >>> model, loss_fn = nn.Linear(3, 2, bias=False).double(), nn.functional.cross_entropy
        >>> x, y = torch.randn(8, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1, 0, 0, 1])
        >>> H = torch.autograd.functional.hessian(lambda w: loss_fn(x @ w.T, y), model.weight).reshape(6, 6)
        >>> estimate = hessian_diagonal(model, loss_fn, x, y, samples=2000, generator=torch.Generator().manual_seed(0))
        >>> exact = H.diagonal().view(2, 3)
        >>> estimate["weight"].shape, bool((estimate["weight"] - exact).abs().max() < 0.1 * exact.abs().max())
        (torch.Size([2, 3]), True)
    """
    total = None
    for probes, products in _hutchinson(model, loss_fn, inputs, targets, samples, generator, chunk_size, max_memory):
        total = _accumulate(total, {n: (probes[n] * products[n]).sum(dim=0) for n in probes}, 1.0)
    assert total is not None  # at least one probe
    return {n: t / samples for n, t in total.items()}


class Eigenpairs(NamedTuple):
    """What :func:`top_hessian_eigenvalues` returns: the top k eigenvalues, largest first, each with its residual
    and, on request, its eigenvector.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from torch_func_recipes import top_hessian_eigenvalues
        >>> _ = torch.manual_seed(0)
        >>> model, loss_fn = nn.Linear(3, 1).double(), nn.functional.mse_loss
        >>> x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)
        >>> values, residuals, vectors = top_hessian_eigenvalues(model, loss_fn, x, y, k=2, eigenvectors=True)
        >>> values.shape, residuals.shape, {name: tuple(v.shape) for name, v in vectors.items()}
        (torch.Size([2]), torch.Size([2]), {'weight': (2, 1, 3), 'bias': (2, 1)})
    """

    values: torch.Tensor
    """(k,): the Ritz values, largest first, each repeated eigenvalue as often as it occurs."""
    residuals: torch.Tensor
    """(k,): ``|H v - value * v|`` for each unit Ritz vector v, computed with k more products: small relative
    to the values where they have converged."""
    vectors: dict[str, torch.Tensor] | None
    """``{name: (k, *shape)}``, the unit Ritz vectors (eigenvectors once converged), with ``eigenvectors=True``;
    else None."""


def _orthonormal_rows(W, basis, generator):
    """W's rows made orthonormal and orthogonal to the rows of basis (twice, "twice is enough"); a row that has
    (almost) no component left is replaced by a random direction orthogonal to everything, so the basis keeps
    growing (an invariant subspace, or a repeated eigenvalue, leaves the block Krylov space short)."""
    scale = W.norm(dim=1).max().item()
    for _ in range(2):
        if len(basis):
            W = W - (W @ basis.T) @ basis
    if len(W) == 1:  # one vector: its norm is its R
        R = W.norm().reshape(1, 1)
        Q = W / R.clamp_min(torch.finfo(W.dtype).tiny)
    else:
        Q, R = torch.linalg.qr(W.T)
        Q = Q.T.clone()
    good = R.diagonal().abs() > 1e-10 * max(scale, torch.finfo(W.dtype).tiny)
    for row in (~good).nonzero().flatten().tolist():  # QR's row there is arbitrary: not orthogonal to the basis
        others = torch.cat([basis, Q[good]])
        fresh = torch.randn(W.shape[1], generator=generator, dtype=W.dtype).to(W.device)
        for _ in range(2):
            fresh = fresh - others.T @ (others @ fresh)
        Q[row], good[row] = fresh / fresh.norm(), True
    return Q


def _block_lanczos(matvec, total, k, block, iterations, dtype, device, generator):
    """The top k Ritz pairs of the symmetric operator matvec ((b, total) -> (b, total)) on a block Krylov space of
    `iterations` dimensions, started from `block` random vectors, with full reorthogonalisation: returns the
    values (k,), the unit vectors (k, total) and the residuals |H v - value v| (k,). T, the operator in the basis,
    is computed entry by entry from the products (Rayleigh-Ritz), so it is exact for whatever basis rounding
    left. A block of b vectors finds an eigenvalue up to b times; iterations = total spans everything (exact)."""
    basis = torch.empty(iterations, total, dtype=dtype, device=device)
    T = torch.zeros(iterations, iterations, dtype=dtype, device=device)
    start = torch.randn(block, total, generator=generator, dtype=dtype).to(device)
    basis[:block] = _orthonormal_rows(start, basis[:0], generator)
    done, size = 0, block  # rows of the basis whose products are in T; rows of the basis
    while True:
        products = matvec(basis[done:size])
        T[:size, done:size] = basis[:size] @ products.T  # the upper triangle, a block of columns at a time
        done, room = size, min(block, iterations - size)
        if room <= 0:
            break
        basis[size:size + room] = _orthonormal_rows(products[:room], basis[:size], generator)
        size += room
    T = torch.triu(T) + torch.triu(T, 1).T
    values, vectors = torch.linalg.eigh(T)
    values, vectors = values.flip(0)[:k], (vectors.flip(1)[:, :k].T @ basis)
    vectors = vectors / vectors.norm(dim=1, keepdim=True)
    residuals = (matvec(vectors) - values[:, None] * vectors).norm(dim=1)
    return values, vectors, residuals


@_gradients_enabled
def top_hessian_eigenvalues(model: nn.Module, loss_fn: Callable[..., torch.Tensor], inputs: Any, targets: Any, k: int = 1, *,
                            iterations: int | None = None, block_size: int | None = None, eigenvectors: bool = False,
                            generator: torch.Generator | None = None, max_memory: float = _MAX_MEMORY) -> Eigenpairs:
    r"""The k algebraically largest eigenvalues of the parameter Hessian, largest first, with their multiplicity.

    Block Lanczos: an orthonormal basis of the block Krylov space ``{V, HV, H^2 V, ...}`` of a random start
    block V of ``block_size`` vectors (reorthogonalised in full), the Hessian in that basis (Rayleigh-Ritz),
    and its eigenpairs; each block's products run as one batched backward pass. Once converged, an eigenvalue
    repeated up to ``block_size`` times among the top k appears as often as it occurs (from one start vector,
    once). Convergence is not guaranteed: each value lies within its residual of a true eigenvalue, so read
    the residuals. With ``iterations = P`` the basis spans every direction and the values are exact up to
    rounding.

    Args:
        model, loss_fn, inputs, targets: as in :func:`empirical_fisher_vp`.
        k (int): how many eigenvalues.
        iterations (int, optional): Hessian-vector products in the basis (its dimension); default
            ``min(P, max(40, 12 * block_size))``. k more products give the residuals.
        block_size (int, optional): start vectors, and products per batched backward pass; default k.
        eigenvectors (bool): also return the unit Ritz vectors.
        generator (torch.Generator, optional): the CPU generator of the start block.
        max_memory (float): bytes the basis may hold (default 2 GiB); above it, refused up front.

    Returns:
        :class:`Eigenpairs` ``(values, residuals, vectors)``, in the parameters' dtype. Memory: the basis,
        ``iterations x P`` numbers (float32 for a float16 or bfloat16 model, whose products it holds in float32:
        torch's eigh and qr take neither), plus ``2 (block_size + k)`` P-vectors and one batch's gradient graph.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from torch_func_recipes import top_hessian_eigenvalues
        >>> _ = torch.manual_seed(0)
        >>> model, loss_fn = nn.Linear(3, 2, bias=False).double(), nn.functional.mse_loss
        >>> x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
        >>> H = torch.autograd.functional.hessian(lambda w: loss_fn(x @ w.T, y), model.weight).reshape(6, 6)
        >>> top = top_hessian_eigenvalues(model, loss_fn, x, y, k=2, generator=torch.Generator().manual_seed(0))
        >>> torch.allclose(top.values, torch.linalg.eigvalsh(H).flip(0)[:2])  # each eigenvalue twice: two outputs
        True
        >>> bool(top.residuals.max() < 1e-10), top.values[0].item() == top.values[1].item() or "equal up to rounding"
        (True, 'equal up to rounding')
    """
    params, data = _trainable(model, loss_fn, inputs, targets)
    total = sum(p.numel() for p in params.values())
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 1 <= k <= total:
        raise ValueError(f"k must be an int from 1 to the number of parameters ({total}), got {k!r}")
    block = k if block_size is None else block_size
    if isinstance(block, bool) or not isinstance(block, numbers.Integral) or not 1 <= block <= total:
        raise ValueError(f"block_size must be an int from 1 to the number of parameters ({total}), got {block!r}")
    steps = min(total, max(40, 12 * block)) if iterations is None else iterations
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or not max(k, block) <= steps <= total:
        raise ValueError(f"iterations must be an int from max(k, block_size) ({max(k, block)}) to the number of "
                         f"parameters ({total}), got {steps!r}")
    _check_max_memory(max_memory)
    first = next(iter(params.values()))
    work = _working_dtype(first.dtype)  # the basis and T: float32 for a half-precision model
    _refuse_above(max_memory, (int(steps) + 2 * (block + k)) * total, work,
                  f"a basis of {int(steps)} vectors of P = {total:,} numbers", "use fewer iterations")
    hvp = _data_hvp(model, loss_fn, data, params)
    sizes = [p.numel() for p in params.values()]

    def matvec(rows):  # (b, P) flat vectors -> (b, P) products, in one batched backward pass (a plain one for b = 1)
        return products(rows.to(first.dtype)).to(work)

    def products(rows):
        if len(rows) == 1:
            pieces = {n: piece.view(p.shape) for (n, p), piece in zip(params.items(), rows[0].split(sizes))}
            return torch.cat([t.reshape(-1) for t in hvp(pieces).values()])[None]
        pieces = {n: piece.reshape(len(rows), *p.shape) for (n, p), piece in zip(params.items(), rows.split(sizes, dim=1))}
        return torch.cat([t.reshape(len(rows), -1) for t in hvp(pieces, batched=True).values()], dim=1)

    values, vectors, residuals = _block_lanczos(matvec, total, int(k), int(block), int(steps), work, first.device,
                                                generator)
    values, vectors, residuals = values.to(first.dtype), vectors.to(first.dtype), residuals.to(first.dtype)
    named = None
    if eigenvectors:
        named = {n: piece.reshape(int(k), *p.shape) for (n, p), piece in zip(params.items(), vectors.split(sizes, dim=1))}
    return Eigenpairs(values, residuals, named)


@_gradients_enabled
def gauss_newton_step(model: nn.Module, loss_fn: Callable[..., torch.Tensor], inputs: Any, targets: Any, *, damping: float,
                      max_memory: float = _MAX_MEMORY) -> dict[str, torch.Tensor]:
    r"""The damped Gauss-Newton step ``-(G + damping I)^{-1} g``, solved in output space.

    ``-J^T (damping I + H_L J J^T)^{-1} r``, with J the (N*Y, P) output Jacobian (``vmap`` over examples of
    ``jacrev``), H_L the loss's Hessian in the outputs (``jacrev`` of ``grad``, a batch's block at a time) and r
    its gradient there: one dense solve of N*Y unknowns.

    Args:
        model, loss_fn, inputs, targets: as in :func:`empirical_fisher_vp`.
        damping (float): the damping, positive.
        max_memory (float): bytes the Jacobian and the system may hold (default 2 GiB); above it, refused up
            front.

    Returns:
        ``{name: tensor shaped like the parameter}``. Memory: the (N*Y, P) Jacobian and two (N*Y, N*Y)
        matrices, ``N Y P + 2 (N Y)^2`` numbers: 2.4 GB in float32 for a 1.2-million-parameter CNN with 50
        examples of 10 outputs.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from torch_func_recipes import gauss_newton_step
        >>> _ = torch.manual_seed(0)
        >>> model, loss_fn = nn.Linear(3, 2, bias=False).double(), nn.functional.cross_entropy
        >>> x, y = torch.randn(8, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1, 0, 0, 1])
        >>> H = torch.autograd.functional.hessian(lambda w: loss_fn(x @ w.T, y), model.weight).reshape(6, 6)
        >>> step = gauss_newton_step(model, loss_fn, x, y, damping=0.1)
        >>> g = torch.autograd.grad(loss_fn(model(x), y), model.weight)[0].flatten()
        >>> expected = -torch.linalg.solve(H + 0.1 * torch.eye(6, dtype=torch.float64), g)  # G = H for this model
        >>> torch.allclose(step["weight"], expected.view(2, 3))
        True
    """
    if isinstance(damping, bool) or not isinstance(damping, numbers.Real) or damping <= 0:
        raise ValueError(f"damping must be a positive number, got {damping!r}")
    params, data = _trainable(model, loss_fn, inputs, targets, tensor_output="gauss_newton_step")
    _check_max_memory(max_memory)
    P = sum(p.numel() for p in params.values())
    jacobians, residuals, hessians = [], [], []
    for x, t, c in data:
        with _no_random_draws(x.device, _held_generators(model)):
            outputs = functional_call(model, params, (x,))
        n = outputs.numel()
        if not jacobians:
            rows = data.size * (n // len(x))
            _refuse_above(max_memory, rows * P + 2 * rows**2, outputs.dtype,
                          f"the (N*Y, P) = ({rows:,}, {P:,}) output Jacobian and two (N*Y)^2 matrices",
                          "use fewer examples")
        # (B*Y, P): output_jacobian, with its fast path and its fall-backs (a GRU or LSTM unrolled, else a loop)
        with _no_random_draws(x.device, _held_generators(model)):
            jacobians.append(output_jacobian(model, x, select=lambda out: out.reshape(len(out), -1)).reshape(n, P))
        loss_of_outputs = lambda o, t=t, c=c: c * _scalar(loss_fn(o, t))
        _check_loss_twice_differentiable(loss_of_outputs, outputs)
        residuals.append(grad(loss_of_outputs)(outputs).reshape(n))
        # jacrev of grad: the composition that is right through every layer (torch.func.hessian, jacfwd of
        # jacrev, is wrong through a LayerNorm in torch 2.13; see "Jacobians and Hessians")
        hessians.append(jacrev(grad(loss_of_outputs))(outputs).reshape(n, n))
    one = len(jacobians) == 1  # one batch: no copy of its Jacobian
    jacobian, residual = (jacobians[0], residuals[0]) if one else (torch.cat(jacobians), torch.cat(residuals))
    output_hessian = hessians[0] if one else torch.block_diag(*hessians)
    system = damping * torch.eye(len(residual), dtype=residual.dtype, device=residual.device) + output_hessian @ (jacobian @ jacobian.T)
    work = _working_dtype(system.dtype)  # float32 for a half-precision model
    step = -(jacobian.T @ torch.linalg.solve(system.to(work), residual.to(work)).to(system.dtype))
    sizes = [p.numel() for p in params.values()]
    return {name: piece.view(p.shape) for (name, p), piece in zip(params.items(), step.split(sizes))}


def conjugate_gradient(matvec: Callable[[torch.Tensor], torch.Tensor], b: torch.Tensor, *, tol: float = 1e-10,
                       max_iterations: int | None = None) -> torch.Tensor:
    r"""Solve ``A x = b`` for a symmetric positive definite A given as a matrix-vector product.

    Args:
        matvec (Callable): ``x -> A x`` on flat vectors.
        b (Tensor): the right-hand side, a flat vector.
        tol (float): stop at a relative residual ``|b - A x| <= tol |b|`` (a number >= 0).
        max_iterations (int, optional): at most this many iterations (default, and when 0: ten times the
            length of b, since rounding can slow convergence past the length that exact arithmetic needs).

    Returns:
        x, shaped like b. Memory: four vectors shaped like b, besides what matvec holds.

    Raises:
        ValueError: if A shows a direction of non-positive curvature.
        RuntimeError: if the residual is still above ``tol`` after ``max_iterations``.

    Example::

        >>> import torch
        >>> from torch_func_recipes import conjugate_gradient
        >>> _ = torch.manual_seed(0)
        >>> M = torch.randn(5, 5, dtype=torch.float64)
        >>> A, b = M @ M.T + torch.eye(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
        >>> torch.allclose(conjugate_gradient(lambda v: A @ v, b), torch.linalg.solve(A, b))
        True
        >>> conjugate_gradient(lambda v: -v, b)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
            ...
        ValueError: conjugate gradients met non-positive curvature ...
    """
    if isinstance(tol, bool) or not isinstance(tol, numbers.Real) or not tol >= 0:
        raise ValueError(f"tol must be a number >= 0, got {tol!r}")
    if max_iterations is not None and (isinstance(max_iterations, bool) or not isinstance(max_iterations, numbers.Integral)
                                       or max_iterations < 0):
        raise ValueError(f"max_iterations must be an int >= 0 or None, got {max_iterations!r}")
    x, r, p = torch.zeros_like(b), b.clone(), b.clone()
    rr, target, limit = torch.dot(b, b), (tol * b.norm()) ** 2, max_iterations or 10 * b.numel()
    for _ in range(limit):
        if rr <= target:
            return x
        ap = matvec(p)
        curvature = torch.dot(p, ap)
        if curvature <= 0:
            raise ValueError(f"conjugate gradients met non-positive curvature (p^T A p = {curvature.item():.3g}): "
                             "the damped Hessian is not positive definite; increase damping")
        step = rr / curvature
        x, r = x + step * p, r - step * ap
        rr, rr_old = torch.dot(r, r), rr
        p = r + (rr / rr_old) * p
    if rr <= target:  # reached by the last iteration
        return x
    raise RuntimeError(f"conjugate gradients did not reach tol={tol} in {limit} iterations")


@_gradients_enabled
def influence_scores(model: nn.Module, loss_fn: Callable[..., torch.Tensor], train_inputs: Any, train_targets: Any, test_inputs: Any, test_targets: Any, *,
                     damping: float, tol: float = 1e-10, max_iterations: int | None = None,
                     max_memory: float = _MAX_MEMORY) -> torch.Tensor:
    r"""Each training example's first-order effect on the test loss, ``w * g_test^T (H + damping I)^{-1} g_i``.

    The change of ``loss_fn(model(test_inputs), test_targets)`` when example i's term is removed from the
    training loss: H the Hessian of the training loss, g_i the gradient of example i's own loss, w = 1/N for
    a mean (1 for a sum). Positive: the example helps the test loss. Conjugate gradients on damped
    Hessian-vector products.

    Args:
        model, loss_fn: as in :func:`empirical_fisher_vp`.
        train_inputs, train_targets: the N training examples (a batch, or an iterable of batches with
            ``train_targets=None``).
        test_inputs, test_targets: the test examples (likewise).
        damping (float): added to H; must make it positive definite.
        tol, max_iterations: as in :func:`conjugate_gradient`.
        max_memory (float): as in :func:`empirical_fisher_vp`: the per-example gradients come in chunks.

    Returns:
        A (N,) tensor. Memory: a few P-vectors for conjugate gradients, one batch's gradient graph, and
        per-example gradients of at most ``max_memory / (2 P * itemsize)`` examples at a time.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from torch_func_recipes import influence_scores
        >>> _ = torch.manual_seed(0)
        >>> model, loss_fn = nn.Linear(3, 2, bias=False).double(), nn.functional.cross_entropy
        >>> x, y = torch.randn(8, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1, 0, 0, 1])
        >>> H = torch.autograd.functional.hessian(lambda w: loss_fn(x @ w.T, y), model.weight).reshape(6, 6)
        >>> x_test, y_test = torch.randn(3, 3, dtype=torch.float64), torch.tensor([1, 0, 1])
        >>> scores = influence_scores(model, loss_fn, x, y, x_test, y_test, damping=0.1)
        >>> g_test = torch.autograd.grad(loss_fn(model(x_test), y_test), model.weight)[0].flatten()
        >>> g = torch.stack([torch.autograd.grad(loss_fn(model(x[n:n + 1]), y[n:n + 1]), model.weight)[0].flatten() for n in range(8)])
        >>> scores.shape, torch.allclose(scores, g @ torch.linalg.solve(H + 0.1 * torch.eye(6, dtype=torch.float64), g_test) / 8)
        (torch.Size([8]), True)
    """
    if isinstance(damping, bool) or not isinstance(damping, numbers.Real) or damping < 0:
        raise ValueError(f"damping must be a non-negative number, got {damping!r}")
    params, train = _trainable(model, loss_fn, train_inputs, train_targets, "train_inputs", tensor_output="influence_scores")
    _check_order_kept(train_inputs, "influence_scores, a score per training example,")
    _, test = _trainable(model, loss_fn, test_inputs, test_targets, "test_inputs")
    _check_max_memory(max_memory)
    sizes = [p.numel() for p in params.values()]
    flatten = lambda d: torch.cat([d[n].reshape(-1) for n in params])
    hvp = _data_hvp(model, loss_fn, train, params)
    test_gradient = sum(c * flatten(_gradient(model, loss_fn, x, t, params)) for x, t, c in test)

    def damped_hvp(vector):
        pieces = {n: piece.view(p.shape) for (n, p), piece in zip(params.items(), vector.split(sizes))}
        return flatten(hvp(pieces)) + damping * vector

    solution = conjugate_gradient(damped_hvp, test_gradient, tol=tol, max_iterations=max_iterations)
    return torch.cat([c * weight * torch.cat([g[n].flatten(1) for n in params], dim=1) @ solution
                      for c, weight, g in _per_example_gradients(model, loss_fn, train, params, max_memory)])
