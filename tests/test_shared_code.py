"""Code that several notebooks need lives once, in book/_shared/ or in the package (src/torch_func_recipes/),
and is copied by scripts/build_shared.py."""
import shutil

import jupytext

from bookcheck import BOOK
from scripts import build_shared as build


def test_every_copy_matches_its_source_is_folded_and_every_shared_file_is_used():
    stale = build.sync(write=False)
    assert not stale, "run: python -m scripts.build_shared; stale copies: " + ", ".join(stale)
    used = set()
    for path in sorted(BOOK.glob("*.md")):
        for cell in jupytext.read(path).cells:
            name = build.shared_name(cell)
            if name:
                used.add(name)
                tags = cell.metadata.get("tags", [])
                assert "hide-input" in tags or "hide-cell" in tags, f"{path.name}: shared-{name} is not folded"
    assert used == set(build.shared_sources()), "unused shared sources: " + str(set(build.shared_sources()) - used)


def test_drift_is_detected(tmp_path):
    """Edit one copy in a scratch book: the check names exactly that cell, and sync repairs it."""
    shutil.copytree(BOOK, tmp_path / "book")
    target = next(p for p in sorted((tmp_path / "book").glob("*.md"))
                  if any(build.shared_name(c) for c in jupytext.read(p).cells))
    notebook = jupytext.read(target)
    cell = next(c for c in notebook.cells if build.shared_name(c))
    cell.source = cell.source.replace("import torch", "import torch  # edited by hand", 1)
    jupytext.write(notebook, target, fmt="md:myst")
    stale = build.sync(tmp_path, write=False)
    assert len(stale) == 1 and stale[0].startswith(f"book/{target.name}: cell")
    build.sync(tmp_path, write=True)
    assert build.sync(tmp_path, write=False) == []


def test_recipe_cells_carry_the_package_text_and_a_drifted_one_is_rewritten(tmp_path):
    """Every definition in a chapter's recipe cell is the package's text, comments included (test_package
    compares syntax trees; this compares text, so `make shared` is what keeps them equal). A cell edited by
    hand is named, and the sync puts the package's text back."""
    stale = build.sync_recipes(write=False)
    assert not stale, "run: python -m scripts.build_shared; stale recipe cells: " + ", ".join(stale)
    shutil.copytree(BOOK, tmp_path / "book")
    chapter = tmp_path / "book" / "02_jacobians_hessians.md"
    text = chapter.read_text()
    edited = "return 2 * jvp(grad(scalar_f), (x,), (v,))[1]"
    chapter.write_text(text.replace("return jvp(grad(scalar_f), (x,), (v,))[1]", edited, 1))
    stale = build.sync_recipes(tmp_path, write=False)
    assert len(stale) == 1 and stale[0].startswith("book/02_jacobians_hessians.md: cell")
    build.sync_recipes(tmp_path, write=True)
    assert build.sync_recipes(tmp_path, write=False) == [] and edited not in chapter.read_text()
