"""scripts/gpu_table.py, the GPU table of Chapter 11, runs anywhere with --quick: its checks (every recipe against
plain vmap(grad) on six transformers families, float32 and bfloat16 autocast) pass, and a recipe that is wrong
stops it before any timing. The timing cells are skipped here (--deadline 0): a timing never decides a test."""
import json
import re

import pytest
import torch

import torch_func_recipes as tfr
from scripts import gpu_table

pytest.importorskip("transformers")
# vmap(grad), the reference, runs scaled_dot_product_attention by its slow fallback, and says so: a note, not a fault
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop")


def run(tmp_path):
    out = tmp_path / "table.json"
    gpu_table.main(["--quick", "--deadline", "0", "--out", str(out)])
    return json.loads(out.read_text())


def test_the_checks_pass_and_every_family_takes_the_fast_path(tmp_path):
    record = run(tmp_path)
    assert set(record["checks"]) == {"GPT-2", "BERT", "Llama", "ResNet (BN eval)", "ConvNeXt", "ViT"}
    for name, check in record["checks"].items():
        assert check["paths"] == ["fast"] * 3 and check["bf16 path"] == "fast", (name, check)
    assert record["cells"] == []  # past the deadline: nothing timed


def test_a_wrong_recipe_stops_the_table(tmp_path, monkeypatch):
    right = tfr.per_sample_grad_norms

    def off_by_a_little(*args, **kwargs):  # every norm 1e-4 too large: float32 would never explain it
        norms, how = right(*args, **kwargs)
        return norms * (1 + 1e-4), how

    monkeypatch.setattr(tfr, "per_sample_grad_norms", off_by_a_little)
    with pytest.raises(AssertionError, match="disagree with vmap.*norms"):
        run(tmp_path)


def test_bfloat16_no_worse_than_vmap_is_checked(tmp_path, monkeypatch):
    right = tfr.per_sample_grads

    def rounded_too_much(*args, **kwargs):  # under autocast, noise of 5% of each gradient's largest entry: far past bfloat16's rounding
        grads, how = right(*args, **kwargs)
        if torch.is_autocast_enabled("cpu"):
            grads = {n: g + 0.05 * g.abs().max() * torch.randn_like(g) for n, g in grads.items()}
        return grads, how

    monkeypatch.setattr(tfr, "per_sample_grads", rounded_too_much)
    with pytest.raises(AssertionError, match="bf16 grads"):
        run(tmp_path)


def test_the_cpu_table_options_narrow_the_run(tmp_path, monkeypatch):
    """--families, --sizes, --dtypes and --methods pick what is checked and timed (one tiny cell is timed here;
    its times are not looked at), and the record names the processor and, on a CPU too, each call's peak memory. The baselines are always timed, the DP
    step's noise among them: the P Gaussian numbers of the whole model."""
    drawn, right = [], tfr.noised_mean

    def counted(clipped_sum, **kwargs):
        drawn.append(sum(t.numel() for t in clipped_sum.values()))
        return right(clipped_sum, **kwargs)

    monkeypatch.setattr(tfr, "noised_mean", counted)
    out = tmp_path / "table.json"
    gpu_table.main(["--quick", "--families", "Llama", "--sizes", "4", "--dtypes", "float32", "--rounds", "1",
                    "--methods", "per_sample_grads", "--out", str(out)])
    record = json.loads(out.read_text())
    assert list(record["checks"]) == ["Llama"]
    assert [(c["family"], c["B"], c["dtype"]) for c in record["cells"]] == [("Llama", 4, "float32")]
    assert set(record["cells"][0]["ratios"]) == {"batch", "write B*P", "noise", "per_sample_grads"}
    assert drawn and set(drawn) == {record["cells"][0]["P"]}
    if not torch.cuda.is_available():  # peak memory, counted on a CPU too: the copy into a buffer creates nothing,
        peak = record["cells"][0]["peak / BP"]  # the per-example gradients are B*P floats and more
        assert set(peak) == set(record["cells"][0]["ratios"]) and peak["write B*P"] == 0 and peak["per_sample_grads"] >= 1
    assert torch.cuda.is_available() or "threads" in record["hardware"]


def test_the_profile_names_each_call_and_its_time(tmp_path, capsys):
    """--profile times one profiled call of the batch gradient and of each recipe, in float32 and under bfloat16
    autocast, against the time the GPU spent in kernels (none on a CPU), with each recipe's top operations."""
    gpu_table.main(["--quick", "--profile", "--families", "Llama", "--sizes", "4", "--out", str(tmp_path / "t.json")])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("== ")]
    calls = [line.split(": wall")[0].removeprefix("== Llama B=4 ") for line in lines]
    assert calls == [f"{dtype} {call}" for dtype in ("f32", "bf16") for call in ("batch", "per_sample_grads", "norms", "DP step")]
    for line in lines:
        wall, busy = (float(v) for v in re.findall(r"wall ([\d.]+) ms \(profiled\), device kernels ([\d.]+) ms", line)[0])
        assert wall > 0 and (busy > 0 if torch.cuda.is_available() else busy == 0), line
