"""The site builds with warnings as errors (the `site` fixture, conftest.py), every chapter shows
its stored outputs, and no internal link or anchor is broken, by pytest-check-links on the built
HTML (external links are skipped: the site must read offline, and this check runs offline), and no
page shows a block (a code cell's source or an output) long enough for a browser to stall on it.
What a browser shows, Colab buttons included, is checked by test_browser.py."""
import subprocess
import sys
import xml.etree.ElementTree as ET

import nbformat
import pytest

from bookcheck import ROOT, notebooks

sys.path.insert(0, str(ROOT / "book" / "_ext"))  # the site's own Sphinx extension
from site_fixes import MAX_BLOCK_LINES, code_blocks  # noqa: E402


def broken_links(site, tmp_path) -> list[str]:
    """pytest-check-links over every page of a built site: the links it reports broken."""
    pages = sorted(str(p.relative_to(site)) for p in site.rglob("*.html") if "_static" not in p.parts)
    report = tmp_path / "links.xml"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-c", "/dev/null", "--rootdir", str(site),
         "--check-links", "--check-anchors", "--check-links-ignore", "^(https?:)?//", f"--junitxml={report}", *pages],
        cwd=site, capture_output=True, text=True)
    assert result.returncode in (0, 1) and report.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    cases = list(ET.parse(report).getroot().iter("testcase"))
    assert len(cases) > len(pages), "pytest-check-links found no links to check"
    return sorted(case.get("name").removeprefix(f"{site}/") for case in cases if case.find("failure") is not None)


def test_no_broken_internal_link(site, tmp_path):
    assert broken_links(site, tmp_path) == []


def test_link_check_catches_a_missing_page_image_and_anchor(broken_site, tmp_path):
    assert broken_links(broken_site, tmp_path) == [
        "book/01_vmap_basics.html <a href=02_jacobians_hessians.html#no-such-part>",
        "book/01_vmap_basics.html <a href=06_error_galery.html>",
        "book/02_jacobians_hessians.html <img src=no-such-figure.png>",
    ]


def test_a_notebook_missing_from_the_toc_has_no_page(broken_site):
    assert not (broken_site / "book" / "99_unlisted.html").exists() and (broken_site / "book" / "01_vmap_basics.html").exists()


@pytest.mark.parametrize("nb_path", notebooks(), ids=lambda p: p.name)
def test_page_shows_the_stored_outputs(site, nb_path):
    nb, page = nbformat.read(nb_path, as_version=4), site / "book" / f"{nb_path.stem}.html"
    assert page.exists(), f"{nb_path.name} has no page: _toc.yml does not list it (only_build_toc_files)"
    page = page.read_text()
    with_outputs = [c for c in nb.cells if c.cell_type == "code" and c.outputs]
    assert page.count('class="cell_output') == len(with_outputs)
    for cell in with_outputs:  # the first line of every printed output appears on the page
        for output in cell.outputs:
            if output.output_type == "stream" and output.text.strip():  # a blank stream shows nothing
                first_line = output.text.strip().splitlines()[0]
                escaped = first_line.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
                assert escaped.replace("'", "&#39;") in page or escaped in page, first_line


def test_every_page_names_the_licences(site):
    """The footer of every page names the text's licence and the code's (_config.yml, extra_footer)."""
    pages = sorted((site / "book").glob("*.html"))
    assert len(pages) == len(notebooks()) + 1  # and the package reference, book/reference.rst
    assert [p.name for p in pages if not ("CC BY 4.0" in (text := p.read_text()) and "BSD 3-Clause" in text)] == []


# --- long code cells: shown as blocks Chromium can lay out (book/_ext/site_fixes.py, fix 3) ---------


def longest_block(page: str) -> int:
    """Lines in the longest <pre> of a built page: a code cell's source, an output, a traceback."""
    return max([0] + [block.split("</pre>")[0].count("\n") for block in page.split("<pre")[1:]])


def test_no_page_shows_one_long_block(site):
    """The folded package (about 4,700 lines) is shown in blocks of at most MAX_BLOCK_LINES lines, save a
    top-level statement that is longer (a class); without the split this finds the 4,700-line block. An
    output is not split: a long one (a compiler's 1,500-line traceback) fails here and is to be shortened."""
    longest = {p.name: longest_block(p.read_text()) for p in sorted((site / "book").glob("*.html"))}
    assert longest["03_per_sample_gradients.html"] > 100, longest  # the package's blocks were found
    assert {name: n for name, n in longest.items() if n > 2 * MAX_BLOCK_LINES} == {}


def test_longest_block_finds_a_long_block():
    source = '<div class="cell_input"><div class="highlight"><pre>' + "x = 1\n" * 300 + "</pre></div></div>"
    output = '<div class="cell_output"><pre>' + "out\n" * 500 + "</pre></div>"
    assert longest_block(source) == 300 and longest_block(source + output) == 500


def _module(definitions: int) -> str:
    """Top-level statements of 10 lines each: a decorated function under a comment, alternating with a class."""
    parts = []
    for i in range(definitions):
        if i % 2:
            parts.append(f"# what f{i} does\n@staticmethod\ndef f{i}(x):\n" + "    x = x + 1\n" * 6 + "    return x\n")
        else:
            parts.append(f"class C{i}:\n" + "    a = 1\n" * 8 + "\n")
    return "".join(parts)


def test_code_blocks_cuts_before_top_level_statements():
    source = _module(100)  # 1,000 lines
    pieces = code_blocks(source, limit=95)
    assert "".join(pieces) == source and len(pieces) == 12
    assert all(p.count("\n") <= 95 for p in pieces)
    assert all(p.startswith(("class C", "# what f")) for p in pieces), [p[:20] for p in pieces]


def test_code_blocks_leaves_what_it_cannot_cut():
    short, unparsable = _module(5), _module(100) + "def broken(:\n"
    long_statement = "values = [\n" + "    1,\n" * 500 + "]\n"
    assert code_blocks(short, limit=95) == [short]
    assert code_blocks(unparsable, limit=95) == [unparsable]
    assert code_blocks(long_statement, limit=95) == [long_statement]
    *before, last = code_blocks(_module(20) + long_statement, limit=95)
    assert last == long_statement and "".join(before) == _module(20) and max(p.count("\n") for p in before) <= 95
