"""The fast path's registry of layer kinds: what the trace knows about each kind of layer, one module each.

A _LayerRule covers the trainable weight and bias of one kind of layer (the module types in `modules`).
It tells the trace (_trace._BatchTrace) how to recognise the ATen operations that use those parameters
(`record`, for the operations in `ops`) and computes, from the layer's recorded input and its output
gradient, what the recipes need: each example's gradient (`per_example_grads`), each
example's rows of the output Jacobian (`jacobian_rows`) and each example's squared gradient
norm (`squared_norms`). A rule that lacks one of them is not used by that recipe.

The trace confirms every rule at run time: every operation that uses a parameter must be one that the rule
of a module registering it recognises (keyed by the module's type), or the fast path steps aside. A
parameter used by several such operations (a layer applied twice, a weight tied between an embedding and
an output layer) gets their shares added up for gradients, Jacobians and the clipped sum (_write_or_add); the
norms add the cross terms between the uses (_CrossTerms) where every rule involved gives its per-example
gradient as a sum of outer products (outer_factors: linear layers, GPT-2's Conv1D, embeddings) or whole (a
bias; RMSNorm's weight and a bare parameter, shares_whole), the same way for both uses, and refuse a second
use otherwise. Adding a layer kind means adding a module _layer_<kind>.py that defines a _LayerRule subclass, registers one
instance with _register, and is imported at the end of this file. Also copied, without this docstring, into the
notebook cells tagged `shared-package` by scripts/build_shared.py: edit it here.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.nn as nn

# What each recipe needs of a rule: the method it calls.
_NEEDS = {"grads": "per_example_grads", "jacobian": "jacobian_rows", "norms": "squared_norms"}


class _LayerRule:
    """One kind of layer on the fast path. Subclasses set kind, modules and ops, implement record, and
    implement whichever of per_example_grads, jacobian_rows and squared_norms they support."""

    kind: str = ""
    modules: tuple[type[nn.Module], ...] = ()  # the module types whose weight and bias this rule covers
    ops: frozenset = frozenset()  # the ATen operations record is called for

    def record(self, trace: Any, func: Any, args: tuple, kwargs: dict, result: Any, r: int | None,
               params: list[str], transposed: list[str]) -> Any:
        """Called by the trace for an operation in `ops`: append a layer to trace.layers (a dict with at least
        kind, weight, bias, a, z, r, versions) and return the output's rows per example; or call trace.fail;
        or return NotImplemented to leave the operation to the trace's general rules (no parameter of this
        rule involved)."""
        raise NotImplementedError

    def covers(self, module: nn.Module) -> bool:
        """Whether this rule covers the module's weight and bias: by default, a module of one of the types in
        `modules`. The trace confirms the operation either way."""
        return isinstance(module, self.modules)

    def covers_parameter(self, module: nn.Module, short: str) -> bool:
        """Whether this rule covers the module's parameter registered under the name `short`: by default its
        weight and bias, where the rule covers the module."""
        return short in ("weight", "bias") and self.covers(module)

    def supports(self, need: str) -> bool:
        return getattr(type(self), _NEEDS[need], None) is not getattr(_LayerRule, _NEEDS[need], None)

    def per_example_grads(self, layer: dict, delta: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
        """Write the layer's per-example weight and bias gradients into out[name] (B, *shape), from the
        gradient delta of the summed loss with respect to the layer's output."""
        raise NotImplementedError

    def jacobian_rows(self, layer: dict, delta: torch.Tensor, columns: dict[str, torch.Tensor]) -> None:
        """Write the layer's columns of the output Jacobian into columns[name] (B, Y, *shape); delta is
        (Y, B*r, ...), one output gradient per model output."""
        raise NotImplementedError

    def weighted_sum(self, layer: dict, g: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """{parameter name: its gradient} for the layer's own parameters, given the gradient g at its output
        (already weighted row by row, the book-kept DP step's clipped sum): the batch gradient's formula, so no
        autograd call is needed. The default, None: the caller asks autograd, and keeps the graph for it
        (has_weighted_sum); a rule that overrides it must always answer."""
        return None

    # Whether outer_factors gives the weight's per-example gradients whole ({"share": (B, ...)}, for a weight of a
    # few numbers per example: a scale per feature) rather than as factors (u, v)
    shares_whole = False

    def outer_factors(self, layer: dict, g: torch.Tensor | None, batch: int) -> dict | None:
        """Each example's weight gradient as a sum of outer products, sum_t u_t v_t^T (u along the weight's
        dimension 0, v along dimension 1), for the norms' cross terms between two uses of one parameter (a tied
        weight, a layer called twice): {"u": factor, "v": factor, "bias": (B, out) per-example bias gradients or
        None}, a factor being ("dense", (B, T, size)) or ("ids", (B, T) indices of one-hot rows). A rule with
        shares_whole gives {"share": (B, ...) per-example weight gradients, "bias": as above} instead. With g
        None, what depends on it is None (the rest is known before the backward pass). The default, None: no
        cross terms for this kind, and the trace refuses a second use of its parameters for the norms."""
        return None

    def has_outer_factors(self) -> bool:
        """Whether outer_factors is defined (a second use of the rule's parameters is then allowed for the norms)."""
        return type(self).outer_factors is not _LayerRule.outer_factors

    def has_weighted_sum(self) -> bool:
        """Whether weighted_sum has the rule's own formula (else the clipped sum asks autograd, through the graph)."""
        return type(self).weighted_sum is not _LayerRule.weighted_sum

    def squared_norms(self, layer: dict, g: torch.Tensor, batch: int) -> list[tuple[str, torch.Tensor, str]]:
        """[(parameter name, (batch,) squared norms of its per-example gradients, "ghost" or "direct")]."""
        raise NotImplementedError


_RULES: dict[str, _LayerRule] = {}


def _register(rule: _LayerRule) -> None:
    """Add a rule to the registry; its kind must be new."""
    if not rule.kind or rule.kind in _RULES:
        raise ValueError(f"a layer rule needs a kind of its own, got {rule.kind!r}")
    _RULES[rule.kind] = rule


def _rule_named(kind: str) -> _LayerRule:
    """The registered rule of this kind (the "kind" of a layer the trace recorded)."""
    return _RULES[kind]


def _rules_for(need: str) -> tuple[_LayerRule, ...]:
    """The registered rules that implement what `need` ("grads", "jacobian" or "norms") asks of them."""
    if need not in _NEEDS:
        raise ValueError(f"need must be one of {sorted(_NEEDS)}, got {need!r}")
    return tuple(rule for rule in _RULES.values() if rule.supports(need))


def _write_or_add(write: Any, layer: dict, delta: torch.Tensor, dest: dict[str, torch.Tensor], done: set | None) -> None:
    """write(layer, delta, dest) (a rule's per_example_grads or jacobian_rows) puts the layer's shares into
    dest[name] for its weight and bias. done: the names earlier layers of the same pass wrote (None: no
    record); a parameter used again (twice, or tied between two modules) gets this layer's share added to what
    is there, through a buffer of its size, since gradients and Jacobians add over a parameter's uses."""
    names = [n for n in (layer.get("weight"), layer.get("bias")) if n is not None]
    again = [n for n in names if done is not None and n in done]
    if not again:
        write(layer, delta, dest)
    else:
        shares = {n: torch.empty_like(dest[n]) for n in again}
        write(layer, delta, {**dest, **shares})
        for n in again:
            dest[n].add_(shares[n])
    if done is not None:
        done.update(names)


def _in_dtype(layer: dict) -> dict:
    """The layer as its products are formed: where it ran in a lower precision than its parameters (autocast;
    layer["dtype"], set by the trace), a copy of its record with the recorded floating tensors (not its output)
    cast to the parameters' dtype, made when a consumer needs it and dropped after; else the layer itself."""
    dtype = layer.get("dtype")
    if dtype is None:
        return layer
    return {key: value.to(dtype) if key != "z" and isinstance(value, torch.Tensor) and value.is_floating_point() else value
            for key, value in layer.items()}


def _delta_in_dtype(layer: dict, delta: torch.Tensor) -> torch.Tensor:
    """The gradient with respect to a layer's output, in the dtype its products are formed in (_in_dtype)."""
    dtype = layer.get("dtype")
    return delta if dtype is None or delta.dtype == dtype else delta.to(dtype)


def _times(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """x * g, written into x (a tensor made for the product alone: a normalised or centred input) where that
    loses nothing: no second temporary as large as the layer's output."""
    return x.mul_(g) if x.dtype == torch.result_type(x, g) else x * g


# A sum of token pairs (a ghost norm, a cross term) carries rounding on the scale of its terms, not of its result. Its
# rounding is taken as u (sqrt(d_in) + sqrt(d_out) + log2(T1 T2) + 1) per unit of scale (u the unit roundoff, the
# roundings of independent sign, as in Higham and Mary's probabilistic error analysis, SIAM J. Sci. Comput. 2019:
# measured on the six families of scripts/gpu_table.py, float32 and bfloat16 autocast, the error was at most 0.55 of
# it). Above _GHOST_MARGIN times its rounding, an error of twice that moves the result's square root by at most 1e-4
# of itself; below, the result is taken as mostly rounding (its square root is 0 where it came out negative, which a
# clip factor would take as no gradient at all, so the example would enter a DP step unclipped).
_GHOST_MARGIN = 1e4


def _pair_rounding(dtype: torch.dtype, widths: tuple[int, ...], rows: int) -> float:
    """The rounding of a sum over `rows` pairs of inner products of vectors of the given widths, per unit of scale."""
    return torch.finfo(dtype).eps / 2 * (sum(math.sqrt(w) for w in widths) + math.log2(max(rows, 1)) + 1)


def _ghost_squares(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """(N,) squared norms ||g_n^T a_n||^2 for a (N, T, d_in) and g (N, T, d_out), from pairs of rows (the ghost
    norm): sum over s, t of (a_s . a_t)(g_s . g_t), N T^2 (d_in + d_out) products in place of N T d_in d_out. In
    float32 at least (its callers turn autocast off). Where the rows' gradients cancel, the pairs' sum is mostly
    rounding (_GHOST_MARGIN; its scale, sum_t |a_t|^2 |g_t|^2, is the pairs' diagonal): those entries are the product
    g_n^T a_n itself, found for them alone after one look at which they are (a synchronisation on a GPU), a few at a
    time, so that their products together hold no more numbers than g."""
    work = torch.promote_types(torch.promote_types(a.dtype, g.dtype), torch.float32)
    a, g = a.to(work), g.to(work)
    pairs = (a @ a.transpose(1, 2)).mul_(g @ g.transpose(1, 2))
    found = pairs.sum((1, 2))
    rounding = _pair_rounding(work, (a.shape[2], g.shape[2]), a.shape[1] ** 2)
    unsure = (found < pairs.diagonal(dim1=1, dim2=2).sum(1).mul_(_GHOST_MARGIN * rounding)).nonzero()[:, 0]
    step = max(1, g.numel() // (a.shape[2] * g.shape[2]))
    for part in unsure.split(step):
        found[part] = (g[part].transpose(1, 2) @ a[part]).square().sum((1, 2))
    return found


def _float32_at_least(factors: dict) -> dict:
    """outer_factors' answer with its floating tensors in float32 at least (a bfloat16 model's cross terms would
    otherwise round to 4e-3 of their terms)."""
    def up(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(torch.promote_types(value.dtype, torch.float32))
        if isinstance(value, tuple):
            return tuple(up(v) for v in value)
        return value
    return {key: up(value) for key, value in factors.items()}


def _autocast_off(device: str) -> Any:
    """A context with autocast off on this device (nothing to do, and nothing done, where it is off already)."""
    return torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device) else contextlib.nullcontext()


def _gram(x: tuple, y: tuple) -> torch.Tensor:
    """(B, T1, T2): the inner products of every row of factor x with every row of factor y, per example (factors as in
    _LayerRule.outer_factors; a one-hot row picks an entry of the other's row, two one-hot rows match or not)."""
    (x_form, x_value), (y_form, y_value) = x, y
    if x_form == "dense" and y_form == "dense":
        return x_value @ y_value.transpose(1, 2)
    if x_form == "ids" and y_form == "ids":
        return x_value[:, :, None] == y_value[:, None, :]
    if x_form == "ids":  # entry x[b, s] of each row t of y
        return y_value.gather(2, x_value[:, None, :].expand(-1, y_value.shape[1], -1)).transpose(1, 2)
    return _gram(y, x).transpose(1, 2)


class _CrossTerms:
    """The norms' cross terms between the uses of a parameter used by several traced layers: for weight W with
    per-example shares G_k and G_l from layers k and l, ||G_k + G_l||^2 = ||G_k||^2 + ||G_l||^2 + 2 <G_k, G_l>,
    the rules giving the squares and this class the inner products, ghost-style: with G = sum_t u_t v_t^T,
    <G_k, G_l> = sum over pairs of rows of (u_k . u_l)(v_k . v_l). Each layer's output gradient reaches
    `take` once (in any order). At the first of a pair, what can be computed is: the Gram of its factor with
    the other layer's factor that needs no output gradient (its one-hot ids, or its recorded input); that
    Gram and the first layer's other factor are kept, and the pair finishes when the second layer's output
    gradient arrives. A share given whole (a bias, or a rule with shares_whole: a scale per feature) is kept
    as it is, and the pair's inner product taken when the other arrives. `mixed` lists the pairs with one use
    of each form, which this class cannot combine (the caller takes another path). Where the uses cancel, the
    inner products are mostly rounding, as a ghost norm's are (_ghost_squares): each parameter's rounding is
    counted, and `unsure` names an example whose squared norm it could move by more than 1e-4 of itself (the
    caller takes another path). In float32 at least, with autocast off."""

    def __init__(self, layers: list[dict], batch: int):
        self.layers, self.batch = layers, batch
        self.kept: dict[tuple, Any] = {}  # pair -> what its first layer left for the second (_start)
        uses: dict[str, list[int]] = {}
        for k, layer in enumerate(layers):
            for part in ("weight", "bias"):
                if layer.get(part) is not None:
                    uses.setdefault(layer[part], []).append(k)
        self.pairs = [(name, k, later) for name, ks in uses.items() for i, k in enumerate(ks) for later in ks[i + 1:]]
        self.names = {name: ks for name, ks in uses.items() if len(ks) > 1}
        self.rounding: dict[str, Any] = {}  # name -> (B,) the rounding of its shares and their cross terms
        self.mixed = [pair for pair in self.pairs if self._whole(pair[1], pair[0]) != self._whole(pair[2], pair[0])]

    def _whole(self, k: int, name: str) -> bool:
        """Whether layer k gives its share of parameter `name` whole (a bias, or a shares_whole rule's weight)."""
        layer = self.layers[k]
        return layer.get("bias") == name or _rule_named(layer["kind"]).shares_whole

    def _share(self, k: int, name: str, mine: dict) -> torch.Tensor:
        """Layer k's per-example share of `name`, given whole, flattened to (B, n)."""
        share = mine["bias"] if self.layers[k].get("bias") == name else mine["share"]
        return share.reshape(self.batch, -1)

    def take(self, k: int, g: torch.Tensor) -> torch.Tensor | None:
        """Layer k's output gradient arrived: (B,) cross terms (already doubled) of the pairs it completes, or None.
        With autocast off, as the layers' own shares (per_sample._layer_squares)."""
        found, mine, scales = None, None, {}
        with _autocast_off(g.device.type):
            for pair in self.pairs:
                name, first, second = pair
                if k not in (first, second):
                    continue
                if mine is None:
                    mine = _rule_named(self.layers[k]["kind"]).outer_factors(_in_dtype(self.layers[k]), g.detach(), self.batch)
                    if mine is None:  # the trace lets a second use through only for rules with outer_factors
                        raise RuntimeError(f"the {self.layers[k]['kind']} rule gives no outer factors for a cross term")
                    mine = _float32_at_least(mine)
                if name not in scales:  # layer k's own share of `name` (added by the caller) is as accurate as this
                    scales[name], rounding = self._scale(k, name, mine)
                    self._add(name, rounding * scales[name])
                if pair not in self.kept:  # the first of the pair to arrive
                    self.kept[pair] = (*self._start(k, name, mine, second if k == first else first), scales[name])
                    continue
                *kept, scale = self.kept.pop(pair)
                cross, rounding = self._finish(k, name, kept, mine)
                self._add(name, 2 * rounding * (scale * scales[name]).sqrt())
                found = 2 * cross if found is None else found + 2 * cross
        return found

    def _add(self, name: str, rounding: torch.Tensor) -> None:
        """Count (B,) rounding in the squared norm of `name`, a parameter several layers use."""
        self.rounding[name] = rounding + self.rounding.get(name, 0)

    def unsure(self, squares: torch.Tensor, offset: int = 0) -> str | None:
        """Why the cross terms cannot be trusted, or None: a parameter whose uses' shares of some example's gradient
        nearly cancel, so that the example's squared norm (squares, over all parameters: what its clip factor
        reads) is mostly the cross terms' rounding (_GHOST_MARGIN). Shares that cancel exactly in an example whose
        other parameters have a gradient (a siamese model's last bias) leave that norm exact."""
        for name, error in self.rounding.items():
            unsure = (squares < _GHOST_MARGIN * error).nonzero()[:, 0]
            if len(unsure):
                return (f"the shares of the gradient of parameter {name} from its {len(self.names[name])} uses nearly "
                        f"cancel for example {offset + int(unsure[0])}, so their cross terms leave its norm to rounding")
        return None

    def _scale(self, k: int, name: str, mine: dict) -> tuple[torch.Tensor, float]:
        """Layer k's share of `name`, for the rounding of the sums it enters: ((B,) its scale, the rounding of its own
        share per unit of that scale). Given whole, |share|^2; else sum_t |u_t|^2 |v_t|^2, the scale of the pairs'
        sum (_ghost_squares), which bounds a share found as the product itself too."""
        if self._whole(k, name):
            share = self._share(k, name, mine)
            return share.square().sum(1), _pair_rounding(share.dtype, (), share.shape[1])
        dense = [value for form, value in (mine["u"], mine["v"]) if form == "dense"]
        norms = [torch.linalg.vector_norm(value, dim=2) for value in dense]
        scale = (norms[0] * norms[1] if len(norms) == 2 else norms[0]).square().sum(1)
        return scale, _pair_rounding(dense[0].dtype, tuple(value.shape[2] for value in dense), dense[0].shape[1] ** 2)

    def _start(self, k, name, mine, other):
        if self._whole(k, name):
            return (self._share(k, name, mine),)
        theirs: dict = _float32_at_least(_rule_named(self.layers[other]["kind"]).outer_factors(_in_dtype(self.layers[other]), None,
                                                                                                self.batch) or {})
        side = "u" if theirs["u"][1] is not None else "v"  # their factor known without their output gradient
        return side, _gram(mine[side], theirs[side]), mine["v" if side == "u" else "u"]

    def _finish(self, k, name, kept, mine):
        """(B,) the pair's inner products, and their rounding per unit of scale."""
        if self._whole(k, name):
            share = self._share(k, name, mine)
            return (kept[0] * share).sum(1), _pair_rounding(share.dtype, (), share.shape[1])
        side, gram, their_other = kept
        other_side = "v" if side == "u" else "u"
        pairs = gram * _gram(their_other, mine[other_side])
        widths = tuple(value.shape[2] for form, value in (their_other, mine[side]) if form == "dense")
        return pairs.sum((1, 2)), _pair_rounding(pairs.dtype, widths, pairs.shape[1] * pairs.shape[2])


def _rule_of(module: nn.Module, rules: tuple[_LayerRule, ...], short: str = "weight") -> _LayerRule | None:
    """The first rule among `rules` that covers the module's parameter `short` (its weight by default), if any."""
    return next((rule for rule in rules if rule.covers_parameter(module, short)), None)


# The layer kinds: each module registers its rule when imported (it uses the definitions above).
from . import (  # noqa: E402, F401
    _layer_batch_norm,
    _layer_conv,
    _layer_embedding,
    _layer_group_norm,
    _layer_hf_conv1d,
    _layer_linear,
    _layer_norm,
    _layer_parameter,
    _layer_rms_norm,
)
