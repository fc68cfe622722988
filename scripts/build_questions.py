"""Write the questions page, book/13_questions.md, from the survey in book/_data/questions.yml.

    python -m scripts.build_questions           # rewrite book/13_questions.md (then `make outputs NB=...` is not
                                                # needed: the page has no code; `jupytext --to ipynb` pairs it)
    python -m scripts.build_questions --check   # exit 1 if the page is not what the survey gives

The survey (issue 30) lists questions readers asked in public issue trackers and forums, each in our own
words with its thread's address, graded against the book: "answered" (a section answers it, executed and
checked), "half" (a section touches it, the answer is incomplete), "not" (nothing answers it yet) or "out of
scope" (its answer uses no function transform), with the section (`where`, a page and an anchor) and, for a
question that starts from an error, the error's opening words as PyTorch prints them. The page groups the
questions by topic, answered ones linked to their section; the others are listed as open, so the page never
claims an answer the book does not give. tests/test_questions.py checks the survey and the page.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SURVEY = ROOT / "book" / "_data" / "questions.yml"
PAGE = ROOT / "book" / "13_questions.md"
STATUSES = ("answered", "half", "not", "out of scope")
TOPICS = {  # the page's sections, in order: topic key -> heading
    "vmap": "`vmap` and what it refuses",
    "gradients": "`grad`, Jacobians, Hessians and forward mode",
    "functional_call": "`functional_call`, modules and migration",
    "per-sample": "Per-sample gradients and differential privacy",
    "models": "Real models: transformers, recurrent layers, Hugging Face",
    "ensembling": "Ensembles and many models at once",
    "curvature": "Curvature, the NTK and influence",
    "compile": "`torch.compile` with transforms",
}
HEADER = """---
jupytext:
  text_representation:
    extension: .md
    format_name: myst
    format_version: 0.13
    jupytext_version: 1.19.6
kernelspec:
  display_name: Python 3
  language: python
  name: python3
---
"""


def load(path: Path | None = None) -> list[dict]:
    return _load(path or SURVEY)


def _load(path: Path) -> list[dict]:
    entries = yaml.safe_load(path.read_text())["questions"]
    for k, e in enumerate(entries):
        missing = {"question", "url", "topic", "status"} - e.keys()
        if missing:
            raise ValueError(f"question {k} lacks {sorted(missing)}")
        if e["status"] not in STATUSES or e["topic"] not in TOPICS:
            raise ValueError(f"question {k}: status {e['status']!r} or topic {e['topic']!r} unknown")
        if e["status"] in ("answered", "half") and not e.get("where"):
            raise ValueError(f"question {k} is {e['status']} but names no section (where)")
    return entries


def thread_label(url: str) -> str:
    """A short name for a thread's address: owner/repo#N for a GitHub issue, else the site's name."""
    parts = url.split("/")
    if "github.com" in url and len(parts) > 6 and parts[5] in ("issues", "pull", "discussions"):
        return f"{parts[4]}#{parts[6]}"
    return parts[2].removeprefix("www.") if len(parts) > 2 else url


def render(entries: list[dict]) -> str:
    counts = {s: sum(e["status"] == s for e in entries) for s in STATUSES}
    lines = [HEADER, "# Questions readers ask", "",
             f"The questions below were asked in public issue trackers (PyTorch, functorch, Opacus and the libraries "
             f"built on them) and the PyTorch forums, each put in our own words with a link to its thread. Each "
             f"answered one links to the section that answers it, executed and checked against a loop or a reference. Of the "
             f"{len(entries)} questions, {counts['answered']} are answered here"
             + (f", {counts['half']} in part and {counts['not']} not yet" if counts["half"] or counts["not"] else "")
             + f"; {counts['out of scope']} need no function transform. The list lives in "
             f"`book/_data/questions.yml`, graded against the book, and this page is written from it.", "",
             "Searching for an error message? Its opening words are quoted with the question, as PyTorch prints them, "
             "and [The error gallery](06_error_gallery.ipynb) shows each one executed.", ""]
    for topic, heading in TOPICS.items():
        rows = [e for e in entries if e["topic"] == topic]
        if not rows:
            continue
        lines += [f"## {heading}", "", "| question | where the book answers it | thread |", "| --- | --- | --- |"]
        for e in rows:
            question = (e["question"] + (f" (``{e['error']}``)" if e.get("error") else "")).replace("|", "\\|")
            if e["status"] == "answered":
                where = f"[{e['where_title']}]({e['where']})"
            elif e["status"] == "half":
                where = f"in part: [{e['where_title']}]({e['where']})"
            elif e["status"] == "not":
                where = "not yet"
            else:
                where = "no transform needed" + (f": {e['note']}" if e.get("note") else "")
            lines.append(f"| {question} | {where} | [{thread_label(e['url'])}]({e['url']}) |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    page = render(load())
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != page:
            print(f"book/{PAGE.name} is not what {SURVEY.name} gives: run python -m scripts.build_questions")
            return 1
        return 0
    PAGE.write_text(page)
    print(f"wrote {PAGE.relative_to(ROOT)}: {len(load())} questions")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
