"""Three fixes to the built pages, found by tests/test_browser.py, and the package's path.

1. Sphinx 7.4 registers a body-only script added after the builder starts twice: once
   with filename ``None`` and once with ``''``, which compare unequal. sphinx-thebe's
   ``const THEBE_JS_URL = ...`` then runs twice and the page logs
   "Identifier 'THEBE_JS_URL' has already been declared" (sphinx-togglebutton's selector
   is doubled the same way). We drop the second copy of any identical script.
2. pydata-sphinx-theme logs "Got invalid theme mode" on a first visit when no default
   mode is set; ``_config.yml`` sets ``html_context.default_mode`` for that.
3. Chromium lays out one ``<pre>`` of highlighted code in time that grows with the square of its length:
   the folded copy of the package (about 4,700 lines, in seven chapters) took 38 s to open, a quarter of it
   2.3 s, the same text without highlighting 0.1 s (headless Chromium, 2 cores). pydata-sphinx-theme also
   measures every code block once a page loads, so each of those pages took 27 s to load though the copy
   is folded. A long code cell's source is therefore shown as consecutive blocks of at most
   ``MAX_BLOCK_LINES`` lines, cut before top-level statements, inside the one cell frame: it reads as one
   listing, and loads in about a second.

The package reference (book/reference.rst) documents src/torch_func_recipes with autodoc, which imports
it: this extension puts src/ first on sys.path (the site's environment need not install the package).
"""
import ast
import sys
from pathlib import Path

from docutils import nodes

_SOURCE = Path(__file__).resolve().parents[2] / "src"
if str(_SOURCE) not in sys.path:
    sys.path.insert(0, str(_SOURCE))


def _drop_duplicate_scripts(app, pagename, templatename, context, doctree):
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, kept = set(), []
    for script in scripts:
        key = (script.filename or "", tuple(sorted(script.attributes.items())))
        if key not in seen:
            seen.add(key)
            kept.append(script)
    context["script_files"] = kept


MAX_BLOCK_LINES = 200


def code_blocks(source: str, limit: int = MAX_BLOCK_LINES) -> list[str]:
    """`source` cut into consecutive pieces of at most `limit` lines, each cut before a top-level statement
    (its decorators or the comments above it included); a statement longer than `limit` stays whole, and
    source that does not parse as Python stays one piece."""
    lines = source.splitlines(keepends=True)
    if len(lines) <= limit:
        return [source]
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return [source]
    starts = set()
    for node in tree.body:
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1
        while first > 0 and lines[first - 1].startswith("#"):  # the unindented comments that head it
            first -= 1
        starts.add(first)
    pieces, begin = [], 0
    cuts = sorted(starts - {0}) + [len(lines)]
    for previous, cut in zip([0] + cuts, cuts):
        if cut - begin > limit and previous > begin:
            pieces.append("".join(lines[begin:previous]))
            begin = previous
    pieces.append("".join(lines[begin:]))
    return pieces


def _split_long_code_cells(app, doctree, docname):
    for cell_input in list(doctree.findall(nodes.container)):
        if cell_input.get("nb_element") != "cell_code_source":
            continue
        for block in [c for c in cell_input.children if isinstance(c, nodes.literal_block)]:
            pieces = code_blocks(block.astext())
            if len(pieces) > 1:
                copies = []
                for i, piece in enumerate(pieces):
                    copy = nodes.literal_block(piece.rstrip("\n"), piece.rstrip("\n"), **block.attributes)
                    copy.source, copy.line = block.source, block.line
                    if i:  # an anchor stays on the first block only
                        copy["ids"], copy["names"] = [], []
                    copies.append(copy)
                block.replace_self(copies)


def setup(app):
    app.connect("html-page-context", _drop_duplicate_scripts)
    app.connect("doctree-resolved", _split_long_code_cells)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
