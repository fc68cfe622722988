"""Copy the book's shared notebook code into every cell tagged `shared-<name>`.

    python -m scripts.build_shared     # rewrite those cells in book/*.md and book/*.ipynb (outputs kept)

Notebooks stay self-contained (Colab opens one file), so code several chapters need is copied into
each of them; this script is the only thing that writes those copies, and tests/test_shared_code.py
fails when a copy drifts. A copy comes from one of two places:

- book/_shared/<name>.py, notebook-only helpers (basics, measure, ...), copied whole;
- a module of the package, src/torch_func_recipes/ (PACKAGE_MODULES below: shared-batch is _batch.py,
  shared-layers is _layers.py and shared-layer_<kind> its rules, shared-batch_trace is _trace.py,
  shared-vmap_gaps is _vmap_gaps.py), which is their one source. A module is not a
  notebook cell as it stands, so the copy leaves out two things: the module's docstring (the cell's
  header comment says where the code comes from instead) and its relative imports (`from ._trace
  import PathReport`), which mean nothing outside the package; a notebook gets those names from the
  shared cell that defines them, which comes earlier in every page that uses them. The absolute
  imports are kept: they rebind torch, nn, F and the rest to the objects a notebook already has, so
  they are harmless there, and they make the cell runnable on its own.

The script also keeps the chapters' cells tagged `recipe` equal to the package: each function or class
such a cell defines is rewritten with the package's text of that definition (tests/test_package.py
fails when the two differ in anything but comments and formatting). The rest of the cell (imports,
notes between definitions) is the chapter's own.

Edit the source file, run this script, then re-execute the notebooks that use it (make outputs NB=...).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import jupytext
import nbformat

ROOT = Path(__file__).resolve().parents[1]
TAG = "shared-"
# The package the shared cells below come from: the real one, even when `root` is a scratch copy of the book.
PACKAGE = ROOT / "src" / "torch_func_recipes"
PACKAGE_MODULES = {"batch": "_batch.py", "layers": "_layers.py", "layer_linear": "_layer_linear.py", "layer_conv": "_layer_conv.py",
                   "layer_norm": "_layer_norm.py", "layer_embedding": "_layer_embedding.py", "batch_trace": "_trace.py",
                   "vmap_gaps": "_vmap_gaps.py"}


def as_cell(module_source: str) -> str:
    """A package module as notebook code: without its docstring and its relative imports (see the docstring above)."""
    tree = ast.parse(module_source)
    lines = module_source.splitlines()
    dropped = set()
    for index, node in enumerate(tree.body):
        docstring = index == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
            and isinstance(node.value.value, str)
        relative = isinstance(node, ast.ImportFrom) and node.level > 0
        if docstring or relative:
            dropped.update(range(node.lineno - 1, node.end_lineno or node.lineno))
    kept = "\n".join(line for number, line in enumerate(lines) if number not in dropped)
    return re.sub(r"\n{4,}", "\n\n\n", kept).strip("\n") + "\n"  # at most two blank lines where lines went


def source_path(name: str) -> str:
    """Where shared-<name> comes from, relative to the repository root."""
    return f"src/torch_func_recipes/{PACKAGE_MODULES[name]}" if name in PACKAGE_MODULES else f"book/_shared/{name}.py"


def shared_sources(root: Path = ROOT, package: Path = PACKAGE) -> dict[str, str]:
    """{name: the code of the cells tagged shared-<name>}, from book/_shared/ under root and from the package."""
    sources = {path.stem: path.read_text() for path in sorted((root / "book" / "_shared").glob("*.py"))}
    for name, module in PACKAGE_MODULES.items():
        if name in sources:
            raise SystemExit(f"shared-{name} has two sources: book/_shared/{name}.py and the package's {module}")
        sources[name] = as_cell((package / module).read_text())
    return dict(sorted(sources.items()))


def cell_text(name: str, source: str) -> str:
    header = f"# From {source_path(name)} by scripts/build_shared.py: edit that file, not this cell.\n"
    return header + source.rstrip("\n")


def shared_name(cell) -> str | None:
    names = [tag[len(TAG):] for tag in cell.metadata.get("tags", []) if tag.startswith(TAG)]
    if len(names) > 1:
        raise ValueError(f"a cell has two shared- tags: {names}")
    return names[0] if names else None


def notebooks(root: Path = ROOT) -> list[Path]:
    return sorted((root / "book").glob("*.md")) + sorted((root / "book").glob("*.ipynb"))


def rewrite_cells(root: Path, write: bool, wanted_source, skip=()) -> list[str]:
    """For every notebook of the book (but the stems in skip) and every cell, wanted_source(path, index, cell)
    gives (label, the source the cell should have) or None to leave it. Returns 'file: cell N (label)' for
    every cell that differs, and rewrites those notebooks when write is set."""
    stale = []
    for path in notebooks(root):
        if path.stem in skip:
            continue
        is_md = path.suffix == ".md"
        notebook = jupytext.read(path) if is_md else nbformat.read(path, as_version=4)
        changed = False
        for index, cell in enumerate(notebook.cells):
            wanted = wanted_source(path, index, cell)
            if wanted is not None and cell.source != wanted[1]:
                stale.append(f"{path.relative_to(root)}: cell {index} ({wanted[0]})")
                cell.source = wanted[1]
                changed = True
        if changed and write:
            if is_md:
                jupytext.write(notebook, path, fmt="md:myst")
            else:
                nbformat.write(notebook, path)
    return stale


def sync(root: Path = ROOT, write: bool = True) -> list[str]:
    """Return 'file: cell N (shared-name)' for every copy that differs; rewrite them when write is set."""
    sources = shared_sources(root)

    def wanted(path, index, cell):
        name = shared_name(cell)
        if name is None:
            return None
        if name not in sources:
            raise SystemExit(f"{path.relative_to(root)}: cell {index} is tagged {TAG}{name}, "
                             f"but book/_shared/{name}.py does not exist and the package has no module for it")
        return f"{TAG}{name}", cell_text(name, sources[name])

    return rewrite_cells(root, write, wanted)


RECIPE_BOX = "08_recipe_box"
DEFINITION = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _spans(source: str) -> dict[str, tuple[int, int]]:
    """{name: (first line, last line), 0-based, decorators included} of every top-level definition."""
    return {node.name: (min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1, node.end_lineno or node.lineno)
            for node in ast.parse(source).body if isinstance(node, DEFINITION)}


def package_texts(package: Path = PACKAGE) -> dict[str, str]:
    """{name: source text} of every top-level function and class of the package's modules."""
    texts = {}
    for path in sorted(package.glob("*.py")):
        lines = path.read_text().splitlines()
        for name, (first, last) in _spans(path.read_text()).items():
            texts[name] = "\n".join(lines[first:last])
    return texts


def recipe_cell_source(source: str, texts: dict[str, str]) -> str:
    """The cell's source with every definition the package also has replaced by the package's text."""
    lines = source.splitlines()
    for name, (first, last) in sorted(_spans(source).items(), key=lambda item: -item[1][0]):
        if name in texts:
            lines[first:last] = texts[name].splitlines()
    return "\n".join(lines)


def sync_recipes(root: Path = ROOT, write: bool = True, package: Path = PACKAGE) -> list[str]:
    """Return 'file: cell N (recipe)' for every recipe cell whose definitions differ from the package's text;
    rewrite them when write is set. The recipe box is generated from the chapters (scripts/build_recipe_box.py)."""
    texts = package_texts(package)

    def wanted(path, index, cell):
        if cell.cell_type != "code" or "recipe" not in cell.metadata.get("tags", []):
            return None
        return "recipe", recipe_cell_source(cell.source, texts)

    return rewrite_cells(root, write, wanted, skip=(RECIPE_BOX,))


if __name__ == "__main__":
    for line in sync() + sync_recipes():
        print("rewrote: " + line)
