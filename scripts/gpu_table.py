"""The GPU table of Chapter 11 (Real models): every recipe beside plain vmap(grad) and Opacus, on a GPU.

For each model family (small configurations of `transformers` models, random weights, nothing downloaded),
batch size and precision (float32 with TF32 off, or bfloat16 under autocast), each method's time is the
median over interleaved rounds of its ratio to the same round's batch gradient; peak memory is what the
call allocates beyond the model and data, as a multiple of B*P float32 numbers (all per-example gradients at
once; on a CPU, the bytes of the tensors the call creates, counted by book/_shared/measure.py). Before timing,
the recipes are checked against plain vmap(grad) on each family in float32. Two baselines
are timed beside them: writing B*P floats (a batch gradient plus that is the floor of per_sample_grads) and the DP
step's noise, P Gaussian numbers (a batch gradient plus that is the DP step's floor).

    python -m scripts.gpu_table                  # on a CUDA machine; writes gpu_table.json beside it
    python -m scripts.gpu_table --quick          # tiny sizes, any device: checks that the script runs
    python -m scripts.gpu_table --sizes 16 --tokens 32 --dtypes float32 --rounds 5   # the CPU table of issue 28

Opacus (hooks and ghost clipping) is timed where it is installed and answers.
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.func import functional_call, grad, vmap  # noqa: E402
from torch.utils.benchmark import Timer  # noqa: E402

import torch_func_recipes as tfr  # noqa: E402

C = 3  # classes


def families(quick: bool, T: int):
    """(name, build, input key, make inputs(B, generator), select logits) for each family."""
    import transformers

    H = 32 if quick else 256
    tiny = dict(num_hidden_layers=2, num_attention_heads=4, intermediate_size=2 * H)
    text = lambda B, g: torch.randint(1, 500, (B, T), generator=g)  # noqa: E731
    image = lambda B, g: torch.randn(B, 3, 32, 32, generator=g)  # noqa: E731
    last = lambda o: o.logits[:, -1, :C]  # noqa: E731
    logits = lambda o: o.logits  # noqa: E731

    def resnet():
        m = transformers.ResNetForImageClassification(transformers.ResNetConfig(
            num_channels=3, embedding_size=H // 4, hidden_sizes=[H // 4, H // 2], depths=[1, 1], num_labels=C))
        m.train()(pixel_values=torch.randn(32, 3, 32, 32, generator=torch.Generator().manual_seed(3)))  # running statistics
        return m

    yield "GPT-2", lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=500, n_positions=T, n_embd=H, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)), "input_ids", text, last
    yield "BERT", lambda: transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=500, hidden_size=H, max_position_embeddings=T, num_labels=C, **tiny)), "input_ids", text, logits
    yield "Llama", lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=500, hidden_size=H, num_key_value_heads=2, max_position_embeddings=T, bos_token_id=0, eos_token_id=0,
        **tiny)), "input_ids", text, last
    yield "ResNet (BN eval)", resnet, "pixel_values", image, logits
    yield "ConvNeXt", lambda: transformers.ConvNextForImageClassification(transformers.ConvNextConfig(
        num_channels=3, hidden_sizes=[H // 4, H // 2], depths=[1, 1], num_stages=2, num_labels=C, image_size=32)), "pixel_values", image, logits
    yield "ViT", lambda: transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=32, patch_size=8 if quick else 4, num_channels=3, hidden_size=H, num_labels=C, **tiny)), "pixel_values", image, logits


class Head(nn.Module):
    """What Opacus is given: model(x) -> (B, C) logits, in training mode (Opacus records activations only then)
    with every dropout at p = 0, so that it computes what the eval-mode model does."""

    def __init__(self, model, key, select):
        super().__init__()
        self.model, self.key, self.select = model, key, select
        self.train()
        for m in self.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0
            for attr in ("dropout_prob", "attention_dropout", "dropout"):
                if isinstance(getattr(m, attr, None), float):
                    setattr(m, attr, 0.0)

    def forward(self, x):
        return self.select(self.model(**{self.key: x}))


def opacus_ways(model, key, select, x, y, notes):
    ways = {}
    try:
        from opacus import GradSampleModule, PrivacyEngine
    except ImportError:
        notes.append("Opacus not installed")
        return ways
    try:
        gsm = GradSampleModule(Head(copy.deepcopy(model), key, select))

        def hooks():
            for p in gsm.parameters():
                p.grad_sample = None
                p.grad = None
            F.cross_entropy(gsm(x).float(), y).backward()
            return [p.grad_sample for p in gsm.parameters()]

        hooks()
        ways["Opacus hooks"] = hooks
    except Exception as e:  # noqa: BLE001 (a peer that fails is reported, not timed)
        notes.append(f"Opacus hooks: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
    try:
        head = Head(copy.deepcopy(model), key, select)
        opt = torch.optim.SGD(head.parameters(), lr=0.0)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=len(x))
        pm, popt, crit, _ = PrivacyEngine().make_private(
            module=head, optimizer=opt, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
            grad_sample_mode="ghost", criterion=nn.CrossEntropyLoss(), poisson_sampling=False)

        def ghost():
            popt.zero_grad()
            crit(pm(x).float(), y).backward()
            popt.step()

        ghost()
        ways["Opacus ghost DP step"] = ghost
    except Exception as e:  # noqa: BLE001
        notes.append(f"Opacus ghost: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
    return ways


@functools.cache
def _measure():
    """The book's own measuring module, book/_shared/measure.py (loaded from its file: it is no package)."""
    spec = importlib.util.spec_from_file_location("measure", Path(__file__).resolve().parents[1] / "book" / "_shared" / "measure.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _peak_tensor_memory(f) -> int:
    """The peak bytes of the tensors f() creates, by the book's own counter (a dispatch mode: the same count on any
    device, and what the chapters' CPU memory figures use)."""
    return _measure().peak_tensor_memory(f)


def _cpu_name() -> str:
    """The CPU's model name (Linux), its threads as torch uses them, and whether huge pages are asked for."""
    name = "CPU"
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    pages = "huge pages" if os.environ.get("THP_MEM_ALLOC_ENABLE") == "1" else "no huge pages"
    return f"{name}, {torch.get_num_threads()} threads, {pages}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="gpu_table.json")
    parser.add_argument("--deadline", type=float, default=450.0, help="seconds after which no new cell is started")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--methods", type=lambda v: v.split(","), default=None, help="comma-separated: time only these (and the baselines)")
    parser.add_argument("--profile", action="store_true", help="profile the first family's batch gradient and recipes at the first size, and stop")
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--sizes", type=lambda v: tuple(int(b) for b in v.split(",")), default=None, help="batch sizes, comma-separated")
    parser.add_argument("--tokens", type=int, default=None, help="sequence length of the text models (default 128)")
    parser.add_argument("--dtypes", type=lambda v: v.split(","), default=["float32", "bfloat16"], help="float32 and/or bfloat16")
    parser.add_argument("--families", type=lambda v: v.split(","), default=None, help="comma-separated: only these families")
    args = parser.parse_args(argv)
    for note in ("There is a performance drop", "Full backward hook is firing", "Secure RNG turned off"):  # vmap's
        warnings.filterwarnings("ignore", message=note)  # fallbacks, Opacus's hooks and its seeded noise: notes, not faults
    start = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32; bfloat16 is asked for by autocast
    torch.backends.cudnn.allow_tf32 = False
    sizes = args.sizes or ((4, 8) if args.quick else (64, 256, 1024))
    T = args.tokens or (16 if args.quick else 128)
    hardware = torch.cuda.get_device_name() if device.type == "cuda" else _cpu_name()
    print(f"{hardware}, torch {torch.__version__}, B in {sizes}, T = {T}", flush=True)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    record: dict = {"hardware": hardware, "torch": torch.__version__, "checks": {}, "cells": []}

    def save():
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)

    built = []
    torch.manual_seed(0)
    for name, build, key, make, select in families(args.quick, T):
        if args.families and name not in args.families:
            continue
        model = build().eval().to(device)
        built.append((name, model, key, make, select))
        if args.skip_checks or args.profile:
            continue
        # correctness: the recipes against plain vmap(grad), float32, the smallest batch
        g = torch.Generator().manual_seed(1)
        x, y = make(8, g).to(device), torch.randint(0, C, (8,), generator=g).to(device)
        loss = lambda out, t, select=select: F.cross_entropy(select(out).float(), t)  # noqa: E731
        params = {n: p.detach() for n, p in model.named_parameters()}

        def one(p, xi, ti, model=model, key=key, loss=loss):
            return loss(functional_call(model, p, (), {key: xi[None]}), ti[None])

        ref = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
        flat = lambda d: torch.cat([v.flatten(1) for v in d.values()], 1)  # noqa: E731
        got, rep = tfr.per_sample_grads(model, loss, targets=y, report=True, **{key: x})
        norms, rep_n = tfr.per_sample_grad_norms(model, loss, targets=y, report=True, **{key: x})
        clipped, rep_c = tfr.clipped_grad_sum(model, loss, targets=y, max_norm=1e-2, report=True, **{key: x})
        ref_flat = flat(ref)
        # the reference's norms and clipped sum in float64: torch.linalg.vector_norm on a CPU accumulates a row in
        # float32 (pytorch#169237), 1e-4 off for GPT-2's 1.7M parameters at T = 32, more than the recipes' error
        ref_norms = ref_flat.double().norm(dim=1)
        ref_clipped = (ref_flat.double() * (1e-2 / ref_norms).clamp(max=1)[:, None]).sum(0)
        check = {
            "paths": [rep.path, rep_n.path, rep_c.path],
            "grads": ((flat(got) - ref_flat).norm() / ref_flat.norm()).item(),
            "norms": ((norms - ref_norms).abs() / ref_norms).max().item(),
            "clipped sum": ((torch.cat([clipped[n].flatten() for n in ref]) - ref_clipped).norm() / ref_clipped.norm()).item(),
        }
        with torch.autocast(device.type, dtype=torch.bfloat16):  # bfloat16: the recipe's error and vmap's, from float32
            low = tfr.per_sample_grads(model, loss, targets=y, report=True, **{key: x})
            check["bf16 path"] = low[1].path
            check["bf16 grads"] = ((flat(low[0]) - ref_flat).norm() / ref_flat.norm()).item()
            try:
                check["bf16 vmap grads"] = ((flat(vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)) - ref_flat).norm() / ref_flat.norm()).item()
            except Exception as e:  # noqa: BLE001
                check["bf16 vmap grads"] = f"{type(e).__name__}: {str(e)[:60]}"
        record["checks"][name] = check
        # float32: the recipes and vmap(grad) add the same products in other orders, a few roundings of 6e-8 each
        # (1e-6 was the largest difference seen, on an H100 and on a CPU); bfloat16: no further from float32 than
        # vmap(grad) under the same autocast, where that runs, with room for rounding in another order
        wrong = [k for k in ("grads", "norms", "clipped sum") if not check[k] < 1e-5]
        bf16_vmap = check["bf16 vmap grads"]
        if isinstance(bf16_vmap, float) and not check["bf16 grads"] <= 1.25 * bf16_vmap:
            wrong.append("bf16 grads")
        if wrong:
            save()
            raise AssertionError(f"{name}: the recipes disagree with vmap(grad) ({', '.join(wrong)}): {check}")
        print(f"check {name}: P = {ref_flat.shape[1]:,}, {check}", flush=True)
        del ref, got, ref_flat
    save()

    if args.profile:  # where the time of one call goes: the GPU's busy time against the wall clock, and the top operations
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile
        name, model, key, make, select = built[0]
        g = torch.Generator().manual_seed(2)
        x, y = make(sizes[0], g).to(device), torch.randint(0, C, (sizes[0],), generator=g).to(device)
        loss = lambda out, t: F.cross_entropy(select(out).float(), t)  # noqa: E731
        calls = (("batch", lambda: torch.autograd.grad(loss(model(**{key: x}), y), list(model.parameters()))),
                 ("per_sample_grads", lambda: tfr.per_sample_grads(model, loss, targets=y, **{key: x})),
                 ("norms", lambda: tfr.per_sample_grad_norms(model, loss, targets=y, **{key: x})),
                 ("DP step", lambda: tfr.clipped_noisy_gradient(model, loss, targets=y, max_norm=1.0, noise_multiplier=1.0,
                                                                generator=torch.Generator(device).manual_seed(0), **{key: x})))
        for low in (False, True):
            for what, f in calls:
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=low):
                    f()
                    f()
                    sync()
                    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
                    with profile(activities=activities) as prof:
                        begin = time.perf_counter()
                        f()
                        sync()
                        wall = (time.perf_counter() - begin) * 1e3
                events = prof.key_averages()
                # the kernels' own events (an operation's device time repeats its kernels'), memory copies and sets included
                busy = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / 1e3
                print(f"== {name} B={sizes[0]} {'bf16' if low else 'f32'} {what}: wall {wall:.2f} ms (profiled), "
                      f"device kernels {busy:.2f} ms", flush=True)
                if what != "batch":
                    print(events.table(sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=50))
        return
    timer = lambda f: Timer("f()", globals={"f": f}, num_threads=torch.get_num_threads()).blocked_autorange(min_run_time=0.05 if args.quick else 0.1).median  # noqa: E731
    for dtype in [getattr(torch, d) for d in args.dtypes]:
        for B in sizes:
            for name, model, key, make, select in built:
                if time.perf_counter() - start > args.deadline:
                    print(f"deadline: {name} B={B} {dtype} not started", flush=True)
                    continue
                g = torch.Generator().manual_seed(2)
                x, y = make(B, g).to(device), torch.randint(0, C, (B,), generator=g).to(device)
                loss = lambda out, t, select=select: F.cross_entropy(select(out).float(), t)  # noqa: E731
                params = {n: p.detach() for n, p in model.named_parameters()}
                P = sum(p.numel() for p in params.values())
                autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype is torch.bfloat16)  # noqa: E731
                notes: list = []
                peak: dict = {}
                try:
                    flat_out, flat_src = torch.empty(B * P, device=device), torch.ones(B * P, device=device)
                    zeros = {n: torch.zeros_like(p) for n, p in params.items()}

                    def one(p, xi, ti, model=model, key=key, loss=loss):
                        return loss(functional_call(model, p, (), {key: xi[None]}), ti[None])

                    def under(f):
                        def run():
                            with autocast():
                                return f()
                        return run

                    ways = {
                        "batch": under(lambda: torch.autograd.grad(loss(model(**{key: x}), y), list(model.parameters()))),
                        "write B*P": lambda: flat_out.copy_(flat_src),
                        "vmap(grad)": under(lambda: vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)),
                        "per_sample_grads": under(lambda: tfr.per_sample_grads(model, loss, targets=y, **{key: x})),
                        "vmap(grad)+norms": under(lambda: torch.cat(
                            [v.flatten(1) for v in vmap(grad(one), in_dims=(None, 0, 0))(params, x, y).values()], 1).norm(dim=1)),
                        "norms": under(lambda: tfr.per_sample_grad_norms(model, loss, targets=y, **{key: x})),
                        "DP step": under(lambda: tfr.clipped_noisy_gradient(model, loss, targets=y, max_norm=1.0, noise_multiplier=1.0,
                                                                            generator=torch.Generator(device).manual_seed(0), **{key: x})),
                        "DP step (CPU noise)": under(lambda: tfr.clipped_noisy_gradient(
                            model, loss, targets=y, max_norm=1.0, noise_multiplier=1.0, generator=torch.Generator().manual_seed(0), **{key: x})),
                        # the DP step's noise alone (P Gaussian numbers, drawn as the step draws them): a batch gradient
                        # plus this is the DP step's floor, as a batch gradient plus writing B*P floats is per_sample_grads'
                        "noise": lambda: tfr.noised_mean(zeros, max_norm=1.0, noise_multiplier=1.0, expected_batch_size=B,
                                                         generator=torch.Generator(device).manual_seed(0)),
                    }
                    if args.methods:
                        ways = {k: f for k, f in ways.items() if k in ("batch", "write B*P", "noise") or k in args.methods}
                    for k in list(ways):  # a method that fails here is reported, not timed
                        try:
                            ways[k]()
                        except Exception as e:  # noqa: BLE001
                            notes.append(f"{k}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
                            del ways[k]
                    if not args.methods or any(k.startswith("Opacus") for k in args.methods):
                        with autocast():
                            peers = opacus_ways(model, key, select, x, y, notes)
                        ways.update({k: under(f) for k, f in peers.items() if not args.methods or k in args.methods})
                    with autocast():
                        paths = [tfr.per_sample_grads(model, loss, targets=y, report=True, **{key: x})[1].path,
                                 tfr.per_sample_grad_norms(model, loss, targets=y, report=True, **{key: x})[1].path]

                    if device.type == "cuda":
                        for k, f in ways.items():
                            sync()
                            torch.cuda.empty_cache()
                            base = torch.cuda.memory_allocated()
                            torch.cuda.reset_peak_memory_stats()
                            f()
                            sync()
                            peak[k] = (torch.cuda.max_memory_allocated() - base) / (4 * B * P)
                    else:  # the bytes of the tensors each call creates, counted as Chapter 11 counts its CPU figures
                        for k, f in ways.items():
                            peak[k] = _peak_tensor_memory(f) / (4 * B * P)
                    ratios: dict = {k: [] for k in ways}
                    batch_ms = []
                    for _ in range(args.rounds):
                        times = {k: timer(f) for k, f in ways.items()}
                        batch_ms.append(times["batch"] * 1e3)
                        for k in ways:
                            ratios[k].append(times[k] / times["batch"])
                    med = {k: statistics.median(v) for k, v in ratios.items()}
                    cell = {"family": name, "B": B, "dtype": str(dtype).replace("torch.", ""), "P": P, "paths": paths,
                            "batch ms": statistics.median(batch_ms), "ratios": med, "peak / BP": peak, "notes": notes}
                except torch.cuda.OutOfMemoryError as e:
                    cell = {"family": name, "B": B, "dtype": str(dtype).replace("torch.", ""), "P": P, "notes": notes + [f"out of memory: {str(e)[:80]}"]}
                finally:
                    ways = {}
                    flat_out = flat_src = zeros = None
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                record["cells"].append(cell)
                save()
                shown = ", ".join(f"{k} {v:.2f}" for k, v in cell.get("ratios", {}).items() if k != "batch")
                print(f"{name} B={B} {cell['dtype']} P={P:,} paths {cell.get('paths')} batch {cell.get('batch ms', 0):.2f} ms: {shown}"
                      + ("; peak/BP " + ", ".join(f"{k} {v:.2f}" for k, v in peak.items()) if cell.get("peak / BP") else "")
                      + (f"; notes {notes}" if notes else ""), flush=True)
    print(f"done in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
