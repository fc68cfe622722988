"""Estimate each chapter's main-path reading time: prose at 200 words a minute plus visible code at 15 lines a minute.

    python -m scripts.read_time [book/NN_name.md ...]     # default: every page in book/

Folded material is not on the main path and is not counted: code cells tagged hide-input, hide-cell,
remove-input or remove-cell, and Markdown inside a dropdown (a {dropdown} directive, or an admonition
or exercise/solution block with :class: dropdown).
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import jupytext

ROOT = Path(__file__).resolve().parents[1]
FOLDED_TAGS = {"hide-input", "hide-cell", "remove-input", "remove-cell"}
FENCE = re.compile(r"^(`{3,}|:{3,})\{?([\w-]*)\}?")


def visible_prose(text: str) -> str:
    """Markdown with every folded (dropdown) block removed."""
    kept, stack = [], []  # stack of (fence, folded?)
    lines = text.splitlines()
    for i, line in enumerate(lines):
        match = FENCE.match(line.strip())
        if match and stack and line.strip() == stack[-1][0]:
            stack.pop()
            continue
        if match and match.group(2):
            body = lines[i + 1:i + 4]
            folded = match.group(2) == "dropdown" or any(re.match(r"\s*:class:.*dropdown", b) for b in body)
            stack.append((match.group(1), folded or bool(stack and stack[-1][1])))
            if not stack[-1][1]:
                kept.append(line)
            continue
        if not (stack and stack[-1][1]):
            kept.append(line)
    return "\n".join(kept)


def read_time(path: Path) -> tuple[int, int, float]:
    words = lines = 0
    for cell in jupytext.read(path).cells:
        if cell.cell_type == "markdown":
            words += len(re.findall(r"\S+", visible_prose(cell.source)))
        elif cell.cell_type == "code" and not FOLDED_TAGS & set(cell.metadata.get("tags", [])):
            lines += sum(1 for line in cell.source.splitlines() if line.strip())
    return words, lines, words / 200 + lines / 15


def main(argv: list[str]) -> None:
    paths = [Path(a) for a in argv] or sorted((ROOT / "book").glob("*.md"))
    print("| page | words | visible code lines | minutes |\n| --- | --- | --- | --- |")
    for path in paths:
        words, lines, minutes = read_time(path)
        print(f"| {path.stem} | {words:,} | {lines} | {minutes:.0f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
