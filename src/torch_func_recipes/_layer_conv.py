"""The fast path's rule for nn.Conv1d and nn.Conv2d (not transposed): a linear map of patches.

Each output position of a convolution is a linear layer applied to the patch it sees, so the
per-example products are those of a linear layer with the positions as rows (im2col). A grouped
convolution (depthwise included) is one such linear layer per group: group k's output channels see
only group k's input channels, whose entries are one contiguous block of each patch. Each example's
weight gradient can also come without im2col: by the batch gradient's own kernel with the examples as
groups, or, for one input channel per group, by a forward convolution of the input with the output
gradient as the kernel; _weight_way picks the fastest way by device and size. A convolution whose
parameters are all frozen passes through with one row per example. Registered in _layers; also copied,
without this docstring, into the notebook cells tagged `shared-package` by scripts/build_shared.py: edit
it here.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.grad import conv1d_weight, conv2d_weight

from ._layers import _ghost_squares, _LayerRule, _register


def _im2col(layer, a, delta):
    """The patches each output position of a convolution saw, (B, C*kh*kw, L), and delta as (..., B, O, L)."""
    if a.dim() == 3:  # a 1-D convolution is a 2-D one of height 1
        a, delta = a[:, :, None, :], delta.unsqueeze(-2)
        kernel, stride, padding, dilation = [(1, *v) for v in (layer["weight_shape"][2:], layer["stride"], layer["padding"], layer["dilation"])]
        padding = (0, padding[1])
    else:
        kernel, stride, padding, dilation = layer["weight_shape"][2:], layer["stride"], layer["padding"], layer["dilation"]
    batch, rows, cols = a.shape[0], delta.shape[-2], delta.shape[-1]
    if any(padding):
        a = F.pad(a, (padding[1], padding[1], padding[0], padding[0]))
    sb, sc, sh, sw = a.stride()
    patches = a.as_strided((batch, a.shape[1], *kernel, rows, cols),
                           (sb, sc, sh * dilation[0], sw * dilation[1], sh * stride[0], sw * stride[1]))
    return patches.reshape(batch, -1, rows * cols), delta.flatten(-2)  # im2col: one copy


def _grouped(layer, a, delta):
    """_im2col's patches and delta split by group: (B, G, C/G*kh*kw, L) and (..., B, G, O/G, L)."""
    patches, delta = _im2col(layer, a, delta)
    groups = layer["groups"]
    return (patches.view(patches.shape[0], groups, -1, patches.shape[-1]),
            delta.view(*delta.shape[:-2], groups, -1, delta.shape[-1]))


# Each example's weight gradient by im2col (one copy of every patch, then one product per group) or by the batch
# gradient's own kernel with the examples as groups (_ConvRule._each_weight): measured on 2 CPU cores, im2col is
# faster while the patches are small (3-4x on a 4x4 patchify or a 1-channel input, 0.4M floats of patches), the
# kernel once they are large (1.1-1.2x at 2-3M floats: a 3x3 or depthwise 7x7 layer; 3.5x at 10.6M, the seed CNN's
# second layer). All ways are exact; _weight_way only picks the fastest.
_PATCHES_FOR_THE_KERNEL = 1_000_000


def _weight_way(layer, a, positions):
    """How each example's weight gradient is found: "im2col" (the patches, then one product per group), "kernel" (the
    batch gradient's own kernel with the examples as groups) or "forward" (a forward convolution of the input with
    the output gradient as the kernel, for one input channel per group). By speed, as measured:

    - CPU (2 cores): im2col below _PATCHES_FOR_THE_KERNEL floats of patches (the seed CNN's first layer at B = 64:
      0.42 ms, against 0.73 by the forward convolution); above it the kernel, or for one input channel per group
      (depthwise with any channel multiplier, or a single input channel) the forward convolution, 2-10x faster
      than the kernel (ConvNeXt's depthwise 7x7 layers at B = 16: 0.12-0.14 against 1.2-1.4 ms; the seed CNN's
      first layer at B = 256: 2.4 against 4.4 ms).
    - CUDA (an H100, torch 2.11): never the kernel, which cuDNN runs as thousands of small launches (at B = 1024,
      2,188 in 14 calls, 30 of the 32 ms of ResNet's per-example gradients); im2col, except a depthwise layer
      (groups > 1, one input channel each), whose patches are (kernel size) times its input: the forward
      convolution there. Whole recipes at B = 1024, in batch gradients, kernel against this: per_sample_grads on
      ResNet 5.3 against 3.5 (bfloat16 6.7 against 2.9), on ConvNeXt 6.0 against 2.2; ConvNeXt's norms 3.9
      against 2.5, with peak memory 0.61 B*P either way (1.48 with im2col for its depthwise layers too).
    - Other devices: as a CPU (not measured)."""
    one_input = layer["weight_shape"][1] == 1
    if a.device.type == "cuda":
        return "forward" if one_input and layer["groups"] > 1 else "im2col"
    if a.shape[0] * layer["weight_shape"][1:].numel() * layer["groups"] * positions < _PATCHES_FOR_THE_KERNEL:
        return "im2col"
    return "forward" if one_input and a.device.type == "cpu" else "kernel"


class _ConvRule(_LayerRule):
    kind = "conv"
    modules = (nn.Conv1d, nn.Conv2d)
    ops = frozenset({torch.ops.aten.convolution.default})

    def record(self, trace, func, args, kwargs, result, r, params, transposed):
        a, w, b, stride, padding, dilation, transposed_conv, output_padding, groups = args
        weight, bias = trace.param_of(w), trace.param_of(b)
        if r is None and not (weight or bias):
            return NotImplemented  # constants only
        if r is None or trace.r_of(a) != 1 or trace.r_of(w) is not None or trace.r_of(b) is not None:
            trace.fail(f"{func}: only the input may carry example data")
        if weight or bias:
            if transposed_conv or a.dim() not in (3, 4):
                trace.fail(f"{func}: transposed or 3-D convolutions are not on the fast path")
            trace.layers.append(dict(kind=self.kind, weight=trace.use(weight, func, self), bias=trace.use(bias, func, self),
                                     a=a, z=result, r=1, stride=stride, padding=padding, dilation=dilation, groups=groups,
                                     weight_shape=w.shape, versions=(a._version, result._version)))
        return 1

    @staticmethod
    def _each_weight(layer, a, delta, way):
        """Each example's weight gradient, (B, *weight shape), without im2col: by the batch gradient's own kernel
        with the examples as groups (way "kernel": the B examples' channels side by side as one image, convolved
        group by group), or, for one input channel per group (way "forward"), by a forward convolution."""
        batch, groups, shape = a.shape[0], layer["groups"], layer["weight_shape"]
        if way == "forward":
            # one input channel per group: example b's channel c correlated with its own output gradients is a
            # forward convolution of the input with the output gradient as the kernel (stride and dilation
            # swapped), cut to the kernel's size
            conv = F.conv2d if a.dim() == 4 else F.conv1d
            each = conv(a.reshape(1, -1, *a.shape[2:]), delta.reshape(-1, 1, *delta.shape[2:]), None, layer["dilation"],
                        layer["padding"], layer["stride"], batch * groups)
            for d, size in enumerate(shape[2:]):
                each = each.narrow(2 + d, 0, size)
            return each.reshape(batch, *shape)
        weight_of = conv2d_weight if a.dim() == 4 else conv1d_weight
        each = weight_of(a.reshape(1, -1, *a.shape[2:]), (batch * shape[0], *shape[1:]), delta.reshape(1, -1, *delta.shape[2:]),
                         layer["stride"], layer["padding"], layer["dilation"], batch * groups)
        return each.view(batch, *shape)

    def per_example_grads(self, layer, delta, out):
        a, weight, bias = layer["a"].detach(), layer["weight"], layer["bias"]
        if bias is not None:
            torch.sum(delta.flatten(2), dim=2, out=out[bias])
        if weight is None:
            return
        way = _weight_way(layer, a, delta[0, 0].numel())
        if way != "im2col":
            out[weight].copy_(self._each_weight(layer, a, delta, way))
            return
        patches, grouped_delta = _grouped(layer, a, delta)  # (B, G, C/G*k, L), (B, G, O/G, L)
        torch.matmul(grouped_delta, patches.transpose(2, 3), out=out[weight].view(*grouped_delta.shape[:3], -1))

    def jacobian_rows(self, layer, delta, columns):
        a, weight, bias = layer["a"].detach(), layer["weight"], layer["bias"]
        patches, grouped_delta = _grouped(layer, a, delta)  # (B, G, C/G*k, L), (Y, B, G, O/G, L)
        if bias is not None:
            columns[bias].copy_(grouped_delta.flatten(2, 3).sum(dim=3).transpose(0, 1))
        if weight is not None:
            products = torch.matmul(grouped_delta.transpose(0, 1), patches[:, None].transpose(3, 4))  # (B, Y, G, O/G, C/G*k)
            columns[weight].copy_(products.reshape(columns[weight].shape))

    def weighted_sum(self, layer, g):
        a, found = layer["a"].detach(), {}
        if layer["weight"] is not None:  # the batch gradient's own kernel (convolution_backward), on the weighted g
            weight_of = conv2d_weight if a.dim() == 4 else conv1d_weight
            found[layer["weight"]] = weight_of(a, layer["weight_shape"], g, layer["stride"], layer["padding"], layer["dilation"],
                                               layer["groups"])
        if layer["bias"] is not None:
            found[layer["bias"]] = g.sum([0, *range(2, g.dim())])
        return found

    def squared_norms(self, layer, g, batch):
        a, found = layer["a"].detach(), []
        if layer["bias"] is not None:
            found.append((layer["bias"], g.flatten(2).sum(2).square().sum(1), "direct"))
        if layer["weight"] is None:
            return found
        shape = layer["weight_shape"]
        positions, k, o = g[0, 0].numel(), shape[1:].numel(), shape[0] // layer["groups"]  # per group: L tokens, k inputs, o outputs
        if positions * positions * (k + o) <= positions * k * o:  # token pairs cost less than the product
            # (B, G, C/G*k, L) and (B, G, O/G, L): per group, a linear layer with the L positions as tokens
            patches, delta = _grouped(layer, a, g)  # per example and group, L rows of k inputs and o outputs
            each = _ghost_squares(patches.transpose(2, 3).flatten(0, 1), delta.transpose(2, 3).flatten(0, 1))
            found.append((layer["weight"], each.view(len(patches), -1).sum(1), "ghost"))
        elif (way := _weight_way(layer, a, positions)) != "im2col":  # no im2col copy
            found.append((layer["weight"], self._each_weight(layer, a, g, way).flatten(1).square().sum(1), "direct"))
        else:
            patches, delta = _grouped(layer, a, g)
            found.append((layer["weight"], (delta @ patches.transpose(2, 3)).square().sum((1, 2, 3)), "direct"))
        return found


_register(_ConvRule())
