"""Checks on the book's sources and built site, as functions that return lists of problems.

The tests in this folder run them on the real book and on deliberately broken copies, so each
check is shown to catch what it guards.
"""
from __future__ import annotations

import ast
import html.parser
import os
import re
import sys
import urllib.parse
from pathlib import Path

import jupytext
import nbformat
import yaml

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"


def notebooks(book: Path = BOOK) -> list[Path]:
    return sorted(book.glob("*.ipynb"))


# --- .md / .ipynb pairs -------------------------------------------------------------------

def _cells(nb) -> list[tuple[str, str, tuple[str, ...]]]:
    return [(c.cell_type, c.source.strip(), tuple(c.metadata.get("tags", []))) for c in nb.cells]


def pair_problems(md_path: Path) -> list[str]:
    """Differences between book/NN.md and book/NN.ipynb: cell kinds, sources and tags."""
    ipynb_path = md_path.with_suffix(".ipynb")
    if not ipynb_path.exists():
        return [f"{md_path.name} has no {ipynb_path.name}: run `make outputs NB={md_path.relative_to(ROOT)}`"]
    md_cells, nb_cells = _cells(jupytext.read(md_path)), _cells(jupytext.read(ipynb_path))
    hint = f"edit one side only? regenerate with `make outputs NB=book/{md_path.name}`"
    if len(md_cells) != len(nb_cells):
        return [f"{md_path.name} has {len(md_cells)} cells but {ipynb_path.name} has {len(nb_cells)} ({hint})"]
    problems = []
    for index, (a, b) in enumerate(zip(md_cells, nb_cells)):
        if a != b:
            what = "kind" if a[0] != b[0] else "tags" if a[2] != b[2] else "source"
            problems.append(f"{md_path.name} and {ipynb_path.name} differ in the {what} of cell {index} ({hint})")
    return problems


def unpaired(book: Path = BOOK) -> list[str]:
    mds = {p.stem for p in book.glob("*.md")}
    nbs = {p.stem for p in book.glob("*.ipynb")}
    return [f"book/{stem}.ipynb has no book/{stem}.md" for stem in sorted(nbs - mds)] + [
        f"book/{stem}.md has no book/{stem}.ipynb" for stem in sorted(mds - nbs)
    ]


# --- table of contents ---------------------------------------------------------------------

def toc_entries(toc_path: Path) -> list[str]:
    """Every file named in a jb-book _toc.yml, root first, without suffix."""
    toc = yaml.safe_load(toc_path.read_text())
    entries = [toc["root"]]

    def walk(items):
        for item in items or []:
            if "file" in item:
                entries.append(item["file"])
            walk(item.get("sections"))

    for part in toc.get("parts", []):
        walk(part.get("chapters"))
    walk(toc.get("chapters"))
    return entries


def toc_problems(toc_path: Path, book: Path) -> list[str]:
    root = toc_path.parent
    entries = toc_entries(toc_path)
    problems = [f"_toc.yml lists {e}, but {e}.ipynb does not exist" for e in entries if not (root / f"{e}.ipynb").exists()]
    listed = set(entries)
    for nb in sorted(book.glob("*.ipynb")):
        name = nb.relative_to(root).with_suffix("").as_posix()
        if name not in listed:
            problems.append(f"{name}.ipynb is not listed in _toc.yml")
    duplicates = {e for e in entries if entries.count(e) > 1}
    problems += [f"_toc.yml lists {e} more than once" for e in sorted(duplicates)]
    return problems


# --- executed notebooks --------------------------------------------------------------------

def execution_problems(nb_path: Path) -> list[str]:
    """A stored notebook must be fully executed, top to bottom, once, with no stray error or stderr."""
    nb = nbformat.read(nb_path, as_version=4)
    problems, expected = [], 1
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        tags = cell.metadata.get("tags", [])
        if cell.execution_count != expected:
            problems.append(f"{nb_path.name} cell {index}: execution count {cell.execution_count}, expected {expected} "
                            "(run the whole notebook in order: `make outputs`)")
        expected += 1
        errors = [o for o in cell.outputs if o.output_type == "error"]
        if errors and "raises-exception" not in tags:
            problems.append(f"{nb_path.name} cell {index}: stored error {errors[0].ename} in a cell not tagged raises-exception")
        if "raises-exception" in tags and not errors:
            problems.append(f"{nb_path.name} cell {index}: tagged raises-exception but has no stored error")
        if any(o.output_type == "stream" and o.name == "stderr" for o in cell.outputs):
            problems.append(f"{nb_path.name} cell {index}: stored output on stderr")
    return problems


# --- self-contained notebooks ----------------------------------------------------------------

def _repository_python_files(root: Path) -> list[Path]:
    """The .py files of the repository, leaving out virtual environments (.venv, .venv-torch-2.14.1, venv)."""
    found = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [d for d in subfolders if not d.startswith((".venv", "venv", ".git"))]
        found += [Path(folder) / name for name in files if name.endswith(".py")]
    return found


def local_import_problems(nb_path: Path, root: Path = ROOT) -> list[str]:
    """Imports of anything that is not installed, such as a module that lives in this repository."""
    nb = nbformat.read(nb_path, as_version=4)
    problems = []
    local_names = {p.stem for p in _repository_python_files(root)} | {
        p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")
    }
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        source = "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!")))
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if node.level == 0 else ["." * node.level]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if not top or top in local_names and top not in sys.stdlib_module_names:
                    problems.append(f"{nb_path.name} cell {index} imports {name!r}, which is not an installed package")
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
        text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
        if "nbval-ignore-output" in cell.metadata.get("tags", []) and _TIMING.search(text):
            if not any(_has_plot(c) for _, c in code[max(k - 2, 0):k + 2]):
                problems.append(f"{nb_path.name} cell {index}: prints measurements but no plot is next to it")
        if _has_plot(cell):
            source = cell.source
            missing = [what for what, ok in [("an x-axis label", "xlabel" in source),
                                             ("a y-axis label", "ylabel" in source or "barh(" in source),
                                             ("a title", "title" in source),
                                             ("the hardware", "hardware" in source)] if not ok]
            if missing:
                problems.append(f"{nb_path.name} cell {index}: its plot lacks " + ", ".join(missing))
    return problems


# --- the built site --------------------------------------------------------------------------

class _LinkParser(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.links, self.ids = [], set()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for key in ("id", "name"):
            if attrs.get(key):
                self.ids.add(attrs[key])
        for key in ("href", "src"):
            if attrs.get(key) and tag in ("a", "link", "script", "img", "source", "iframe"):
                self.links.append((tag, attrs[key]))


def _parse(path: Path) -> _LinkParser:
    parser = _LinkParser()
    parser.feed(path.read_text(encoding="utf-8", errors="replace"))
    return parser


def link_problems(site: Path) -> list[str]:
    """Internal links (href/src) of every page that point at a missing file or a missing anchor."""
    problems, parsed = [], {}

    def page(path: Path) -> _LinkParser:
        if path not in parsed:
            parsed[path] = _parse(path)
        return parsed[path]

    pages = [p for p in sorted(site.rglob("*.html")) if "_static" not in p.relative_to(site).parts]
    for html_file in pages:  # _static/ holds the theme's template fragments, not pages
        for tag, link in page(html_file).links:
            url = urllib.parse.urlsplit(link)
            if url.scheme or link.startswith("//"):
                continue  # external: Colab, GitHub, ...
            target = html_file if not url.path else (html_file.parent / urllib.parse.unquote(url.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            name = html_file.relative_to(site)
            if not target.exists():
                problems.append(f"{name}: <{tag}> points at missing {link}")
            elif url.fragment and target.suffix == ".html" and url.fragment not in page(target).ids:
                problems.append(f"{name}: <{tag}> points at missing anchor {link}")
    return problems
