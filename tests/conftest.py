"""Fixtures shared by the tests: the recipes, from the package; the real site, and a site built from
deliberately broken sources, each built once per test session."""
import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import yaml

from bookcheck import ROOT


def build_site(source: Path, out: Path, strict: bool = True) -> Path:
    """Build the book in `source` the way `make site` does (with `strict`, warnings are errors)."""
    jupyter_book = Path(sys.executable).with_name("jupyter-book")
    result = subprocess.run(
        [str(jupyter_book), "build", str(source), "--path-output", str(out), *(["-W"] if strict else []), "--keep-going"],
        capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    log = result.stdout + result.stderr
    assert result.returncode == 0, f"the site build failed:\n{log[-5000:]}"
    assert not strict or "WARNING" not in log, log
    return out / "_build" / "html"


@pytest.fixture(scope="session")
def recipes():
    """Every name the package's modules define, public recipes and private helpers alike, as one dict
    (the tests call helpers such as _BatchTrace too). A name two modules share must be one object."""
    import pkgutil

    import torch_func_recipes

    namespace = {}
    for info in pkgutil.iter_modules(torch_func_recipes.__path__):
        module = importlib.import_module(f"torch_func_recipes.{info.name}")
        for name, value in vars(module).items():
            if name.startswith("__"):
                continue
            assert namespace.setdefault(name, value) is value, f"{name} means two things in torch_func_recipes"
    return namespace


@pytest.fixture(scope="session")
def site(tmp_path_factory):
    return build_site(ROOT, tmp_path_factory.mktemp("site"))


# --- a book broken on purpose, to show that the site checks catch what they guard ------------

# The pages broken below, and the front page, broken only by the Colab branch of _config.yml.
BROKEN_PAGES = ["book/00_front_page", "book/01_vmap_basics", "book/02_jacobians_hessians", "book/04_output_jacobians",
                "book/05_model_ensembling", "book/06_error_gallery", "book/07_compile_with_transforms"]

# Markdown cells added at the top of a page's notebook (raw HTML passes through MyST to the page).
BROKEN_MARKDOWN = {
    "book/01_vmap_basics": '<a href="06_error_galery.html">a missing page</a> '
                           '<a href="02_jacobians_hessians.html#no-such-part">a missing anchor</a>',
    "book/02_jacobians_hessians": '<img src="no-such-figure.png" alt="a missing figure">',
    "book/04_output_jacobians": r"A macro MathJax does not know: $\nosuchmacro{x}$",
    "book/06_error_gallery": '<script src="https://cdn.example.org/lib.js"></script>'
                             '<script>console.error("something broke")</script>',
}


def _break_outputs(entry, nb):
    """Changes to a notebook's cells that its page must show differently from the real notebook."""
    code = [c for c in nb.cells if c.cell_type == "code"]
    if entry == "book/02_jacobians_hessians":  # a folded input unfolded
        next(c for c in code if "hide-input" in c.metadata.get("tags", [])).metadata["tags"].remove("hide-input")
    if entry == "book/07_compile_with_transforms":  # a plot gone
        for output in next(c for c in code if any("image/png" in o.get("data", {}) for o in c.outputs)).outputs:
            output.get("data", {}).pop("image/png", None)
    if entry == "book/05_model_ensembling":  # an output folded away
        next(c for c in code if c.outputs and not c.metadata.get("tags")).metadata["tags"] = ["hide-output"]


@pytest.fixture(scope="session")
def broken_site(tmp_path_factory):
    """The site of a scratch copy of the book whose sources are broken on purpose: some pages each
    in one way (above), and every Colab button pointing at another branch (_config.yml)."""
    source = tmp_path_factory.mktemp("broken-book")
    shutil.copytree(ROOT / "book", source / "book", ignore=shutil.ignore_patterns("*.md", "_shared"))
    shutil.copytree(ROOT / "src", source / "src")  # the package reference documents it (autodoc)
    shutil.copy(ROOT / "book" / "01_vmap_basics.ipynb", source / "book" / "99_unlisted.ipynb")  # not in _toc.yml
    shutil.copy(ROOT / "_toc.yml", source / "_toc.yml")
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    config["repository"]["branch"] = "master"
    (source / "_config.yml").write_text(yaml.safe_dump(config))
    for entry in BROKEN_PAGES:
        nb = nbformat.read(ROOT / f"{entry}.ipynb", as_version=4)
        if entry in BROKEN_MARKDOWN:
            nb.cells.insert(1, nbformat.v4.new_markdown_cell(BROKEN_MARKDOWN[entry]))
        _break_outputs(entry, nb)
        nbformat.write(nb, source / f"{entry}.ipynb")
    return build_site(source, tmp_path_factory.mktemp("broken-site"), strict=False)
