"""The book's sources: every page a pair, each stored notebook executed in order with no local
imports and every measurement plotted, the pre-commit hook that keeps each pair in sync, glossary
links, and the reading-time budget. Each check is also run on a broken copy, to show that it can
fail. (That every notebook is listed in _toc.yml is checked on the built site, test_site.py.)"""
import os
import shutil
import subprocess
import sys

import nbformat
import pytest

from bookcheck import (
    ANSWERS,
    BOOK,
    MARKDOWN_ANSWERS,
    ROOT,
    chapter_number_problems,
    execution_problems,
    figure_problems,
    first_screen_problems,
    local_import_problems,
    notebooks,
    site_chapter_numbers,
)
from scripts import read_time

PAGES = sorted(BOOK.glob("*.md"))


def test_every_page_is_a_pair():
    assert len(PAGES) >= 2 and [p.stem for p in notebooks()] == [p.stem for p in PAGES]


@pytest.mark.parametrize("nb_path", notebooks(), ids=lambda p: p.name)
def test_stored_notebook(nb_path):
    """Executed in order with no stray error or stderr, self-contained, and every measurement plotted."""
    assert execution_problems(nb_path) + local_import_problems(nb_path) + figure_problems(nb_path) == []


def test_every_chapter_number_is_the_sites():
    """The site numbers chapters by their place in _toc.yml (Real models is 5, Curvature 6), not by file name:
    no page, and no docstring of the package that the pages copy, writes "Chapter N" except as the link
    text of the site's chapter N; pages refer to each other by links with their titles."""
    numbers = site_chapter_numbers()
    assert numbers["11_real_models"] == 5 and numbers["10_curvature"] == 6 and len(numbers) == 12
    sources = PAGES + sorted((ROOT / "src").rglob("*.py")) + sorted((BOOK / "_shared").glob("*.py"))
    problems = [p for path in sources for p in chapter_number_problems(path.read_text(), numbers, path.name)]
    assert problems == []


def test_the_chapter_number_check_catches_a_file_number():
    numbers = site_chapter_numbers()
    assert chapter_number_problems("as [Real models](11_real_models.ipynb) shows", numbers, "ok") == []
    assert chapter_number_problems("as [Chapter 5](11_real_models.ipynb) shows", numbers, "ok") == []
    assert chapter_number_problems("as Chapter 11 shows", numbers, "bare") == ["bare: 'Chapter 11' is not a link to the site's chapter of that number"]
    assert chapter_number_problems("see [Chapter 11](11_real_models.ipynb)", numbers, "file number") == [
        "file number: '[Chapter 11](11_real_models.ipynb)' links to the site's chapter 5"]


@pytest.mark.parametrize("stem", sorted(ANSWERS))
def test_the_answer_is_on_the_first_screen(stem):
    """Within the first 40 rendered lines after its goals, each chapter shows the call that answers its question,
    with its result; the set-up and the tools come after it."""
    nb = nbformat.read(BOOK / f"{stem}.ipynb", as_version=4)
    assert first_screen_problems(nb, ANSWERS[stem], stem, markdown=stem in MARKDOWN_ANSWERS) == []


def test_every_numbered_chapter_names_its_answer():
    assert set(ANSWERS) == set(site_chapter_numbers())


def test_the_first_screen_check_catches_a_late_or_hidden_answer():
    goals = nbformat.v4.new_markdown_cell("# A chapter\n\n:::{admonition} What you will learn\n- vmap\n:::")
    answer = nbformat.v4.new_code_cell("print(vmap(f)(x))", outputs=[nbformat.v4.new_output("stream", name="stdout", text="tensor([1.])\n")])
    prose = nbformat.v4.new_markdown_cell("\n".join(f"Line {i} of set-up prose." for i in range(36)))
    early = nbformat.v4.new_notebook(cells=[goals, prose, answer])
    assert first_screen_problems(early, r"vmap\(", "early") == []
    late = nbformat.v4.new_notebook(cells=[goals, prose, nbformat.v4.new_code_cell("import torch\nimport math\nx = 1"), answer])
    assert first_screen_problems(late, r"vmap\(", "late") == [
        "late: the answer (cell 3) ends 41 rendered lines after the goals, more than 40: move the set-up and the tools after it"]
    no_result = nbformat.v4.new_notebook(cells=[goals, nbformat.v4.new_code_cell("vmap(f)(x)")])
    hidden = nbformat.v4.new_notebook(cells=[goals, nbformat.v4.new_code_cell(
        answer.source, outputs=answer.outputs, metadata={"tags": ["hide-input"]})])
    prose_only = nbformat.v4.new_notebook(cells=[goals, nbformat.v4.new_markdown_cell("Call `vmap(f)(x)`.")])
    for nb in (no_result, hidden, prose_only):
        assert first_screen_problems(nb, r"vmap\(", "x") == ["x: no cell matches 'vmap\\\\(' with a result"]


# --- the checks catch what they guard -------------------------------------------------------

@pytest.fixture
def chapter_copy(tmp_path):
    """A copy of chapter 1 (both files of the pair) in a scratch book/ folder."""
    book = tmp_path / "book"
    book.mkdir()
    for suffix in (".md", ".ipynb"):
        shutil.copy(BOOK / f"01_vmap_basics{suffix}", book / f"01_vmap_basics{suffix}")
    return book / "01_vmap_basics.md"


def _hook_run(repo, env):
    """`pre-commit run --all-files` in the scratch repository: (exit status, files it changed)."""
    before = {p: p.read_bytes() for p in repo.rglob("*") if p.is_file() and ".git" not in p.parts}
    result = subprocess.run([sys.executable, "-m", "pre_commit", "run", "--all-files"], cwd=repo, env=env,
                            capture_output=True, text=True)
    after = {p: p.read_bytes() for p in repo.rglob("*") if p.is_file() and ".git" not in p.parts}
    return result.returncode, sorted(p.name for p in after if before.get(p) != after[p])


def test_sync_hook_catches_an_edit_to_one_side_of_a_pair(chapter_copy):
    """The repository's own .pre-commit-config.yaml, in a scratch git repository holding one pair."""
    repo = chapter_copy.parent.parent
    for name in (".pre-commit-config.yaml", "jupytext.toml"):
        shutil.copy(ROOT / name, repo / name)
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}",
           "PRE_COMMIT_HOME": str(repo.parent / "pre-commit-home")}
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "."], cwd=repo, check=True)
    _hook_run(repo, env)  # the first run brings the copy in sync, if main's pair was not (`make lint` checks that)
    assert _hook_run(repo, env) == (0, [])
    chapter_copy.write_text(chapter_copy.read_text().replace("print(torch.vmap is torch.func.vmap)",
                                                             "print(torch.vmap is not torch.func.vmap)"))
    assert _hook_run(repo, env) == (1, ["01_vmap_basics.ipynb"])  # the .ipynb is rewritten from the newer .md
    assert "torch.vmap is not torch.func.vmap" in chapter_copy.with_suffix(".ipynb").read_text()
    chapter_copy.with_suffix(".ipynb").unlink()  # a .md without its notebook gets one
    assert _hook_run(repo, env) == (1, ["01_vmap_basics.ipynb"])


def _rewrite(nb_path, change):
    nb = nbformat.read(nb_path, as_version=4)
    change([c for c in nb.cells if c.cell_type == "code"])
    nbformat.write(nb, nb_path)


@pytest.mark.parametrize("change, message", [
    (lambda cells: cells[3].__setitem__("execution_count", None), "execution count None"),
    (lambda cells: cells[3].__setitem__("execution_count", 99), "execution count 99"),
    (lambda cells: cells[3].outputs.append(nbformat.v4.new_output("stream", name="stderr", text="warning\n")), "stderr"),
    (lambda cells: cells[3].outputs.append(nbformat.v4.new_output("error", ename="ValueError", evalue="", traceback=[])), "stored error"),
    (lambda cells: next(c for c in cells if "raises-exception" in c.metadata.get("tags", [])).__setitem__("outputs", []), "no stored error"),
])
def test_execution_check_catches(chapter_copy, change, message):
    nb_path = chapter_copy.with_suffix(".ipynb")
    assert execution_problems(nb_path) == []
    _rewrite(nb_path, change)
    assert message in " ".join(execution_problems(nb_path))


def test_local_import_check_catches_an_import_of_a_repository_module(chapter_copy):
    nb_path = chapter_copy.with_suffix(".ipynb")
    _rewrite(nb_path, lambda cells: cells[0].__setitem__("source", "import bookcheck\nfrom tests import bookcheck\n" + cells[0].source))
    problems = local_import_problems(nb_path)
    assert len(problems) == 2 and "'bookcheck'" in problems[0] and "'tests'" in problems[1]


# --- the glossary is linked from the text ----------------------------------------------------

GLOSSARY_TERMS = ["vmap", "grad", "vjp", "jvp", "jacrev", "jacfwd", "hessian", "functional_call", "stack_module_state",
                  "pytree", "primal", "tangent", "cotangent", "batching_rule", "forward_reverse_mode", "wide_tall",
                  "replace_all_batch_norm_modules"]


@pytest.mark.parametrize("term", GLOSSARY_TERMS)
def test_every_transform_has_a_glossary_entry_linked_from_a_chapter(term):
    label = "glossary-" + term.replace("_", "-")
    assert f"({label})=" in (BOOK / "09_glossary.md").read_text(), f"no entry for {term} in the glossary"
    linking = [p.name for p in PAGES if p.name != "09_glossary.md" and f"]({label})" in p.read_text()]
    assert linking, f"no page links to the glossary entry of {term}"


@pytest.mark.parametrize("md_path", [p for p in PAGES if p.name[:2] in {"01", "02", "03", "04", "05", "06", "07"}],
                         ids=lambda p: p.name)
def test_every_chapter_links_to_the_glossary(md_path):
    assert "](glossary-" in md_path.read_text()


def test_figure_check_catches_numbers_alone_and_an_unlabelled_plot(tmp_path):
    timing = nbformat.v4.new_code_cell("print('loop 12.0 ms, vmap 1.5 ms')", metadata={"tags": ["nbval-ignore-output"]},
                                       outputs=[nbformat.v4.new_output("stream", name="stdout", text="loop 12.0 ms\n")])
    plot = nbformat.v4.new_code_cell("ax.plot(x, y); ax.set(xlabel='B')",
                                     outputs=[nbformat.v4.new_output("display_data", data={"image/png": "iVBOR"})])
    far = [nbformat.v4.new_code_cell("pass") for _ in range(3)]
    nb = nbformat.v4.new_notebook(cells=[timing, *far, plot])
    path = tmp_path / "numbers.ipynb"
    nbformat.write(nb, path)
    assert figure_problems(path) == [
        "numbers.ipynb cell 0: prints measurements but no plot is next to it",
        "numbers.ipynb cell 4: its plot lacks a y-axis label, a title, the hardware",
    ]


# --- every chapter's main path reads in at most 30 minutes --------------------------------------

CHAPTERS = [p for p in PAGES if p.name[:2] not in {"00", "08", "09"}]  # not the front matter, the box or the glossary


@pytest.mark.parametrize("md_path", CHAPTERS, ids=lambda p: p.name)
def test_main_path_is_at_most_30_minutes(md_path):
    words, lines, minutes = read_time.read_time(md_path)
    assert minutes <= 30, f"{md_path.name}: {words} words + {lines} visible code lines = {minutes:.1f} min (fold or cut)"


def test_read_time_counts_what_is_visible_and_skips_what_is_folded(tmp_path):
    page = tmp_path / "page.md"
    visible = "word " * 2000
    code = "\n".join(f"x{i} = {i}" for i in range(150))
    header = ("---\njupytext:\n  text_representation:\n    extension: .md\n    format_name: myst\n"
              "kernelspec:\n  display_name: Python 3\n  language: python\n  name: python3\n---\n")
    page.write_text(f"{header}# Page\n\n{visible}\n\n```{{code-cell}} ipython3\n{code}\n```\n\n"
                    f":::{{dropdown}} More\n{visible * 3}\n:::\n\n"
                    f"```{{code-cell}} ipython3\n:tags: [hide-input]\n\n{code}\n```\n")
    words, lines, minutes = read_time.read_time(page)
    assert (lines, round(minutes)) == (150, 20) and 2000 <= words <= 2005  # 10 + 10 min; the folded parts not counted
    page.write_text(page.read_text().replace(":::{dropdown} More", ":::{note}"))  # unfolded: 6000 more words
    assert read_time.read_time(page)[2] > 30
