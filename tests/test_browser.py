"""The site as readers see it: every page opened in headless Chromium, served on 127.0.0.1, with
every request that would leave the machine blocked (the site must read offline).

Per page: no console or script error and no failed request; every image loads with a non-zero
size; all mathematics is typeset by the MathJax shipped with the site; the code cells and outputs
of the notebook are on the page (folded cells folded, the others visible); the Colab button opens
this notebook on branch main; previous/next follow the table of contents; every internal link
reaches an existing page and anchor. The search page finds each chapter by a word of its title.
A full-page screenshot of each page goes to test-artifacts/screenshots/ (JPEG). The last test breaks a copy of the
site in each of those ways and checks that every break is reported.

Needs Chromium and Playwright; without them the tests are skipped, except in CI (CI set), where
that is a failure. The `site` fixture (the build) is in conftest.py.
"""
import os
import re
import shutil

import nbformat
import pytest
import yaml

import browsercheck as bc
from bookcheck import BOOK, ROOT, toc_entries

SCREENSHOTS = ROOT / "test-artifacts" / "screenshots"
ENTRIES = toc_entries(ROOT / "_toc.yml")            # book/00_front_page, book/01_vmap_basics, ...
EXTRA_PAGES = ["index.html", "search.html", "genindex.html"]
CONFIG = yaml.safe_load((ROOT / "_config.yml").read_text())
REPOSITORY = CONFIG["repository"]["url"].removeprefix("https://github.com/")


def colab_url(entry: str) -> str:
    return f"https://colab.research.google.com/github/{REPOSITORY}/blob/main/{entry}.ipynb"


@pytest.fixture(scope="module")
def browser():
    executable = bc.find_chromium()
    try:
        import playwright  # noqa: F401
    except ImportError:
        executable = None
    if executable is None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the browser test, but {bc.HOW_TO_ENABLE}")
        pytest.skip(bc.HOW_TO_ENABLE)
    with bc.chromium(executable) as chromium:
        yield chromium


@pytest.fixture(scope="module")
def base_url(site):
    with bc.serve(site) as url:
        yield url


def inspect_site(browser, base_url, pages, screenshots=None):
    return {page: bc.inspect_page(browser, base_url + page,
                                  screenshots / (page.replace("/", "__").removesuffix(".html") + ".jpg")
                                  if screenshots else None)
            for page in pages}


@pytest.fixture(scope="module")
def reports(browser, base_url):
    if SCREENSHOTS.exists():
        shutil.rmtree(SCREENSHOTS)
    return inspect_site(browser, base_url, [f"{e}.html" for e in ENTRIES] + EXTRA_PAGES, SCREENSHOTS)


def expectations(base_url, index):
    entry = ENTRIES[index]
    nb = nbformat.read(ROOT / f"{entry}.ipynb", as_version=4)
    return dict(expected=bc.expected_content(nb), colab=colab_url(entry),
                previous=base_url + ENTRIES[index - 1] + ".html" if index > 0 else None,
                next_=base_url + ENTRIES[index + 1] + ".html" if index + 1 < len(ENTRIES) else None)


@pytest.mark.parametrize("index", range(len(ENTRIES)), ids=lambda i: ENTRIES[i].removeprefix("book/"))
def test_page_in_the_browser(reports, base_url, index):
    report = reports[f"{ENTRIES[index]}.html"]
    assert bc.page_problems(report, **expectations(base_url, index)) == []
    assert (SCREENSHOTS / f"{ENTRIES[index].replace('/', '__')}.jpg").stat().st_size > 0


@pytest.mark.parametrize("page", EXTRA_PAGES)
def test_site_page_in_the_browser(reports, base_url, page):
    assert bc.page_problems(reports[page], None, None, None, None) == []
    if page == "index.html":
        assert reports[page].redirect == f"{base_url}{ENTRIES[0]}.html"


def test_no_internal_link_is_broken(reports):
    checker = bc.LinkChecker()
    problems = [p for page, report in reports.items() for p in checker.problems(page, report.links)]
    assert problems == []
    assert sum(len(r.links) for r in reports.values()) > 100  # the check saw the site's links


def test_the_site_has_plots_and_typeset_math(reports):
    """Guards against the per-page checks passing vacuously."""
    assert sum(r.images for r in reports.values()) >= 10
    assert sum(r.typeset for r in reports.values()) >= 100


@pytest.mark.parametrize("entry", ENTRIES[1:], ids=lambda e: e.removeprefix("book/"))
def test_search_finds_the_page_by_a_word_of_its_title(browser, base_url, entry):
    title = next(line for line in (ROOT / f"{entry}.md").read_text().splitlines() if line.startswith("# "))
    word = max(re.findall(r"[A-Za-z]{3,}", title), key=len)
    assert f"{entry}.html" in bc.search(browser, base_url, word), f"searching for {word!r}"


def test_search_finds_nothing_for_a_word_not_in_the_book(browser, base_url):
    assert bc.search(browser, base_url, "xylophonically") == []


# --- the checks catch what they guard -------------------------------------------------------

def test_a_broken_site_is_caught(browser, site, tmp_path):
    broken = tmp_path / "html"
    shutil.copytree(site, broken)

    def edit(entry, old, new, count=1):
        path = broken / f"{entry}.html"
        text = path.read_text()
        assert old in text, (entry, old)
        path.write_text(text.replace(old, new, count))

    chapters = [e for e in ENTRIES if e.split("/")[-1][:2] in ("01", "02", "03", "04", "05", "06")]
    ch1, ch2, ch3, ch4, ch5, ch6 = chapters
    # 1. a missing image
    image = re.search(r'src="\.\./(_images/[^"]+\.png)"', (broken / f"{ch2}.html").read_text()).group(1)
    (broken / image).unlink()
    # 2. a wrong Colab link (the notebook on another branch)
    edit(ch3, f"/blob/main/{ch3}.ipynb", f"/blob/master/{ch3}.ipynb")
    # 3. untypeset math: TeX that MathJax cannot parse, and a page whose MathJax does not load
    edit(ch4, '<span class="math notranslate nohighlight">', '<span class="math notranslate nohighlight">\\(\\frac{1}{\\)</span>'
         '<span class="math notranslate nohighlight">')
    edit(ch1, "mathjax/tex-chtml-full.js", "mathjax/tex-chtml-missing.js")
    # 4. broken links: a missing page and a missing anchor
    edit(ch5, "<h1>", '<a href="06_error_galery.html">x</a><a href="02_jacobians_hessians.html#no-such-part">y</a><h1>')
    # 5. a page that fetches a script from the network
    edit(ch6, "</head>", '<script src="https://cdn.example.org/lib.js"></script></head>')

    with bc.serve(broken) as url:
        reports = inspect_site(browser, url, [f"{e}.html" for e in chapters])
        problems = {entry: "\n".join(bc.page_problems(reports[f"{entry}.html"], **expectations(url, ENTRIES.index(entry))))
                    for entry in chapters}
        links = bc.LinkChecker().problems(ch5, reports[f"{ch5}.html"].links)

    assert f"image did not load: ../{image}" in problems[ch2] and "HTTP 404" in problems[ch2]
    assert "Colab link(s)" in problems[ch3] and "/blob/master/" in problems[ch3]
    assert "math not typeset: 1 of" in problems[ch4]
    assert "MathJax did not load" in problems[ch1] and "tex-chtml-missing.js" in problems[ch1]
    assert any("06_error_galery.html gives HTTP 404" in p for p in links)
    assert any("no element with id 'no-such-part'" in p for p in links)
    assert "request leaves the site (it must read offline): https://cdn.example.org/lib.js" in problems[ch6]
    # and nothing else was reported broken on the pages left alone, nor on ch5 apart from its links
    assert problems[ch5] == ""
