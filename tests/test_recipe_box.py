"""The recipe box is generated from the chapters' `recipe` cells and must not drift from them."""
import importlib.util
import shutil

import jupytext

from bookcheck import BOOK, ROOT

spec = importlib.util.spec_from_file_location("build_recipe_box", ROOT / ".ci" / "build_recipe_box.py")
build = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build)


def test_box_matches_the_chapters():
    assert build.BOX.read_text() == build.render(), "run: python .ci/build_recipe_box.py, then make outputs NB=book/08_recipe_box.md"


def test_box_has_every_recipe_once():
    box = jupytext.read(build.BOX)
    box_sources = [c.source.strip() for c in box.cells if "recipe" in c.metadata.get("tags", [])]
    chapter_sources = [source for _, _, source in build.recipe_cells()]
    assert box_sources == chapter_sources and len(chapter_sources) >= 9


def test_drift_is_detected(tmp_path, monkeypatch):
    """Edit one recipe in a copy of the book: the committed box no longer matches."""
    (tmp_path / "book").mkdir()
    shutil.copy(ROOT / "_toc.yml", tmp_path / "_toc.yml")
    for md in BOOK.glob("*.md"):
        shutil.copy(md, tmp_path / "book" / md.name)
    chapter = tmp_path / "book" / "02_jacobians_hessians.md"
    chapter.write_text(chapter.read_text().replace("return jvp(grad(scalar_f), (x,), (v,))[1]",
                                                   "return 2 * jvp(grad(scalar_f), (x,), (v,))[1]"))
    monkeypatch.setattr(build, "ROOT", tmp_path)
    assert build.render() != build.BOX.read_text()
    changed = [source for _, _, source in build.recipe_cells() if "return 2 * jvp" in source]
    assert len(changed) == 1 and "def hvp" in changed[0]
