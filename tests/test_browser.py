"""The site as readers see it: every page in headless Chromium driven by Playwright, served on
127.0.0.1 with every request that would leave the machine blocked: no console error or failed
request, images loaded and exactly the notebook's plots, all math typeset by the shipped MathJax,
the notebook's cells and outputs (folded ones folded), and a Colab button for this notebook on
branch main. Screenshots go to test-artifacts/screenshots/. The last test opens the site built
from broken sources (conftest.py) and requires each break, and nothing else, to be reported.
Without Chromium and Playwright the tests skip, or fail when the environment variable CI is set.
"""
import contextlib
import functools
import http.server
import os
import re
import shutil
import sys
import threading
import time
from pathlib import Path

import nbformat
import pytest
import yaml

try:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
except ImportError:  # the tests skip (or fail under CI) in the browser fixture
    PlaywrightTimeout = TimeoutError

from bookcheck import ROOT, toc_entries
from conftest import BROKEN_PAGES

# The flags a root process in a closed network needs: no sandbox (root), and no background
# connections to Google's services, which this machine's network refuses.
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]

HOW_TO_ENABLE = ("the browser test needs Chromium and Playwright: `apt-get install chromium` (Debian's package; "
                 "or set CHROMIUM=/path/to/chromium) and `pip install -r requirements.txt`")


class _Handler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def handle(self):  # a browser closing a page may drop a connection mid-response: not a fault of the site
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            super().handle()


# What a page shows, read once it has settled. Every wait races a timer, so a resource that never
# settles fails the check with a message instead of hanging the test run.
_PAGE = """async () => {
  const late = (promise, ms) => Promise.race([promise.then(() => false), new Promise(done => setTimeout(done, ms, true))]);
  const problems = [], images = Array.from(document.images);
  images.forEach(img => { img.loading = "eager"; });
  if (await late(Promise.all(images.map(img => img.complete ? null : new Promise(done => {
        img.addEventListener("load", done, {once: true}); img.addEventListener("error", done, {once: true}); }))), 15000))
    problems.push("images still loading after 15 s");
  images.filter(img => !(img.complete && img.naturalWidth > 0 && img.naturalHeight > 0))
        .forEach(img => problems.push("image did not load: " + (img.getAttribute("src") || "(no src)").slice(0, 120)));
  const math = Array.from(document.querySelectorAll(".math"));
  if (math.length && !(window.MathJax && MathJax.startup && MathJax.startup.promise)) problems.push("MathJax did not load");
  else if (math.length && await late(MathJax.startup.promise, 20000))
    problems.push("MathJax did not finish typesetting within 20 s");
  const shown = el => el.checkVisibility({opacityProperty: true, visibilityProperty: true})
                      && el.getBoundingClientRect().height > 0;
  const inputs = Array.from(document.querySelectorAll("div.cell div.cell_input"));
  const outputs = Array.from(document.querySelectorAll("div.cell div.cell_output"));
  return {
    problems, math: math.length,
    typeset: math.filter(n => n.querySelector("mjx-container") && !n.querySelector("mjx-merror")).length,
    plots: document.querySelectorAll("div.cell_output img").length,  // images inside cell outputs: the notebook's figures
    cells: inputs.length, cells_visible: inputs.filter(shown).length,
    outputs: outputs.length, outputs_visible: outputs.filter(shown).length,
    colab: Array.from(document.querySelectorAll('a[href*="colab.research.google.com"]'), a => a.href),
  };
}"""


# How long a page may take to load, settle and be photographed. A page of this site loads in about 2 s
# on 2 cores; the slowest took 30 s when one long code block made the theme's script lay it out again
# and again (book/_ext/site_fixes.py).
LOAD_MS, SETTLE_MS, SCREENSHOT_MS = 30_000, 15_000, 30_000


def inspect_page(browser, url: str, screenshot: Path | None = None) -> dict:
    """Open `url` in a fresh browser context that may reach nothing but the site's own server: what
    `_PAGE` reads, with the console errors and the failed or outside requests added to its problems.
    A page that does not load, settle or photograph in time gives only that problem (`timed_out`)."""
    try:
        return _inspect_page(browser, url, screenshot)
    except PlaywrightTimeout as error:
        return {"url": url, "timed_out": True, "problems": [f"timed out: {str(error).splitlines()[0]}"]}


def _inspect_page(browser, url: str, screenshot: Path | None) -> dict:
    origin = url[:url.index("/", len("http://"))]
    problems, blocked = [], set()

    def only_the_site(route):
        if route.request.url.startswith((origin + "/", "data:")):
            return route.continue_()
        blocked.add(route.request.url)
        problems.append(f"request leaves the site (it must read offline): {route.request.url}")
        route.abort()

    context = browser.new_context(viewport={"width": 1280, "height": 900}, service_workers="block")
    try:
        context.route("**/*", only_the_site)
        page = context.new_page()
        page.on("console", lambda m: m.type == "error" and problems.append(f"console error: {m.text}"))
        page.on("pageerror", lambda e: problems.append(f"script error: {e}"))
        page.on("response", lambda r: r.status >= 400 and problems.append(f"HTTP {r.status}: {r.url}"))
        page.on("requestfailed", lambda r: r.url not in blocked and problems.append(f"failed to load {r.url}: {r.failure}"))
        page.goto(url, wait_until="load", timeout=LOAD_MS)
        page.wait_for_load_state("networkidle", timeout=SETTLE_MS)  # late requests: fonts, async scripts
        report = page.evaluate(_PAGE)
        if screenshot is not None:
            page.screenshot(path=str(screenshot), full_page=True, type="jpeg", quality=70, timeout=SCREENSHOT_MS)
        report["problems"] = problems + report["problems"]  # a copy: closing cancels requests still in flight
    finally:
        context.close()
    return {"url": url, **report}


# --- what each page must show --------------------------------------------------------------

REMOVED_INPUT, REMOVED_OUTPUT = {"remove-cell", "remove-input"}, {"remove-cell", "remove-output"}  # not on the page
FOLDED_INPUT, FOLDED_OUTPUT = {"hide-cell", "hide-input"}, {"hide-cell", "hide-output"}  # in a closed <details>
_TEX = re.compile(r"\$\$.+?\$\$|\$[^$\n]+\$|\\begin\{", re.S)


def expected_content(entry: str) -> dict:
    """What a notebook's page must show, read off the stored notebook (nothing of the kind for a page that
    is not a notebook: the package reference, book/reference.rst)."""
    if not (ROOT / f"{entry}.ipynb").exists():
        return {"cells": 0, "cells_visible": 0, "outputs": 0, "outputs_visible": 0, "plots": 0, "tex": 0}
    nb = nbformat.read(ROOT / f"{entry}.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    tags = [set(c.metadata.get("tags", [])) for c in code]
    shown_inputs = [t for t in tags if not t & REMOVED_INPUT]
    shown_outputs = [t for c, t in zip(code, tags) if c.outputs and not t & REMOVED_OUTPUT]
    return {
        "cells": len(shown_inputs),
        "cells_visible": sum(not t & FOLDED_INPUT for t in shown_inputs),
        "outputs": len(shown_outputs),
        "outputs_visible": sum(not t & FOLDED_OUTPUT for t in shown_outputs),
        "plots": sum("image/png" in o.get("data", {}) for c, t in zip(code, tags) if not t & REMOVED_OUTPUT
                     for o in c.outputs),
        "tex": sum(len(_TEX.findall(c.source)) for c in nb.cells if c.cell_type == "markdown"),
    }


def page_problems(report: dict, entry: str) -> list[str]:
    """Everything wrong with the inspected page of `entry`, given what its notebook promises
    (`expected_content`) and the Colab button it must have."""
    if report.get("timed_out"):
        return list(report["problems"])
    expected, problems = expected_content(entry), list(report["problems"])
    if report["math"] != report["typeset"]:
        problems.append(f"math not typeset: {report['math'] - report['typeset']} of {report['math']} formulas")
    for key in ("cells", "cells_visible", "outputs", "outputs_visible", "plots"):
        if report[key] != expected[key]:
            problems.append(f"{key}: the page has {report[key]}, the notebook {expected[key]}")
    if report["math"] < expected["tex"]:
        problems.append(f"{report['math']} formulas on the page, the notebook's text has {expected['tex']}")
    colab = [colab_url(entry)] if (ROOT / f"{entry}.ipynb").exists() else []  # only a notebook opens in Colab
    if report["colab"] != colab:
        problems.append(f"Colab link(s) {report['colab']}, expected {colab}")
    return problems


# --- the tests ---------------------------------------------------------------------------------

SCREENSHOTS = ROOT / "test-artifacts" / "screenshots"
ENTRIES = toc_entries(ROOT / "_toc.yml")            # book/00_front_page, book/00_run_it, ...
REPOSITORY = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]["url"].removeprefix("https://github.com/")


def colab_url(entry: str, branch: str = "main") -> str:
    return f"https://colab.research.google.com/github/{REPOSITORY}/blob/{branch}/{entry}.ipynb"


@pytest.fixture(scope="module")
def browser():
    executable = next((c for c in [os.environ.get("CHROMIUM"), shutil.which("chromium"), shutil.which("chromium-browser")]
                       if c and Path(c).exists()), None)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        executable = None
    if executable is None:
        if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
            pytest.fail(f"CI must run the browser test, but {HOW_TO_ENABLE}")
        pytest.skip(HOW_TO_ENABLE)
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_FLAGS)
        yield launched
        launched.close()


def inspect_site(browser, site: Path, entries, screenshots=False) -> dict:
    """Serve `site` on 127.0.0.1 (a free port) and inspect the page of each entry."""
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Handler, directory=str(site))) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            return {entry: inspect_page(browser, f"http://127.0.0.1:{server.server_address[1]}/{entry}.html",
                                        SCREENSHOTS / f"{entry.replace('/', '__')}.jpg" if screenshots else None)
                    for entry in entries}
        finally:
            server.shutdown()


@pytest.fixture(scope="module")
def reports(browser, site):
    shutil.rmtree(SCREENSHOTS, ignore_errors=True)
    SCREENSHOTS.mkdir(parents=True)
    return inspect_site(browser, site, ENTRIES, screenshots=True)


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.removeprefix("book/"))
def test_page_in_the_browser(reports, entry):
    assert page_problems(reports[entry], entry) == []
    assert (SCREENSHOTS / f"{entry.replace('/', '__')}.jpg").stat().st_size > 10_000


def test_the_checks_had_something_to_check(reports):
    """The per-page checks must not pass vacuously: the site has plots, math and cells."""
    plots = sum(expected_content(e)["plots"] for e in ENTRIES)
    assert plots >= 10 and sum(r["plots"] for r in reports.values()) >= plots
    assert sum(r["typeset"] for r in reports.values()) >= 100
    assert sum(r["cells"] for r in reports.values()) >= 200


# --- the checks catch what they guard -------------------------------------------------------

def test_a_broken_site_is_caught(browser, broken_site):
    """Each page of the broken book (conftest.py) is compared with the real notebook it came from,
    and must report exactly its break, and a Colab button on the wrong branch (every page)."""
    reports = inspect_site(browser, broken_site, BROKEN_PAGES)
    url = reports[BROKEN_PAGES[0]]["url"].removesuffix(f"{BROKEN_PAGES[0]}.html")
    wanted = {  # exactly these problems, each given by the start of its message
        "book/00_front_page": [],
        "book/01_vmap_basics": [],  # its broken links are for the link check (test_site.py)
        "book/02_jacobians_hessians": [f"HTTP 404: {url}book/no-such-figure.png", "console error: Failed to load resource",
                                       "image did not load: no-such-figure.png", "cells_visible: the page has "],
        "book/04_output_jacobians": ["math not typeset: 1 of "],
        "book/06_error_gallery": ["request leaves the site (it must read offline): https://cdn.example.org/lib.js",
                                  "console error: Failed to load resource", "console error: something broke"],
        "book/07_compile_with_transforms": ["plots: the page has "],
        "book/05_model_ensembling": ["outputs_visible: the page has "],
    }
    wanted = {e: sorted([f"Colab link(s) {[colab_url(e, 'master')]}", *starts]) for e, starts in wanted.items()}
    got = {e: sorted(page_problems(reports[e], e)) for e in wanted}
    # each problem cut to the length of the start it must have; any problem beyond those stays whole
    assert {e: [g[:len(s)] for g, s in zip(got[e], starts)] + got[e][len(starts):] for e, starts in wanted.items()} == wanted, got


class _Stalling(_Handler):
    """Serves the site, but answers a request for /stall.js only after 5 s: a page that needs it never loads in time."""

    def do_GET(self):
        if self.path == "/stall.js":
            time.sleep(5)
            self.send_error(404)
        else:
            super().do_GET()


def test_a_page_that_times_out_fails_alone(browser, tmp_path, monkeypatch):
    """A page that does not load in time is reported as such, and the pages after it are still inspected
    (before, one timeout stopped the whole site's fixture and every page's test errored)."""
    icon = '<link rel="icon" href="data:,">'
    (tmp_path / "stalls.html").write_text(f'<html><head>{icon}<script src="/stall.js"></script></head><body>x</body></html>')
    (tmp_path / "fine.html").write_text(f"<html><head>{icon}</head><body>fine</body></html>")
    monkeypatch.setattr(sys.modules[__name__], "LOAD_MS", 2_000)
    monkeypatch.setattr(sys.modules[__name__], "_Handler", _Stalling)
    reports = inspect_site(browser, tmp_path, ["stalls", "fine"])
    assert [p[:len("timed out: Page.goto: Timeout 2000ms")] for p in page_problems(reports["stalls"], "stalls")] == [
        "timed out: Page.goto: Timeout 2000ms"]
    assert page_problems(reports["fine"], "fine") == []
