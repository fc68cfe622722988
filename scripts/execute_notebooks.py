"""Regenerate the stored outputs of the book's notebooks from their MyST twins.

    python -m scripts.execute_notebooks                     # every book/*.md
    python -m scripts.execute_notebooks book/01_vmap_basics.md

For each page, the cells of book/NN_name.md are executed top to bottom in a fresh kernel of
this Python environment (working directory book/), and book/NN_name.ipynb is replaced by the
result. The notebook is written to a temporary file first and moved into place only when
the run succeeded, so a failed run never leaves a half-written notebook behind.

A run fails (and writes nothing) when the result breaks what `execution_problems` (below;
tests/ runs it on the stored notebooks too) requires of a stored notebook: a cell that raises without the
`raises-exception` tag, a cell tagged `raises-exception` that does not raise, or anything on
stderr. The notebook's metadata follows the .md's, as `jupytext --sync` (the pre-commit hook)
would write it. The kernel runs without THP_MEM_ALLOC_ENABLE, whatever the caller's environment: the
stored timings are made without huge pages.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import jupytext
import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"


def execution_problems(notebook: Path | nbformat.NotebookNode, name: str = "") -> list[str]:
    """A stored notebook must be fully executed, top to bottom, once, with no stray error or stderr.

    `notebook` is a path, or a notebook just executed (`execute` checks it before
    writing it), then named by `name` in the messages."""
    nb = notebook if isinstance(notebook, nbformat.NotebookNode) else nbformat.read(notebook, as_version=4)
    name = name or Path(notebook).name
    problems, expected = [], 1
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        tags = cell.metadata.get("tags", [])
        if cell.execution_count != expected:
            problems.append(f"{name} cell {index}: execution count {cell.execution_count}, expected {expected} "
                            "(run the whole notebook in order: `make outputs`)")
        expected += 1
        errors = [o for o in cell.outputs if o.output_type == "error"]
        if errors and "raises-exception" not in tags:
            problems.append(f"{name} cell {index}: stored error {errors[0].ename} in a cell not tagged raises-exception "
                            f"({errors[0].evalue[:200]})")
        if "raises-exception" in tags and not errors:
            problems.append(f"{name} cell {index}: tagged raises-exception but has no stored error")
        stderr = "".join(o.text for o in cell.outputs if o.output_type == "stream" and o.name == "stderr")
        if stderr:
            problems.append(f"{name} cell {index}: stored output on stderr: {stderr[:300]!r}")
    return problems


def execute(md_path: Path) -> float:
    ipynb_path = md_path.with_suffix(".ipynb")
    nb = jupytext.read(md_path)
    nb.metadata.setdefault("kernelspec", {"display_name": "Python 3", "language": "python", "name": "python3"})
    start = time.perf_counter()
    # the kernel inherits this environment: the stored timings are made without huge pages (they change which
    # tensors are fresh memory, and so the ratios; Chapter 3's benchmark runs each setting in a process of its own)
    huge_pages = os.environ.pop("THP_MEM_ALLOC_ENABLE", None)
    try:
        NotebookClient(
            nb, timeout=900, kernel_name="python3", allow_errors=False,
            resources={"metadata": {"path": str(md_path.parent)}},
        ).execute()
    finally:
        if huge_pages is not None:
            os.environ["THP_MEM_ALLOC_ENABLE"] = huge_pages
    seconds = time.perf_counter() - start
    found = execution_problems(nb, md_path.name)
    if found:
        raise RuntimeError(f"{md_path.relative_to(ROOT)}: not written, because\n  " + "\n  ".join(found))
    handle, tmp_name = tempfile.mkstemp(dir=ipynb_path.parent, suffix=".tmp.ipynb")
    os.close(handle)
    try:
        jupytext.write(nb, tmp_name, fmt="ipynb")
        nbformat.validate(nbformat.read(tmp_name, as_version=4))
        os.replace(tmp_name, ipynb_path)
    finally:
        if os.path.exists(tmp_name):
            os.remove(tmp_name)
    return seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pages", nargs="*", type=Path, help="book/NN_name.md or .ipynb (default: all)")
    args = parser.parse_args(argv)
    pages = [p.with_suffix(".md") for p in args.pages] or sorted(BOOK.glob("*.md"))
    failed = 0
    for md_path in pages:
        md_path = md_path.resolve()
        if not md_path.exists():
            print(f"{md_path}: no such page", file=sys.stderr)
            failed += 1
            continue
        try:
            seconds = execute(md_path)
        except Exception as exc:  # report every page, then fail
            print(f"FAILED {md_path.relative_to(ROOT)}: {exc}", file=sys.stderr)
            failed += 1
        else:
            print(f"wrote {md_path.with_suffix('.ipynb').relative_to(ROOT)} ({seconds:.1f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
