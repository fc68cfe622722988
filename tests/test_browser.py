"""The site as readers see it: every page in headless Chromium driven by Playwright, served on
127.0.0.1 with every request that would leave the machine blocked: no console error or failed
request, images loaded and exactly the notebook's plots, all math typeset by the shipped MathJax,
the notebook's cells and outputs (folded ones folded), and a Colab button for this notebook on
branch main. Screenshots go to test-artifacts/screenshots/. The last test opens the site built
from broken sources (conftest.py) and requires each break, and nothing else, to be reported.
Without Chromium and Playwright the tests skip, or fail when the environment variable CI is set.
"""
from __future__ import annotations

import contextlib
import functools
import http.server
import os
import re
import shutil
import sys
import threading
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import pytest
import yaml

from bookcheck import ROOT, toc_entries
from conftest import BROKEN_PAGES

# The flags a root process in a closed network needs: no sandbox (root), and no background
# connections to Google's services, which this machine's network refuses.
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]

HOW_TO_ENABLE = ("the browser test needs Chromium and Playwright: `apt-get install chromium` (Debian's package; "
                 "or set CHROMIUM=/path/to/chromium) and `pip install -r requirements.txt`")


def find_chromium() -> str | None:
    candidates = [os.environ.get("CHROMIUM"), shutil.which("chromium"), shutil.which("chromium-browser")]
    return next((c for c in candidates if c and Path(c).exists()), None)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        # A browser closing a page may drop a connection mid-response: not a fault of the site.
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


@contextlib.contextmanager
def serve(folder: Path):
    """Serve `folder` on 127.0.0.1 (a free port); yields the base URL, ending in '/'."""
    server = _Server(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def chromium(executable: str):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_FLAGS)
        try:
            yield browser
        finally:
            browser.close()


@dataclass
class PageReport:
    url: str
    problems: list[str] = field(default_factory=list)  # console errors, failed or outside requests, broken images
    plots: int = 0              # images inside cell outputs: the notebook's figures
    math: int = 0               # elements holding TeX on the page
    typeset: int = 0            # of those, how many MathJax rendered without an error
    cells: int = 0              # code cells on the page (inputs)
    cells_visible: int = 0      # ... of them not folded away (hide-cell)
    outputs: int = 0
    outputs_visible: int = 0
    colab: list[str] = field(default_factory=list)


# Every wait inside the page races a timer, so a resource that never settles fails the check
# with a message instead of hanging the test run.
_IMAGES_SETTLED = """async () => {
  const settle = img => img.complete ? Promise.resolve() : new Promise(done => {
    img.addEventListener("load", done, {once: true});
    img.addEventListener("error", done, {once: true});
  });
  const images = Array.from(document.images);
  images.forEach(img => { img.loading = "eager"; });
  const timer = new Promise(done => setTimeout(() => done("timeout"), 15000));
  const timedOut = (await Promise.race([Promise.all(images.map(settle)), timer])) === "timeout";
  const broken = images.filter(img => !(img.complete && img.naturalWidth > 0 && img.naturalHeight > 0))
                       .map(img => (img.getAttribute("src") || "(no src)").slice(0, 120));
  return [broken, timedOut];
}"""

_MATH = """async () => {
  const nodes = Array.from(document.querySelectorAll(".math"));
  if (nodes.length === 0) return [0, 0, null];
  if (!(window.MathJax && MathJax.startup && MathJax.startup.promise)) return [nodes.length, 0, "MathJax did not load"];
  const timer = new Promise(done => setTimeout(() => done("timeout"), 20000));
  if ((await Promise.race([MathJax.startup.promise, timer])) === "timeout")
    return [nodes.length, 0, "MathJax did not finish typesetting within 20 s"];
  const good = nodes.filter(n => n.querySelector("mjx-container") && !n.querySelector("mjx-merror"));
  return [nodes.length, good.length, null];
}"""

_CONTENT = """() => {
  const shown = el => el.checkVisibility({opacityProperty: true, visibilityProperty: true})
                      && el.getBoundingClientRect().height > 0;
  const inputs = Array.from(document.querySelectorAll("div.cell div.cell_input"));
  const outputs = Array.from(document.querySelectorAll("div.cell div.cell_output"));
  const hrefs = sel => Array.from(document.querySelectorAll(sel), a => a.href);
  return {
    plots: document.querySelectorAll("div.cell_output img").length,
    cells: inputs.length, cells_visible: inputs.filter(shown).length,
    outputs: outputs.length, outputs_visible: outputs.filter(shown).length,
    colab: hrefs('a[href*="colab.research.google.com"]'),
  };
}"""

def inspect_page(browser, url: str, screenshot: Path | None = None) -> PageReport:
    """Open `url` in a fresh browser context that may reach nothing but the site's own server."""
    origin = "{0.scheme}://{0.netloc}".format(urllib.parse.urlsplit(url))
    report = PageReport(url)
    problems: list[str] = []
    blocked: set[str] = set()

    def only_the_site(route):
        request_url = route.request.url
        if request_url.startswith(origin + "/") or request_url.startswith("data:"):
            route.continue_()
        else:
            blocked.add(request_url)
            problems.append(f"request leaves the site (it must read offline): {request_url}")
            route.abort()

    context = browser.new_context(viewport={"width": 1280, "height": 900}, service_workers="block")
    try:
        context.route("**/*", only_the_site)
        page = context.new_page()
        page.on("console", lambda m: m.type == "error" and problems.append(f"console error: {m.text}"))
        page.on("pageerror", lambda e: problems.append(f"script error: {e}"))
        page.on("response", lambda r: r.status >= 400 and problems.append(f"HTTP {r.status}: {r.url}"))
        page.on("requestfailed", lambda r: r.url not in blocked and problems.append(
            f"failed to load {r.url}: {r.failure}"))
        page.goto(url, wait_until="load", timeout=30_000)
        page.wait_for_load_state("networkidle", timeout=15_000)  # late requests: fonts, async scripts
        broken, timed_out = page.evaluate(_IMAGES_SETTLED)
        problems.extend(f"image did not load: {src}" for src in broken)
        if timed_out:
            problems.append("images still loading after 15 s")
        report.math, report.typeset, math_error = page.evaluate(_MATH)
        if math_error:
            problems.append(math_error)
        for key, value in page.evaluate(_CONTENT).items():
            setattr(report, key, value)
        if screenshot is not None:
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(screenshot), full_page=True, type="jpeg", quality=70)
        report.problems = list(problems)  # taken before closing: closing cancels requests still in flight
    finally:
        context.close()
    return report


# --- what each page must show --------------------------------------------------------------

REMOVED_INPUT = {"remove-cell", "remove-input"}      # myst-nb leaves these out of the page
REMOVED_OUTPUT = {"remove-cell", "remove-output"}
FOLDED_INPUT = {"hide-cell", "hide-input"}           # on the page, inside a closed <details>
FOLDED_OUTPUT = {"hide-cell", "hide-output"}
_TEX = re.compile(r"\$\$.+?\$\$|\$[^$\n]+\$|\\begin\{", re.S)


def expected_content(entry: str) -> dict:
    """What a notebook's page must show, read off the stored notebook."""
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


def page_problems(report: PageReport, expected: dict, colab: list[str]) -> list[str]:
    """Everything wrong with one inspected page, given what its notebook (`expected_content`)
    promises and the Colab link(s) it must have."""
    problems = list(report.problems)
    if report.math != report.typeset:
        problems.append(f"math not typeset: {report.math - report.typeset} of {report.math} formulas")
    for key in ("cells", "cells_visible", "outputs", "outputs_visible", "plots"):
        if getattr(report, key) != expected[key]:
            problems.append(f"{key}: the page has {getattr(report, key)}, the notebook {expected[key]}")
    if report.math < expected["tex"]:
        problems.append(f"{report.math} formulas on the page, the notebook's text has {expected['tex']}")
    if report.colab != colab:
        problems.append(f"Colab link(s) {report.colab}, expected {colab}")
    return problems


# --- the tests ---------------------------------------------------------------------------------

SCREENSHOTS = ROOT / "test-artifacts" / "screenshots"
ENTRIES = toc_entries(ROOT / "_toc.yml")            # book/00_front_page, book/00_run_it, ...
CONFIG = yaml.safe_load((ROOT / "_config.yml").read_text())
REPOSITORY = CONFIG["repository"]["url"].removeprefix("https://github.com/")


def colab_url(entry: str, branch: str = "main") -> str:
    return f"https://colab.research.google.com/github/{REPOSITORY}/blob/{branch}/{entry}.ipynb"


def screenshot_path(page: str):
    return SCREENSHOTS / (page.replace("/", "__").removesuffix(".html") + ".jpg")


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="module")
def browser():
    executable = find_chromium()
    try:
        import playwright  # noqa: F401
    except ImportError:
        executable = None
    if executable is None:
        if in_ci():
            pytest.fail(f"CI must run the browser test, but {HOW_TO_ENABLE}")
        pytest.skip(HOW_TO_ENABLE)
    with chromium(executable) as launched:
        yield launched


def inspect_site(browser, site, entries, screenshots=False):
    with serve(site) as base_url:
        return {entry: inspect_page(browser, f"{base_url}{entry}.html",
                                       screenshot_path(f"{entry}.html") if screenshots else None)
                for entry in entries}


@pytest.fixture(scope="module")
def reports(browser, site):
    if SCREENSHOTS.exists():
        shutil.rmtree(SCREENSHOTS)
    return inspect_site(browser, site, ENTRIES, screenshots=True)


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.removeprefix("book/"))
def test_page_in_the_browser(reports, entry):
    assert page_problems(reports[entry], expected_content(entry), [colab_url(entry)]) == []
    assert screenshot_path(f"{entry}.html").stat().st_size > 10_000


def test_the_checks_had_something_to_check(reports):
    """The per-page checks must not pass vacuously: the site has plots, math and cells."""
    plots = sum(expected_content(e)["plots"] for e in ENTRIES)
    assert plots >= 10 and sum(r.plots for r in reports.values()) >= plots
    assert sum(r.typeset for r in reports.values()) >= 100
    assert sum(r.cells for r in reports.values()) >= 200


# --- the checks catch what they guard -------------------------------------------------------

def test_a_broken_site_is_caught(browser, broken_site):
    """Each page of the broken book (conftest.py) is compared with the real notebook it came from,
    and must report exactly its break, and a Colab button on the wrong branch (every page)."""
    reports = inspect_site(browser, broken_site, BROKEN_PAGES)
    problems = {e: page_problems(reports[e], expected_content(e), [colab_url(e)]) for e in BROKEN_PAGES}
    url = reports[BROKEN_PAGES[0]].url.removesuffix(f"{BROKEN_PAGES[0]}.html")

    wanted = {
        "book/00_front_page": [],
        "book/01_vmap_basics": [],  # its broken links are for the link check (test_site.py)
        "book/02_jacobians_hessians": [f"HTTP 404: {url}book/no-such-figure.png", "console error: Failed to load resource",
                                       "image did not load: no-such-figure.png", "cells_visible: the page has "],
        "book/04_output_jacobians": ["math not typeset: 1 of "],
        "book/06_error_gallery": ["request leaves the site (it must read offline): https://cdn.example.org/lib.js",
                                  "console error: Failed to load resource", "console error: something broke"],
        "book/07_compile_with_transforms": ["plots: the page has "],
        "book/08_recipe_box": ["outputs_visible: the page has "],
    }
    wrong = {}
    for entry, starts in wanted.items():  # exactly these problems, each given by the start of its message
        starts = sorted([f"Colab link(s) {[colab_url(entry, 'master')]}", *starts])
        got = sorted(problems[entry])
        if not (len(got) == len(starts) and all(g.startswith(e) for g, e in zip(got, starts))):
            wrong[entry] = got
    assert wrong == {}
