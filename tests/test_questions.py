"""The survey of the questions readers ask (issue 30) and the page written from it: the survey holds at least 40
graded questions, each with a public thread, the page is what the survey gives (scripts/build_questions.py), and
every answered question links to a section (the links and their anchors are checked on the built site,
test_site.py). Each check is also shown to fail on a broken copy."""
import copy

import pytest
import yaml

from scripts import build_questions


def test_the_survey_is_large_graded_and_cited():
    entries = build_questions.load()
    assert len(entries) >= 40
    urls = [e["url"] for e in entries]
    assert len(set(urls)) == len(urls) and all(u.startswith("https://") for u in urls)
    assert {e["status"] for e in entries} <= set(build_questions.STATUSES)
    linked = [e for e in entries if e["status"] in ("answered", "half")]
    assert linked and all(".ipynb#" in e["where"] and e["where_title"] for e in linked)


def test_the_page_is_what_the_survey_gives():
    assert build_questions.main(["--check"]) == 0
    page = build_questions.PAGE.read_text()
    for e in build_questions.load():
        assert e["url"] in page
        if e["status"] == "answered":
            assert f"[{e['where_title']}]({e['where']})" in page


def test_a_stale_page_and_a_bad_entry_are_caught(tmp_path, monkeypatch):
    doc = yaml.safe_load(build_questions.SURVEY.read_text())
    changed = copy.deepcopy(doc)
    changed["questions"][0]["question"] += " (edited)"
    survey = tmp_path / "questions.yml"
    survey.write_text(yaml.safe_dump(changed))
    monkeypatch.setattr(build_questions, "SURVEY", survey)
    assert build_questions.main(["--check"]) == 1  # the page no longer matches the survey
    unlinked = copy.deepcopy(doc)
    first_answered = next(e for e in unlinked["questions"] if e["status"] == "answered")
    del first_answered["where"]
    survey.write_text(yaml.safe_dump(unlinked))
    with pytest.raises(ValueError, match="names no section"):
        build_questions._load(survey)
