"""The fast path's newer layer kinds (issue 28, item 1): LayerNorm and embeddings in per_sample_grads, a position
embedding every example shares (broadcast over the batch), transformers' Conv1D (GPT-2's projections),
scaled_dot_product_attention with and without a mask, a model that returns a pytree (a ModelOutput) and a cache
concatenated to an empty tensor. Each model takes the path named in its case, and its per-sample gradients and
norms equal the loop (every example as a batch of one, plain autograd) in float64. The adversarial cases (item 5)
break one assumption each, a lookup used twice, a tied table, a mask or keys that mix examples, a projection
called twice, and must be refused by the trace (another path, still equal to the loop)."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import torch_func_recipes as tfr  # noqa: E402

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
    default), the token table is also the output layer's weight: refused, and still equal to the loop."""
    model = gpt2(tie)
    loss_fn = lambda out, t: F.cross_entropy(out.logits[:, -1, :C], t)  # noqa: E731
    grads, how = tfr.per_sample_grads(model, loss_fn, targets=TARGETS, report=True, input_ids=IDS)
    norms, how_norms = tfr.per_sample_grad_norms(model, loss_fn, targets=TARGETS, report=True, input_ids=IDS)
    assert (how.path, how_norms.path) == (("vmap", "vmap") if tie else ("fast", "fast")), (how, how_norms)
    reference = tfr.per_sample_grads(model, loss_fn, targets=TARGETS, path="loop", input_ids=IDS)
    for name in reference:
        torch.testing.assert_close(grads[name], reference[name], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(norms, norms_of(reference), rtol=1e-10, atol=1e-12)


def test_a_conv1d_called_twice_is_refused():
    model = gpt2(False)
    block = model.transformer.h[0].mlp
    forward = block.forward
    block.forward = lambda h: forward(forward(h))  # the same projections twice
    try:
        _, how = tfr.per_sample_grads(model, lambda out, t: F.cross_entropy(out.logits[:, -1, :C], t),
                                      targets=TARGETS, report=True, input_ids=IDS)
    finally:
        del block.forward
    assert how.path == "vmap" and "used twice" in how.reason, how


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
    grads, how = tfr.per_sample_grads(model, F.cross_entropy, images, TARGETS, report=True)
    norms, how_norms = tfr.per_sample_grad_norms(model, F.cross_entropy, images, TARGETS, report=True)
    J, how_jacobian = tfr.output_jacobian(model, images, report=True)
    assert (how.path, how_norms.path, how_jacobian.path) == ("fast", "fast", "fast"), (how, how_norms, how_jacobian)
    reference = loop_grads(model, F.cross_entropy, images, TARGETS)
    for name in reference:
        torch.testing.assert_close(grads[name], reference[name], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(norms, norms_of(reference), rtol=1e-10, atol=1e-12)
    params = [p for p in model.parameters() if p.requires_grad]
    rows = [torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(o, params, retain_graph=True)]) for o in model(x[None])[0]])
            for x in images]
    torch.testing.assert_close(J, torch.stack(rows), rtol=1e-10, atol=1e-12)
    if "BatchNorm" in case:  # refused before anything runs, naming the layer
        with pytest.raises(ValueError, match="is a BatchNorm in training mode"):
            tfr.per_sample_grads(model.train(), F.cross_entropy, images, TARGETS)
