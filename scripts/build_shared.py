"""Copy the book's shared notebook code into every cell tagged `shared-<name>`.

    python -m scripts.build_shared     # rewrite those cells in book/*.md and book/*.ipynb (outputs kept)

Notebooks stay self-contained (Colab opens one file), so code several chapters need is copied into
each of them; this script is the only thing that writes those copies, and tests/test_shared_code.py
fails when a copy drifts. A copy comes from one of two places:

- book/_shared/<name>.py, notebook-only helpers (basics, measure, ...), copied whole;
- the package, src/torch_func_recipes/, which is its one source: the cell tagged shared-package holds
  every module of it (PACKAGE_ORDER below, in an order where each module comes after those it imports
  from), so a chapter that calls the package's recipes carries all of it in one folded cell. A module
  is not a notebook cell as it stands, so the copy leaves out, per module, its docstring (a comment
  names the file instead), its relative imports (`from ._trace import PathReport`: in one cell, the
  name is already defined above) and `from __future__ import annotations`, which the cell states
  once, first, where Python requires it. The absolute imports are kept: they rebind torch, nn, F and
  the rest to the objects a notebook already has, so they are harmless there, and they make the
  cell runnable on its own. `__init__` (re-exports only) and `_torch_private` (the register of private
  APIs, which nothing imports) are not copied.

The script also keeps the chapters' cells tagged `recipe` equal to the package: each function or class
such a cell defines is rewritten with the package's text of that definition (its docstring without the
`Example::` section, which belongs to the package reference) (tests/test_package.py
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
# Each module after the modules it imports from (tests/test_shared_code.py checks this against the imports).
PACKAGE_ORDER = ("_batch", "_layers", "_layer_batch_norm", "_layer_group_norm", "_layer_conv", "_layer_embedding", "_layer_rms_norm",
                 "_layer_linear", "_layer_hf_conv1d", "_layer_norm", "_layer_parameter", "_trace", "_vmap_gaps", "transforms", "per_sample",
                 "output_jacobians", "ensembles", "curvature", "migration")
FUTURE = "from __future__ import annotations"


def as_cell(module_source: str) -> str:
    """A package module as notebook code: without its docstring, its relative imports and its __future__
    import (see the docstring above)."""
    tree = ast.parse(module_source)
    lines = module_source.splitlines()
    dropped = set()
    for index, node in enumerate(tree.body):
        docstring = index == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
            and isinstance(node.value.value, str)
        relative = isinstance(node, ast.ImportFrom) and (node.level > 0 or node.module == "__future__")
        if docstring or relative:
            dropped.update(range(node.lineno - 1, node.end_lineno or node.lineno))
    kept = "\n".join(line for number, line in enumerate(lines) if number not in dropped)
    return re.sub(r"\n{4,}", "\n\n\n", kept).strip("\n") + "\n"  # at most two blank lines where lines went


def package_cell(package: Path = PACKAGE) -> str:
    """The whole package as one cell: every module of PACKAGE_ORDER, each under a comment naming its file."""
    missing = sorted({p.stem for p in package.glob("*.py")} - set(PACKAGE_ORDER) - {"__init__", "_torch_private"})
    if missing:
        raise SystemExit(f"scripts/build_shared.py: add {missing} to PACKAGE_ORDER (after the modules they import from)")
    parts = [f"{FUTURE}\n"]
    for module in PACKAGE_ORDER:
        banner = f"# ---- src/torch_func_recipes/{module}.py " + "-" * max(0, 70 - len(module))
        parts.append(f"{banner}\n\n{as_cell((package / f'{module}.py').read_text())}")
    return "\n\n".join(parts)


def source_path(name: str) -> str:
    """Where shared-<name> comes from, relative to the repository root."""
    return "src/torch_func_recipes/ (the whole package)" if name == "package" else f"book/_shared/{name}.py"


def shared_sources(root: Path = ROOT, package: Path = PACKAGE) -> dict[str, str]:
    """{name: the code of the cells tagged shared-<name>}, from book/_shared/ under root and from the package."""
    sources = {path.stem: path.read_text() for path in sorted((root / "book" / "_shared").glob("*.py"))}
    if "package" in sources:
        raise SystemExit("shared-package has two sources: book/_shared/package.py and the package")
    sources["package"] = package_cell(package)
    return dict(sorted(sources.items()))


def cell_text(name: str, source: str) -> str:
    what = "those files" if name == "package" else "that file"
    header = f"# From {source_path(name)} by scripts/build_shared.py: edit {what}, not this cell.\n"
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


QUOTES = chr(34) * 3
DEFINITION = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _spans(source: str) -> dict[str, tuple[int, int]]:
    """{name: (first line, last line), 0-based, decorators included} of every top-level definition."""
    return {node.name: (min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1, node.end_lineno or node.lineno)
            for node in ast.parse(source).body if isinstance(node, DEFINITION)}


def without_examples(source: str) -> str:
    """The source with the `Example::` section of every docstring left out (the section runs to the
    docstring's closing quotes, which the package writes as three double quotes). A chapter's recipe cell
    shows the package's definition without it: the example is the package reference's, and a doctest the
    tests run (tests/test_doctests.py)."""
    kept, skipping = [], False
    for line in source.splitlines():
        if line.strip() == "Example::":
            skipping = True
            while kept and not kept[-1].strip():
                kept.pop()  # the blank line before the section
            continue
        if skipping and line.strip().startswith(QUOTES):
            skipping = False
        if not skipping:
            kept.append(line)
    return "\n".join(kept) + ("\n" if source.endswith("\n") else "")


def package_texts(package: Path = PACKAGE) -> dict[str, str]:
    """{name: source text, without docstring examples} of every top-level function and class of the package's modules."""
    texts = {}
    for path in sorted(package.glob("*.py")):
        source = without_examples(path.read_text())
        lines = source.splitlines()
        for name, (first, last) in _spans(source).items():
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
    rewrite them when write is set."""
    texts = package_texts(package)

    def wanted(path, index, cell):
        if cell.cell_type != "code" or "recipe" not in cell.metadata.get("tags", []):
            return None
        return "recipe", recipe_cell_source(cell.source, texts)

    return rewrite_cells(root, write, wanted)


if __name__ == "__main__":
    for line in sync() + sync_recipes():
        print("rewrote: " + line)
