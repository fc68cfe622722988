"""The GPU figures Real models prints in its tables are those of the recorded runs in
book/_data/gpu_h100_2026-11-27.json (rounded to two places): a table edited by hand, or a run
recorded without its table updated, fails here. Where a cell has words instead of a number (Opacus
refusing a model), the run has no figure for it."""
import json
import re

import pytest

from bookcheck import ROOT

RUNS = json.loads((ROOT / "book" / "_data" / "gpu_h100_2026-11-27.json").read_text())
CHAPTER = (ROOT / "book" / "11_real_models.md").read_text()
FAMILIES = {"GPT-2 (tied)": "GPT-2", "ResNet": "ResNet (BN eval)"}

# Each table: the line that heads it, the run it shows, and each column as (dtype, what) after the name.
TABLES = {
    "table": ("| B = 1024, float32 | P |", [("float32", "P"), ("float32", "floor"), ("float32", "per_sample_grads"),
              ("float32", "vmap(grad)"), ("float32", "norms"), ("float32", "DP step"), ("float32", "Opacus hooks"),
              ("float32", "Opacus ghost DP step")]),
    "cnn_after": ("| | `per_sample_grads` f32 | bf16 | `vmap(grad)` f32 |",
                  [("float32", "per_sample_grads"), ("bfloat16", "per_sample_grads"), ("float32", "vmap(grad)"),
                   ("float32", "norms"), ("bfloat16", "norms"), ("float32", "DP step"), ("bfloat16", "DP step"),
                   ("float32", "Opacus hooks"), ("bfloat16", "Opacus hooks")]),
}


def table_rows(text: str, head: str) -> dict[str, list[str]]:
    """The rows of the markdown table whose header line starts with `head`: name -> cells."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(head))
    rows = {}
    for line in lines[start + 2:]:
        if not line.strip().startswith("|"):
            break
        name, *cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[name] = cells
    return rows


def expected(run: str, family: str, dtype: str, what: str) -> str | None:
    cell = next(c for c in RUNS[run]["cells"] if c["family"] == family and c["B"] == 1024 and c["dtype"] == dtype)
    if what == "P":
        return f"{cell['P']:,}"
    ratios = cell["ratios"]
    if what == "floor":
        return f"{1 + ratios['write B*P']:.2f}"
    return f"{ratios[what]:.2f}" if what in ratios else None


def mismatches(text: str, run: str) -> list[str]:
    head, columns = TABLES[run]
    found = []
    for name, cells in table_rows(text, head).items():
        family = FAMILIES.get(name, name)
        assert len(cells) == len(columns), (name, cells)
        for cell, (dtype, what) in zip(cells, columns):
            want = expected(run, family, dtype, what)
            number = re.fullmatch(r"[\d,.]+", cell)
            if (want is None and number) or (want is not None and cell != want):
                found.append(f"{name}, {what} ({dtype}): the chapter says {cell}, the run {want or 'no figure'}")
    return found


@pytest.mark.parametrize("run", TABLES)
def test_the_chapter_prints_the_recorded_figures(run):
    assert len(table_rows(CHAPTER, TABLES[run][0])) >= 2
    assert mismatches(CHAPTER, run) == []


def test_a_changed_figure_is_caught():
    changed = CHAPTER.replace("| ConvNeXt | 1.22 |", "| ConvNeXt | 1.20 |").replace("| 1.13 | 5.67 |", "| 1.13 | 5.76 |")
    assert changed.count("\n") == CHAPTER.count("\n") and changed != CHAPTER
    assert mismatches(changed, "cnn_after") == ["ConvNeXt, per_sample_grads (float32): the chapter says 1.20, the run 1.22"]
    assert mismatches(changed, "table") == ["BERT, vmap(grad) (float32): the chapter says 5.76, the run 5.67"]
