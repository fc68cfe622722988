"""Fixtures shared by the site tests: the site is built once per test session."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bookcheck import ROOT


@pytest.fixture(scope="session")
def site(tmp_path_factory):
    """Build the site the way `make site` does (warnings are errors), into a scratch folder."""
    out = tmp_path_factory.mktemp("site")
    jupyter_book = Path(sys.executable).with_name("jupyter-book")
    result = subprocess.run(
        [str(jupyter_book), "build", str(ROOT), "--path-output", str(out), "-W", "--keep-going"],
        capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    log = result.stdout + result.stderr
    assert result.returncode == 0, f"the site build failed:\n{log[-5000:]}"
    assert "WARNING" not in log, log
    return out / "_build" / "html"
