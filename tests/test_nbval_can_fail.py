"""nbval is only worth running if it fails when an output changes. For every notebook with code, alter the
first output that nbval compares, run nbval on that copy, and require exactly that cell to fail."""
import subprocess
import sys
import xml.etree.ElementTree as ET

import nbformat
import pytest

from bookcheck import notebooks

IGNORED = {"nbval-ignore-output", "nbval-skip", "raises-exception"}  # cells whose outputs nbval does not compare


@pytest.mark.parametrize("nb_path", notebooks(), ids=lambda p: p.name)
def test_nbval_fails_when_a_stored_output_is_altered(nb_path, tmp_path):
    nb = nbformat.read(nb_path, as_version=4)
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    if not code_cells:  # a page of prose only (the questions index): nbval runs nothing there, so nothing can change
        pytest.skip(f"{nb_path.name} has no code cell")
    index, output = next(((i, o) for i, c in enumerate(code_cells) if not IGNORED & set(c.metadata.get("tags", []))
                          for o in c.outputs if o.output_type == "stream" or "text/plain" in o.get("data", {})), (None, None))
    assert output is not None, f"{nb_path.name} has no output that nbval compares"
    if output.output_type == "stream":
        output.text = output.text.replace("True", "False") if "True" in output.text else output.text + "altered\n"
    else:
        output.data["text/plain"] += " altered"
    altered = tmp_path / f"altered_{nb_path.name}"
    nbformat.write(nb, altered)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    report = tmp_path / "report.xml"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--nbval", "--nbval-current-env", "-p", "no:cacheprovider", "-x",
         f"--junitxml={report}", str(altered)],
        cwd=tmp_path, capture_output=True, text=True,
    )
    assert result.returncode == 1, result.stdout[-3000:]
    cases = ET.parse(report).getroot().iter("testcase")
    outcomes = [(case.get("name"), "failed" if case.find("failure") is not None else "passed") for case in cases]
    assert outcomes[-1][1] == "failed" and all(outcome == "passed" for _, outcome in outcomes[:-1]), outcomes
    assert outcomes[-1][0].endswith(f"Cell {index}"), (outcomes[-1], index)
