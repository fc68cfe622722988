"""The site as readers see it: every page in headless Chromium (browsercheck.py), served on
127.0.0.1 with every request that would leave the machine blocked: no console error or failed
request, images loaded and exactly the notebook's plots, all math typeset by the shipped MathJax,
the notebook's cells and outputs (folded ones folded), and a Colab button for this notebook on
branch main. Screenshots go to test-artifacts/screenshots/. The last test opens the site built
from broken sources (conftest.py) and requires each break, and nothing else, to be reported.
Without Chromium and Playwright the tests skip, or fail when the environment variable CI is set.
"""
import os
import shutil

import nbformat
import pytest
import yaml

import browsercheck as bc
from bookcheck import ROOT, toc_entries
from conftest import BROKEN_PAGES

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
    executable = bc.find_chromium()
    try:
        import playwright  # noqa: F401
    except ImportError:
        executable = None
    if executable is None:
        if in_ci():
            pytest.fail(f"CI must run the browser test, but {bc.HOW_TO_ENABLE}")
        pytest.skip(bc.HOW_TO_ENABLE)
    with bc.chromium(executable) as chromium:
        yield chromium


def inspect_site(browser, site, entries, screenshots=False):
    with bc.serve(site) as base_url:
        return {entry: bc.inspect_page(browser, f"{base_url}{entry}.html",
                                       screenshot_path(f"{entry}.html") if screenshots else None)
                for entry in entries}


@pytest.fixture(scope="module")
def reports(browser, site):
    if SCREENSHOTS.exists():
        shutil.rmtree(SCREENSHOTS)
    return inspect_site(browser, site, ENTRIES, screenshots=True)


def expected_content(entry):
    return bc.expected_content(nbformat.read(ROOT / f"{entry}.ipynb", as_version=4))


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.removeprefix("book/"))
def test_page_in_the_browser(reports, entry):
    assert bc.page_problems(reports[entry], expected_content(entry), [colab_url(entry)]) == []
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
    problems = {e: bc.page_problems(reports[e], expected_content(e), [colab_url(e)]) for e in BROKEN_PAGES}
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
