"""How every recipe reads its batch, and the one validator of models and inputs they all call.

The batch convention, the same in every recipe that takes data:

- ``inputs`` is what the model is called with: a tensor (``model(inputs)``), a tuple or list of
  positional arguments (``model(*inputs)``) or a dict of keyword arguments (``model(**inputs)``, the
  dict a Hugging Face data collator returns). The per-example recipes also take the keyword arguments
  as their own (``per_sample_grads(model, loss_fn, targets=labels, **batch)``), in place of inputs.
- ``targets`` is what ``loss_fn`` takes besides the model's output: a tensor, a tuple or a dict of
  tensors, or None, and then ``loss_fn`` is called with the output alone. ``loss_fn`` receives
  whatever the model returns (a tensor, a tuple, a ``ModelOutput``).
- Every tensor in ``inputs`` and ``targets`` holds the examples along dimension 0, all with the same
  number of rows, except the arguments named in ``unbatched`` (positions of a tuple, keys of a dict),
  which every example receives whole (a shared mask, position ids of shape (1, T)). Values that are
  not tensors (None, flags such as ``use_cache=False``) are passed as they are.

The validator's answers (tests/test_validation.py checks every one for every recipe):

==========================================  ==========================================================
case                                        answer
==========================================  ==========================================================
B = 0 (an empty batch)                      per-example recipes return empty results (B = 0 rows) and
                                            report path "none"; output_jacobian finds Y from the model's
                                            output on the empty batch; the DP step returns noise alone
                                            when ``expected_batch_size`` is given, else ValueError;
                                            curvature recipes: ValueError (the loss of no examples)
tensors with different numbers of rows      ValueError naming both arguments and their row counts
a loss that is not one number               ValueError: ``loss_fn`` must return a scalar
BatchNorm in training mode (or without      ValueError for every recipe: the batch's statistics mix the
running statistics)                         examples (per-example recipes) and change on every call
                                            (curvature); call ``model.eval()``
a random module (Dropout with p > 0,        per-example recipes: each example draws its own randomness
RReLU) in training mode                     (``vmap(..., randomness="different")``), as the loop does;
                                            curvature recipes: ValueError (the curvature of a random
                                            function); call ``model.eval()``
a model whose output for one example        per-example recipes: ValueError naming the problem (no
depends on the others (a batch mean or      example has a gradient of its own), found by running the
softmax by hand, a roll over the batch,     first two examples together and alone
the batch's size read as a number)          (``_check_examples_apart``); curvature recipes accept it
                                            (the batch's loss is one function of the parameters), but
                                            ``ggn_diagonal``, which needs per-example factors, refuses it
a module compiled by ``torch.compile`` (or  fullgraph=True: ValueError for every recipe (torch cannot
``module.compile()``)                       run it inside torch.func's transforms); otherwise the
                                            per-example recipes answer (torch runs it eagerly there)
                                            and the curvature recipes: ValueError (no double backward);
                                            pass the module before compiling (``._orig_mod``); a
                                            function compiled inside forward is not seen (torch's error)
a forward pass calling ``torch.cond`` (a     per-example recipes: the loop (the fast path's trace stops
higher-order operator)                      at it and mends what torch 2.13 breaks by running it under
                                            a dispatch mode, ``torch.compiler.reset()``; vmap raises
                                            inside torch); curvature recipes answer, or refuse where a
                                            second derivative would pass through its backward pass
a trainable parameter used inside a custom  ValueError naming it, for every recipe taking data
Function's forward where autograd cannot    (``_check_parameters_reached``): every path would give it no
reach it (``checkpoint(...,                 gradient and no curvature; use ``use_reentrant=False``
use_reentrant=True)``, a Function reading   (transformers' default), pass the parameter to the
a parameter it is not given)                Function, or freeze it; one read under a plain no_grad
                                            gets autograd's zero, as with ``.backward()``
a tensor computed from a trainable         ValueError naming the parameter, for every recipe taking
parameter before the call, with its         data (``_FunctionUses.premade``, ``_batch_made_with``):
autograd graph (a view of a weight kept as  autograd carries its share of the gradient back to the
an attribute or closed over by loss_fn;     parameter, which the fast path, vmap and the curvature
inputs or targets computed from the model)  recipes do not follow; detached, it is a constant and answers
a backward pass that mixes the examples     per-example recipes: vmap or the loop (they run it on each
(a gradient hook on an activation that      example's gradient); the fast path's end examples are
normalises the gradient it is given)        compared with those examples alone once per call signature
                                            (``_trace._end_gradients_alone``); ``path='fast'``: ValueError
a custom Function whose backward calls      ValueError naming them, for every recipe taking data
backward() itself for parameters it         (``_model_kept``): every path would give them no
returns no gradient for (a reentrant        gradient; their ``.grad`` (which it writes) is put back
checkpoint written by hand)                 as it was
a parameter with a gradient hook of its     per-example recipes: the loop, the one path that runs it on
own (``Tensor.register_hook``)              each example's gradient; ``path='fast'``, ``'vmap'`` or
                                            ``'unroll'``: ValueError (each would leave it out);
                                            curvature recipes: ValueError (it changes gradients, not
                                            the loss whose curvature they measure)
a forward pass or hook that writes into a   every recipe puts the buffer back (``_model_kept``) and
buffer, an attribute (a call counter) or    refuses a written ``.grad`` (ValueError; ``.grad`` put
registers a submodule, parameter or hook,   back); an attribute, submodule, parameter or hook added,
or a hook that writes ``.grad``             replaced or removed is put back too
no parameter requires grad                  ValueError for every recipe
called inside ``torch.no_grad()`` or        every recipe computes as outside them (gradients are
``torch.inference_mode()``                  enabled inside the call; inference tensors are copied);
                                            results are ordinary tensors
==========================================  ==========================================================

Also copied, without this docstring, into the notebook cells tagged ``shared-package`` by
scripts/build_shared.py: edit it here.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import operator
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Union

import torch
import torch.nn as nn
from torch.func import functional_call
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

# The types of the recipes' public arguments (see the batch convention above). Union rather than `|` here:
# the package reference is built with torch mocked (no torch install), and a mocked torch.Tensor has no `|`.
_Inputs = Union[torch.Tensor, tuple, list, Mapping[str, Any]]  # model(inputs), model(*inputs) or model(**inputs)
_Unbatched = int | str | tuple | list  # positions or keys of inputs every example receives whole
_LossFn = Callable[..., torch.Tensor]  # loss_fn(output, targets) or loss_fn(output): a 0-d tensor
_Grads = dict[str, torch.Tensor]  # {parameter name: tensor}, in named_parameters() order

# The dicts and sets nn.Module.__init__ makes (_parameters, _buffers, _modules, the hook dicts, the names of
# non-persistent buffers): what registering a parameter, buffer, submodule or hook changes in place. Found from a
# bare module, not named, so that _model_kept puts back whatever this release keeps there.
_MODULE_CONTAINERS = tuple(name for name, value in vars(nn.Module()).items() if isinstance(value, (dict, set)))

# Modules whose forward in training mode draws random numbers.
_RANDOM_IN_TRAINING = (nn.modules.dropout._DropoutNd, nn.RReLU)


def _cuda_devices(model: nn.Module, batch: _Batch) -> list[int]:
    """The CUDA devices the model's parameters and the batch's tensors are on (their generators are the ones a
    forward pass may draw from, besides the CPU's)."""
    return sorted({t.device.index or 0 for t in [*batch.tensors(), *model.parameters()] if t.device.type == "cuda"})


def _held_generators(model: nn.Module) -> list[torch.Generator]:
    """The torch.Generator objects the model holds: attributes of its modules, or items of a list, tuple or dict there
    (a generator of the model's own, which a forward pass may draw from or re-seed); not one deeper (in a nested list
    or another object's attribute). About 2 us a module."""
    found: dict[int, torch.Generator] = {}
    for module in model.modules():
        for value in vars(module).values():
            kind = type(value)  # `is`, not isinstance: 4x faster over the many attributes of a large model
            if kind is torch.Generator:
                found[id(value)] = value
            elif kind is list or kind is tuple or kind is dict:
                items = value.values() if kind is dict else value
                found.update((id(item), item) for item in items if type(item) is torch.Generator)
    return list(found.values())


def _generator_states(cuda: list[int], held: Sequence[torch.Generator] = ()) -> list[torch.Tensor]:
    """The states of the default generators, the CPU's and those of the CUDA devices given, and of the generators
    the model holds. A forward pass that drew random numbers (F.dropout, a float dropout rate, noise added by hand,
    not only a Dropout module) changed one of them."""
    return [torch.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in cuda), *(g.get_state() for g in held)]


def _drew_random_numbers(before: list[torch.Tensor], cuda: list[int], held: Sequence[torch.Generator] = ()) -> bool:
    return not all(torch.equal(a, b) for a, b in zip(before, _generator_states(cuda, held)))


class _GeneratorWatch(TorchFunctionMode):
    """Notes every torch.Generator passed to a torch function while it is active (torch.randn(..., generator=g),
    x.normal_(generator=g), torch.bernoulli, torch.randperm, nn.init), with its state when first passed (before
    that call draws): the one way Python code draws from a generator other than a default one, so the generators a
    forward pass draws from are known after it, wherever the model keeps them (in a nested list, another object, a
    global), where _held_generators finds only those its modules hold; and restore() puts them back. A function
    mode, not a dispatch mode: it sees the call before any transform (vmap, grad) and lets a higher-order operator
    (torch.cond) run as it is. Not seen: draws in another thread, or in the backward pass (a hook, a custom
    Function's backward), where the mode is not active. About 6 us per torch call (2 CPU cores): on the checks'
    passes and the curvature recipes' forward passes, not on the per-example recipes' own."""

    def __init__(self) -> None:
        super().__init__()
        self.generators: dict[int, tuple[torch.Generator, torch.Tensor]] = {}  # id -> (generator, state first seen)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Generator) and id(value) not in self.generators:
                self.generators[id(value)] = (value, value.get_state())
        return func(*args, **kwargs)

    def others(self, held: Sequence[torch.Generator] = ()) -> list[torch.Generator]:
        """The generators passed that are neither a default one nor among `held`."""
        known = {id(g) for g in held} | {id(torch.default_generator)}
        if torch.cuda.is_available():
            known |= {id(torch.cuda.default_generators[d]) for d in range(torch.cuda.device_count())}
        return [g for key, (g, _) in self.generators.items() if key not in known]

    def restore(self, held: Sequence[torch.Generator] = ()) -> None:
        """Put the generators of others(held) back in the states they had when first passed."""
        others = {id(g) for g in self.others(held)}
        for key, (generator, state) in self.generators.items():
            if key in others:
                generator.set_state(state)


@contextlib.contextmanager
def _generators_kept(model: Any, batch: "_Batch") -> Iterator[Callable[[], bool]]:
    """Runs a check's extra passes of the model and leaves every generator they may draw from as it found it: the
    default ones (torch.random.fork_rng), those the model holds (_held_generators) and any other a torch function
    is passed (_GeneratorWatch). Yields a function telling whether the block has drawn random numbers so far (call
    it inside the block): a pass that draws cannot be compared with another."""
    module = model if isinstance(model, nn.Module) else None
    cuda, held = (_cuda_devices(module, batch), _held_generators(module)) if module is not None else ([], [])
    before, watch = _generator_states(cuda, held), _GeneratorWatch()
    try:
        with torch.random.fork_rng(devices=cuda), watch:
            yield lambda: _drew_random_numbers(before, cuda, held) or bool(watch.others(held))
    finally:
        for generator, state in zip(held, before[1 + len(cuda):]):
            generator.set_state(state)
        watch.restore(held)


def _set_generator_states(states: list[torch.Tensor], cuda: list[int], held: Sequence[torch.Generator] = ()) -> None:
    """Puts back the states _generator_states(cuda, held) returned."""
    torch.set_rng_state(states[0])
    for device, state in zip(cuda, states[1:]):
        torch.cuda.set_rng_state(state, device)
    for generator, state in zip(held, states[1 + len(cuda):]):
        generator.set_state(state)


def _random_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module of the model that draws random numbers in its forward now: a Dropout with
    p > 0 or an RReLU, in training mode. The one test of randomness the recipes share."""
    return [(name or "the model", m) for name, m in model.named_modules()
            if isinstance(m, _RANDOM_IN_TRAINING) and m.training and getattr(m, "p", 1) > 0]


class _Batch:
    """One batch under the convention above: the model's positional and keyword arguments, the targets,
    and which tensors carry examples along dimension 0. Built and checked by _as_batch."""

    def __init__(self, args: tuple, kwargs: dict, targets: Any, batched_args: tuple[bool, ...],
                 batched_kwargs: dict[str, bool], size: int):
        self.args, self.kwargs, self.targets, self.size = args, kwargs, targets, size
        self.batched_args, self.batched_kwargs = batched_args, batched_kwargs
        self._flat: tuple[list, Any, list[bool]] | None = None  # _leaves, worked out once (a batch never changes)

    def __len__(self) -> int:
        return self.size

    def _leaves(self) -> tuple[list, Any, list[bool]]:
        """Every leaf of (args, kwargs, targets), their structure, and whether each carries examples."""
        if self._flat is not None:
            return self._flat
        leaves, spec = tree_flatten((self.args, self.kwargs, self.targets))
        batched = []
        for k, value in enumerate(self.args):
            batched += [self.batched_args[k] and isinstance(leaf, torch.Tensor) for leaf in tree_flatten(value)[0]]
        for key, value in self.kwargs.items():
            batched += [self.batched_kwargs[key] and isinstance(leaf, torch.Tensor) for leaf in tree_flatten(value)[0]]
        batched += [isinstance(leaf, torch.Tensor) for leaf in tree_flatten(self.targets)[0]]
        assert len(batched) == len(leaves)
        self._flat = leaves, spec, batched
        return self._flat

    def _rebuild(self, leaves: list) -> "_Batch":
        """A batch of the same structure holding `leaves` (one per leaf of _leaves), its size read from them."""
        _, spec, batched = self._leaves()
        args, kwargs, targets = tree_unflatten(leaves, spec)
        size = next((leaf.shape[0] for leaf, b in zip(leaves, batched) if b), self.size)
        return _Batch(tuple(args), dict(kwargs), targets, self.batched_args, self.batched_kwargs, size)

    def rows(self, rows: slice | list[int]) -> "_Batch":
        """The examples in `rows` (a slice, or a list of indices, which may repeat), as a batch of its own."""
        leaves, _, batched = self._leaves()
        return self._rebuild([leaf[rows] if b else leaf for leaf, b in zip(leaves, batched)])

    def example(self, n: int) -> "_Batch":
        """Example n as a batch of one."""
        return self.rows(slice(n, n + 1))

    def tensors(self) -> list[torch.Tensor]:
        """The tensors that carry examples: the model's (not the targets)."""
        leaves, _, batched = self._leaves()
        count = len(tree_flatten(self.targets)[0])
        return [leaf for leaf, b in zip(leaves[: len(leaves) - count], batched) if b]

    def call(self, model: Callable[..., Any], params: dict | None = None) -> Any:
        """model(*args, **kwargs), its buffers as found (_as_found), or functional_call of it (an nn.Module) with
        params, as the vmap paths call it inside a transform, where a buffer cannot be written (they put the buffers
        back before the transform: _as_found)."""
        if params is None:
            _as_found()
            return model(*self.args, **self.kwargs)
        assert isinstance(model, nn.Module)
        return functional_call(model, params, self.args, self.kwargs)

    def loss(self, loss_fn: Callable, output: Any) -> Any:
        """loss_fn on the output (and targets), refused where it reads a trainable parameter of the model a recipe
        runs on (_model_kept names them): the recipes differentiate the parameters through the forward pass (the
        fast path from the layers' outputs, vmap from copies swapped into the model), so a penalty inside loss_fn
        would count on the loop alone; so would one through a tensor computed from a parameter before the call (a
        view of a weight loss_fn closes over: _FunctionUses.premade)."""
        watched = _LOSS_READS.get()
        if watched is None or not watched[1]:
            return loss_fn(output) if self.targets is None else loss_fn(output, self.targets)
        uses = _FunctionUses(watched[1], anywhere=True, given=[id(t) for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)])
        with uses:
            value = loss_fn(output) if self.targets is None else loss_fn(output, self.targets)
        if uses.found:
            raise _loss_reads_parameters([name for name, p in watched[0].named_parameters() if id(p) in uses.found])
        if uses.premade:
            raise _made_before([name for name, p in watched[0].named_parameters() if id(p) in uses.premade], "loss_fn")
        return value

    def per_example(self, f: Callable[..., Any]) -> tuple[Callable[..., Any], tuple, tuple]:
        """(g, in_dims, leaves) such that vmap(g, in_dims=(None, *in_dims))(extra, *leaves) calls
        f(extra, one) for every example, `one` being that example as a batch of one."""
        leaves, spec, batched = self._leaves()

        def g(extra, *values):
            one = [v.unsqueeze(0) if b else v for v, b in zip(values, batched)]
            args, kwargs, targets = tree_unflatten(one, spec)
            return f(extra, _Batch(tuple(args), dict(kwargs), targets, self.batched_args, self.batched_kwargs, 1))

        return g, tuple(0 if b else None for b in batched), tuple(leaves)

    def usable_outside_inference_mode(self) -> "_Batch":
        """A copy whose inference tensors (made inside torch.inference_mode()) are ordinary tensors."""
        leaves, _, _ = self._leaves()
        if not any(isinstance(leaf, torch.Tensor) and leaf.is_inference() for leaf in leaves):
            return self
        return self._rebuild([leaf.clone() if isinstance(leaf, torch.Tensor) and leaf.is_inference() else leaf for leaf in leaves])


def _as_batch(inputs: Any, targets: Any = None, unbatched: Any = (), keyword_inputs: dict[str, Any] | None = None) -> _Batch:
    """Check inputs and targets under the batch convention (the module docstring) and return them as a _Batch.
    keyword_inputs: the model's keyword arguments given to the recipe as keywords (**batch), in place of
    inputs. Raises TypeError for a container it does not know and ValueError, naming the argument, for
    tensors whose numbers of rows differ or that have no dimension 0."""
    if keyword_inputs:
        if inputs is not None:
            raise TypeError("pass the model's inputs either as one argument (a tensor, a tuple or a dict) or as keyword "
                            f"arguments ({', '.join(keyword_inputs)}), not both")
        inputs = dict(keyword_inputs)
    elif inputs is None:
        raise TypeError("no inputs: pass what the model is called with as a tensor, a tuple or a dict, or as keyword "
                        "arguments (**batch)")
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    if isinstance(inputs, torch.Tensor):
        args, kwargs, names = (inputs,), {}, ["inputs"]
    elif isinstance(inputs, (tuple, list)):
        args, kwargs, names = tuple(inputs), {}, [f"inputs[{k}]" for k in range(len(inputs))]
    elif isinstance(inputs, Mapping):
        if not all(isinstance(key, str) for key in inputs):
            raise TypeError("a dict of inputs must have str keys: the model's keyword arguments")
        args, kwargs, names = (), dict(inputs), []
    else:
        raise TypeError(f"inputs must be a tensor, a tuple of the model's positional arguments or a dict of its "
                        f"keyword arguments, got {type(inputs).__name__}")
    unbatched = (unbatched,) if isinstance(unbatched, (int, str)) else tuple(unbatched or ())
    for key in unbatched:
        known = key in kwargs if isinstance(key, str) else isinstance(key, int) and -len(args) <= key < len(args)
        if not known or isinstance(key, bool):
            raise ValueError(f"unbatched names {key!r}, which is not one of the inputs' "
                             + ("keys" if kwargs else "positions"))
    positions = {k % len(args) for k in unbatched if isinstance(k, int)}
    batched_args = tuple(k not in positions for k in range(len(args)))
    batched_kwargs = {key: key not in unbatched for key in kwargs}
    named: list[tuple[str, Any]] = [(names[k], value) for k, value in enumerate(args) if batched_args[k]]
    named += [(f"inputs[{key!r}]", value) for key, value in kwargs.items() if batched_kwargs[key]]
    if targets is not None:
        if not isinstance(targets, (torch.Tensor, tuple, list, Mapping)):
            raise TypeError(f"targets must be a tensor, a tuple or a dict of tensors, or None, got {type(targets).__name__}")
        named.append(("targets", targets))
    size, first = None, None
    for name, value in named:
        for leaf in tree_flatten(value)[0]:
            if not isinstance(leaf, torch.Tensor):
                continue
            if leaf.dim() == 0:
                raise ValueError(f"{name} is a 0-d tensor, but examples go along dimension 0"
                                 + (" (name it in unbatched= to give it whole to every example)" if name != "targets" else ""))
            if size is None:
                size, first = leaf.shape[0], name
            elif leaf.shape[0] != size:
                raise ValueError(f"{name} has {leaf.shape[0]} rows along dimension 0 but {first} has {size}: every "
                                 "tensor of a batch holds one row per example")
    if size is None:
        raise ValueError("the batch holds no tensor with examples along dimension 0")
    return _Batch(args, kwargs, targets, batched_args, batched_kwargs, size)


def _compiled(module: nn.Module) -> str | None:
    """How torch.compile made this module: "fullgraph" (compiled with fullgraph=True), "compiled", or None where it
    did not. torch.compile(module, ...) returns a module holding its options (dynamo_ctx); module.compile(...)
    keeps the compiled call, whose closure holds them."""
    if hasattr(type(module), "dynamo_ctx") or type(module).__getattr__ is not nn.Module.__getattr__:
        options = getattr(module, "dynamo_ctx", None)  # a class of its own may define or forward it (a wrapper)
    else:  # the same lookup, without Module.__getattr__'s miss (1 us a module on every call)
        options = vars(module).get("dynamo_ctx")
    compiled_call = module._compiled_call_impl
    if options is None and compiled_call is None:
        return None
    if options is None:  # module.compile(...): the options are in the compiled call's closure
        for cell in getattr(compiled_call, "__closure__", None) or ():
            try:
                held = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if hasattr(held, "fullgraph"):
                options = held
    return "fullgraph" if getattr(options, "fullgraph", False) is True else "compiled"


def _check_model(model: nn.Module, *, deterministic: bool = False) -> dict[str, nn.Parameter]:
    """The one check of a recipe's model; returns its trainable parameters {name: parameter}.
    deterministic=True (the curvature recipes) also refuses modules that draw random numbers in training mode."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    for name, module in model.named_modules():
        _refuse_lazy(name, module)
        compiled = _compiled(module)
        if compiled == "fullgraph" or (compiled and deterministic):
            raise ValueError(f"{name or 'the model'} ({type(module).__name__}) was compiled"
                             + (" with fullgraph=True, which torch.func's transforms cannot run from eager code (torch raises "
                                "rather than falling back)" if compiled == "fullgraph" else
                                ", and a compiled module gives no second derivatives (torch's compiled autograd does not "
                                "support double backward)")
                             + ": pass the module as it was before compiling (torch.compile keeps it as ._orig_mod)")
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and (module.training or module.running_mean is None):
            raise ValueError(f"{name or 'the model'} ({type(module).__name__}) is a BatchNorm in training mode or without "
                             "running statistics: it normalises with the statistics of the batch it sees, which mix the "
                             "examples and change from call to call; call model.eval() (after training with running "
                             "statistics), or use GroupNorm/LayerNorm")

    random = _random_modules(model) if deterministic else []
    if random:
        raise ValueError(f"{random[0][0]} ({type(random[0][1]).__name__}) is random in training mode, so the "
                         "loss is a different function on every call and has no curvature to measure; call model.eval()")
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if not trainable:
        raise ValueError("the model has no parameters that require grad")
    return trainable


def _refuse_lazy(name: str, module: nn.Module) -> None:
    """Refuse a module (named `name` in the model) with a parameter not yet initialised (nn.LazyLinear before its
    first forward pass): its first forward pass would change the model's make-up, on every pass a recipe runs."""
    lazy = next((n for n, p in module._parameters.items() if isinstance(p, nn.parameter.UninitializedParameter)), None)
    if lazy is not None:
        raise ValueError(f"parameter {f'{name}.' if name else ''}{lazy} ({type(module).__name__}) is not initialised yet: "
                         "a lazy module gets its parameters' shapes from its first forward pass; run the model once "
                         "on a batch (model(x)) before the recipe")


_NORM_BLOCK = 4096  # entries per block of _row_squares


def _row_squares(g: torch.Tensor) -> torch.Tensor:
    """Each example's sum of squares, (n, ...) -> (n,), as accurate in float32 on a CPU as on a GPU.

    torch.linalg.vector_norm's CPU kernel accumulates each row in a few float32 numbers (pytorch#169237): the
    norm of a row of 40 million entries came out 0.5% off, where torch.sum's cascade summation is off by about
    1e-7. Norms of blocks of 4,096 entries, squared and summed by torch.sum, are as accurate and as fast as
    vector_norm, with no copy of g (x.square().sum() would write one)."""
    rows = g.reshape(len(g), -1)
    n, m = rows.shape
    whole = m - m % _NORM_BLOCK
    total = torch.linalg.vector_norm(rows[:, whole:], dim=1).square()
    if whole:
        total = total + torch.linalg.vector_norm(rows[:, :whole].reshape(n, whole // _NORM_BLOCK, _NORM_BLOCK), dim=2).square().sum(1)
    return total


def _clip_factors(norms: torch.Tensor, max_norm: float) -> torch.Tensor:
    """min(1, max_norm / (n + 1e-6)) for each norm n: the factor that clips an example's gradient to norm
    max_norm (1e-6 as in Opacus, so an all-zero gradient gets 1, not a division by zero)."""
    return (max_norm / (norms + 1e-6)).clamp(max=1.0)


# Checks of _check_examples_apart that passed (or were left undone), remembered per model: {model: {call
# signature}}; and whether the model's forward pass drew random numbers, {model: {call signature: bool}}. A model
# that is freed takes its entries with it.
_APART: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_DRAWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _per_model(memory: weakref.WeakKeyDictionary, model: Any, empty: Callable[[], Any]) -> Any:
    """The model's entry of a per-model memory (_APART here, _trace._FAILED), made with empty() the first time; a
    fresh, unremembered empty() for a model that cannot be weakly referenced."""
    try:
        return memory.setdefault(model, empty())
    except TypeError:
        return empty()


def _call_signature(model: Any, batch: _Batch) -> tuple | None:
    """What a model's behaviour on a batch depends on besides its code and the tensors' values: the structure of
    the arguments, each tensor's shape, dtype, device and whether it carries examples, the other arguments'
    values, every submodule's train/eval mode, whether autograd records and whether parametrize.cached() is on.
    None when an argument that is not a tensor cannot be hashed (nothing can then be remembered)."""
    leaves, _, batched = batch._leaves()
    parts: list[Any] = []
    for leaf, carries in zip(leaves, batched):
        if isinstance(leaf, torch.Tensor):
            parts.append((tuple(leaf.shape), leaf.dtype, leaf.device, carries))
        else:
            try:
                hash(leaf)
            except TypeError:
                return None
            parts.append((type(leaf), leaf))
    modes = tuple(m.training for m in model.modules()) if isinstance(model, nn.Module) else ()
    cached = nn.utils.parametrize._cache_enabled > 0  # parametrize.cached(): parametrized weights made once, reused
    return len(batch.args), tuple(batch.kwargs), tuple(parts), modes, torch.is_grad_enabled(), cached


def _check_examples_apart(model: nn.Module, batch: _Batch) -> str | None:
    """The per-example recipes' check that an example's output does not depend on the other examples of the
    batch (a batch statistic computed by hand, a softmax or a roll across the batch, a Python branch on the whole
    batch that another example can flip): then no example has a gradient of its own, and per-example gradients,
    norms or a clipped sum would be silently wrong (vmap and the loop see each example alone, where a batch
    mean is the example itself). How: the model runs on two of the batch's examples together and on each alone
    (the first, and the first whose inputs differ from it: two equal examples agree even through a batch mean;
    a batch of copies of one example is not checked, nor remembered), with gradients on as on every path the
    recipes take (a model may branch on the grad mode, and a reentrant checkpoint warns under no_grad that its
    gradients will be None) and autocast off (its rounding differs between batch sizes: a bfloat16 Llama's
    outputs 3e-3 apart), and every output tensor with the two examples along dimension 0 must agree to a
    relative 1e-5 of its largest entry, or 16 roundings of a dtype coarser than float32 (rounding between batch
    sizes stays far below, but for an output that is a difference of larger numbers: where they differ by no more
    than _SIZES_ROUNDING, each example beside a copy of itself, a pass of the pair's size, must give the pair's
    row, or the model mixes them). A model that fails on the two together but runs on each alone depends on the batch's
    size (a tensor with a row per example passed as unbatched, which the fast path's trace would take for a
    constant with a row per example, where vmap and the loop give every example all of it): the reason is
    returned (else None), for the fast path to step aside; one that reads the size but agrees at two examples
    (`max(x.shape[0], 2)`) is caught by the fast path's own comparison of its end rows (_trace._end_rows_alone).
    Cost: three forward passes of one or two examples, on every path (the fast path's trace sees each operation,
    but not a Python number read from a tensor: the batch's size in `h / x.shape[0]`,
    or `.tolist()`). Not run for a batch of one; nor for a model with a random module in training mode, or whose
    forward pass draws random numbers at all (F.dropout, noise by hand, from a default generator or one the model
    holds, _held_generators, or any other it passes to a torch function, _GeneratorWatch: held deeper, global: a
    pass that moved one, or drew from another, runs once more, from where it left them, and a model whose outputs
    then differ draws; one that re-seeds a generator and agrees does not), whose draws differ between the passes
    (the passes leave every generator they drew from as they found it); nor where a pass of one example raises
    (the recipe then meets the error itself, on its own path). A model that mixes examples only beyond the two
    compared, or only through randomness, is not detected; nor is a model that draws random numbers and also
    reads the batch's size (the check is left undone for it, and the trace cannot see the size). Whether the first
    pass drew is remembered too (_remembered_draws). A check passed or left undone is remembered for the model and
    the call's signature (_call_signature: shapes, dtypes, devices, non-tensor arguments, train/eval modes, grad
    mode), so a training loop pays it once, not every step (a quarter of a small transformer's per-sample
    gradients otherwise); a model that mixes examples only for some values of its inputs or parameters, or only in
    calls after the first, is not detected either."""
    if len(batch) < 2:
        return None
    signature = _call_signature(model, batch)
    passed = _per_model(_APART, model, set)
    if signature is not None and signature in passed or _random_modules(model):
        return None
    other = _first_other_example(batch)
    if other is None:  # every example is the first one again: nothing to tell apart, and nothing remembered
        return None
    pair = slice(0, other + 1, other)  # examples 0 and `other`
    try:
        # the caller's generators are left as they were (_generators_kept); a pass that drew random numbers (dropout by
        # F.dropout or a float rate, noise by hand, from one of them) cannot be compared with another, so the check
        # is left undone, and remembered
        with torch.enable_grad(), contextlib.ExitStack() as context, _generators_kept(model, batch) as moved:
            for device in {t.device.type for t in batch.tensors()} | {"cpu"}:
                if torch.is_autocast_enabled(device):
                    context.enter_context(torch.autocast(device, enabled=False))
            try:
                together = _detached(batch.rows(pair).call(model))
            except Exception:  # noqa: BLE001 (any error, no message read): does the model run on each alone?
                for n in (0, other):
                    batch.rows(slice(n, n + 1)).call(model)  # if one raises too, the recipe's own path meets it
                raise _BatchSizeRead() from None
            # a moved generator, or one drawn from that the states do not cover, means random draws, or a pass that
            # re-seeds a generator and is deterministic: a second pass, from where the first left the generators,
            # gives other outputs only in the first case
            drew = moved() and not _outputs_agree(together, _detached(batch.rows(pair).call(model)))
            if signature is not None:
                _per_model(_DRAWS, model, dict)[signature] = drew
            if drew:
                if signature is not None:
                    passed.add(signature)
                return None
            alone = [_detached(batch.rows(slice(n, n + 1)).call(model)) for n in (0, other)]
            gap = _largest_gap(together, alone[0], alone[1])
            if gap is not None and gap[0] <= _SIZES_ROUNDING:  # each example beside a copy of itself: the pair's size
                try:
                    copies = [_detached(batch.rows([n, n]).call(model)) for n in (0, other)]
                except Exception:  # noqa: BLE001 (no message read): the gap stands
                    copies = None
                row = lambda outputs, i: [o[i:i + 1] if isinstance(o, torch.Tensor) and o.dim() else o for o in outputs]  # noqa: E731
                if copies is not None and _largest_gap(together, row(copies[0], 0), row(copies[1], 1)) is None:
                    gap = None  # the pair's rows are each example's own: only the two sizes' rounding differs
    except _BatchSizeRead:
        return (f"the model runs on one example at a time and on all {len(batch)} together but not on two of them "
                "together: its batched forward pass depends on the batch's size (a tensor with a row per example passed "
                "as unbatched, which every example receives whole off the fast path, say), which the trace cannot see")
    except Exception:  # any error: the recipe's own path meets it and reports it (no message is read here)
        return None
    if gap is not None:
        pair_named = "first two examples" if other == 1 else f"examples 0 and {other}"
        raise ValueError("the model's output for one example depends on the other examples of the batch (its "
                         f"{pair_named} give outputs {gap[1]:.1e} apart, relative to the largest, together and alone): "
                         "a batch statistic or an operation across the batch mixes them, or a number read from the "
                         "whole batch (its size, x.shape[0], or values by .tolist()), so no example has a gradient "
                         "of its own; compute it per example (BatchNorm: model.eval(), or GroupNorm/LayerNorm)")
    if signature is not None:
        passed.add(signature)
    return None


# The largest difference, relative to the largest output, that _check_examples_apart takes for rounding between a batch
# of two and one example, once each example beside a copy of itself gives the pair's row exactly as in the pair: an
# output that is a difference of larger numbers (f(x1) - f(x2) for inputs 1e-2 apart: 1.2e-5 in float32) shows the two
# sizes' rounding on the scale of those numbers. A model that reads the batch's size differs by far more (h /
# x.shape[0]: 0.5); one that differs by less is left to the fast path's comparison of its end rows
# (_trace._end_rows_alone), as one that agrees at two examples is.
_SIZES_ROUNDING = 1e-3


def _largest_gap(together: list, first: list, second: list) -> tuple[float, float] | None:
    """Where a pass of two examples' outputs (together, flattened) differ from the rows given for each (first and
    second: the same outputs' rows for that example, (1, ...) each) by more than _tolerance relative to the largest
    entry: (the largest such difference relative to the largest entry, the same for the output it was first seen in);
    None where they agree. Outputs that are not floating tensors with the two examples along dimension 0 are skipped."""
    found = None
    for k, joint in enumerate(together):
        if not (isinstance(joint, torch.Tensor) and joint.is_floating_point() and joint.dim() >= 1 and joint.shape[0] == 2):
            continue
        parts = [rows[k] for rows in (first, second) if k < len(rows) and isinstance(rows[k], torch.Tensor)
                 and rows[k].shape == (1, *joint.shape[1:])]
        if len(parts) != 2:
            continue
        separate = torch.cat(parts)
        scale, tolerance = joint.abs().max().item(), _tolerance(joint)
        if not torch.allclose(joint, separate, rtol=tolerance, atol=tolerance * scale):
            gap = (joint - separate).abs().max().item() / max(scale, torch.finfo(joint.dtype).tiny)
            found = (max(gap, found[0]), found[1]) if found is not None else (gap, gap)
    return found


def _memory_span(t: torch.Tensor) -> tuple[Any, int, int]:
    """(device, first byte, one past the last byte) of the memory a strided tensor's elements lie in."""
    start = t.data_ptr()
    extent = sum((n - 1) * abs(step) for n, step in zip(t.shape, t.stride()) if n > 0) + 1 if t.numel() else 0
    return t.device, start, start + extent * t.element_size()


def _overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two of t's elements may share memory (an expanded tensor, a stride of 0, as_strided views): False when
    each dimension, by increasing stride, steps past all the smaller ones, the layout of any view that is not such."""
    dims = sorted((abs(step), n) for n, step in zip(t.shape, t.stride()) if n > 1)
    reach = 1
    for step, n in dims:
        if step < reach:
            return True
        reach = step * n
    return False


def _check_out_memory(out: dict[str, torch.Tensor], others: dict[str, torch.Tensor]) -> None:
    """Refuses (ValueError) out= tensors that share memory, with themselves, with one another, or with the tensors in
    others (the parameters, the inputs), each named by its key: the loop writes one example's row at a time, so an
    expanded out came back with the last example in every row. Conservative: two views whose elements interleave
    count as sharing."""
    for name, t in out.items():
        if t.numel() and _overlaps_itself(t):
            raise ValueError(f"{name} has elements that share memory (an expanded tensor, say): each example's result "
                             "needs a place of its own")
    spans = [(name, _memory_span(t)) for name, t in out.items() if t.numel()]
    spans += [(name, _memory_span(t)) for name, t in others.items() if t.numel() and t.layout == torch.strided]
    for i, (name, (device, start, end)) in enumerate(spans[: len(out)]):
        for other, (other_device, other_start, other_end) in spans[i + 1:]:
            if device == other_device and start < other_end and other_start < end:
                raise ValueError(f"{name} shares memory with {other}: out= needs memory of its own")


class _BatchSizeRead(Exception):
    """Raised inside _check_examples_apart: two examples together fail where each alone runs."""


def _first_other_example(batch: _Batch) -> int | None:
    """The index of the first example whose model inputs are not example 0's (None: every one is), so that the check
    compares two different examples: two equal ones agree together and alone even through a batch mean."""
    differs = None
    for t in batch.tensors():
        rows = (t[1:] != t[:1]).reshape(len(t) - 1, -1).any(1) if t.numel() else torch.zeros(len(t) - 1, dtype=torch.bool, device=t.device)
        differs = rows if differs is None else differs | rows.to(differs.device)
    if differs is None:
        return 1
    found = differs.nonzero()
    return int(found[0, 0]) + 1 if len(found) else None


def _detached(output: Any) -> list:
    """The leaves of a model's output (a tensor, or a pytree of them), tensors detached: a check's pass keeps no graph."""
    return [t.detach() if isinstance(t, torch.Tensor) else t for t in tree_flatten(output)[0]]


def _tolerance(output: torch.Tensor) -> float:
    """The check's relative tolerance for an output: 1e-5, or 16 roundings of a dtype coarser than float32."""
    return max(1e-5, 16 * torch.finfo(output.dtype).eps)


def _outputs_agree(first: list, second: list, tolerance: float = 0.0) -> bool:
    """Whether two passes' flattened outputs agree: floating tensors to _tolerance (or the tolerance given, where
    larger), relative to the largest entry, other tensors exactly (what is not a tensor is not compared)."""
    if len(first) != len(second):
        return False
    for a, b in zip(first, second):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.shape != b.shape or a.dtype != b.dtype:
                return False
            if not a.is_floating_point():
                if not torch.equal(a, b):
                    return False
                continue
            within = max(tolerance, _tolerance(a))
            scale = a.abs().max().item() if a.numel() else 0.0
            if not torch.allclose(a, b, rtol=within, atol=within * scale, equal_nan=True):
                return False
    return True


# torch.autograd.Function.apply's code: on the Python stack while a custom Function's forward runs (None where torch
# no longer defines it in Python: then every parameter use counts as inside one, the safe side)
_FUNCTION_APPLY = getattr(getattr(torch.autograd.Function.apply, "__func__", None), "__code__", None)


def _in_custom_function() -> bool:
    """Whether the caller runs inside a torch.autograd.Function's forward (a reentrant checkpoint's among them)."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code is _FUNCTION_APPLY:
            return True
        frame = frame.f_back
    return _FUNCTION_APPLY is None


class _FunctionUses(TorchFunctionMode):
    """Notes the parameters (by id) that a torch function receives inside a custom Function's forward (with gradients
    off, or on a graph of its own under enable_grad), where autograd then differentiates the Function's own
    backward (or, for a reentrant checkpoint, a recomputation), not what ran; anywhere=True: wherever they are.

    Also notes, in `premade`, the parameters that a tensor made before the pass reaches through its autograd graph:
    a view of a weight kept as an attribute (`self.w_t = self.fc.weight.t()` in __init__) or closed over, an input
    or target computed from the model with its graph attached. The transforms differentiate copies of the
    parameters swapped into the model, and the fast path each layer's own use of them: neither follows such a
    tensor, so its share of the gradient would be left out. A tensor counts as made before the pass unless a torch
    function returned it during the pass or it is in `given` (ids: the output handed to a loss); each is looked at
    once. One made under no_grad, or detached, has no graph: a constant, for autograd as for the recipes."""

    def __init__(self, params: Mapping[int, Any], anywhere: bool = False, given: Iterable[int] = ()) -> None:
        super().__init__()
        self.params, self.found, self.anywhere = params, set[Any](), anywhere
        self.made, self.premade = set(given), set[Any]()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = [leaf for value in (*args, *kwargs.values()) for leaf in (value if isinstance(value, (list, tuple)) else (value,))]
        names = [self.params[id(leaf)] for leaf in leaves if id(leaf) in self.params]
        if names and (self.anywhere or _in_custom_function()):  # the stack is walked only for a parameter's use
            self.found.update(names)
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and id(leaf) not in self.made and leaf.grad_fn is not None:
                self.made.add(id(leaf))  # looked at once
                self.premade.update(_graph_reaches([leaf], self.params))
        result = func(*args, **kwargs)
        self.made.update(id(t) for t in (result if isinstance(result, (list, tuple)) else (result,)) if isinstance(t, torch.Tensor))
        return result


def _graph_reaches(tensors: Iterable[Any], params: Mapping[int, Any]) -> set[Any]:
    """The values of params ({id(parameter): value}) whose parameters the autograd graphs of tensors reach (an
    AccumulateGrad node's variable is the leaf it accumulates into)."""
    return {params[id(variable)] for node in _graph_nodes(t.grad_fn for t in tensors if isinstance(t, torch.Tensor))
            if id(variable := getattr(node, "variable", None)) in params}


def _batch_made_with(batch: "_Batch", model: nn.Module | Mapping[str, Any]) -> ValueError | None:
    """The refusal of a batch whose inputs or targets were computed from the model's trainable parameters (or those
    of a dict {name: parameter}) with their autograd graph (_FunctionUses.premade), or None. Looked at on every
    call: the batch's tensors, not its signature, tell."""
    leaves = [leaf for leaf in batch._leaves()[0] if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None]
    if not leaves:
        return None
    named = model.named_parameters() if isinstance(model, nn.Module) else model.items()
    ids = {id(p): name for name, p in named if p.requires_grad}
    reached = _graph_reaches(leaves, ids)
    return _made_before([name for name in ids.values() if name in reached], "the batch") if reached else None


def _made_before(names: list[str], where: str) -> ValueError:
    """The refusal of a tensor computed from trainable parameters before the call, with its autograd graph
    (_FunctionUses.premade): where: "the forward pass", "loss_fn" or "the batch" (inputs or targets)."""
    them = "them" if len(names) > 1 else "it"
    listed = f"parameter {', '.join(names[:3])}{' and more' if len(names) > 3 else ''}"
    if where == "the batch":
        return ValueError(f"the inputs or targets were computed from {listed} with their autograd graph: the recipes "
                          f"differentiate the parameters where the forward pass uses {them}, and would leave the share "
                          f"of the gradient that flows through the inputs or targets out; detach them, or compute them "
                          f"inside forward")
    return ValueError(f"{where} uses a tensor computed from {listed} before the call, with its autograd graph (a view "
                      f"kept as an attribute, such as self.w_t = self.fc.weight.t() in __init__, or closed over): the "
                      f"recipes differentiate the parameters where the forward pass uses {them}, and would leave that "
                      f"tensor's share of the gradient out; compute it inside forward, or detach it if no gradient "
                      f"should flow through it")


# The model a per-example or curvature recipe runs on and its trainable parameters, (model, {id: id}), while it
# runs (_model_kept sets it): _Batch.loss refuses a loss_fn that reads one of them.
_LOSS_READS: contextvars.ContextVar[tuple[Any, Mapping[int, Any]] | None] = contextvars.ContextVar("loss_reads", default=None)

# The buffers of the model a recipe runs on, while it runs (_model_kept sets it): [buffer, its version, its copy from
# the start of the call], for _as_found.
_FOUND_BUFFERS: contextvars.ContextVar[list[list[Any]] | None] = contextvars.ContextVar("found_buffers", default=None)


def _as_found() -> None:
    """Before each pass a recipe runs the model through: the buffers a forward pass wrote in place since (its version
    moved) hold again what they held when the call began, so that every pass (the trace, each check, each example of
    the loop, each product of a curvature recipe) runs the model as it was given, not as the passes before left it:
    spectral_norm's power iteration in training mode writes its vectors on every pass, and each pass would see
    another weight (8e-4 off on the loop). A version comparison per buffer where nothing was written. Called outside
    torch.func's transforms (a grad transform refuses a write into a tensor it captured): before a vmap path's
    transform, not inside it, so the chunks of one vmap call (its chunk_size) follow each other's writes."""
    tracked = _FOUND_BUFFERS.get()
    for entry in tracked or ():
        b, version, copy = entry
        if b._version != version:
            with torch.no_grad():
                if b.shape == copy.shape and b.dtype == copy.dtype and b.device == copy.device:
                    b.copy_(copy)
            entry[1] = b._version


def _loss_reads_parameters(names: list[str]) -> ValueError:
    return ValueError(f"loss_fn reads parameter {', '.join(names[:3])}{' and more' if len(names) > 3 else ''} of the "
                      "model (a penalty such as weight decay inside the loss, say): the recipes differentiate the "
                      "parameters through the model's forward pass only, so such a term would count on some paths "
                      "and not others; add it to the model's forward pass, or add its gradient or curvature yourself")


_REACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _graph_nodes(starts: Iterable[Any]) -> Iterator[Any]:
    """Each autograd node reachable from the nodes starts (None entries skipped), starts included, once each, depth
    first. Lazy, so a caller looking for one node stops where it finds it. The one walk of an autograd graph in
    the package: the parameter check below, the norms' lowest layers (per_sample._lowest_layers) and the custom
    nodes of a differentiable backward pass (curvature._differentiable_backward)."""
    stack, seen = [node for node in starts if node is not None], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        yield node
        stack.extend(child for child, _ in node.next_functions if child is not None)


def _hooked_parameters(model: nn.Module | dict[str, nn.Parameter]) -> list[str]:
    """The trainable parameters (of a model, or of a dict {name: parameter}) with a gradient hook of their own
    (Tensor.register_hook): autograd runs it on every gradient taken of the parameter, the loop's per example
    included, but the fast path computes each example's gradient from the layer's input and output gradient, and
    vmap from a copy of the parameter that carries no hook: both would leave it out."""
    named = model.items() if isinstance(model, dict) else model.named_parameters()
    return [name for name, p in named if p.requires_grad and p._backward_hooks]


def _module_backward_hook(model: nn.Module) -> str | None:
    """Where a module backward hook (register_full_backward_hook or its pre-hook, on a module of the model or global)
    would change the gradients autograd gives, as words ("module encoder.0 has a backward hook"); None if none is registered."""
    for name, module in model.named_modules():
        if module._backward_hooks or module._backward_pre_hooks:
            return f"module {name} has a backward hook" if name else "the model has a backward hook"
    if nn.modules.module._global_backward_hooks or nn.modules.module._global_backward_pre_hooks:
        return "a global module backward hook is registered"
    return None


def _check_parameters_reached(model: nn.Module, batch: _Batch, remember: bool = True) -> None:
    """Refuses (ValueError) a model whose forward pass uses a trainable parameter inside a custom autograd.Function's
    forward (with gradients off, or under enable_grad on a graph of the forward's own) where autograd does not
    reach it from the output: torch.utils.checkpoint with use_reentrant=True (it runs the block under no_grad and
    recomputes it in its backward pass, which torch.autograd.grad never calls for the block's parameters), or a
    Function whose forward reads a parameter it is not given as an input. The loop and vmap would give that
    parameter no gradient, silently. A parameter read under a plain no_grad is not refused: autograd's zero is then
    what the model means and what .backward() gives too (transformers' LayoutLMv3 reads its relative position
    biases so). How: the batch's first example runs once with gradients on, a function mode noting the parameters
    passed to torch functions inside a Function's forward (its apply on the Python stack), and the output's
    autograd graph is walked (_graph_nodes) for the parameters it reaches. Generators are left as they were found
    (as in _check_examples_apart). Run on every path off the fast path, remembered per model and call signature;
    where the pass raises, the recipe's own path meets the error. remember=False (before the loop, where one more
    forward pass of one example costs little): run even where it passed before, so a model changed since
    (checkpointing turned on) is seen. The same pass refuses a tensor computed from a trainable parameter before
    the call with its autograd graph (_FunctionUses.premade: a view of a weight kept as an attribute), and every
    call refuses a batch computed so (_batch_made_with): their share of the gradient only the loop would count."""
    if not isinstance(model, nn.Module) or len(batch) == 0:
        return
    refusal = _batch_made_with(batch, model)
    if refusal is not None:
        raise refusal
    signature = _call_signature(model, batch) if remember else None
    passed = _per_model(_REACHED, model, set)
    if signature is not None and signature in passed:
        return
    trainable = {id(p): name for name, p in model.named_parameters() if p.requires_grad}
    uses = _FunctionUses(trainable)
    try:
        with torch.enable_grad(), _generators_kept(model, batch), uses:
            output = tree_flatten(batch.rows(slice(0, 1)).call(model))[0]
    except Exception:  # noqa: BLE001 (any error: the recipe's own path meets it)
        return
    reached = {trainable[id(t)] for t in output if isinstance(t, torch.Tensor) and id(t) in trainable} | _graph_reaches(output, trainable)
    if uses.premade:
        raise _made_before([name for name in trainable.values() if name in uses.premade], "the forward pass")
    unreached = [name for name in trainable.values() if name in uses.found and name not in reached]
    if unreached:
        them = "them" if len(unreached) > 1 else "it"
        names = ", ".join(unreached[:3]) + (f" and {len(unreached) - 3} more parameters" if len(unreached) > 3 else "")
        raise ValueError(f"{names}: read inside a custom autograd.Function's forward, where autograd does not reach "
                         f"{them} (torch.utils.checkpoint with use_reentrant=True, or a Function reading a parameter it "
                         f"is not given, say), so no path can give {them} a gradient: use checkpoint(..., "
                         "use_reentrant=False), pass the parameter to the Function as an input, or freeze it")
    if signature is not None:
        passed.add(signature)


def _seen_deterministic(model: nn.Module, batch: _Batch) -> bool:
    """Whether _check_examples_apart ran the model twice on this call's signature and found it deterministic though a
    generator moved or was drawn from (a pass that re-seeds one, or makes and seeds its own)."""
    signature = _call_signature(model, batch)
    return signature is not None and _per_model(_DRAWS, model, dict).get(signature) is False


def _remembered_draws(model: nn.Module, batch: _Batch) -> bool:
    """Whether the model's forward pass draws random numbers, as far as known without running it: a random module
    in training mode, or a draw _check_examples_apart saw and remembered for the call's signature."""
    if _random_modules(model):
        return True
    signature = _call_signature(model, batch)
    return signature is not None and _per_model(_DRAWS, model, dict).get(signature, False)


@contextlib.contextmanager
def _model_kept(model: Any) -> Any:
    """Around all a recipe runs on the model: puts back, on the way out and whatever happens, what the model's own
    code may change along the way, so that a recipe leaves the model as it found it whether it answers, refuses or
    fails (tests/test_model_untouched.py):

    - each parameter's .grad, set aside meanwhile (None). The recipes take gradients by torch.autograd.grad, which
      writes none, so a backward pass that wrote one anyway is refused (ValueError naming the parameters): a custom
      autograd.Function whose backward calls backward() itself for parameters it returns no gradient for (a
      hand-written reentrant checkpoint given them as inputs, say), for which every path would give autograd's
      zero, silently; or a hook that writes .grad.
    - each buffer, copied on the way in (a model's buffers are small: running statistics, position ids; 4 kB on
      the ResNet of scripts/gpu_table.py, none on its GPT-2): one a forward pass or hook changed in place (a
      running statistic kept by hand, spectral_norm's power iteration in training mode), through .data (which
      moves no version: the values are compared; a dtype it gave is put back too), or replaced is put back.
    - each module's class (register_parametrization swaps it for a subclass), and each buffer's requires_grad.
    - each module's own attributes (its __dict__, shallow): one rebound during the call (a call counter,
      `self.calls += 1`; the training flag; spectral_norm's weight, recomputed by every forward pass) is set back
      to the object it held, and one added is removed; and the contents of the dicts and sets nn.Module keeps its
      parameters, buffers, submodules and hooks in, so that one registered, replaced or removed during the call (a
      head built on the first call, a hook registered by every forward pass, a buffer filled in where it was None)
      is as it was. Each parameter's gradient hooks (Tensor.register_hook, register_post_accumulate_grad_hook)
      likewise, and its requires_grad: one switched during the call is put back and the call refused (ValueError
      naming it). A lazy module's parameter not yet initialised is refused before anything runs (ValueError
      naming it): its first forward pass would change the model's make-up on every pass.
    - while the call runs, each pass through the model (the trace, each check, each example of the loop, each
      product of a curvature recipe, and each vmap path before its transform) starts from the buffers as found
      (_as_found): a forward pass that writes a buffer it reads (spectral_norm's power iteration in training mode)
      runs as given on every pass, as on a fresh copy of the model.

    - the parameters, which are not copied (P numbers): a model whose forward pass writes into one is refused
      before anything runs where that is known (nn.Embedding or nn.EmbeddingBag with max_norm, which renormalises
      the rows it looks up in place), and a parameter written in place anyway (its version moved) is reported
      after the call (ValueError naming it; its values are not put back).

    Meanwhile, _Batch.loss refuses a loss_fn that reads one of the model's trainable parameters (_LOSS_READS).
    Not put back: a parameter changed through .data (its P numbers are not copied), and what an attribute's object
    holds when changed in place (a list appended to). An error raised inside is raised as it is, after all is put
    back."""
    params: dict[int, nn.Parameter] = {}  # one walk of the modules (named_parameters and named_buffers cost 4x more)
    buffers: list[tuple[nn.Module, str, torch.Tensor]] = []
    found: list[tuple[nn.Module, dict[str, Any], tuple[Any, ...], list[Any]]] = []  # each module's attributes, containers
    classes: list[tuple[nn.Module, type]] = []  # each module's class (register_parametrization swaps it)
    for module in model.modules() if isinstance(model, nn.Module) else ():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.max_norm is not None:
            name = next(n for n, m in model.named_modules() if m is module)
            raise ValueError(f"module {name or 'the model'} ({type(module).__name__} with max_norm={module.max_norm}) "
                             "renormalises the rows of its weight it looks up, in place, on every forward pass: a recipe "
                             "would change the model, and the loop's examples would each see another weight; renormalise "
                             "once beforehand (torch.embedding_renorm_) and set max_norm=None for the call")
        if any(isinstance(p, nn.parameter.UninitializedParameter) for p in module._parameters.values()):
            _refuse_lazy(next(n for n, m in model.named_modules() if m is module), module)
        params.update((id(p), p) for p in module._parameters.values() if p is not None)
        buffers.extend((module, name, b) for name, b in module._buffers.items()
                       if b is not None and not isinstance(b, nn.parameter.UninitializedBuffer))
        attributes = dict(vars(module))
        containers = [held for held in map(attributes.get, _MODULE_CONTAINERS) if held is not None]
        found.append((module, attributes, tuple([held for held in containers if not held]), [(held, held.copy()) for held in containers if held]))
        classes.append((module, module.__class__))
    versions = {key: p._version for key, p in params.items() if not p.is_inference()}
    flags = {key: p.requires_grad for key, p in params.items()}
    buffer_flags = [b.requires_grad for _, _, b in buffers]
    hooks = {key: dict(p._backward_hooks) for key, p in params.items() if p._backward_hooks}  # each one's gradient hooks
    after = {key: dict(p._post_accumulate_grad_hooks) for key, p in params.items() if p._post_accumulate_grad_hooks}
    with torch.inference_mode(False), torch.no_grad():  # an inference tensor has no version, and nothing writes it here
        copies = [(b._version, b.clone()) if not b.is_inference() else (None, None) for _, _, b in buffers]
    saved = [p.grad for p in params.values()]
    for p, grad in zip(params.values(), saved):
        if grad is not None:
            p.grad = None
    watched = (model, {key: key for key, p in params.items() if p.requires_grad}) if isinstance(model, nn.Module) else None
    token = _LOSS_READS.set(watched)
    found_token = _FOUND_BUFFERS.set([[b, version, copy] for (_, _, b), (version, copy) in zip(buffers, copies) if copy is not None])
    try:
        yield
    finally:
        _FOUND_BUFFERS.reset(found_token)
        _LOSS_READS.reset(token)
        written = [p for p in params.values() if p.grad is not None]
        for p, grad in zip(params.values(), saved):
            if p.grad is not grad:
                p.grad = grad
        for module, attributes, empty, full in found:
            _put_back_attributes(module, attributes, empty, full)
        for module, cls in classes:
            if module.__class__ is not cls:  # a parametrization registered during the call
                module.__class__ = cls
        for (_, _, b), flag in zip(buffers, buffer_flags):
            if b.requires_grad != flag and b.is_leaf:
                b.requires_grad_(flag)
        switched = [p for key, p in params.items() if p.requires_grad != flags[key]]  # by the model's own code
        for p in switched:
            p.requires_grad_(not p.requires_grad)
        for key, p in params.items():  # a gradient hook, or one run after .grad is written, registered or removed
            for held, kept in ((p._backward_hooks, hooks), (p._post_accumulate_grad_hooks, after)):
                if held is not None and held.keys() != kept.get(key, {}).keys():
                    held.clear()
                    held.update(kept.get(key, {}))
        with torch.inference_mode(False), torch.no_grad():
            changed = [(b, copy) for (module, name, b), (version, copy) in zip(buffers, copies)
                       if copy is not None and (b._version != version or not _same_values(b, copy))]
            for b, copy in changed:
                if b.dtype != copy.dtype or b.device != copy.device:  # its .data replaced by another dtype's
                    b.data = copy
                else:  # resized in place: put back too
                    (b.resize_(copy.shape) if b.shape != copy.shape else b).copy_(copy)
        if switched:  # raised whether the call answered or failed (autograd's error is then its __context__)
            ids = {id(p) for p in switched}
            switched_names = [name for name, p in model.named_parameters() if id(p) in ids]
            raise ValueError(f"parameter {', '.join(switched_names[:3])}{' and more' if len(switched_names) > 3 else ''} had requires_grad "
                             "switched during the call by the model's own code (a forward pass or a hook): the recipes "
                             "differentiate the parameters that require grad when the call starts, so each pass would "
                             "differentiate another set; it is put back; freeze or unfreeze parameters before the call")
    moved = {key for key, version in versions.items() if params[key]._version != version}
    if moved:
        moved_names = [name for name, p in model.named_parameters() if id(p) in moved]
        raise ValueError(f"parameter {', '.join(moved_names[:3])}{' and more' if len(moved_names) > 3 else ''} was written in place "
                         "during the call, by the model's own code (a forward pass or a hook), and keeps what was "
                         "written: the recipes never change a parameter, and no path's answer would be the model's")
    if written:
        written_ids = {id(p) for p in written}
        written_names = [name for name, p in model.named_parameters() if id(p) in written_ids]
        names = ", ".join(written_names[:3]) + (f" and {len(written_names) - 3} more parameters" if len(written_names) > 3 else "")
        raise ValueError(f"{names}: the backward pass wrote into their .grad, which torch.autograd.grad (every recipe's "
                         "backward pass) never does: a custom autograd.Function's backward calls backward() itself for "
                         "parameters it returns no gradient for (a hand-written reentrant checkpoint, say), so every "
                         "path would give them none, or a hook writes .grad; use torch.utils.checkpoint(..., "
                         "use_reentrant=False), or return their gradients from the Function's backward (the model's "
                         ".grad is left as it was)")


def _put_back_attributes(module: nn.Module, attributes: dict[str, Any], empty: tuple[Any, ...], full: list[tuple[Any, Any]]) -> None:
    """module's own attributes as they were (attributes: a shallow copy of its __dict__), and the contents of the
    dicts and sets nn.Module keeps its parameters, buffers, submodules and hooks in: empty, those that were empty
    (most hook dicts: one test for all at C speed), full, (each other one, a copy of its contents). For _model_kept."""
    now = vars(module)
    # the usual case first, at C speed: the same names in the same order, each holding the same object
    if not (len(now) == len(attributes) and all(map(operator.is_, now.values(), attributes.values()))
            and now.keys() == attributes.keys()):
        for name in [name for name in now if name not in attributes]:  # added during the call
            del now[name]
        for name, value in attributes.items():
            if name not in now or now[name] is not value:  # rebound, or deleted
                now[name] = value
    if any(empty):  # something registered in a container that was empty
        for held in empty:
            held.clear()
    for held, contents in full:  # a submodule, parameter, buffer or hook registered, replaced or removed
        if isinstance(held, dict):
            same = (len(held) == len(contents) and all(map(operator.is_, held.values(), contents.values()))
                    and held.keys() == contents.keys())
        else:
            same = held == contents
        if not same:
            held.clear()
            held.update(contents)


def _same_values(b: torch.Tensor, copy: torch.Tensor) -> bool:
    """Whether buffer b still holds its copy's values: same shape and dtype, equal entries, NaN where the copy has
    NaN (a write through .data moves no version counter). Called with autograd off, outside inference_mode."""
    if b.shape != copy.shape or b.dtype != copy.dtype or b.device != copy.device:
        return False
    if torch.equal(b, copy):
        return True
    if not (b.is_floating_point() or b.is_complex()):
        return False
    nan = copy.isnan()
    return torch.equal(b.isnan(), nan) and torch.equal(b.masked_fill(nan, 0), copy.masked_fill(nan, 0))


def _gradients_enabled(recipe: Callable[..., Any]) -> Callable[..., Any]:
    """Runs a recipe as it runs outside torch.no_grad() and torch.inference_mode(): gradients enabled, and
    tensor arguments made inside inference_mode copied to ordinary tensors, so results are ordinary tensors."""

    @functools.wraps(recipe)
    def run(*args, **kwargs):
        with torch.inference_mode(False), torch.enable_grad():
            leaves, spec = tree_flatten((args, kwargs))
            if any(isinstance(leaf, torch.Tensor) and leaf.is_inference() for leaf in leaves):
                args, kwargs = tree_unflatten([leaf.clone() if isinstance(leaf, torch.Tensor) and leaf.is_inference() else leaf
                                               for leaf in leaves], spec)
            with _model_kept(args[0] if args else kwargs.get("model")):
                return recipe(*args, **kwargs)

    return run


def _check_chunk_size(chunk_size: Any) -> None:
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be None or a positive int, got {chunk_size!r}")


def _dense_grads(grads: Sequence[torch.Tensor | None], params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """torch.autograd.grad's gradients as the recipes return them: zeros for a parameter the loss does not reach
    (None), and dense where autograd gave a sparse one (nn.Embedding(sparse=True)), as every other path does."""
    return [torch.zeros_like(p) if g is None else g.to_dense() if g.layout != torch.strided else g for p, g in zip(params, grads)]


def _scalar_loss(loss: Any) -> torch.Tensor:
    """The loss of one example (or of a whole batch, in the curvature recipes), checked to be one number."""
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"loss_fn must return a scalar (a 0-d tensor), but returned {shape}: reduce it, "
                         "e.g. with reduction='mean' or 'sum'")
    return loss
