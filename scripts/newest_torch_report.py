"""The body of the issue that .github/workflows/newest-torch.yml opens or updates when the notebooks
fail under the newest torch: one line per failing cell, read from pytest's JUnit XML.

    python -m scripts.newest_torch_report nbval.xml --env "torch 2.15.0" --run URL > report.md

Standard library only (the workflow runs it with the runner's python).
"""
from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def failing_cells(junit_xml: Path) -> list[tuple[str, str]]:
    """(test id, first line of its message) for every failed or erroring test case in `junit_xml`."""
    failed = []
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        for outcome in ("failure", "error"):
            found = case.find(outcome)
            if found is not None:
                message = (found.get("message") or found.text or "").strip().splitlines()
                test_id = "::".join(part for part in (case.get("classname", ""), case.get("name", "")) if part)
                failed.append((test_id, message[0][:200] if message else outcome))
                break
    return failed


def report(junit_xml: Path, env: str, run: str) -> str:
    cells = failing_cells(junit_xml)
    lines = [
        "The weekly run of the notebooks under the newest torch pip installs failed "
        "(`make env TORCH=newest`, then `pytest --nbval book`). Pushes and pull requests are not "
        "affected: they test the commit with the lock.",
        "",
        f"- environment: {env}",
        f"- run: {run}",
        f"- failing cells: {len(cells)}",
        "",
        "| cell | first line of the failure |",
        "| --- | --- |",
    ]
    lines += [f"| `{test_id}` | {message.replace('|', '/')} |" for test_id, message in cells]
    if not cells:
        lines.append("| (none recorded) | pytest failed before any cell ran: see the run's log |")
    lines += ["", "This issue is rewritten by each failing run and closed by the next passing one."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("junit_xml", type=Path)
    parser.add_argument("--env", default="torch: unknown")
    parser.add_argument("--run", default="")
    args = parser.parse_args(argv)
    sys.stdout.write(report(args.junit_xml, args.env, args.run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
