"""The site builds with warnings as errors, every chapter is in it with its stored outputs, and
no internal link or anchor is broken. (The `site` fixture is in conftest.py; the Colab buttons,
and what a browser shows, are checked by test_browser.py.)"""
import nbformat
import pytest

from bookcheck import ROOT, link_problems, notebooks, toc_entries


def test_every_toc_entry_has_a_page(site):
    for entry in toc_entries(ROOT / "_toc.yml"):
        assert (site / f"{entry}.html").exists(), entry
    assert (site / "index.html").exists() and (site / "search.html").exists()


def test_no_broken_internal_link(site):
    assert link_problems(site) == []


@pytest.mark.parametrize("nb_path", notebooks(), ids=lambda p: p.name)
def test_page_shows_the_stored_outputs(site, nb_path):
    nb = nbformat.read(nb_path, as_version=4)
    page = (site / "book" / f"{nb_path.stem}.html").read_text()
    with_outputs = [c for c in nb.cells if c.cell_type == "code" and c.outputs]
    assert page.count('class="cell_output') == len(with_outputs)
    for cell in with_outputs:  # the first line of every printed output appears on the page
        for output in cell.outputs:
            if output.output_type == "stream" and output.text.strip():  # a blank stream shows nothing
                first_line = output.text.strip().splitlines()[0]
                escaped = first_line.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
                assert escaped.replace("'", "&#39;") in page or escaped in page, first_line


def test_link_check_catches_a_missing_page_and_a_missing_anchor(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.html").write_text('<h1 id="top">A</h1><a href="b.html">ok</a><a href="#top">ok</a>')
    (tmp_path / "sub" / "b.html").write_text('<a href="a.html#top">ok</a><a href="https://example.org/x">ext</a>'
                                             '<img src="../_images/missing.png"><a href="a.html#nowhere">bad</a>')
    problems = link_problems(tmp_path)
    assert len(problems) == 2
    assert "missing ../_images/missing.png" in problems[0] and "missing anchor a.html#nowhere" in problems[1]
