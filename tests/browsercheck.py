"""Checks of the built site in a real browser: headless Chromium (Debian's `chromium` package),
driven by Playwright, against the site served on 127.0.0.1.

`inspect_page` opens one page and returns what a reader would meet there: console errors,
requests that fail or leave the machine, images that did not load, mathematics MathJax did not
typeset, how many code cells and outputs are on the page and visible, the Colab links, the
previous/next links and every internal link. tests/test_browser.py turns that into assertions,
on the real site and on a deliberately broken copy.
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
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

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
    images: int = 0
    math: int = 0               # elements holding TeX on the page
    typeset: int = 0            # of those, how many MathJax turned into rendered math without an error
    cells: int = 0              # code cells on the page (inputs)
    cells_visible: int = 0      # ... of them not folded away (hide-cell)
    outputs: int = 0
    outputs_visible: int = 0
    colab: list[str] = field(default_factory=list)
    previous: str | None = None
    next: str | None = None
    links: list[str] = field(default_factory=list)  # internal links, absolute
    redirect: str | None = None  # where a <meta http-equiv="refresh"> page sent the browser


_IMAGES_SETTLED = """async () => {
  for (const img of document.images) {
    img.loading = "eager";
    if (!img.complete) await new Promise(done => { img.onload = img.onerror = done; });
  }
  return Array.from(document.images).filter(img => !(img.complete && img.naturalWidth > 0))
              .map(img => img.getAttribute("src").slice(0, 120));
}"""

_MATH = """async () => {
  const nodes = Array.from(document.querySelectorAll(".math"));
  if (nodes.length === 0) return [0, 0, null];
  if (!(window.MathJax && MathJax.startup && MathJax.startup.promise)) return [nodes.length, 0, "MathJax did not load"];
  await MathJax.startup.promise;
  const good = nodes.filter(n => n.querySelector("mjx-container") && !n.querySelector("mjx-merror"));
  return [nodes.length, good.length, null];
}"""

_CONTENT = """() => {
  const shown = el => el.checkVisibility();
  const inputs = Array.from(document.querySelectorAll("div.cell div.cell_input"));
  const outputs = Array.from(document.querySelectorAll("div.cell div.cell_output"));
  const hrefs = sel => Array.from(document.querySelectorAll(sel), a => a.href);
  return {
    cells: inputs.length, cells_visible: inputs.filter(shown).length,
    outputs: outputs.length, outputs_visible: outputs.filter(shown).length,
    colab: hrefs('a[href*="colab.research.google.com"]'),
    previous: hrefs(".prev-next-area a.left-prev")[0] || null,
    next: hrefs(".prev-next-area a.right-next")[0] || null,
    links: hrefs("a[href]"),
  };
}"""


_REFRESH = re.compile(r"""<meta\s+http-equiv=["']refresh["']\s+content=["']\d+;\s*url=([^"']+)["']""", re.I)


def _refresh_target(url: str) -> str | None:
    with urllib.request.urlopen(url, timeout=10) as response:
        found = _REFRESH.search(response.read().decode("utf-8", "replace"))
    return urllib.parse.urljoin(url, found.group(1)) if found else None


def inspect_page(browser, url: str, screenshot: Path | None = None) -> PageReport:
    """Open `url` in a fresh browser context that may reach nothing but the site's own server."""
    origin = "{0.scheme}://{0.netloc}".format(urllib.parse.urlsplit(url))
    report = PageReport(url)
    blocked: set[str] = set()

    def only_the_site(route):
        request_url = route.request.url
        if request_url.startswith(origin + "/") or request_url.startswith("data:"):
            route.continue_()
        else:
            blocked.add(request_url)
            report.problems.append(f"request leaves the site (it must read offline): {request_url}")
            route.abort()

    context = browser.new_context(viewport={"width": 1280, "height": 900}, service_workers="block")
    try:
        context.route("**/*", only_the_site)
        page = context.new_page()
        page.on("console", lambda m: m.type == "error" and report.problems.append(f"console error: {m.text}"))
        page.on("pageerror", lambda e: report.problems.append(f"script error: {e}"))
        page.on("response", lambda r: r.status >= 400 and report.problems.append(f"HTTP {r.status}: {r.url}"))
        page.on("requestfailed", lambda r: r.url not in blocked and report.problems.append(
            f"failed to load {r.url}: {r.failure}"))
        page.goto(url, wait_until="load")
        if redirect := _refresh_target(url):  # index.html forwards to the front page
            page.wait_for_url(redirect)
            page.wait_for_load_state("load")
            report.redirect = page.url
        broken = page.evaluate(_IMAGES_SETTLED)
        report.images = page.evaluate("() => document.images.length")
        report.problems += [f"image did not load: {src}" for src in broken]
        report.math, report.typeset, math_error = page.evaluate(_MATH)
        if math_error:
            report.problems.append(math_error)
        content = page.evaluate(_CONTENT)
        for key, value in content.items():
            setattr(report, key, value)
        report.links = sorted({link.split("#")[0] + ("#" + link.split("#", 1)[1] if "#" in link else "")
                               for link in report.links if link.startswith(origin + "/")})
        if screenshot is not None:
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(screenshot), full_page=True, type="jpeg", quality=70)
    finally:
        context.close()
    return report


def search(browser, base: str, word: str) -> list[str]:
    """The pages (paths relative to the site) that the site's own search page lists for `word`."""
    context = browser.new_context()
    try:
        page = context.new_page()
        page.goto(f"{base}search.html?q={urllib.parse.quote(word)}", wait_until="load")
        # Sphinx lists the results one by one, then writes a summary: wait for the summary.
        page.wait_for_function("""() => /Search finished|did not match/.test(
                                      document.querySelector("#search-results")?.innerText || "")""",
                               timeout=20_000)
        hrefs = page.evaluate("""() => Array.from(document.querySelectorAll("#search-results ul.search li a"),
                                                   a => a.href)""")
    finally:
        context.close()
    return sorted({urllib.parse.urlsplit(h).path.lstrip("/") for h in hrefs})


_IDS = re.compile(r"""\b(?:id|name)=["']([^"']+)["']""")


class LinkChecker:
    """Fetches each internal link's target once from the running server; checks anchors too."""

    def __init__(self):
        self._pages: dict[str, tuple[int, set[str]]] = {}

    def _fetch(self, url: str) -> tuple[int, set[str]]:
        if url not in self._pages:
            try:
                with urllib.request.urlopen(url, timeout=10) as response:
                    body = response.read()
                    ids = set(_IDS.findall(body.decode("utf-8", "replace"))) if url.endswith((".html", "/")) else set()
                    self._pages[url] = (response.status, ids)
            except urllib.error.HTTPError as error:
                self._pages[url] = (error.code, set())
        return self._pages[url]

    def problems(self, page_url: str, links: list[str]) -> list[str]:
        found = []
        for link in links:
            target, _, anchor = link.partition("#")
            status, ids = self._fetch(target)
            if status != 200:
                found.append(f"{page_url}: link to {link} gives HTTP {status}")
            elif anchor and target.endswith(".html") and urllib.parse.unquote(anchor) not in ids:
                found.append(f"{page_url}: link to {link}: no element with id {anchor!r}")
        return found


# --- what each page must show --------------------------------------------------------------

HIDE_INPUT = {"hide-cell", "hide-input", "remove-cell", "remove-input"}
HIDE_OUTPUT = {"hide-cell", "hide-output", "remove-cell", "remove-output"}


def expected_content(nb) -> dict:
    """What a notebook's page must show, read off the stored notebook."""
    code = [c for c in nb.cells if c.cell_type == "code"]
    tags = [set(c.metadata.get("tags", [])) for c in code]
    with_outputs = [(c, t) for c, t in zip(code, tags) if c.outputs]
    return {
        "cells": len(code),
        "cells_visible": sum(not (t & HIDE_INPUT) for t in tags),
        "outputs": len(with_outputs),
        "outputs_visible": sum(not (t & HIDE_OUTPUT) for _, t in with_outputs),
        "images_at_least": sum("image/png" in o.get("data", {}) for c in code for o in c.outputs),
        "has_math": any("$" in c.source for c in nb.cells if c.cell_type == "markdown"),
    }


def page_problems(report: PageReport, expected: dict | None, colab: str | None,
                  previous: str | None, next_: str | None) -> list[str]:
    """Everything wrong with one inspected page, given what its notebook and the toc promise."""
    problems = list(report.problems)
    if report.math != report.typeset:
        problems.append(f"math not typeset: {report.math - report.typeset} of {report.math} formulas")
    if expected is not None:
        for key in ("cells", "cells_visible", "outputs", "outputs_visible"):
            if getattr(report, key) != expected[key]:
                problems.append(f"{key}: the page has {getattr(report, key)}, the notebook {expected[key]}")
        if report.images < expected["images_at_least"]:
            problems.append(f"{report.images} images on the page, the notebook has {expected['images_at_least']} plots")
        if expected["has_math"] and report.math == 0:
            problems.append("the notebook has mathematics but the page shows none")
    if colab is not None and report.colab != [colab]:
        problems.append(f"Colab link(s) {report.colab}, expected [{colab}]")
    if previous is not None and report.previous != previous:
        problems.append(f"'previous' link {report.previous}, expected {previous}")
    if next_ is not None and report.next != next_:
        problems.append(f"'next' link {report.next}, expected {next_}")
    return problems
