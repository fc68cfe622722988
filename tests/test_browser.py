"""The site as readers see it: every page opened in headless Chromium, served on 127.0.0.1, with
every request that would leave the machine blocked (the site must read offline).

Per page: no console or script error and no failed request; every image loads with a non-zero
size, and the page shows exactly the notebook's plots; all mathematics is typeset by the MathJax
shipped with the site (an undefined macro counts as an error); the code cells and outputs of the
notebook are on the page (folded cells folded, the others visible); the Colab button opens this
notebook on branch main; previous/next follow the table of contents. The search page finds each
page by a word that only its text uses. (Internal links and anchors are checked on the same build
by bookcheck.link_problems in test_site.py; the broken copy below shows it catching both kinds.)
A full-page screenshot of each page goes to test-artifacts/screenshots/ (JPEG). The last test
breaks a copy of the site in each of those ways and checks that each break, and nothing else,
is reported.

Needs Chromium and Playwright; without them the tests are skipped with a message, except when the
environment variable CI is set (to anything but "", "0" or "false"), where that is a failure. The
`site` fixture (the build) is in conftest.py.
"""
import collections
import os
import re
import shutil

import jupytext
import nbformat
import pytest
import yaml

import browsercheck as bc
from bookcheck import ROOT, link_problems, toc_entries

SCREENSHOTS = ROOT / "test-artifacts" / "screenshots"
ENTRIES = toc_entries(ROOT / "_toc.yml")            # book/00_front_page, book/00_run_it, ...
EXTRA_PAGES = ["index.html", "search.html", "genindex.html"]
CONFIG = yaml.safe_load((ROOT / "_config.yml").read_text())
REPOSITORY = CONFIG["repository"]["url"].removeprefix("https://github.com/")


def colab_url(entry: str) -> str:
    return f"https://colab.research.google.com/github/{REPOSITORY}/blob/main/{entry}.ipynb"


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


@pytest.fixture(scope="module")
def base_url(site):
    with bc.serve(site) as url:
        yield url


def inspect_site(browser, base_url, pages, screenshots=False):
    return {page: bc.inspect_page(browser, base_url + page, screenshot_path(page) if screenshots else None)
            for page in pages}


@pytest.fixture(scope="module")
def reports(browser, base_url):
    if SCREENSHOTS.exists():
        shutil.rmtree(SCREENSHOTS)
    return inspect_site(browser, base_url, [f"{e}.html" for e in ENTRIES] + EXTRA_PAGES, screenshots=True)


def expectations(base_url, entry):
    index = ENTRIES.index(entry)
    nb = nbformat.read(ROOT / f"{entry}.ipynb", as_version=4)
    return dict(expected=bc.expected_content(nb), colab=[colab_url(entry)],
                previous=base_url + ENTRIES[index - 1] + ".html" if index > 0 else None,
                next_=base_url + ENTRIES[index + 1] + ".html" if index + 1 < len(ENTRIES) else None)


def test_every_built_page_is_opened(site):
    built = {p.relative_to(site).as_posix() for p in site.rglob("*.html") if "_static" not in p.parts}
    assert built == {f"{e}.html" for e in ENTRIES} | set(EXTRA_PAGES)


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.removeprefix("book/"))
def test_page_in_the_browser(reports, base_url, entry):
    assert bc.page_problems(reports[f"{entry}.html"], **expectations(base_url, entry)) == []
    assert screenshot_path(f"{entry}.html").stat().st_size > 10_000


def test_index_forwards_to_the_front_page(reports, base_url):
    report = reports["index.html"]
    assert report.redirect == f"{base_url}{ENTRIES[0]}.html"
    assert report.problems == [] and report.math == report.typeset


@pytest.mark.parametrize("page", ["search.html", "genindex.html"])
def test_site_page_in_the_browser(reports, page):
    assert bc.page_problems(reports[page], None, [], None, None) == []
    assert screenshot_path(page).stat().st_size > 0


def test_the_checks_had_something_to_check(reports):
    """The per-page checks must not pass vacuously: the site has plots, math and cells."""
    notebooks = [nbformat.read(ROOT / f"{e}.ipynb", as_version=4) for e in ENTRIES]
    plots = sum(bc.expected_content(nb)["plots"] for nb in notebooks)
    assert plots >= 10 and sum(r.plots for r in reports.values()) >= plots
    assert sum(r.typeset for r in reports.values()) >= 100
    assert sum(r.cells for r in reports.values()) >= 200


def unique_words() -> dict[str, str]:
    """For each page, the most frequent word of its prose (not code, math or links) that no other page uses."""
    words = {}
    for entry in ENTRIES:
        prose = " ".join(c.source for c in jupytext.read(ROOT / f"{entry}.md").cells if c.cell_type == "markdown")
        prose = re.sub(r"`[^`]*`|\$[^$]*\$|\]\([^)]*\)|\{[a-z]+\}", " ", prose)
        words[entry] = collections.Counter(w.lower() for w in re.findall(r"\b[A-Za-z]{6,}\b", prose))
    chosen = {}
    for entry, counts in words.items():
        others = set().union(*(set(c) for e, c in words.items() if e != entry))
        unique = [(n, w) for w, n in counts.items() if w not in others]
        chosen[entry] = max(unique)[1]
    return chosen


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.removeprefix("book/"))
def test_search_finds_the_page_by_a_word_only_it_uses(browser, base_url, entry):
    word = unique_words()[entry]
    report = bc.search(browser, base_url, word)
    assert report.problems == []
    assert f"{entry}.html" in report.results, f"searching for {word!r} found {report.results}"


def test_search_finds_nothing_for_a_word_not_in_the_book(browser, base_url):
    report = bc.search(browser, base_url, "xylophonically")
    assert report.problems == [] and report.results == []


# --- the checks catch what they guard -------------------------------------------------------

def test_a_broken_site_is_caught(browser, site, tmp_path):
    broken = tmp_path / "html"
    shutil.copytree(site, broken)
    by_number = {e.split("/")[-1][:2]: e for e in ENTRIES if not e.endswith("run_it")}

    def edit(number, old, new):
        path = broken / f"{by_number[number]}.html"
        text = path.read_text()
        assert old in text, (number, old)
        path.write_text(text.replace(old, new, 1))

    # 01: MathJax does not load
    edit("01", "mathjax/tex-chtml-full.js", "mathjax/tex-chtml-missing.js")
    # 02: a plot's image file is missing
    image = re.search(r'src="\.\./(_images/[^"]+\.png)"', (broken / f"{by_number['02']}.html").read_text()).group(1)
    (broken / image).unlink()
    # 03: the Colab button opens the notebook on another branch
    edit("03", f"/blob/main/{by_number['03']}.ipynb", f"/blob/master/{by_number['03']}.ipynb")
    # 04: TeX that MathJax cannot parse, and a macro it does not know
    math_span = '<span class="math notranslate nohighlight">'
    edit("04", math_span, math_span + "\\(\\frac{1}{\\)</span>" + math_span + "\\(\\nosuchmacro{x}\\)</span>" + math_span)
    # 05: two broken links, a missing page and a missing anchor (found by the link check)
    edit("05", "<h1>", '<a href="06_error_galery.html">x</a><a href="02_jacobians_hessians.html#no-such-part">y</a><h1>')
    # 06: a script from the network, and a script that logs an error
    edit("06", "</head>", '<script src="https://cdn.example.org/lib.js"></script>'
                          '<script>console.error("something broke")</script></head>')
    # 07: its only plot is gone from the page
    edit("07", '<img alt="../_images/', '<span alt="../_images/')
    # 08: outputs hidden by a stray style
    edit("08", "</head>", "<style>div.cell_output { display: none }</style></head>")
    # 02 again: a folded (hide-cell) cell shown open
    edit("02", '<details class="admonition hide above-input"', '<details open class="admonition hide above-input"')
    # 00 (front page): 'next' points at the wrong page
    edit("00", 'class="right-next"\n       href="00_run_it.html"', 'class="right-next"\n       href="09_glossary.html"')

    pages = [f"{e}.html" for e in ENTRIES]
    with bc.serve(broken) as url:
        reports = inspect_site(browser, url, pages)
        problems = {e: bc.page_problems(reports[f"{e}.html"], **expectations(url, e)) for e in ENTRIES}

    def only(entry, *expected):
        """The page's problems are exactly these, each given by the start of its message."""
        got = problems[entry]
        assert len(got) == len(expected) and all(g.startswith(e) for g, e in zip(sorted(got), sorted(expected))), got

    missing_mathjax = f"{url}_static/mathjax/tex-chtml-missing.js"
    only(by_number["01"], f"HTTP 404: {missing_mathjax}", "console error: Failed to load resource",
         f"failed to load {missing_mathjax}", "MathJax did not load", "math not typeset: ")
    only(by_number["02"], f"HTTP 404: {url}{image}", "console error: Failed to load resource",
         f"image did not load: ../{image}", "cells_visible: the page has ", "outputs_visible: the page has ")
    only(by_number["03"], "Colab link(s) ['https://colab.research.google.com/github/", )
    assert "/blob/master/" in problems[by_number["03"]][0]
    only(by_number["04"], "math not typeset: 2 of ")
    only(by_number["05"])  # its page is fine to the eye; the link check finds the two links
    # the file-level link check of test_site.py sees the missing files and the two broken links
    static = link_problems(broken)
    expected_static = [f"{by_number['01']}.html: <script> points at missing ../_static/mathjax/tex-chtml-missing.js",
                       f"{by_number['02']}.html: <img> points at missing ../{image}",
                       f"{by_number['05']}.html: <a> points at missing 06_error_galery.html",
                       f"{by_number['05']}.html: <a> points at missing anchor 02_jacobians_hessians.html#no-such-part"]
    assert len(static) == len(expected_static) and all(p.startswith(e) for p, e in zip(static, expected_static)), static
    only(by_number["06"], "request leaves the site (it must read offline): https://cdn.example.org/lib.js",
         "console error: Failed to load resource", "console error: something broke")
    only(by_number["07"], "plots: the page has 0, the notebook 1")
    only(by_number["08"], "outputs_visible: the page has 0, the notebook ")
    only(by_number["00"], f"'next' link {url}book/09_glossary.html, expected {url}book/00_run_it.html")
    for untouched in [e for e in ENTRIES if e.endswith(("run_it", "09_glossary"))]:
        only(untouched)
