"""The commit-msg hook (.pre-commit-config.yaml): a commit's subject line is at most 72 characters.

    python -m scripts.check_commit_msg .git/COMMIT_EDITMSG

The convention (STYLE.md): a subject of at most 72 characters in the imperative ("Move the build
tools to scripts/"), a blank line, then a body for the details. Only the subject's presence and
length are enforced; lines git treats as comments (starting with '#') are not part of the message.
"""
from __future__ import annotations

import sys
from pathlib import Path

LIMIT = 72


def subject_problems(message: str) -> list[str]:
    lines = [line.rstrip() for line in message.splitlines() if not line.startswith("#")]
    while lines and not lines[0].strip():
        lines.pop(0)
    if not lines:
        return ["the commit message is empty"]
    problems = []
    if len(lines[0]) > LIMIT:
        problems.append(f"the subject has {len(lines[0])} characters, more than {LIMIT}: "
                        "say what the commit does in a short imperative line, and the details in the body "
                        "after a blank line")
    if len(lines) > 1 and lines[1].strip():
        problems.append("the subject must be followed by a blank line before the body")
    return problems


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    problems = subject_problems(Path(args[0]).read_text())
    for problem in problems:
        print(f"commit message: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
