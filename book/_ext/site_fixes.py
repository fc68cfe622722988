"""Two fixes to the built pages, found by tests/test_browser.py (console errors), and the package's path.

1. Sphinx 7.4 registers a body-only script added after the builder starts twice: once
   with filename ``None`` and once with ``''``, which compare unequal. sphinx-thebe's
   ``const THEBE_JS_URL = ...`` then runs twice and the page logs
   "Identifier 'THEBE_JS_URL' has already been declared" (sphinx-togglebutton's selector
   is doubled the same way). We drop the second copy of any identical script.
2. pydata-sphinx-theme logs "Got invalid theme mode" on a first visit when no default
   mode is set; ``_config.yml`` sets ``html_context.default_mode`` for that.

The package reference (book/reference.rst) documents src/torch_func_recipes with autodoc, which imports
it: this extension puts src/ first on sys.path (the site's environment need not install the package).
"""
import sys
from pathlib import Path

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


def setup(app):
    app.connect("html-page-context", _drop_duplicate_scripts)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
