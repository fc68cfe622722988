"""The fast path's registry of layer kinds: what the trace knows about each kind of layer, one module each.

A _LayerRule covers the trainable weight and bias of one kind of layer (the module types in `modules`).
It tells the trace (_trace._BatchTrace) how to recognise the ATen operations that use those parameters
(`record`, for the operations in `ops`) and computes, from the layer's recorded input and its output
gradient, what the recipes need: each example's gradient (`per_example_grads`), each
example's rows of the output Jacobian (`jacobian_rows`) and each example's squared gradient
norm (`squared_norms`). A rule that lacks one of them is not used by that recipe.

The trace confirms every rule at run time: a parameter may be used by one operation only, the one its
owning module's rule recognises (keyed by the module's type), or the fast path steps aside. Adding a
layer kind means adding a module _layer_<kind>.py that defines a _LayerRule subclass, registers one
instance with _register, and is imported at the end of this file. Also copied, without this docstring, into the
notebook cells tagged `shared-package` by scripts/build_shared.py: edit it here.
"""

from __future__ import annotations

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
