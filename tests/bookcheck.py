"""Checks on the book's sources, as functions that return lists of problems.

The tests in this folder run them on the real book and on deliberately broken copies, so each
check is shown to catch what it guards.
"""
import ast
import re
import sys
from pathlib import Path

import nbformat
import yaml

from scripts.execute_notebooks import execution_problems  # noqa: F401  (tests import it from here too)

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"


def notebooks(book: Path = BOOK) -> list[Path]:
    return sorted(book.glob("*.ipynb"))


# --- table of contents ---------------------------------------------------------------------

def toc_entries(toc_path: Path) -> list[str]:
    """Every page of a jb-book _toc.yml made of parts of chapters (as ours is), root first, without suffix."""
    toc = yaml.safe_load(toc_path.read_text())
    return [toc["root"]] + [chapter["file"] for part in toc["parts"] for chapter in part["chapters"]]


# --- self-contained notebooks ----------------------------------------------------------------

def local_import_problems(nb_path: Path) -> list[str]:
    """Imports of a module or package that lives in this repository (Colab opens one file), or relative ones;
    the book's own package, torch_func_recipes, included (Colab does not have it)."""
    local = {p.stem for folder in ("tests", "scripts", "book", "src") for p in (ROOT / folder).rglob("*.py")} | {
        p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")} | {
        p.name for p in (ROOT / "src").iterdir() if p.is_dir()} - set(sys.stdlib_module_names)
    problems = []
    for index, cell in enumerate(nbformat.read(nb_path, as_version=4).cells):
        if cell.cell_type != "code":
            continue
        source = "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!")))
        for node in ast.walk(ast.parse(source)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module if node.level == 0 else "."] if isinstance(node, ast.ImportFrom) else [])
            problems += [f"{nb_path.name} cell {index} imports {name!r}, which is not an installed package"
                         for name in names if name.split(".")[0] in local | {""}]
    return problems


# --- figures -------------------------------------------------------------------------------

_TIMING = re.compile(r"\d\s*(ms|us|µs)\b|\d+(\.\d+)?x\b")


def _has_plot(cell) -> bool:
    return any("image/png" in o.get("data", {}) for o in cell.get("outputs", []))


def figure_problems(nb_path: Path) -> list[str]:
    """Measurements shown as numbers alone, and plots without axis labels, title or hardware.

    A cell whose output is not compared (timings) and prints times (ms, us) or ratios (2.5x) must
    have a plot in it or in a code cell at most two before or one after it. A cell that draws a
    plot must label its x axis, its y axis (or draw horizontal bars, whose bars are labelled),
    set a title, and name the hardware in it.
    """
    nb = nbformat.read(nb_path, as_version=4)
    code = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    problems = []
    for k, (index, cell) in enumerate(code):
        text, source = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream"), cell.source
        ignored = "nbval-ignore-output" in cell.metadata.get("tags", [])
        if ignored and _TIMING.search(text) and not any(_has_plot(c) for _, c in code[max(k - 2, 0):k + 2]):
            problems.append(f"{nb_path.name} cell {index}: prints measurements but no plot is next to it")
        missing = [what for what, ok in [("an x-axis label", "xlabel" in source),
                                         ("a y-axis label", "ylabel" in source or "barh(" in source),
                                         ("a title", "title" in source), ("the hardware", "hardware" in source)] if not ok]
        if _has_plot(cell) and missing:
            problems.append(f"{nb_path.name} cell {index}: its plot lacks " + ", ".join(missing))
    return problems


def site_chapter_numbers(toc_path: Path = ROOT / "_toc.yml") -> dict[str, int]:
    """{file stem: chapter number on the site}: Jupyter Book numbers the chapters of the parts marked
    `numbered: true` in _toc.yml, in order, continuing from one numbered part to the next."""
    toc, numbers = yaml.safe_load(toc_path.read_text()), {}
    for part in toc.get("parts", []):
        if part.get("numbered"):
            for chapter in part["chapters"]:
                numbers[Path(chapter["file"]).name] = len(numbers) + 1
    return numbers


def chapter_number_problems(text: str, numbers: dict[str, int], where: str) -> list[str]:
    """Every "Chapter N" in text that is not the link text of the site's chapter N: the site numbers the
    chapters by their place in _toc.yml, not by their file names, so a page refers to another by a link
    with its title (or, if it must say a number, "[Chapter N](file.ipynb)" with the site's N)."""
    problems = []
    links = {m.start(): m for m in re.finditer(r"\[Chapter (\d+)\]\((\d\d_[a-z_]+)\.ipynb\)", text)}
    for m in re.finditer(r"Chapters? \d+", text):
        link = links.get(m.start() - 1)
        if link is None:
            problems.append(f"{where}: '{m.group(0)}' is not a link to the site's chapter of that number")
        elif numbers.get(link.group(2)) != int(link.group(1)):
            problems.append(f"{where}: '{link.group(0)}' links to the site's chapter {numbers.get(link.group(2))}")
    return problems


# --- the answer on the first screen ------------------------------------------------------------

FIRST_SCREEN_LINES = 40
# What answers each numbered chapter's question: a visible code cell whose source matches the pattern and
# that has output (the result); for the error gallery, a lookup page, its table of messages (Markdown).
# Each must end within FIRST_SCREEN_LINES rendered lines after the goals box.
ANSWERS = {
    "01_vmap_basics": r"\bvmap\(",
    "02_jacobians_hessians": r"\bjacrev\(",
    "03_per_sample_gradients": r"\bvmap\(grad\(",
    "04_output_jacobians": r"\bvmap\(jacrev\(",
    "11_real_models": r"\bper_sample_grads\(",
    "10_curvature": r"\bjvp\(grad\(",
    "05_model_ensembling": r"\bvmap\(",
    "06_error_gallery": r"^\| The message starts with",
    "07_compile_with_transforms": r"torch\.compile\(vmap\(",
    "14_training_loops": r"\bvmap\(",
    "15_short_answers": r"^\| The question \| The short answer",
    "16_model_answers": r"^\| The question \| The short answer",
}
MARKDOWN_ANSWERS = {"06_error_gallery", "15_short_answers", "16_model_answers"}  # lookup pages: a table of questions or messages
_FOLDED = {"hide-input", "hide-cell", "remove-input", "remove-cell"}
_WIDTH = 110  # characters a rendered line holds (the book's Markdown and code are wrapped at about 100)


def _lines(text: str) -> int:
    """Rendered lines of text: blank lines are free, a long line takes as many as it wraps into, and a
    Markdown link counts its text only (its target is not shown)."""
    text = re.sub(r"\]\([^)\s]*\)", "]", text)
    return sum(-(-len(line) // _WIDTH) for line in text.splitlines() if line.strip())


def rendered_lines(cell) -> int:
    """About how many lines a cell takes on the site: its visible source (a folded cell shows one line, its
    toggle), and its outputs (a figure counts as 15 lines, a folded output as one)."""
    tags = set(cell.metadata.get("tags", []))
    if cell.cell_type == "markdown":
        return _lines(cell.source)
    count = 1 if tags & _FOLDED else _lines(cell.source)
    if "remove-output" in tags or "remove-cell" in tags:
        return count
    if "hide-output" in tags:
        return count + 1
    for output in cell.get("outputs", []):
        data = output.get("data", {})
        if "image/png" in data or "image/svg+xml" in data:
            count += 15
        else:
            text = output.get("text") or data.get("text/plain") or "\n".join(output.get("traceback", []))
            count += _lines(text if isinstance(text, str) else "".join(text))
    return count


def first_screen_problems(nb, pattern: str, name: str, *, markdown: bool = False) -> list[str]:
    """The answer within FIRST_SCREEN_LINES rendered lines after the goals box (the first admonition): the
    first visible code cell with output whose source matches pattern (a Markdown cell, if markdown)."""
    cells = nb.cells
    start = next((i for i, c in enumerate(cells) if c.cell_type == "markdown" and "{admonition}" in c.source), None)
    if start is None:
        return [f"{name}: no goals box (an admonition) to count from"]
    goals = cells[start].source
    tail = goals[goals.index(":::", goals.index("{admonition}") + 12) + 3:] if goals.count(":::") >= 2 else ""
    used = _lines(tail)
    if markdown and re.search(pattern, tail, re.MULTILINE):  # the answer is in the goals' cell, after the box
        return [] if used <= FIRST_SCREEN_LINES else [f"{name}: the answer ends {used} rendered lines after the goals"]
    for index in range(start + 1, len(cells)):
        cell = cells[index]
        used += rendered_lines(cell)
        if markdown:
            shown = cell.cell_type == "markdown"
        else:
            shown = cell.cell_type == "code" and cell.get("outputs") and not _FOLDED & set(cell.metadata.get("tags", []))
        answer = shown and re.search(pattern, cell.source, re.MULTILINE)
        if answer:
            if used > FIRST_SCREEN_LINES:
                return [f"{name}: the answer (cell {index}) ends {used} rendered lines after the goals, "
                        f"more than {FIRST_SCREEN_LINES}: move the set-up and the tools after it"]
            return []
    return [f"{name}: no cell matches {pattern!r} with a result"]
