"""`make colab-check` (scripts/colab_check.py) is only worth running if it fails a notebook that
needs something beyond its environment and its own cells. Tiny notebooks, run with this
interpreter as the "Colab" environment (the script takes the Python as a parameter): one that
imports a module of this repository fails, naming the cell; one that keeps to itself passes."""
import sys

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from scripts import colab_check


def write_notebook(path, *cells):
    nbformat.write(new_notebook(cells=list(cells)), path)
    return path


def test_a_notebook_importing_a_module_of_the_repository_fails(tmp_path, capsys):
    # `scripts` is importable here (pytest.ini puts the repository on sys.path), never in the kernel
    notebook = write_notebook(
        tmp_path / "needs_the_repository.ipynb",
        new_markdown_cell("A chapter that forgot to copy a helper in."),
        new_code_cell("x = 1"),
        new_code_cell("from scripts.colab_check import check"),
    )
    assert colab_check.main([str(notebook), "--python", sys.executable]) == 1
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(notebook.name))
    assert " failed " in line and "cell 2: ModuleNotFoundError: No module named 'scripts'" in line, line


def test_a_notebook_that_keeps_to_itself_passes(tmp_path, capsys):
    notebook = write_notebook(
        tmp_path / "alone.ipynb",
        new_code_cell("import os, sys\n"
                      "assert os.listdir('.') == ['alone.ipynb'], os.listdir('.')  # copied alone\n"
                      f"assert sys.prefix != {sys.prefix!r}  # the throwaway layer, not the caller's environment\n"
                      "assert 'PYTHONPATH' not in os.environ"),
        new_code_cell("1 / 0", metadata={"tags": ["raises-exception"]}),  # a deliberate error may raise
        new_code_cell("import nbformat  # a package of the given environment"),
    )
    assert colab_check.main([str(notebook), "--python", sys.executable]) == 0, capsys.readouterr().out
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(notebook.name))
    assert " passed " in line, line


def test_an_untagged_error_fails(tmp_path, capsys):
    notebook = write_notebook(tmp_path / "raises.ipynb", new_code_cell("pass"), new_code_cell("1 / 0"))
    assert colab_check.main([str(notebook), "--python", sys.executable]) == 1
    assert "cell 1: ZeroDivisionError: division by zero" in capsys.readouterr().out
