"""Every recipe of the package (torch_func_recipes, the `recipes` fixture of conftest.py), exercised on models beyond its chapter's example (linear, 1-D and
2-D convolutions, an embedding, LayerNorm, GroupNorm, a small attention block, a model with buffers
in eval mode), in float64 on the CPU, against plain loops."""
import copy
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def close(a, b, rtol=1e-10):
    torch.testing.assert_close(a, b, rtol=rtol, atol=1e-12)
    return True


class Model(nn.Module):
    """The modules and parameters given, under their names, and a forward function of (model, x)."""

    def __init__(self, forward, **parts):
        super().__init__()
        self.fn = forward
        for name, part in parts.items():
            setattr(self, name, part)

    def forward(self, x):
        return self.fn(self, x)


def zoo():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    bn = nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 6 * 6, 3))
    bn(torch.randn(8, 1, 8, 8, generator=g))
    bn.eval()
    models = {
        "linear": (nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)), torch.randn(5, 6, generator=g)),
        "conv1d": (nn.Sequential(nn.Conv1d(2, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 9, 3)),
                   torch.randn(5, 2, 9, generator=g)),
        "conv2d": (nn.Sequential(nn.Conv2d(1, 4, 3, stride=2), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 3 * 3, 3)),
                   torch.randn(5, 1, 8, 8, generator=g)),
        # groups: two groups with padding and dilation, a depthwise convolution with a stride (ConvNeXt's kind), then
        # two groups on one output position (its weight's norm by pairs of positions, "ghost")
        "grouped conv2d": (nn.Sequential(nn.Conv2d(4, 6, 3, groups=2, padding=2, dilation=2), nn.ReLU(),
                                         nn.Conv2d(6, 6, 3, groups=6, stride=2), nn.Tanh(), nn.Conv2d(6, 8, 3, groups=2),
                                         nn.Flatten(), nn.Linear(8, 3)),
                           torch.randn(5, 4, 8, 8, generator=g)),
        "grouped conv1d": (nn.Sequential(nn.Conv1d(4, 6, 3, groups=2, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(6 * 9, 3)),
                           torch.randn(5, 4, 9, generator=g)),
        "embedding": (nn.Sequential(nn.Embedding(11, 4), nn.Flatten(), nn.Linear(12, 3)), torch.randint(11, (5, 3), generator=g)),
        "LayerNorm": (nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3)), torch.randn(5, 6, generator=g)),
        "GroupNorm": (nn.Sequential(nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)),
                      torch.randn(5, 1, 8, 8, generator=g)),
        "attention": (Model(lambda m, x: m.head(m.norm(x + m.attention(x, x, x, need_weights=False)[0]).mean(dim=1)),
                            attention=nn.MultiheadAttention(8, 2, batch_first=True), norm=nn.LayerNorm(8), head=nn.Linear(8, 3)),
                      torch.randn(5, 4, 8, generator=g)),  # self-attention on (B, T, E), then a head on the mean token
        "buffers, eval mode": (bn, torch.randn(5, 1, 8, 8, generator=g)),
    }
    return {name: (model.double(), x.double() if x.is_floating_point() else x) for name, (model, x) in models.items()}


ZOO = zoo()
TARGETS = torch.randint(3, (5,), generator=torch.Generator().manual_seed(2))


def loop_per_sample(model, x, t):
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    rows = [torch.autograd.grad(F.cross_entropy(model(xi[None]), ti[None]), [p for _, p in named]) for xi, ti in zip(x, t)]
    return {n: torch.stack([r[i] for r in rows]) for i, (n, _) in enumerate(named)}


def grad_rows(outputs, model):
    """One row per entry of `outputs`: its gradient in every trainable parameter, by plain autograd."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.stack([torch.cat([a.reshape(-1) for a in torch.autograd.grad(o, params, retain_graph=True, materialize_grads=True)])
                        for o in outputs.reshape(-1)])


def loop_output_jacobian(model, x):
    return torch.stack([grad_rows(model(xi[None])[0], model) for xi in x])


def loop_norms(model, x, t):
    return torch.cat([g.flatten(1) for g in loop_per_sample(model, x, t).values()], dim=1).norm(dim=1)


def test_clip_and_noise(recipes):
    model, x = ZOO["conv2d"]
    per_sample, norms = loop_per_sample(model, x, TARGETS), loop_norms(model, x, TARGETS)
    max_norm = norms.median().item()
    got = recipes["clip_and_noise"](per_sample, max_norm, 0.0)
    scale = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    assert all(close(got[k], sum(scale[i] * g[i] for i in range(len(x))) / len(x)) for k, g in per_sample.items())


def test_pairwise_jacobian_hvp(recipes):
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(4, 6, generator=g, dtype=torch.float64), torch.randn(5, 6, generator=g, dtype=torch.float64)
    cosine = lambda u, v: torch.dot(u, v) / (u.norm() * v.norm())
    assert close(recipes["pairwise"](cosine)(a, b), torch.stack([torch.stack([cosine(u, v) for v in b]) for u in a]))
    f = lambda m: torch.tanh(m @ m.T).sum(dim=0)  # a matrix in, a vector out
    m = torch.randn(3, 4, generator=g, dtype=torch.float64)
    assert close(recipes["jacobian_via_vjp"](f, m), torch.autograd.functional.jacobian(f, m))
    assert close(recipes["jacobian_via_vjp"](f, m, chunk_size=2), torch.autograd.functional.jacobian(f, m))
    for empty, at in ((lambda m: f(m)[:0], m), (lambda m: f(m), m[:, :0])):  # no output entries: jacrev's empty shape
        assert recipes["jacobian_via_vjp"](empty, at).shape == torch.func.jacrev(empty)(at).shape
    scalar = lambda m: torch.logsumexp(f(m), dim=0)
    v = torch.randn(3, 4, generator=g, dtype=torch.float64)
    hessian = torch.autograd.functional.hessian(scalar, m).reshape(12, 12)
    assert close(recipes["hvp"](scalar, m, v), (hessian @ v.reshape(12)).reshape(3, 4))


# ---------------------------------------------------------------------------------------------
# Real models (book/11_real_models.md, issue 15): a small transformer with a padding mask, LSTM and
# GRU, and a block under torch.utils.checkpoint. vmap cannot run the last three (in float64), so
# per_sample_grads and output_jacobian must take the unroll (LSTM, GRU) or the loop, report it, and
# still equal the loop; a user's own error inside forward must still raise.

def tiny_transformer(m, tokens):
    """Embedding, one encoder layer that ignores padding tokens (id 0), mean over real tokens, head."""
    pad = tokens == 0
    h = m.encoder(m.embed(tokens), src_key_padding_mask=pad)
    keep = (~pad).unsqueeze(-1).to(h.dtype)
    return m.head((h * keep).sum(1) / keep.sum(1))


class RecurrentHead(nn.Module):
    """Examples along dim 0 of (B, T, 3); a head reads the last output and every final state (so their
    order is checked too). hx: learned initial states; unbatched: each sequence on its own, as 2-D."""

    def __init__(self, rnn, hx=False, unbatched=False):
        super().__init__()
        self.rnn, self.unbatched = rnn, unbatched
        lstm, directions = isinstance(rnn, nn.LSTM), 2 if rnn.bidirectional else 1
        states, width = rnn.num_layers * directions, rnn.proj_size or rnn.hidden_size
        self.h0 = nn.Parameter(torch.randn(states, 1, width)) if hx else None
        self.c0 = nn.Parameter(torch.randn(states, 1, rnn.hidden_size)) if hx and lstm else None
        self.head = nn.Linear(width * (states + directions) + lstm * rnn.hidden_size * states, 3)

    def run(self, x):  # x: (B, T, 3) or, unbatched, (T, 3)
        batch_dim = None if x.dim() == 2 else (0 if self.rnn.batch_first else 1)
        initial = lambda p: p[:, 0] if batch_dim is None else p.expand(-1, x.shape[0], -1)
        hx = None if self.h0 is None else initial(self.h0) if self.c0 is None else (initial(self.h0), initial(self.c0))
        out, state = self.rnn(x.transpose(0, 1) if batch_dim == 1 else x, hx)
        states = state if isinstance(state, tuple) else (state,)
        if batch_dim is None:
            return torch.cat([out[-1], *(s.flatten() for s in states)])
        last = out[:, -1] if batch_dim == 0 else out[-1]
        return torch.cat([last, *(s.transpose(0, 1).flatten(1) for s in states)], dim=-1)

    def forward(self, x):
        return self.head(torch.stack([self.run(seq) for seq in x]) if self.unbatched else self.run(x))


def checkpointed(norm):
    """A block recomputed in the backward pass. With linear layers only, the fast path's trace accepts
    it (its products need no saved tensors of vmap's); a LayerNorm inside sends it to vmap, which
    cannot run saved tensor hooks, and so to the loop."""
    block = lambda m, x: torch.tanh(m.outer(m.norm(torch.tanh(m.inner(x)))))
    return Model(lambda m, x: m.head(checkpoint(block, m, x, use_reentrant=False)), inner=nn.Linear(6, 8),
                 outer=nn.Linear(8, 8), head=nn.Linear(8, 3), norm=nn.LayerNorm(8) if norm else nn.Identity())


def real_models():
    torch.manual_seed(4)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(1, 11, (5, 6), generator=g)
    for n, length in enumerate([6, 4, 2, 5, 1]):
        tokens[n, length:] = 0  # padding at the end of each sequence
    data = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)
    return {  # a head on the last output and the final states (RecurrentHead): the unroll's states are checked too
        "transformer": (Model(tiny_transformer, embed=nn.Embedding(11, 8),
                              encoder=nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True),
                              head=nn.Linear(8, 3)).double(), tokens, "vmap"),
        "LSTM": (RecurrentHead(nn.LSTM(3, 6, batch_first=True)).double(), data(5, 4, 3), "unroll"),
        "GRU": (RecurrentHead(nn.GRU(3, 6, batch_first=True)).double(), data(5, 4, 3), "unroll"),
        "checkpoint, linear only": (checkpointed(False).double(), data(5, 6), "fast"),
        "checkpoint with LayerNorm": (checkpointed(True).double(), data(5, 6), "fast"),  # the trace runs it batched
    }


REAL = real_models()
# Every model, with the path the recipes must take (None: not prescribed).
ALL_MODELS = {**{name: (model, x, None) for name, (model, x) in ZOO.items()}, **REAL}


def check_paths(call, same, expected_path):
    """The path a recipe takes on its own, chunks, the loop, and the vmap path: all equal to the loop, but
    where vmap alone cannot run the model, the vmap path raises (the fallback is what makes these work)."""
    got, report = call(report=True)
    assert same(got) and report.path == (expected_path or report.path), report
    assert same(call(chunk_size=2)) and same(call(path="loop"))
    if expected_path in (None, "vmap"):
        assert same(call(path="vmap"))
    elif expected_path in ("loop", "unroll"):
        with pytest.raises(RuntimeError) as raised:
            call(path="vmap")
        # torch's error names a shape or a kernel; a note names the layer and the path that runs it (none without one)
        notes = getattr(raised.value, "__notes__", [])
        if sys.version_info >= (3, 11):  # exceptions take notes from 3.11 on
            assert any("path='unroll' or 'auto' computes it step by step" in note for note in notes) == (expected_path == "unroll")
    if expected_path == "unroll":  # forced
        assert same(call(path="unroll"))


@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("name", list(ALL_MODELS))
def test_per_sample_grads(recipes, name):
    model, x, expected_path = ALL_MODELS[name]
    expected = loop_per_sample(model, x, TARGETS)
    same = lambda got: list(got) == list(expected) and all(close(got[k], expected[k]) for k in expected)
    grads = lambda **options: recipes["per_sample_grads"](model, F.cross_entropy, x, TARGETS, **options)
    check_paths(grads, same, expected_path)
    buffers = {k: torch.full_like(v, float("nan")) for k, v in expected.items()}
    assert all(v is buffers[k] for k, v in grads(out=buffers).items()) and same(buffers)
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            assert same(grads())
    one = recipes["per_sample_grads"](model, F.cross_entropy, x[:1], TARGETS[:1])
    assert all(close(one[k], expected[k][:1]) for k in expected)
    empty = recipes["per_sample_grads"](model, F.cross_entropy, x[:0], TARGETS[:0])
    assert all(empty[k].shape == (0, *v.shape[1:]) for k, v in expected.items())
    assert all("forward" not in vars(m) for m in model.modules())  # an unrolled layer has its fused forward back


@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("name", list(ALL_MODELS))
def test_output_jacobian_and_ntk(recipes, name):
    model, x, expected_path = ALL_MODELS[name]
    expected = loop_output_jacobian(model, x)
    jacobian = lambda inputs=x, **options: recipes["output_jacobian"](model, inputs, **options)
    check_paths(jacobian, lambda got: close(got, expected), expected_path)
    buffer = torch.full_like(expected, float("nan"))
    assert jacobian(out=buffer) is buffer and close(buffer, expected)
    with torch.inference_mode():
        frozen_x = x.clone()
        assert close(jacobian(), expected)
    with torch.no_grad():
        assert close(jacobian(frozen_x), expected) and close(jacobian(x[:1]), expected[:1])
    try:  # an empty batch: Y from the model's output on it, where the model runs on one
        with torch.no_grad():
            model(x[:0])
    except RuntimeError:
        with pytest.raises(ValueError, match="the batch is empty, and the model cannot run on an empty batch"):
            jacobian(x[:0])
    else:
        assert jacobian(x[:0]).shape == (0, *expected.shape[1:])
    pieces = recipes["split_by_parameter"](expected, model)
    assert list(pieces) == [n for n, p in model.named_parameters() if p.requires_grad]
    assert all(piece.shape[2:] == p.shape for piece, p in zip(pieces.values(), model.parameters()))
    assert close(recipes["empirical_ntk"](model, x[:3], x[3:]), torch.einsum("aip,bjp->abij", expected[:3], expected[3:]))


def buggy_gru(m, x):
    """A genuine mistake in forward (adding a (2, 6) tensor to a (B, 6) state): the loop meets it too, and raises it."""
    h = m.rnn(x)[0][:, -1]
    if m.bug == "value":
        raise ValueError("my own check failed")
    return m.head(h.add_(torch.ones(2, 6, dtype=h.dtype)))


@pytest.mark.parametrize("bug", ["value", "shape"])
def test_users_own_error_still_raises(recipes, bug):
    """From every recipe that falls back to the loop where vmap raised: the loop's error, chained to vmap's."""
    model = Model(buggy_gru, rnn=nn.GRU(3, 6, batch_first=True), head=nn.Linear(6, 3), bug=bug).double()
    x, ones = REAL["GRU"][1], torch.ones(5, dtype=torch.float64)
    # per_sample_grad_norms first runs one example through the model (to find its linear layers): the
    # mistake is raised there, before vmap; the others meet it under vmap, then in the loop
    for call, chained in ((lambda: recipes["per_sample_grads"](model, F.cross_entropy, x, TARGETS), True),
                          (lambda: recipes["output_jacobian"](model, x), True),
                          (lambda: recipes["per_sample_grad_norms"](model, F.cross_entropy, x, TARGETS), False),
                          (lambda: recipes["clipped_noisy_gradient"](
                              model, F.cross_entropy, x, TARGETS, norms=ones, max_norm=1.0, noise_multiplier=0.0), True)):
        with pytest.raises(ValueError if bug == "value" else RuntimeError, match="my own check|must match|size of tensor|broadcast") as raised:
            call()
        assert type(raised.value.__cause__) is (type(raised.value) if chained else type(None))


def snapshot(model):
    """What the recipes must leave as it was, module by module: the class, the attribute names (so no
    instance `forward`), and which objects its parameters, buffers, submodules and flat weights are."""
    ids = lambda d: {k: id(v) for k, v in d.items()}
    return [(type(m), sorted(vars(m)), ids(m._parameters), ids(m._buffers), ids(m._modules),
             [id(w) for w in getattr(m, "_flat_weights", [])]) for m in model.modules()]


def rnn_then_head(m, x):
    h = m.rnn(x)[0][:, -1]
    if m.broken:
        raise ValueError("broken on purpose")
    return m.head(h)


@pytest.mark.parametrize("kind", [nn.GRU, nn.LSTM])
def test_the_unroll_never_changes_the_users_model(recipes, kind):
    """The unroll runs vmap on a stand-in sharing the model's parameters: nothing is assigned on the
    user's recurrent layer or its parents, during the call (a forward pre-hook on the layer looks) or
    after it, whether the call returns or raises."""
    torch.manual_seed(8)
    model = Model(rnn_then_head, rnn=kind(3, 6, batch_first=True), head=nn.Linear(6, 3), broken=False).double()
    x, rnn, seen = REAL["GRU"][1], model.rnn, []
    rnn.register_forward_pre_hook(lambda module, args: seen.append((module is rnn, "forward" in vars(rnn))))
    before = snapshot(model)
    calls = {"per_sample_grads": lambda **o: recipes["per_sample_grads"](model, F.cross_entropy, x, TARGETS, **o),
             "output_jacobian": lambda **o: recipes["output_jacobian"](model, x, **o),
             "per_sample_grad_norms": lambda **o: recipes["per_sample_grad_norms"](model, F.cross_entropy, x, TARGETS, **o)}
    for name, call in calls.items():
        for broken, path in [(False, "auto"), (True, "auto"), (True, "unroll")]:
            model.broken, seen[:] = broken, []
            if broken:
                with pytest.raises(ValueError, match="broken on purpose"):
                    call(path=path)
            else:
                assert call(report=True)[1].path == "unroll"
            if not (broken and name == "per_sample_grad_norms"):  # which raises on its first, plain run of one example
                assert any(not on_users for on_users, _ in seen), f"{name}: the stand-in never ran"
            assert not any(assigned for _, assigned in seen), f"{name}: forward was assigned on the user's layer"
            assert snapshot(model) == before, name
            assert type(rnn) is kind and type(rnn).forward is kind.forward


class SharedGRU(nn.Module):
    """One GRU reached under two names (rnn and block.0): the stand-in must unroll it on both paths."""

    def __init__(self):
        super().__init__()
        self.rnn, self.head = nn.GRU(3, 4, batch_first=True), nn.Linear(8, 3)
        self.block = nn.Sequential(self.rnn)

    def forward(self, x):
        return self.head(torch.cat([self.rnn(x)[0][:, -1], self.block(x)[0][:, -1]], dim=-1))


def test_the_stand_in_covers_shared_layers_and_a_recurrent_root(recipes):
    torch.manual_seed(9)
    x = REAL["GRU"][1]
    model = SharedGRU().double()
    stand_in = recipes["_unrolled_stand_in"](model, recipes["_unrollable"](model))
    assert stand_in.rnn is stand_in.block[0] and stand_in.rnn is not model.rnn and stand_in.head is model.head
    assert [n for n, _ in stand_in.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert all(p is q for p, q in zip(stand_in.parameters(), model.parameters()))
    before = snapshot(model)
    grads, report = recipes["per_sample_grads"](model, F.cross_entropy, x, TARGETS, report=True)
    expected = loop_per_sample(model, x, TARGETS)
    assert report.path == "unroll" and all(close(grads[k], expected[k]) for k in expected) and snapshot(model) == before
    root = nn.LSTM(3, 3, batch_first=True).double()  # the model is the recurrent layer itself
    last_step = lambda out, t: F.cross_entropy(out[0][:, -1], t)
    before = snapshot(root)
    grads, report = recipes["per_sample_grads"](root, last_step, x, TARGETS, report=True)
    expected = {n: torch.stack([torch.autograd.grad(last_step(root(x[i : i + 1]), TARGETS[i : i + 1]), p)[0] for i in range(len(x))])
                for n, p in root.named_parameters()}
    assert report.path == "unroll" and all(close(grads[k], expected[k]) for k in expected) and snapshot(root) == before


# Recurrent layers on the unroll path (torch_func_recipes/_vmap_gaps.py): every option nn.RNNBase has, through
# both recipes, against the loop (which runs the fused kernel) in float64 at close()'s 1e-10. A plain
# one-layer LSTM and GRU are REAL's, through every recipe and option above.
class DoublingGRU(nn.GRU):
    """Overrides forward: the unroll must leave it alone (vmap fails on it, so the loop runs)."""

    def forward(self, input, hx=None):
        output, h = super().forward(input, hx)
        return 2 * output, h


class PlainSubclassGRU(nn.GRU):
    """Keeps nn.GRU's forward: the unroll computes it."""


def packed(m, x):  # whole sequences, packed then unpacked
    sequences = nn.utils.rnn.pack_padded_sequence(x, [x.shape[1]] * len(x), batch_first=True)
    return m.head(nn.utils.rnn.pad_packed_sequence(m.rnn(sequences)[0], batch_first=True)[0][:, -1])


RECURRENT = {  # name: (factory, expected path)
    "RNN relu, 2 layers, no bias": (lambda: RecurrentHead(nn.RNN(3, 5, 2, nonlinearity="relu", bias=False, batch_first=True)), "unroll"),
    "GRU 2 layers bidirectional, time-major": (lambda: RecurrentHead(nn.GRU(3, 5, 2, bidirectional=True)), "unroll"),
    "LSTM proj_size, bidirectional": (lambda: RecurrentHead(nn.LSTM(3, 5, proj_size=2, bidirectional=True, batch_first=True)), "unroll"),
    "LSTM dropout, eval mode": (lambda: RecurrentHead(nn.LSTM(3, 5, 2, dropout=0.5, batch_first=True)).eval(), "unroll"),
    "GRU dropout=1, training (zeros between layers)": (lambda: RecurrentHead(nn.GRU(3, 5, 2, dropout=1.0, batch_first=True)), "unroll"),
    "LSTM explicit hx, time-major": (lambda: RecurrentHead(nn.LSTM(3, 5, 2), hx=True), "unroll"),
    "RNN tanh explicit hx": (lambda: RecurrentHead(nn.RNN(3, 5, batch_first=True), hx=True), "unroll"),
    "GRU unbatched input, hx": (lambda: RecurrentHead(nn.GRU(3, 5, bidirectional=True), hx=True, unbatched=True), "unroll"),
    "subclass keeping forward": (lambda: RecurrentHead(PlainSubclassGRU(3, 5, batch_first=True)), "unroll"),
    "subclass overriding forward": (lambda: RecurrentHead(DoublingGRU(3, 5, batch_first=True)), "loop"),
    "PackedSequence": (lambda: Model(packed, rnn=nn.GRU(3, 5, batch_first=True), head=nn.Linear(5, 3)), "loop"),
    "GRU under checkpoint": (  # unrolled, vmap still meets checkpointing's gap, so the loop runs
        lambda: Model(lambda m, x: m.head(checkpoint(lambda x: m.rnn(x)[0][:, -1], x, use_reentrant=False)),
                      rnn=nn.GRU(3, 5, batch_first=True), head=nn.Linear(5, 3)), "loop"),
}


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # pack_padded_sequence under vmap
@pytest.mark.parametrize("name", list(RECURRENT))
def test_recurrent_layers(recipes, name):
    factory, expected_path = RECURRENT[name]
    torch.manual_seed(6)
    model = factory().double()
    x = torch.randn(5, 4, 3, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    grads, report = recipes["per_sample_grads"](model, F.cross_entropy, x, TARGETS, report=True)
    expected = loop_per_sample(model, x, TARGETS)
    assert report.path == expected_path and all(close(grads[k], expected[k]) for k in expected), report
    jacobian, report = recipes["output_jacobian"](model, x, report=True)
    assert report.path == expected_path and close(jacobian, loop_output_jacobian(model, x))
    if expected_path == "unroll":
        forced = recipes["per_sample_grads"](model, F.cross_entropy, x, TARGETS, path="unroll")
        assert all(close(forced[k], expected[k]) for k in expected)
    else:  # forced, the unroll refuses (or leaves the layer alone) and says so; under checkpoint, vmap's gap is raised
        checkpointed = "checkpoint" in name
        with pytest.raises(RuntimeError if checkpointed else ValueError, match=None if checkpointed else "unroll"):
            recipes["output_jacobian"](model, x, path="unroll")
    assert all("forward" not in vars(m) for m in model.modules())  # the fused forward is back


def test_a_wrong_unroll_is_caught(recipes):
    """The equality check guards the unroll: the GRU's gates taken in the wrong order (z, r, n) fail it."""
    model, x, _ = REAL["GRU"]
    cells, right = recipes["_CELLS"], recipes["_CELLS"]["GRU"]
    swap = lambda t: torch.cat([*t.chunk(3, 0)[1::-1], t.chunk(3, 0)[2]])  # (r, z, n) -> (z, r, n) along the gates
    cells["GRU"] = lambda gi, h, c, w: right(swap(gi.movedim(-1, 0)).movedim(0, -1), h, c, {**w, "weight_hh": swap(w["weight_hh"])})
    try:
        wrong = recipes["output_jacobian"](model, x)
    finally:
        cells["GRU"] = right
    assert not torch.allclose(wrong, loop_output_jacobian(model, x), rtol=1e-10, atol=1e-12)
    assert close(recipes["output_jacobian"](model, x), loop_output_jacobian(model, x))


# ---------------------------------------------------------------------------------------------
# Per-sample gradient norms without B·P (book/11_real_models.md): per_sample_grad_norms equals the norms
# of the loop's per-example gradients on every model above, and clipped_noisy_gradient equals clip_and_noise
# applied to the loop's per-example gradients. The norms' fast path (one traced batched pass; LayerNorm,
# GroupNorm, eval-mode BatchNorm and embedding weights as layers of their own) is taken exactly where the trace
# covers every parameter; anything else (nn.MultiheadAttention's in_proj_weight, say) goes to vmap, the unroll
# or the loop:
NORMS_PATH = {"attention": "vmap", "transformer": "vmap", "LSTM": "unroll", "GRU": "unroll"}


@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("name", list(ALL_MODELS))
def test_per_sample_grad_norms_and_clipped_step(recipes, name):
    model, x, _ = ALL_MODELS[name]
    per_sample, expected = loop_per_sample(model, x, TARGETS), loop_norms(model, x, TARGETS)
    norms_of = lambda x, t, **options: recipes["per_sample_grad_norms"](model, F.cross_entropy, x, t, **options)
    norms, report = norms_of(x, TARGETS, report=True)
    assert close(norms, expected) and report.path == NORMS_PATH.get(name, "fast"), report.reason
    assert close(norms_of(x, TARGETS, chunk_size=2), expected)
    with torch.inference_mode():  # inputs made under inference mode, and a call under no_grad
        frozen_x, frozen_t = x.clone(), TARGETS.clone()
    with torch.no_grad():
        assert close(norms_of(frozen_x, frozen_t), expected)
    assert norms_of(x[:0], TARGETS[:0]).shape == (0,)
    assert sorted(report.ghost + report.direct + report.streamed) == sorted(n for n, p in model.named_parameters() if p.requires_grad)
    max_norm = expected.median().item()
    for noise, generator in [(0.0, lambda: None), (0.5, lambda: torch.Generator().manual_seed(9))]:
        step = recipes["clipped_noisy_gradient"](model, F.cross_entropy, x, TARGETS, norms=norms, max_norm=max_norm,
                                                 noise_multiplier=noise, generator=generator())
        reference = recipes["clip_and_noise"](per_sample, max_norm, noise, generator())
        assert step.keys() == reference.keys() and all(close(step[k], reference[k]) for k in step)
    # without norms: one forward pass gives both, on the fast path by book-keeping (each layer kind's own formula)
    step = recipes["clipped_noisy_gradient"](model, F.cross_entropy, x, TARGETS, max_norm=max_norm, noise_multiplier=0.0)
    reference = recipes["clip_and_noise"](per_sample, max_norm, 0.0)
    assert step.keys() == reference.keys() and all(close(step[k], reference[k]) for k in step)


@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_norms_use_the_token_pairs_on_linear_layers_and_catch_a_missing_share(recipes):
    model, x, _ = REAL["transformer"]
    norms, report = recipes["per_sample_grad_norms"](model, F.cross_entropy, x, TARGETS, report=True)
    assert report.path == "vmap" and "head.weight" in report.ghost and "encoder.linear1.weight" in report.ghost
    assert "embed.weight" in report.streamed and "encoder.self_attn.in_proj_weight" in report.streamed
    model.head.bias.requires_grad_(False)  # one parameter's share left out: the norms must differ
    try:
        assert not torch.allclose(recipes["per_sample_grad_norms"](model, F.cross_entropy, x, TARGETS), norms)
    finally:
        model.head.bias.requires_grad_(True)


def test_norms_fast_path_padding_rows_and_a_model_that_mixes_examples(recipes):
    norms = recipes["per_sample_grad_norms"]
    tokens = REAL["transformer"][1]  # padding id 0, repeated ids within a sequence
    padded = nn.Sequential(nn.Embedding(11, 4, padding_idx=0), nn.LayerNorm(4), nn.Flatten(), nn.Linear(24, 3)).double()
    found, report = norms(padded, F.cross_entropy, tokens, TARGETS, report=True)
    assert report.path == "fast" and "0.weight" in report.ghost and close(found, loop_norms(padded, tokens, TARGETS))
    padded[0].padding_idx = None  # the padding row's share counted: the norms must differ
    assert not torch.allclose(norms(padded, F.cross_entropy, tokens, TARGETS), found)
    # the batched pass subtracts the batch mean, so it mixes examples: no example has a norm of its own
    mixer = Model(lambda m, tokens: m.head((lambda h: h - h.mean(0))(m.norm(m.embed(tokens)).mean(1))),
                  embed=nn.Embedding(11, 4, padding_idx=0), norm=nn.LayerNorm(4), head=nn.Linear(4, 3)).double()
    for path in ("auto", "fast", "vmap", "loop"):  # refused on every path, before any trace
        with pytest.raises(ValueError, match="depends on the other examples of the batch"):
            norms(mixer, F.cross_entropy, tokens, TARGETS, path=path)
    batch = recipes["_as_batch"](tokens, TARGETS, (), {})  # and the trace sees it on its own
    _, _, why = recipes["_run_trace"](mixer, batch, dict(mixer.named_parameters()), "norms", None)
    assert "works along the batch dimension" in why, why


def test_norms_edge_cases_and_errors(recipes):
    model, x = ZOO["linear"]
    norms, step, ce = recipes["per_sample_grad_norms"], recipes["clipped_noisy_gradient"], F.cross_entropy
    assert close(norms(model, ce, x[:1], TARGETS[:1]), loop_norms(model, x[:1], TARGETS[:1]))
    calls = [(lambda: norms(model, ce, x, TARGETS[:3]), "one row per example"),
             (lambda: norms(model, ce, x, TARGETS, chunk_size=0), "chunk_size"),
             (lambda: norms(model, lambda p, t: ce(p, t, reduction="none").expand(2), x, TARGETS), "scalar"),
             (lambda: step(model, ce, x, TARGETS, norms=torch.ones(3, dtype=torch.float64), max_norm=1.0, noise_multiplier=0.0), "one norm per example"),
             (lambda: step(model, ce, x, TARGETS, norms=torch.ones(5, dtype=torch.float64), max_norm=0.0, noise_multiplier=0.0), "max_norm")]
    for call, message in calls:
        with pytest.raises(ValueError, match=message):
            call()


def ensemble_members(name, count=3):
    """`count` copies of a zoo model whose floating-point parameters differ."""
    members = [copy.deepcopy(ZOO[name][0]) for _ in range(count)]
    with torch.no_grad():
        for k, member in enumerate(members):
            for p in member.parameters():
                p.add_(0.1 * k)
    return members


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # SDPA under vmap: a known, measured fallback
@pytest.mark.parametrize("name", list(ZOO))
def test_stack_models(recipes, name):
    """One batch for all models, one batch per model (in_dims=(0, 0, 0)), and gradients: the gradient of the
    summed per-model losses, sliced at model i, is model i's own gradient."""
    _, x = ZOO[name]
    members = ensemble_members(name)
    forward, params, buffers = recipes["stack_models"](members)
    assert close(forward(params, buffers, x), torch.stack([m(x) for m in members]))
    xs = torch.stack([x.roll(k, dims=0) for k in range(len(members))])
    assert close(forward(params, buffers, xs, per_model_batches=True), torch.stack([m(xi) for m, xi in zip(members, xs)]))
    trainable = {n: p for n, p in params.items() if p.requires_grad}
    losses = torch.vmap(F.cross_entropy, in_dims=(0, None))(forward(params, buffers, x), TARGETS)
    stacked = dict(zip(trainable, torch.autograd.grad(losses.sum(), list(trainable.values()))))
    for i, member in enumerate(members):
        named = [(n, p) for n, p in member.named_parameters() if p.requires_grad]
        own = torch.autograd.grad(F.cross_entropy(member(x), TARGETS), [p for _, p in named])
        assert all(close(stacked[n][i], g) for (n, _), g in zip(named, own))


def test_stack_models_keeps_the_stacked_mode_and_refuses_mixed_modes(recipes):
    """Model 0 switched to train mode after stacking (BatchNorm would then use batch statistics) does not
    change the ensemble's output; models in different modes are refused."""
    _, x = ZOO["buffers, eval mode"]
    members = ensemble_members("buffers, eval mode")
    forward, params, buffers = recipes["stack_models"](members)
    before = forward(params, buffers, x)
    members[0].train()
    assert torch.equal(forward(params, buffers, x), before)
    with pytest.raises(ValueError, match="train/eval mode"):
        recipes["stack_models"](members)
    members[0].eval()
    assert close(before, torch.stack([m(x) for m in members]))


class Tempered(nn.Module):
    """A linear layer whose logits are divided by a temperature, a plain attribute (not a parameter or buffer)."""

    def __init__(self, temperature):
        super().__init__()
        self.lin, self.temperature = nn.Linear(6, 3), temperature

    def forward(self, x):
        return self.lin(x) / self.temperature


def test_stack_models_refuses_models_whose_attributes_or_hooks_differ(recipes):
    """The ensemble runs model 0's modules with every model's parameters and buffers: models whose temperature
    differed ran with model 0's (model 1 off by a factor of 10), a tensor attribute likewise (5.0 off), and a model
    with a forward hook of its own ran without it (147 off). Refused, naming the module and the attribute; models
    that agree stack as before."""
    torch.manual_seed(8)
    x = torch.randn(4, 6, dtype=torch.float64)
    members = [Tempered(1.0).double(), Tempered(1.0).double()]
    forward, params, buffers = recipes["stack_models"](members)
    assert close(forward(params, buffers, x), torch.stack([m(x) for m in members]))
    members[1].temperature = 10.0
    with pytest.raises(ValueError, match="model 1's top module differs from model 0's in its attribute 'temperature'"):
        recipes["stack_models"](members)
    members[1].temperature, members[1].lin.scale = 1.0, torch.ones(3)
    with pytest.raises(ValueError, match="model 1's lin differs from model 0's in its attribute 'scale'"):
        recipes["stack_models"](members)
    del members[1].lin.scale
    members[1].lin.register_forward_hook(lambda module, args, out: out * 100)
    with pytest.raises(ValueError, match="model 1's lin differs from model 0's in its forward hooks"):
        recipes["stack_models"](members)


@pytest.mark.parametrize("name", ["conv1d", "conv2d", "grouped conv2d", "grouped conv1d", "GroupNorm", "buffers, eval mode"])
@pytest.mark.parametrize("threshold", [0, 10**12])
def test_both_ways_to_a_convolutions_per_example_weights(name, threshold, monkeypatch):
    """A convolution's per-example weight gradients, and their norms where token pairs would cost more, come from
    im2col or, for large patches, from the batch gradient's kernel with the examples as groups (on a CPU, a
    depthwise layer's from a forward convolution), whichever is faster for the layer's size: each way, on every
    convolution model of the zoo, they equal the loop (the zoo's layers are small, so without the patch only
    im2col would run)."""
    import torch_func_recipes as tfr
    import torch_func_recipes._layer_conv as conv

    monkeypatch.setattr(conv, "_PATCHES_FOR_THE_KERNEL", threshold)
    model, x = ZOO[name]
    got, report = tfr.per_sample_grads(model, F.cross_entropy, x, TARGETS, report=True)
    expected = loop_per_sample(model, x, TARGETS)
    assert report.path == "fast" and all(close(got[k], expected[k]) for k in expected)
    norms, report = tfr.per_sample_grad_norms(model, F.cross_entropy, x, TARGETS, report=True)
    assert report.path == "fast" and close(norms, torch.cat([g.flatten(1) for g in expected.values()], 1).norm(dim=1))
    assert "0.weight" in report.direct, report  # the first convolution's weight took one of the two direct ways


def test_small_recipes_take_a_generator_and_say_what_is_wrong(recipes):
    """named_like_parameters read a generator twice (its check used it up: "the tuple has 0 tensors") and called a
    None gradient a dict; stack_models met lazy modules with load_state_dict's message."""
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2)).double()
    grads = torch.autograd.grad(model(torch.ones(1, 3, dtype=torch.float64)).sum(), tuple(model.parameters()))
    named = recipes["named_like_parameters"](model, (g for g in grads))
    assert list(named) == [n for n, _ in model.named_parameters()] and all(named[n] is g for n, g in zip(named, grads))
    with pytest.raises(TypeError, match="entry 0 is None .*allow_unused=True, materialize_grads=True"):
        recipes["named_like_parameters"](model, (None, *grads[1:]))
    with pytest.raises(ValueError, match="model 0 has lazy parameters not yet initialised"):
        recipes["stack_models"]([nn.LazyLinear(2), nn.LazyLinear(2)])
