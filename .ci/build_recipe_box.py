"""Generate book/08_recipe_box.md from every cell tagged `recipe` in the chapters, in _toc.yml order.

    python .ci/build_recipe_box.py           # write book/08_recipe_box.md
    python .ci/build_recipe_box.py --check   # exit 1 if the box differs from the chapters' recipe cells

The box is never edited by hand: tests/test_recipe_box.py fails when a chapter's recipe and the box
differ. After regenerating, store its outputs with `make outputs NB=book/08_recipe_box.md`.
"""
from __future__ import annotations

import sys
from pathlib import Path

import jupytext
import yaml

ROOT = Path(__file__).resolve().parents[1]
BOX = ROOT / "book" / "08_recipe_box.md"

HEADER = '''---
jupytext:
  text_representation:
    extension: .md
    format_name: myst
    format_version: 0.13
    jupytext_version: 1.19.6
kernelspec:
  display_name: Python 3
  language: python
  name: python3
---

# The recipe box

Every reusable function the book teaches, collected from the chapters' cells tagged `recipe` by
`.ci/build_recipe_box.py` (never edited by hand: a test fails if a chapter and this page drift
apart). Run this page, or copy the cells you need; each recipe is tested by `tests/test_recipes.py`
on models beyond its chapter's example, against loop references.

```{code-cell} ipython3
import copy
import numbers

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, jacfwd, jacrev, jvp, stack_module_state, vjp, vmap

print("recipes loaded with torch >= 2.6:", tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 6))
```
'''


def chapters() -> list[Path]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [entry["file"] for part in toc.get("parts", []) for entry in part.get("chapters", [])]
    return [ROOT / f"{name}.md" for name in files if not name.endswith("08_recipe_box")]


def recipe_cells() -> list[tuple[str, str, str]]:
    """(chapter file name, chapter title, cell source) for every recipe cell, in book order."""
    found = []
    for path in chapters():
        nb = jupytext.read(path)
        title = next((c.source.lstrip("# ").splitlines()[0] for c in nb.cells
                      if c.cell_type == "markdown" and c.source.startswith("# ")), path.stem)
        for cell in nb.cells:
            if cell.cell_type == "code" and "recipe" in cell.metadata.get("tags", []):
                found.append((path.name, title, cell.source.strip()))
    return found


def render() -> str:
    parts, current = [HEADER], None
    for name, title, source in recipe_cells():
        if name != current:
            parts.append(f"\n## From {title.replace('`', '')}\n\nSource: `{name}`.\n")
            current = name
        parts.append(f"\n```{{code-cell}} ipython3\n:tags: [recipe]\n\n{source}\n```\n")
    return "".join(parts)


def main(argv) -> int:
    text = render()
    if "--check" in argv:
        if not BOX.exists() or BOX.read_text() != text:
            print(f"{BOX.relative_to(ROOT)} is out of date: run python .ci/build_recipe_box.py", file=sys.stderr)
            return 1
        return 0
    BOX.write_text(text)
    print(f"wrote {BOX.relative_to(ROOT)} with {len(recipe_cells())} recipe cells")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
