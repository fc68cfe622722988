"""Hugging Face models called as they are (issue 27, item 2): tiny, randomly initialised GPT-2, BERT with its usual
2-D padding mask, Llama (RMSNorm, rotary embeddings, grouped key-value heads), transformers' own ResNet (BatchNorm
in eval mode), a ViT and a ConvNeXt (depthwise convolutions, a layer scale), built from configs (HF_HUB_OFFLINE=1:
nothing is downloaded), called with their own keyword inputs, their ModelOutput handed to loss_fn. Every per-example
recipe equals the per-example loop in float64, and takes the path recorded in PATHS (the closing notes' table); Opacus's hooks are shown wrong for position
embeddings broadcast over the batch, and right elsewhere."""
import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402

import torch_func_recipes as tfr  # noqa: E402

# vmap runs transformers' scaled_dot_product_attention by its slow fallback and says so: a note, not a fault
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop")
D = torch.float64
B, T, V, C = 4, 6, 50, 3  # examples, tokens, vocabulary, classes
g = torch.Generator().manual_seed(0)
IDS = torch.randint(1, V, (B, T), generator=g)
MASK = torch.ones(B, T, dtype=torch.long)
MASK[1, 4:], MASK[3, 3:] = 0, 0  # two padded sequences: the 2-D mask a tokenizer returns
PIXELS = torch.randn(B, 3, 16, 16, generator=g, dtype=D)
LABELS = torch.randint(0, C, (B,), generator=g)
TINY = dict(num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)


def gpt2():
    config = transformers.GPT2Config(vocab_size=V, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config), {"input_ids": IDS}, lambda out: out.logits[:, -1, :C]


def bert():
    config = transformers.BertConfig(vocab_size=V, hidden_size=16, max_position_embeddings=16, num_labels=C, **TINY)
    return transformers.BertForSequenceClassification(config), {"input_ids": IDS, "attention_mask": MASK}, lambda out: out.logits


def llama():
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=16, num_key_value_heads=1, max_position_embeddings=16,
                                      bos_token_id=0, eos_token_id=0, **TINY)
    return transformers.LlamaForCausalLM(config), {"input_ids": IDS, "attention_mask": MASK}, lambda out: out.logits[:, -1, :C]


def resnet():
    config = transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=C)
    model = transformers.ResNetForImageClassification(config)
    model.train()(pixel_values=torch.randn(16, 3, 16, 16, generator=torch.Generator().manual_seed(1)))  # running statistics
    return model, {"pixel_values": PIXELS}, lambda out: out.logits


def vit():
    config = transformers.ViTConfig(image_size=16, patch_size=8, num_channels=3, hidden_size=16, num_labels=C, **TINY)
    return transformers.ViTForImageClassification(config), {"pixel_values": PIXELS}, lambda out: out.logits


def convnext():  # depthwise convolutions, a channels-last LayerNorm, a layer scale per feature
    config = transformers.ConvNextConfig(num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=C,
                                         image_size=16, layer_scale_init_value=0.5)
    return transformers.ConvNextForImageClassification(config), {"pixel_values": PIXELS}, lambda out: out.logits


BUILDERS = {"GPT-2": gpt2, "BERT, 2-D padding mask": bert, "Llama, 2-D padding mask": llama, "ResNet, BatchNorm in eval mode": resnet, "ViT": vit,
            "ConvNeXt": convnext}
# The path each recipe takes on each model today, and why (the fast path covers linear, conv, GPT-2's Conv1D,
# LayerNorm, RMSNorm, GroupNorm, eval-mode BatchNorm, embeddings and parameters every example receives whole, such as
# ViT's class token and ConvNeXt's layer scale, and grouped convolutions such as ConvNeXt's depthwise ones; GPT-2's
# LM head ties its weight to the token table, used twice; the ResNet's shortcut added in place into a BatchNorm output
# is allowed; tests/test_fast_paths.py has GPT-2 untied and a Llama without a mask).
# A 2-D padding mask (BERT's, Llama's) meets a data-dependent check inside transformers (a .all() on the mask),
# which vmap cannot run: the recipes fall back to the loop, and stay right.
# GPT-2 ties its embedding and output weights: the fast path adds the two uses' shares (and, for the norms,
# their cross term)
PATHS = {"GPT-2": "fast", "BERT, 2-D padding mask": "loop", "Llama, 2-D padding mask": "loop", "ResNet, BatchNorm in eval mode": "fast", "ViT": "fast",
         "ConvNeXt": "fast"}


def build(name):
    torch.manual_seed(0)
    model, batch, select = BUILDERS[name]()
    return model.to(D).eval(), batch, select


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def loop_rows(model, batch, f):
    """f(model(**example n)) differentiated by plain autograd, one example at a time: (B, rows of f, P)."""
    out = []
    for n in range(B):
        value = f(model(**{k: v[n:n + 1] for k, v in batch.items()}), n).reshape(-1)
        out.append(torch.stack([torch.cat([a.flatten() for a in torch.autograd.grad(v, trainable(model), retain_graph=True,
                                                                                      allow_unused=True, materialize_grads=True)])
                                for v in value]))
    return torch.stack(out)


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12 * max(1.0, b.abs().max().item()))
    return True


@pytest.mark.parametrize("name", list(BUILDERS))
def test_every_per_example_recipe_equals_the_loop_on_hugging_face_models(name):
    model, batch, select = build(name)
    loss_fn = lambda out, t: F.cross_entropy(select(out), t)  # noqa: E731  (out: the model's ModelOutput)
    G = loop_rows(model, batch, lambda out, n: loss_fn(out, LABELS[n:n + 1]))[:, 0]  # (B, P)
    grads, report = tfr.per_sample_grads(model, loss_fn, targets=LABELS, report=True, **batch)
    assert close(torch.cat([g.flatten(1) for g in grads.values()], dim=1), G)
    assert report.path == PATHS[name], report
    norms, report = tfr.per_sample_grad_norms(model, loss_fn, targets=LABELS, report=True, **batch)
    assert close(norms, G.norm(dim=1)) and report.path == PATHS[name]
    step = tfr.clipped_noisy_gradient(model, loss_fn, targets=LABELS, max_norm=0.5 * G.norm(dim=1).median().item(),
                                      noise_multiplier=0.0, expected_batch_size=B, **batch)
    clip = (0.5 * G.norm(dim=1).median() / (G.norm(dim=1) + 1e-6)).clamp(max=1.0)
    assert close(torch.cat([s.flatten() for s in step.values()]), (clip[:, None] * G).sum(0) / B)
    J, report = tfr.output_jacobian(model, select=select, report=True, **batch)
    assert close(J, loop_rows(model, batch, lambda out, n: select(out)[0])) and report.path == PATHS[name]


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True")
def test_gradient_checkpointing_is_right_or_refused_by_name():
    """model.activation_checkpointing_enable() (gradient_checkpointing_enable before transformers 5; it runs in training
    mode; dropout 0 here): transformers' default, non-reentrant, keeps every path right; use_reentrant=True, whose blocks autograd.grad cannot reach, is
    refused on every path, naming the first parameters (before: torch's own error from the checkpoint's backward)."""
    model, batch, select = build("GPT-2")
    loss_fn = lambda out, t: F.cross_entropy(select(out), t)  # noqa: E731
    G = loop_rows(model, batch, lambda out, n: loss_fn(out, LABELS[n:n + 1]))[:, 0]
    model.config.resid_pdrop = model.config.embd_pdrop = model.config.attn_pdrop = 0.0
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    model.activation_checkpointing_enable()
    model.train()
    for path in ("auto", "loop"):
        norms = tfr.per_sample_grad_norms(model, loss_fn, targets=LABELS, path=path, **batch)
        assert close(norms, G.norm(dim=1))
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    for path in ("auto", "loop"):
        refusal = "^transformer.h.0.ln_1.weight, .* more parameters: read inside a custom autograd.Function's forward.*use_reentrant=True"
        with pytest.raises(ValueError, match=refusal):
            tfr.per_sample_grad_norms(model, loss_fn, targets=LABELS, path=path, **batch)


def test_a_dict_of_inputs_and_keyword_inputs_are_the_same_call():
    model, batch, select = build("BERT, 2-D padding mask")
    loss_fn = lambda out, t: F.cross_entropy(select(out), t)  # noqa: E731
    as_dict = tfr.per_sample_grads(model, loss_fn, batch, LABELS)  # the dict a data collator returns
    as_keywords = tfr.per_sample_grads(model, loss_fn, targets=LABELS, **batch)
    assert all(torch.equal(as_dict[n], as_keywords[n]) for n in as_dict)


def test_an_unbatched_input_reaches_every_example_whole():
    """GPT-2's position_ids of shape (1, T): named in unbatched=, every example receives it as it is (here shifted by
    two positions, so the answer differs from the default positions and the test can fail)."""
    model, batch, select = build("GPT-2")
    positions = torch.arange(2, 2 + T)[None]
    loss_fn = lambda out, t: F.cross_entropy(select(out), t)  # noqa: E731
    grads = tfr.per_sample_grads(model, loss_fn, targets=LABELS, unbatched="position_ids", position_ids=positions, **batch)
    G = loop_rows(model, {**batch}, lambda out, n: loss_fn(out, LABELS[n:n + 1]))[:, 0]
    shifted = []
    for n in range(B):
        loss = loss_fn(model(input_ids=IDS[n:n + 1], position_ids=positions), LABELS[n:n + 1])
        shifted.append(torch.cat([a.flatten() for a in torch.autograd.grad(loss, trainable(model), materialize_grads=True)]))
    flat = torch.cat([g.flatten(1) for g in grads.values()], dim=1)
    assert close(flat, torch.stack(shifted)) and not torch.allclose(flat, G)


def test_a_wrong_batch_size_names_its_argument():
    model, batch, select = build("BERT, 2-D padding mask")
    with pytest.raises(ValueError, match=r"inputs\['attention_mask'\] has 3 rows along dimension 0 but inputs\['input_ids'\] has 4"):
        tfr.per_sample_grads(model, lambda out, t: F.cross_entropy(out.logits, t), targets=LABELS, input_ids=IDS, attention_mask=MASK[:3])


def test_output_jacobian_of_a_model_output_asks_for_a_selector():
    model, batch, _ = build("ViT")
    with pytest.raises((TypeError, ValueError), match="select"):
        tfr.output_jacobian(model, **batch)


@pytest.mark.parametrize("name", ["GPT-2", "BERT, 2-D padding mask"])
def test_opacus_sums_a_position_embedding_over_the_batch_where_the_package_does_not(name):
    """A learned position embedding is looked up with the same positions for every example, so its output is
    broadcast over the batch; Opacus's embedding hook then returns one (1, T, d) "per-sample" gradient, the sum over
    the batch, where each example has its own. Every other parameter agrees with the loop (in training mode with
    dropout off, as Opacus records activations only in training mode), and so does the package everywhere."""
    from opacus import GradSampleModule

    torch.manual_seed(0)
    if name == "GPT-2":
        config = transformers.GPT2Config(vocab_size=V, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0,
                                         pad_token_id=0, num_labels=C, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model, batch, position = transformers.GPT2ForSequenceClassification(config), {"input_ids": IDS}, "transformer.wpe.weight"
    else:
        config = transformers.BertConfig(vocab_size=V, hidden_size=16, max_position_embeddings=16, num_labels=C,
                                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **TINY)
        model, batch = transformers.BertForSequenceClassification(config), {"input_ids": IDS, "attention_mask": MASK}
        position = "bert.embeddings.position_embeddings.weight"
    model = model.to(D).train()
    loss_fn = lambda out, t: F.cross_entropy(out.logits, t, reduction="sum")  # noqa: E731
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    G = loop_rows(model, batch, lambda out, n: loss_fn(out, LABELS[n:n + 1]))[:, 0]
    mine = tfr.per_sample_grads(model, loss_fn, targets=LABELS, **batch)
    assert close(torch.cat([mine[n].flatten(1) for n in names], dim=1), G)
    wrapped = GradSampleModule(model, loss_reduction="sum")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing")  # Opacus's own hooks
        loss_fn(wrapped(**batch), LABELS).backward()
    theirs = {n: p.grad_sample for n, p in model.named_parameters() if p.requires_grad}
    sizes = [mine[n][0].numel() for n in names]
    loop = dict(zip(names, G.split(sizes, dim=1)))
    wrong = [n for n in names if theirs[n].shape != mine[n].shape or not torch.allclose(theirs[n], mine[n], rtol=1e-9, atol=1e-12)]
    assert wrong == [position]
    assert theirs[position].shape == (1, *mine[position].shape[1:])
    assert close(theirs[position][0].flatten(), loop[position].sum(0))  # the batch's gradient, not any example's
    wrapped._close()
