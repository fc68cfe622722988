"""The fast path's newer layer kinds (issue 28, item 1): LayerNorm and embeddings in per_sample_grads, a position
embedding every example shares (broadcast over the batch), transformers' Conv1D (GPT-2's projections),
scaled_dot_product_attention with and without a mask, a model that returns a pytree (a ModelOutput), a cache
concatenated to an empty tensor, and weights cast to another dtype (by the model, or by autocast). Each model
takes the path named in its case, and its per-sample gradients and norms equal the loop (every example as a
batch of one, plain autograd) in float64. The adversarial cases (item 5) break one assumption each, a lookup
used twice, a tied table, a mask or keys that mix examples, a projection called twice, a cast weight used
outside its layer, and must be refused by the trace (another path, still equal to the loop)."""
import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import torch_func_recipes as tfr  # noqa: E402
from torch_func_recipes import _trace  # noqa: E402
from torch_func_recipes._batch import _as_batch  # noqa: E402

# vmap runs scaled_dot_product_attention by its slow fallback on the refused cases, and says so: a note, not a fault
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop")
B, T, V, D, C = 5, 6, 11, 8, 3
G = torch.Generator().manual_seed(28)
IDS = torch.randint(1, V, (B, T), generator=G)
IDS[0, :3] = 4  # an id repeated within an example
IDS[1, 4:] = 0  # padding
TARGETS = torch.randint(0, C, (B,), generator=G)


def loop_grads(model, loss_fn, inputs, targets):
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    rows = [torch.autograd.grad(loss_fn(model(x[None]), t[None]), [p for _, p in named], materialize_grads=True)
            for x, t in zip(inputs, targets)]
    return {n: torch.stack([r[i] for r in rows]) for i, (n, _) in enumerate(named)}


def norms_of(grads):
    return torch.cat([g.flatten(1) for g in grads.values()], dim=1).norm(dim=1)


def check_clipped_sum(clipped_sum, reference):
    """clipped_sum(max_norm) (the book-kept DP step's sum on the fast path) equals clipping the loop's per-example
    gradients to the median norm and summing them, in float64."""
    max_norm = norms_of(reference).median().item()
    factors = (max_norm / (norms_of(reference) + 1e-6)).clamp(max=1.0)
    clipped = clipped_sum(max_norm)
    for name in reference:
        torch.testing.assert_close(clipped[name], torch.einsum("b,b...->...", factors, reference[name]), rtol=1e-10, atol=1e-12)


# A parameter whose per-example shares are given whole (RMSNorm's weight, a layer scale) used twice: gradients and
# (B, Y, P) add its uses' shares on the fast path; the norms add the inner product of the two shares
USED_TWICE = ("fast", "fast", "fast")


def check_paths_and_the_loop(model, inputs, path):
    """per_sample_grads, per_sample_grad_norms and output_jacobian take `path` (one for all three, or a tuple of
    the three in that order) and equal the loop in float64:
    gradients and norms against loop_grads, (B, Y, P) against one autograd call per output of each example;
    clipped_grad_sum against the loop's gradients clipped and summed.
    Returns the loop's gradients and per_sample_grads' report."""
    grads, how = tfr.per_sample_grads(model, F.cross_entropy, inputs, TARGETS, report=True)
    norms, how_norms = tfr.per_sample_grad_norms(model, F.cross_entropy, inputs, TARGETS, report=True)
    J, how_jacobian = tfr.output_jacobian(model, inputs, report=True)
    assert (how.path, how_norms.path, how_jacobian.path) == (path if isinstance(path, tuple) else (path,) * 3), (how, how_norms, how_jacobian)
    reference = loop_grads(model, F.cross_entropy, inputs, TARGETS)
    for name in reference:
        torch.testing.assert_close(grads[name], reference[name], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(norms, norms_of(reference), rtol=1e-10, atol=1e-12)
    params = [p for p in model.parameters() if p.requires_grad]
    rows = [torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(o, params, retain_graph=True)]) for o in model(x[None])[0]])
            for x in inputs]
    torch.testing.assert_close(J, torch.stack(rows), rtol=1e-10, atol=1e-12)
    check_clipped_sum(lambda max_norm: tfr.clipped_grad_sum(model, F.cross_entropy, inputs, TARGETS, max_norm=max_norm), reference)
    return reference, how


class Tokens(nn.Module):
    """Embedding (padding 0), optional learned positions, LayerNorm, one attention layer, a head on the mean."""

    def __init__(self, positions="shared", attention="sdpa", mask=None, tie=False, extra=None):
        super().__init__()
        self.embed, self.pos = nn.Embedding(V, D, padding_idx=0), nn.Embedding(T, D)
        self.norm, self.qkv, self.head = nn.LayerNorm(D), nn.Linear(D, 3 * D), nn.Linear(D, C)
        self.positions, self.attention, self.mask, self.tie, self.extra = positions, attention, mask, tie, extra

    def forward(self, ids):
        h = self.embed(ids)
        where = torch.arange(ids.shape[1], device=ids.device)
        if self.positions == "shared":  # one lookup every example shares, broadcast over the batch
            h = h + self.pos(where)[None]
        elif self.positions == "per example":
            h = h + self.pos(where.expand(ids.shape[0], -1))
        elif self.positions == "used twice":
            p = self.pos(where)[None]
            h = h + p + p
        elif self.positions == "scaled":
            h = h + 2 * self.pos(where)[None]
        h = self.norm(h)
        q, k, v = self.qkv(h).unflatten(-1, (3, 1, D)).unbind(-3)  # (B, T, 1, D) each: one head
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, 1, T, D)
        mask = None if self.mask is None else self.mask(ids)
        if self.extra == "keys from another example":
            k = k.roll(1, 0)
        if self.attention == "sdpa":
            h = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            scores = q @ k.transpose(-1, -2) / D**0.5
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            h = torch.softmax(scores, dim=-1) @ v
        h = h.transpose(1, 2).flatten(2).mean(1)
        if self.tie:  # the embedding table used again, as the output layer's weight
            return F.linear(h, self.embed.weight)[:, :C]
        return self.head(h)


def padding_mask(ids):  # (B, 1, T, T): each query sees the real tokens of its own sequence
    return (ids != 0)[:, None, None, :].expand(-1, 1, ids.shape[1], -1)


def mixing_mask(ids):  # built from every sequence of the batch at once: examples depend on each other
    return ((ids != 0).any(0))[None, None, None, :].expand(ids.shape[0], 1, ids.shape[1], -1)


CASES = {
    "shared positions, SDPA, no mask": (dict(), "fast"),
    "shared positions, SDPA, padding mask": (dict(mask=padding_mask), "fast"),
    "positions looked up per row, written-out attention with a mask": (dict(positions="per example", attention="written", mask=padding_mask), "fast"),
    "no positions": (dict(positions=None), "fast"),
    "a position lookup used twice": (dict(positions="used twice"), "vmap"),
    "a position lookup scaled before the addition": (dict(positions="scaled"), "vmap"),
    "a table tied to the output layer": (dict(tie=True), "vmap"),
    "a mask that mixes examples": (dict(mask=mixing_mask), "refused"),
    "keys from another example": (dict(extra="keys from another example"), "refused"),
}


def build(options, dtype=torch.float64):
    torch.manual_seed(0)
    model = Tokens(**options).to(dtype).eval()
    if options.get("positions", "shared") is None:
        model.pos.requires_grad_(False)  # unused: frozen, so that every trainable parameter has a use
    return model


@pytest.mark.parametrize("case", CASES)
def test_fast_path_or_refusal_and_the_loop(case):
    options, path = CASES[case]
    model = build(options)
    loss_fn = F.cross_entropy
    if path == "refused":  # the batch's examples interact: no example has a gradient of its own, and the recipes say so
        for recipe in (tfr.per_sample_grads, tfr.per_sample_grad_norms):
            with pytest.raises(ValueError, match="depends on the other examples"):
                recipe(model, loss_fn, IDS, TARGETS)
        return
    grads, how = tfr.per_sample_grads(model, loss_fn, IDS, TARGETS, report=True)
    norms, how_norms = tfr.per_sample_grad_norms(model, loss_fn, IDS, TARGETS, report=True)
    assert (how.path, how_norms.path) == (path, path), (how, how_norms)
    reference = loop_grads(model, loss_fn, IDS, TARGETS)
    assert grads.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(grads[name], reference[name], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(norms, norms_of(reference), rtol=1e-10, atol=1e-12)
    # the DP step's clipped sum, book-kept on the fast path: the padding row gets nothing, a shared lookup its sum
    check_clipped_sum(lambda max_norm: tfr.clipped_grad_sum(model, loss_fn, IDS, TARGETS, max_norm=max_norm), reference)


def test_the_dp_step_forms_small_layers_per_example_gradients_once(monkeypatch):
    """The book-kept DP step keeps each layer's output gradient for the clipped sum, except where the layer's
    per-example gradients take no more memory: the LayerNorm (2 x 8 numbers per example against its 6 x 8 output
    gradient) and the position table every example shares (6 x 8 against 6 x 8) get them formed once, for both the
    norms and the clipped sum; the larger layers (the attention projection, 8 x 24 against 6 x 24; the token table, 11
    rows; the head, 8 x 3 against 1 x 3) keep their output gradient and take their own formulas. The sum still equals
    the loop, and a weighting left out of the kept per-example gradients fails that check (below)."""
    from collections import Counter

    from torch_func_recipes import _layers

    calls: Counter = Counter()
    for kind in ("layer_norm", "linear", "embedding"):
        rule = _layers._rule_named(kind)
        for method in ("squared_norms", "weighted_sum", "per_example_grads"):
            def counted(*args, _f=getattr(rule, method), _key=(kind, method), **kwargs):
                calls[_key] += 1
                return _f(*args, **kwargs)
            monkeypatch.setattr(rule, method, counted)
    model = build(CASES["shared positions, SDPA, padding mask"][0])
    reference = loop_grads(model, F.cross_entropy, IDS, TARGETS)
    check_clipped_sum(lambda max_norm: tfr.clipped_grad_sum(model, F.cross_entropy, IDS, TARGETS, max_norm=max_norm), reference)
    # the first call of a call signature also takes its first and last examples' gradients by the same formulas,
    # weighted by a one-hot (_squared_norms_checked): three weighted sums per layer, the small layers' formed once
    assert dict(calls) == {("layer_norm", "per_example_grads"): 1, ("embedding", "per_example_grads"): 1,
                           ("embedding", "squared_norms"): 1, ("embedding", "weighted_sum"): 3,
                           ("linear", "squared_norms"): 2, ("linear", "weighted_sum"): 6}, dict(calls)
    calls.clear()  # a second call: the sum's own
    check_clipped_sum(lambda max_norm: tfr.clipped_grad_sum(model, F.cross_entropy, IDS, TARGETS, max_norm=max_norm), reference)
    assert dict(calls) == {("layer_norm", "per_example_grads"): 1, ("embedding", "per_example_grads"): 1,
                           ("embedding", "squared_norms"): 1, ("embedding", "weighted_sum"): 1,
                           ("linear", "squared_norms"): 2, ("linear", "weighted_sum"): 2}, dict(calls)
    unweighted = lambda weights, e, dims: e.sum(0)  # noqa: E731 (every example's share added unclipped)
    monkeypatch.setattr(torch, "tensordot", unweighted)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        check_clipped_sum(lambda max_norm: tfr.clipped_grad_sum(model, F.cross_entropy, IDS, TARGETS, max_norm=max_norm), reference)


def test_the_trace_names_what_stops_it():
    reasons = {case: tfr.per_sample_grads(build(CASES[case][0]), F.cross_entropy, IDS, TARGETS, report=True)[1].reason
               for case in ("a position lookup used twice", "a position lookup scaled before the addition",
                            "a table tied to the output layer")}
    assert "used twice" in reasons["a position lookup used twice"]
    assert "made from a parameter for every example" in reasons["a position lookup scaled before the addition"]
    assert "embed.weight" in reasons["a table tied to the output layer"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sdpa_fast_path_in_both_precisions(dtype):
    """float32 on the CPU runs SDPA's fused kernel; float64 its decomposition (with _safe_softmax)."""
    model = build(dict(mask=padding_mask), dtype)
    grads, how = tfr.per_sample_grads(model, F.cross_entropy, IDS, TARGETS, report=True)
    assert how.path == "fast", how
    reference = loop_grads(model, F.cross_entropy, IDS, TARGETS)
    tolerance = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    for name in reference:
        torch.testing.assert_close(grads[name], reference[name], **tolerance)


class DictOutput(nn.Module):
    """Returns a dict of tensors, as Hugging Face models return a ModelOutput; "shared" adds a tensor that is not
    per example, and the cache is concatenated to an empty 1-D tensor along the tokens, as transformers' cache does."""

    def __init__(self, shared=False):
        super().__init__()
        self.a, self.b, self.shared = nn.Linear(4, 8), nn.Linear(8, C), shared

    def forward(self, x):
        h = torch.tanh(self.a(x))  # (B, T, 8)
        cache = torch.cat([torch.empty(0, dtype=x.dtype), h], dim=-2)
        out = {"logits": self.b(h.mean(1)), "cache": cache}
        if self.shared:
            out["shared"] = self.a.bias.detach() * 2
        return out


@pytest.mark.parametrize("shared", [False, True])
def test_a_pytree_output_and_an_empty_cache(shared):
    torch.manual_seed(0)
    model = DictOutput(shared).double()
    x = torch.randn(B, T, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    loss_fn = lambda out, t: F.cross_entropy(out["logits"], t)  # noqa: E731
    grads, how = tfr.per_sample_grads(model, loss_fn, x, TARGETS, report=True)
    assert how.path == ("vmap" if shared else "fast"), how
    reference = loop_grads(model, loss_fn, x, TARGETS)
    for name in reference:
        torch.testing.assert_close(grads[name], reference[name], rtol=1e-10, atol=1e-12)


transformers = pytest.importorskip("transformers")


def gpt2(tie):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=V, n_positions=16, n_embd=D, n_layer=2, n_head=2, bos_token_id=0,
                                     eos_token_id=0, tie_word_embeddings=tie)
    return transformers.GPT2LMHeadModel(config).double().eval()


@pytest.mark.parametrize("tie", [False, True])
def test_gpt2_conv1d_and_positions(tie):
    """GPT-2 untied: its Conv1D projections, shared position lookup, SDPA and cache on the fast path. Tied (the
    default), the token table is also the output layer's weight: the fast path adds both uses' shares, and for the
    norms their cross term; equal to the loop either way."""
    model = gpt2(tie)
    loss_fn = lambda out, t: F.cross_entropy(out.logits[:, -1, :C], t)  # noqa: E731
    grads, how = tfr.per_sample_grads(model, loss_fn, targets=TARGETS, report=True, input_ids=IDS)
    norms, how_norms = tfr.per_sample_grad_norms(model, loss_fn, targets=TARGETS, report=True, input_ids=IDS)
    assert (how.path, how_norms.path) == ("fast", "fast"), (how, how_norms)
    reference = tfr.per_sample_grads(model, loss_fn, targets=TARGETS, path="loop", input_ids=IDS)
    for name in reference:
        torch.testing.assert_close(grads[name], reference[name], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(norms, norms_of(reference), rtol=1e-10, atol=1e-12)
    check_clipped_sum(lambda max_norm: tfr.clipped_grad_sum(model, loss_fn, targets=TARGETS, max_norm=max_norm, input_ids=IDS),
                      reference)


def test_a_conv1d_called_twice_adds_up_its_shares_and_their_cross_terms():
    model = gpt2(False)
    block = model.transformer.h[0].mlp
    forward = block.forward
    block.forward = lambda h: forward(forward(h))  # the same projections twice
    loss_fn = lambda out, t: F.cross_entropy(out.logits[:, -1, :C], t)  # noqa: E731
    try:
        grads, how = tfr.per_sample_grads(model, loss_fn, targets=TARGETS, report=True, input_ids=IDS)
        norms, how_norms = tfr.per_sample_grad_norms(model, loss_fn, targets=TARGETS, report=True, input_ids=IDS)
        reference = tfr.per_sample_grads(model, loss_fn, targets=TARGETS, path="loop", input_ids=IDS)
        check_clipped_sum(lambda max_norm: tfr.clipped_grad_sum(model, loss_fn, targets=TARGETS, max_norm=max_norm, input_ids=IDS),
                          reference)
    finally:
        del block.forward
    assert how.path == "fast" and how_norms.path == "fast", (how, how_norms)
    for name in reference:
        torch.testing.assert_close(grads[name], reference[name], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(norms, norms_of(reference), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", ["shared positions, SDPA, padding mask", "positions looked up per row, written-out attention with a mask",
                                  "a position lookup used twice"])
def test_output_jacobian_through_the_same_layers(case):
    """(B, Y, P) through embeddings (one lookup every example shares included), LayerNorm and attention: the fast
    path where the trace completes, and equal to the loop of one autograd call per example and output either way."""
    options, path = CASES[case]
    model = build(options)
    J, how = tfr.output_jacobian(model, IDS, report=True)
    assert how.path == path, how
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for ids in IDS:
        out = model(ids[None])[0]
        rows.append(torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(o, params, retain_graph=True, materialize_grads=True)])
                                 for o in out]))
    torch.testing.assert_close(J, torch.stack(rows), rtol=1e-10, atol=1e-12)


class TokensWithBatchNorm(nn.Module):
    """BatchNorm1d over the (B*T, C) rows of tokens folded into the batch, then unfolded: r = T rows per example."""

    def __init__(self):
        super().__init__()
        self.lin, self.bn, self.head = nn.Linear(16, 5), nn.BatchNorm1d(5), nn.Linear(10, C)

    def forward(self, x):
        h = self.lin(x.flatten(2))  # (B, 2, 5)
        return self.head(self.bn(h.flatten(0, 1)).view(x.shape[0], -1))


def normalised_models():
    torch.manual_seed(3)
    models = {
        "BatchNorm2d, eval mode, after a strided convolution": nn.Sequential(
            nn.Conv2d(2, 4, 3, stride=2), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4, C)),
        "GroupNorm": nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), nn.Linear(64, C)),
        "BatchNorm1d on tokens folded into the batch": TokensWithBatchNorm(),
    }
    images = torch.randn(B, 2, 4, 4, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    for model in models.values():
        model.double().train()(images)  # running statistics from one batch, then eval mode
        model.eval()
    return models, images


@pytest.mark.parametrize("case", ["BatchNorm2d, eval mode, after a strided convolution", "GroupNorm",
                                  "BatchNorm1d on tokens folded into the batch"])
def test_normalisation_layers(case):
    """Eval-mode BatchNorm and GroupNorm affine parameters on the fast path: gradients, norms and (B, Y, P) equal
    the loop in float64; in training mode BatchNorm's batch statistics mix the examples and the recipes refuse."""
    models, images = normalised_models()
    model = models[case]
    check_paths_and_the_loop(model, images, "fast")
    if "BatchNorm" in case:  # refused before anything runs, naming the layer
        with pytest.raises(ValueError, match="is a BatchNorm in training mode"):
            tfr.per_sample_grads(model.train(), F.cross_entropy, images, TARGETS)


DEPTHWISE = {  # one input channel per group: on a CPU, with large patches, per-example weights by a forward convolution
    "2-D, 7x7, padding 3": (2, dict(kernel_size=7, padding=3), 1),
    "2-D, stride 2, dilation 2, 2 outputs per channel": (2, dict(kernel_size=3, stride=2, dilation=2, padding=1), 2),
    "2-D, stride 3 leaving a remainder": (2, dict(kernel_size=2, stride=3), 1),
    "1-D, stride 2, padding 2, 3 outputs per channel": (1, dict(kernel_size=3, stride=2, padding=2), 3),
}


@pytest.mark.parametrize("case", DEPTHWISE)
@pytest.mark.parametrize("threshold", [0, 10**12], ids=["kernel", "im2col"])
def test_depthwise_convolutions(case, threshold, monkeypatch):
    """Depthwise convolutions (groups = input channels, any channel multiplier, strides, dilation, padding, 1-D
    and 2-D): per-example gradients, norms, (B, Y, P) and the clipped sum equal the loop in float64, by im2col and
    by the way large patches take (on a CPU a forward convolution with the output gradient as the kernel; these
    layers are small, so the threshold is patched to make both run)."""
    import torch_func_recipes._layer_conv as conv_rule

    monkeypatch.setattr(conv_rule, "_PATCHES_FOR_THE_KERNEL", threshold)
    dims, options, multiplier = DEPTHWISE[case]
    torch.manual_seed(21)
    layer = (nn.Conv2d if dims == 2 else nn.Conv1d)(3, 3 * multiplier, groups=3, **options)
    inputs = torch.randn(B, 3, *[9] * dims, generator=torch.Generator().manual_seed(22), dtype=torch.float64)
    width = layer(inputs[:1].float()).numel()
    model = nn.Sequential(layer, nn.Tanh(), nn.Flatten(), nn.Linear(width, C)).double().eval()
    check_paths_and_the_loop(model, inputs, "fast")


def test_the_way_to_each_examples_convolution_weights_by_device(recipes):
    """_weight_way, for layers with 16x16 outputs: on a CPU im2col while the patches are small, then the batch
    kernel with the examples as groups, or a forward convolution for one input channel per group; on a GPU never
    the kernel (cuDNN launches it once per group): im2col, and the forward convolution for a depthwise layer only
    (tests/test_cuda.py runs each way there)."""
    from types import SimpleNamespace

    way = recipes["_weight_way"]
    depthwise = dict(weight_shape=torch.Size([64, 1, 7, 7]), groups=64)
    dense = dict(weight_shape=torch.Size([64, 64, 3, 3]), groups=1)
    single_input = dict(weight_shape=torch.Size([4, 1, 3, 3]), groups=1)
    on = lambda device, batch: SimpleNamespace(device=torch.device(device), shape=(batch, 64, 16, 16))  # what the rule reads
    assert [way(layer, on("cuda", 1024), 256) for layer in (depthwise, dense, single_input)] == ["forward", "im2col", "im2col"]
    assert [way(layer, on("cpu", 1024), 256) for layer in (depthwise, dense, single_input)] == ["forward", "kernel", "forward"]
    assert [way(layer, on("cpu", 1), 256) for layer in (depthwise, dense, single_input)] == ["im2col"] * 3


class GemmaStyleRMSNorm(nn.Module):
    """Named like an RMSNorm but scaling by 1 + w: the weight's use is an addition first, which the trace must
    refuse rather than trust the name."""

    def __init__(self, size):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + self.weight)


class RMSNormed(nn.Module):
    """Linear, RMSNorm over the features of each token, a head on the mean over tokens; `misuse` breaks one
    assumption of the RMSNorm rule."""

    def __init__(self, norm=None, misuse=None):
        super().__init__()
        self.lin, self.norm, self.head = nn.Linear(4, D), norm if norm is not None else nn.RMSNorm(D), nn.Linear(D, C)
        self.misuse = misuse

    def forward(self, x):  # x: (B, T, 4)
        h = self.norm(torch.tanh(self.lin(x)))
        if self.misuse == "used twice":
            h = self.norm(h)
        elif self.misuse == "used outside its layer":
            h = h + self.norm.weight
        return self.head(h.mean(1))


RMS_CASES = {
    "nn.RMSNorm": (dict(), "fast"),
    "an RMSNorm used twice": (dict(misuse="used twice"), USED_TWICE),
    "its weight used outside the layer": (dict(misuse="used outside its layer"), "vmap"),
    "a class named RMSNorm that scales by 1 + w": (dict(norm=GemmaStyleRMSNorm(D)), "vmap"),
}


@pytest.mark.parametrize("case", RMS_CASES)
def test_rms_norm(case):
    """nn.RMSNorm's weight on the fast path (gradients, norms and (B, Y, P) equal the loop in float64); a weight
    used outside its layer, or a look-alike class, is refused by the trace and still equals the loop; used twice,
    its gradients add the two uses' shares and its norms are refused."""
    options, path = RMS_CASES[case]
    torch.manual_seed(5)
    model = RMSNormed(**options).double().eval()
    nn.init.normal_(model.norm.weight)  # not all ones, so that a wrong rule would show
    x = torch.randn(B, T, 4, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    check_paths_and_the_loop(model, x, path)


def test_llama_rms_norm_takes_the_fast_path():
    """transformers' LlamaRMSNorm (a class of its own, the product w * h at its end) on the fast path, the whole
    tiny Llama with it, equal to the vmap path in float64."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=D, num_key_value_heads=1, num_attention_heads=2,
                                      intermediate_size=16, num_hidden_layers=1, max_position_embeddings=16,
                                      bos_token_id=0, eos_token_id=0)
    model = transformers.LlamaForCausalLM(config).double().eval()
    for m in model.modules():
        if type(m).__name__ == "LlamaRMSNorm":
            nn.init.normal_(m.weight)
    loss_fn = lambda out, t: F.cross_entropy(out.logits[:, -1, :C], t)  # noqa: E731
    fast, how = tfr.per_sample_grads(model, loss_fn, targets=TARGETS, input_ids=IDS, report=True)
    assert how.path == "fast", how
    reference = tfr.per_sample_grads(model, loss_fn, targets=TARGETS, input_ids=IDS, path="loop")
    for name in reference:
        torch.testing.assert_close(fast[name], reference[name], rtol=1e-10, atol=1e-12)
    norms, how_norms = tfr.per_sample_grad_norms(model, loss_fn, targets=TARGETS, input_ids=IDS, report=True)
    assert how_norms.path == "fast" and "model.norm.weight" in how_norms.direct, how_norms
    torch.testing.assert_close(norms, norms_of(reference), rtol=1e-10, atol=1e-12)


class Residual(nn.Module):
    """A convolution and an eval-mode BatchNorm, a shortcut added into the BatchNorm's output in place (as
    transformers' ResNet does), then a head; `variant` changes what happens to that output."""

    def __init__(self, variant):
        super().__init__()
        self.conv, self.bn, self.short = nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Conv2d(2, 4, 1)
        self.head, self.variant = nn.Linear(4 * 16, C), variant

    def forward(self, x):
        h = self.bn(self.conv(x))
        if self.variant == "read before the addition":
            seen = h.relu()  # the old values used elsewhere: the gradient at h also flows through `seen`
            h += self.short(x)
            h = h + seen
        elif self.variant == "scaled in place":
            h *= 2.0
            h = h + self.short(x)
        elif self.variant == "added to itself":
            h += h
            h = h + self.short(x)
        else:
            h += self.short(x)
        return self.head(torch.relu(h).flatten(1))


RESIDUAL_CASES = {"a shortcut added in place": "fast", "read before the addition": "vmap", "scaled in place": "vmap",
                  "added to itself": "vmap"}


@pytest.mark.parametrize("case", RESIDUAL_CASES)
def test_a_residual_added_in_place_into_a_layer_output(case):
    """An in-place addition into a layer's output before anything read it leaves that layer's output gradient
    unchanged, so the fast path keeps the layer; an output read first, scaled in place or added to itself is
    refused (another path), and every case equals the loop in float64."""
    torch.manual_seed(7)
    model = Residual(case).double()
    images = torch.randn(B, 2, 4, 4, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    model.train()(images)
    model.eval()
    expected = RESIDUAL_CASES[case]
    _, how = check_paths_and_the_loop(model, images, expected)
    if expected == "vmap":
        assert "in-place operation changed" in how.reason, how


class Tokenised(nn.Module):
    """ViT's pattern: a class token expanded over the batch and put in front of the patches, a learned
    position embedding added to every example; `misuse` breaks one assumption of the parameter rule."""

    def __init__(self, misuse=None):
        super().__init__()
        self.patch, self.head = nn.Linear(4, D), nn.Linear(D, C)
        tokens = 1 if misuse == "positions broadcast along the tokens" else T + 1
        self.cls_token, self.positions = nn.Parameter(torch.randn(1, 1, D)), nn.Parameter(torch.randn(1, tokens, D))
        self.misuse = misuse

    def forward(self, x):  # x: (B, T, 4)
        h = self.patch(x)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        if self.misuse == "class token used twice":
            h = torch.cat([torch.cat([cls, h[:, 1:]], dim=1), cls], dim=1)
        elif self.misuse == "class token last":
            h = torch.cat([h, cls], dim=-2)
        else:
            h = torch.cat([cls, h], dim=1)
        if self.misuse == "positions scaled":
            h = h + 2 * self.positions
        else:  # (1, T + 1, D), or (1, 1, D): broadcast along the tokens too
            h = h + self.positions
        return self.head(torch.tanh(h)[:, -1 if self.misuse == "class token last" else 0])


PARAMETER_CASES = {"a class token and position embeddings": (None, "fast"),
                   "class token last": ("class token last", "fast"),
                   "class token used twice": ("class token used twice", "vmap"),
                   "positions scaled": ("positions scaled", "vmap"),
                   "positions broadcast along the tokens": ("positions broadcast along the tokens", "vmap")}


@pytest.mark.parametrize("case", PARAMETER_CASES)
def test_parameters_every_example_receives_whole(case):
    """A class token (expanded, concatenated) and a position embedding (added) on the fast path, equal to the
    loop in float64 for gradients, norms and (B, Y, P); a token used twice, a scaled embedding or one broadcast
    along another dimension are refused by the trace and still equal the loop."""
    misuse, path = PARAMETER_CASES[case]
    torch.manual_seed(9)
    model = Tokenised(misuse).double()
    x = torch.randn(B, T, 4, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    check_paths_and_the_loop(model, x, path)


@pytest.mark.parametrize("path", ["fast", "vmap"])
def test_output_jacobian_through_dropout_in_training_mode(path):
    """Dropout in training mode: on either path each example draws its own mask, which every row of its
    Jacobian shares. Read off the last layer's block (d y_j / d W2[j, k] is the dropped hidden unit k, the same
    for every row j). Before the vmap path passed randomness="different", it raised instead."""
    torch.manual_seed(11)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Dropout(0.5), nn.Linear(16, C)).double().train()
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    J = tfr.output_jacobian(model, x, path=path)
    blocks = tfr.split_by_parameter(J, model)["3.weight"]  # (B, Y, Y, 16)
    kept = torch.stack([torch.stack([blocks[b, j, j] != 0 for j in range(C)]) for b in range(8)])  # (B, Y, 16)
    assert bool((kept == kept[:, :1]).all())  # one mask per example, shared by its rows
    assert len({tuple(k[0].tolist()) for k in kept}) > 1  # not one mask for the whole batch


class LayerScaled(nn.Module):
    """ConvNeXt's layer scale (transformers' layer_scale_parameter): a parameter of one number per feature that
    multiplies the example data along its last dimension; `misuse` breaks one assumption of the parameter rule."""

    def __init__(self, misuse=None):
        super().__init__()
        self.a, self.head = nn.Linear(4, D), nn.Linear(D, C)
        scales = torch.linspace(0.5, 1.5, T)[:, None] if misuse == "scale along the tokens" else torch.linspace(0.5, 1.5, D)
        self.gamma = nn.Parameter(scales)  # (D,), or (T, 1): one number per token, broadcast over the features
        self.misuse = misuse

    def forward(self, x):  # x: (B, T, 4)
        h = torch.tanh(self.a(x))
        if self.misuse == "scale used twice":
            h = self.gamma * (self.gamma * h)
        elif self.misuse == "one plus the scale":
            h = (1 + self.gamma) * h
        else:
            h = h * self.gamma
        return self.head(h.mean(1))


SCALE_CASES = {"a layer scale": (None, "fast"), "scale used twice": ("scale used twice", USED_TWICE),
               "one plus the scale": ("one plus the scale", "vmap"), "scale along the tokens": ("scale along the tokens", "vmap")}


@pytest.mark.parametrize("case", SCALE_CASES)
def test_a_layer_scale(case):
    """A layer scale on the fast path, equal to the loop in float64 for gradients, norms, (B, Y, P) and the
    book-kept clipped sum; shifted by one or scaling another dimension it is refused by the trace, used twice its
    norms are, and every path equals the loop."""
    misuse, path = SCALE_CASES[case]
    torch.manual_seed(11)
    model = LayerScaled(misuse).double()
    x = torch.randn(B, T, 4, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    check_paths_and_the_loop(model, x, path)


class TiedTable(nn.Module):
    """A token table (padding row 0) that is also the output layer's weight, as in GPT-2; `twice` looks the table
    up a second time (ids modulo 5), so the weight has three uses."""

    def __init__(self, twice=False):
        super().__init__()
        self.embed, self.mix = nn.Embedding(V, D, padding_idx=0), nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.embed.weight
        self.twice = twice

    def forward(self, ids):
        h = self.embed(ids) + (self.embed(ids % 5) if self.twice else 0.0)
        return self.head(torch.tanh(self.mix(h))).mean(1)[:, :C]


@pytest.mark.parametrize("twice", [False, True], ids=["tied", "tied and looked up twice"])
def test_a_tied_table_adds_its_uses_and_their_cross_terms(twice):
    """Gradients, (B, Y, P) and the book-kept clipped sum add each use's share; the norms add the cross terms
    between the uses (table against head: a token's row of the head's output gradient times the lookup's
    gradient against the head's input; two lookups: matching ids), padding row excluded. All on the fast path
    and equal to the loop in float64."""
    torch.manual_seed(13)
    model = TiedTable(twice).double()
    check_paths_and_the_loop(model, IDS, "fast")


class CastsItsWeights(nn.Module):
    """Parameters in float64, arithmetic in float32: the forward pass casts each weight itself (as models that keep
    a master copy do, and as autocast does for a GPU's bfloat16). misuse="outside" also adds the cast weight to the
    output, a use outside its layer; misuse="twice" applies the first layer twice (its norms' cross term)."""

    def __init__(self, misuse=None):
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, C)
        self.misuse = misuse

    def forward(self, x):
        x = x.float()
        h = torch.tanh(F.linear(x, self.first.weight.float(), self.first.bias.float()))
        if self.misuse == "twice":
            h = torch.tanh(F.linear(h, self.first.weight.float(), self.first.bias.float()))
        out = F.linear(h, self.second.weight.float(), self.second.bias.float())
        out = out.mean(1)  # three rows (tokens) per example
        return out + self.second.weight.float().sum() if self.misuse == "outside" else out


@pytest.mark.parametrize("misuse", [None, "twice", "outside"], ids=["cast", "cast and called twice", "cast and used outside its layer"])
def test_a_weight_cast_to_another_dtype_stands_for_the_parameter(misuse):
    """The trace follows a parameter's copy in another dtype as the parameter (the gradient flows back through the
    cast), and forms each example's products in the parameter's dtype. The loop runs the same float32 forward and
    backward pass and rounds the gradient to float32 on its way back through the cast, where the fast path multiplies
    in float64: they differ by float32 rounding (about 6e-8 relative per operation, a few operations deep), hence
    rtol 1e-5. A layer applied twice adds its uses' cross term to the norms; a cast copy used outside its layer is
    refused."""
    torch.manual_seed(14)
    model = CastsItsWeights(misuse).double()
    x = torch.randn(B, 3, 4, generator=torch.Generator().manual_seed(15), dtype=torch.float64)
    loss_fn = lambda out, t: F.cross_entropy(out, t)  # noqa: E731
    reference = loop_grads(model, loss_fn, x, TARGETS)
    grads, how = tfr.per_sample_grads(model, loss_fn, x, TARGETS, report=True)
    norms, how_norms = tfr.per_sample_grad_norms(model, loss_fn, x, TARGETS, report=True)
    clipped, how_clipped = tfr.clipped_grad_sum(model, loss_fn, x, TARGETS, max_norm=norms_of(reference).median().item(), report=True)
    expected = "vmap" if misuse == "outside" else "fast"
    assert (how.path, how_norms.path, how_clipped.path) == (expected,) * 3, (how, how_norms, how_clipped)
    for name in reference:
        assert grads[name].dtype == torch.float64
        torch.testing.assert_close(grads[name], reference[name], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(norms, norms_of(reference), rtol=1e-5, atol=1e-7)
    factors = (norms_of(reference).median() / (norms_of(reference) + 1e-6)).clamp(max=1.0)
    for name in reference:
        torch.testing.assert_close(clipped[name], torch.einsum("b,b...->...", factors, reference[name]), rtol=1e-5, atol=1e-7)
    J, how_jacobian = tfr.output_jacobian(model, x, report=True)
    assert how_jacobian.path == expected, how_jacobian
    params = list(model.parameters())
    rows = [torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(o, params, retain_graph=True)]) for o in model(xi[None])[0]])
            for xi in x]
    torch.testing.assert_close(J, torch.stack(rows), rtol=1e-5, atol=1e-7)  # in the parameters' dtype on every path


def relative_error(grads, reference):
    flat = lambda d: torch.cat([d[n].double().flatten(1) for n in reference], dim=1)  # noqa: E731
    return ((flat(grads) - flat(reference)).norm() / flat(reference).norm()).item()


def test_autocast_keeps_the_fast_path_and_its_precision():
    """Under autocast (bfloat16 on the CPU here, as on a GPU), GPT-2's layers run on bfloat16 copies of the float32
    weights: the recipes stay on the fast path, also after a forward pass in the same autocast region (whose cached
    copies would reach the trace unannounced), and their per-example gradients are no further from the float64 loop
    than plain vmap(grad)'s under the same autocast (bfloat16 keeps 8 significant bits: about 4e-3 relative per
    rounding, so both land near 1e-2; 1.25x leaves room for rounding in a different order)."""
    model = gpt2(True).float()
    loss_fn = lambda out, t: F.cross_entropy(out.logits[:, -1, :C].float(), t)  # noqa: E731
    reference = tfr.per_sample_grads(gpt2(True), lambda out, t: F.cross_entropy(out.logits[:, -1, :C], t), targets=TARGETS,
                                     path="loop", input_ids=IDS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=IDS)  # fills autocast's cache of bfloat16 weights
        grads, how = tfr.per_sample_grads(model, loss_fn, targets=TARGETS, report=True, input_ids=IDS)
        norms, how_norms = tfr.per_sample_grad_norms(model, loss_fn, targets=TARGETS, report=True, input_ids=IDS)
        step, how_step = tfr.clipped_noisy_gradient(model, loss_fn, targets=TARGETS, max_norm=1.0, noise_multiplier=0.0,
                                                    report=True, input_ids=IDS)
        plain = tfr.per_sample_grads(model, loss_fn, targets=TARGETS, path="vmap", input_ids=IDS)
    assert (how.path, how_norms.path, how_step.path) == ("fast",) * 3, (how, how_norms, how_step)
    assert all(g.dtype == torch.float32 for g in grads.values())
    # the trace keeps each layer's input as the layer ran (bfloat16): the products cast it one layer at a time, so
    # that no float32 copy of every layer's input is held beside the ones autograd saved
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, layers, reason = _trace._traced_forward(model, _as_batch(None, TARGETS, (), {"input_ids": IDS}),
                                                   dict(model.named_parameters()), "norms")
    low = [layer for layer in layers if "dtype" in layer]
    assert reason is None and len(low) >= 8, reason  # the attention and MLP projections of both blocks, the head
    assert all(layer["a"].dtype == torch.bfloat16 for layer in low if layer["a"].is_floating_point())
    ours, theirs = relative_error(grads, reference), relative_error(plain, reference)
    assert ours <= 1.25 * theirs and ours < 3e-2, (ours, theirs)
    assert ((norms.double() - norms_of(reference)).abs() / norms_of(reference)).max() < 3e-2
    factors = (1.0 / (norms_of(reference) + 1e-6)).clamp(max=1.0)
    expected = {n: torch.einsum("b,b...->...", factors, reference[n]) / B for n in reference}
    assert relative_error({n: step[n][None] for n in reference}, {n: expected[n][None] for n in reference}) < 3e-2


class WeightAlsoAdded(nn.Module):
    """An output layer's weight (1, D) also added to every example's features as a learned offset: one parameter
    with a linear layer's use (its share as outer-product factors) and a bare parameter's (its share whole)."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(D, 1)
        self.offset = self.head.weight  # registered twice: in head, and here as a parameter of this module

    def forward(self, x):
        return torch.cat([self.head(torch.tanh(x + self.offset)), x[:, :C - 1]], dim=1)


def test_a_weight_used_in_both_forms_is_refused_for_the_norms_only():
    """Gradients and (B, Y, P) add the two shares on the fast path; the norms' cross term would pair outer-product
    factors with a whole share, which _CrossTerms does not combine: the norms take vmap, equal to the loop."""
    torch.manual_seed(16)
    model = WeightAlsoAdded().double()
    x = torch.randn(B, D, generator=torch.Generator().manual_seed(17), dtype=torch.float64)
    check_paths_and_the_loop(model, x, ("fast", "vmap", "fast"))


def test_autocast_with_a_layer_called_twice():
    """Under bfloat16 autocast, a linear layer called twice: the norms' cross term pairs its two uses, both run in
    bfloat16 and formed in float32; as close to the float64 loop as bfloat16 allows (8 significant bits: a few
    roundings of 4e-3 each, so 3e-2)."""
    torch.manual_seed(18)
    layer = nn.Linear(D, D)
    model = nn.Sequential(layer, nn.Tanh(), layer, nn.Flatten(), nn.Linear(T * D, C))
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(19))
    reference = norms_of(loop_grads(copy.deepcopy(model).double(), F.cross_entropy, x.double(), TARGETS))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        norms, how = tfr.per_sample_grad_norms(model, lambda out, t: F.cross_entropy(out.float(), t), x, TARGETS, report=True)
    assert how.path == "fast", how
    assert ((norms.double() - reference).abs() / reference).max() < 3e-2


class RoundsByBatchSize(nn.Module):
    """Under autocast, logits (upcast to float32, as transformers' Llama's are) that move by 1e-4 relative per extra
    example of the batch: what a low-precision kernel's rounding can do between batch sizes (a bfloat16 Llama's
    logits differ by 3e-3 between its first two examples together and alone on a 2-core Xeon), standing in for it
    deterministically. With bfloat16 weights, outputs one bfloat16 rounding (2**-8) apart per extra example."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, C)

    def forward(self, x):
        logits = self.b(torch.tanh(self.a(x)))
        if logits.dtype == torch.bfloat16 and not torch.is_autocast_enabled("cpu"):  # bfloat16 weights: a rounding more
            return logits * (1 + 2**-8 * (len(x) - 1))
        logits = logits.float()
        return logits * (1 + 1e-4 * (len(x) - 1)) if torch.is_autocast_enabled("cpu") else logits


def test_the_check_of_examples_apart_runs_without_autocast():
    """The check that runs the first two examples together and alone does so with autocast off, and allows 16
    roundings of an output dtype coarser than float32, so that rounding which differs between batch sizes is not
    taken for examples that mix: under autocast, and with bfloat16 weights, the recipes keep the fast path. (With
    the check under autocast, or at float32's tolerance for bfloat16 outputs, the model above is refused.)"""
    torch.manual_seed(20)
    model, loss_fn = RoundsByBatchSize(), lambda out, t: F.cross_entropy(out.float(), t)  # noqa: E731
    x = torch.randn(B, D, generator=torch.Generator().manual_seed(21))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, how = tfr.per_sample_grads(model, loss_fn, x, TARGETS, report=True)
    assert how.path == "fast", how
    _, how = tfr.per_sample_grads(model.to(torch.bfloat16), loss_fn, x.to(torch.bfloat16), TARGETS, report=True)
    assert how.path == "fast", how
