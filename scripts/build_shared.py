"""Copy the book's shared notebook code from book/_shared/<name>.py into every cell tagged `shared-<name>`.

    python -m scripts.build_shared     # rewrite those cells in book/*.md and book/*.ipynb (outputs kept)

Notebooks stay self-contained (Colab opens one file), so code several chapters need is copied into
each of them; this script is the only thing that writes those copies, and tests/test_shared_code.py
fails when a copy drifts. Edit book/_shared/<name>.py, run this script, then re-execute the notebooks
that use it (make outputs NB=...).
"""
from __future__ import annotations

from pathlib import Path

import jupytext
import nbformat

ROOT = Path(__file__).resolve().parents[1]
TAG = "shared-"


def shared_sources(root: Path = ROOT) -> dict[str, str]:
    return {path.stem: path.read_text() for path in sorted((root / "book" / "_shared").glob("*.py"))}


def cell_text(name: str, source: str) -> str:
    header = f"# From book/_shared/{name}.py by scripts/build_shared.py: edit that file, not this cell.\n"
    return header + source.rstrip("\n")


def shared_name(cell) -> str | None:
    names = [tag[len(TAG):] for tag in cell.metadata.get("tags", []) if tag.startswith(TAG)]
    if len(names) > 1:
        raise ValueError(f"a cell has two shared- tags: {names}")
    return names[0] if names else None


def notebooks(root: Path = ROOT) -> list[Path]:
    return sorted((root / "book").glob("*.md")) + sorted((root / "book").glob("*.ipynb"))


def sync(root: Path = ROOT, write: bool = True) -> list[str]:
    """Return 'file: cell N (shared-name)' for every copy that differs; rewrite them when write is set."""
    sources = shared_sources(root)
    stale = []
    for path in notebooks(root):
        is_md = path.suffix == ".md"
        notebook = jupytext.read(path) if is_md else nbformat.read(path, as_version=4)
        changed = False
        for index, cell in enumerate(notebook.cells):
            name = shared_name(cell)
            if name is None:
                continue
            if name not in sources:
                raise SystemExit(f"{path.relative_to(root)}: cell {index} is tagged {TAG}{name}, "
                                 f"but book/_shared/{name}.py does not exist")
            wanted = cell_text(name, sources[name])
            if cell.source != wanted:
                stale.append(f"{path.relative_to(root)}: cell {index} ({TAG}{name})")
                cell.source = wanted
                changed = True
        if changed and write:
            if is_md:
                jupytext.write(notebook, path, fmt="md:myst")
            else:
                nbformat.write(notebook, path)
    return stale


if __name__ == "__main__":
    for line in sync():
        print("rewrote: " + line)
