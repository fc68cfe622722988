"""The recipe box is generated from the chapters' `recipe` cells and must not drift from them."""
import shutil

import jupytext
import pytest

from bookcheck import BOOK, ROOT
from scripts import build_recipe_box as build


def test_box_matches_the_chapters_and_has_every_recipe_once():
    assert build.BOX.read_text() == build.render(), "run: python -m scripts.build_recipe_box, then make outputs NB=book/08_recipe_box.md"
    box_sources = [c.source.strip() for c in jupytext.read(build.BOX).cells if "recipe" in c.metadata.get("tags", [])]
    assert box_sources == [source for _, _, source in build.recipe_cells()] and len(box_sources) >= 9


def test_drift_is_detected(tmp_path, monkeypatch):
    """Edit one recipe in a copy of the book: the committed box no longer matches."""
    shutil.copytree(BOOK, tmp_path / "book", ignore=shutil.ignore_patterns("*.ipynb"))
    shutil.copy(ROOT / "_toc.yml", tmp_path / "_toc.yml")
    chapter = tmp_path / "book" / "02_jacobians_hessians.md"
    chapter.write_text(chapter.read_text().replace("return jvp(grad(scalar_f), (x,), (v,))[1]",
                                                   "return 2 * jvp(grad(scalar_f), (x,), (v,))[1]"))
    monkeypatch.setattr(build, "ROOT", tmp_path)
    assert build.render() != build.BOX.read_text()
    changed = [source for _, _, source in build.recipe_cells() if "return 2 * jvp" in source]
    assert len(changed) == 1 and "def hvp" in changed[0]


def test_generator_refuses_a_recipe_without_example_and_an_unimported_name(monkeypatch):
    """The box's usage examples and imports are computed: a recipe no example calls, or a name the
    recipes use that nothing imports, stops generation with a message naming it."""
    found = build.recipe_cells()
    for source, named in [("def brand_new_recipe(x):\n    return x", "brand_new_recipe"),
                          ("def _helper(x):\n    return scipy.special.erf(x)", "scipy")]:
        monkeypatch.setattr(build, "recipe_cells", lambda: found + [(found[0][0], found[0][1], source)])
        with pytest.raises(build.BoxError, match=named):
            build.render()


def test_generator_imports_each_name_once_and_finds_dependencies():
    text = build.render()
    setup = text.split("```{code-cell} ipython3\n", 1)[1].split("```", 1)[0]
    assert "import numbers" not in setup  # Chapter 2's recipe cell imports it, before any use
    assert text.count("\nimport numbers\n") == 1
    row = next(line for line in text.splitlines() if line.startswith("| `empirical_ntk` |"))
    assert "`output_jacobian`" in row
