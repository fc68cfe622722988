"""Check that every notebook runs alone, as it must in Colab.

    python -m scripts.colab_check --python .venv-colab/bin/python            # every book/*.ipynb
    python -m scripts.colab_check --python .venv-colab/bin/python book/03_per_sample_gradients.ipynb

`make colab-check` builds that environment from colab-packages.txt (what Colab preinstalls) and
runs this. For each notebook, in a fresh temporary directory:

- the notebook is copied alone into an empty folder, `content/`, the kernel's working directory;
- a throwaway environment, `env/`, is layered on the given Python's: it sees that environment's
  packages, and whatever the notebook's own cells install (`sys.executable -m pip`, `%pip` or
  `!pip`) goes into the throwaway layer, so no notebook sees what another one installed and the
  given environment stays as it was built;
- the kernel is that layer's Python (a kernelspec in a temporary JUPYTER_PATH), started without
  PYTHONPATH, without the caller's virtual environment on its PATH and with an empty IPython
  profile, so nothing of the repository is importable;
- the cells run top to bottom. A cell tagged `raises-exception` may raise; any other error fails
  the notebook, and the run stops there.

Outputs are not compared (that is nbval's job, `make test`): this checks only that the notebook
runs alone. One line per notebook: name, passed or failed, seconds and, for a failure, the cell
index and the error. The exit status is 1 when any notebook failed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
KERNEL_NAME = "colab-check"
# Variables of the caller's shell that would let the kernel see more than its own environment.
DROPPED_VARIABLES = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "PYTHONSAFEPATH",
                     "VIRTUAL_ENV", "CONDA_PREFIX", "JUPYTER_PATH", "JUPYTER_CONFIG_DIR", "IPYTHONDIR",
                     "MPLBACKEND")


def site_packages(python: str) -> str:
    """The directory the environment of `python` installs packages into."""
    return subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()


def layered_env(python: str, where: Path) -> Path:
    """A venv at `where` on top of `python`'s environment; returns its Python.

    Its site-packages holds one .pth line that adds the base environment's site-packages (and the
    .pth files there) after its own: imports find the base packages, and pip, run with this
    Python, installs into the layer (a newer release of a base package shadows the base one)."""
    subprocess.run([python, "-m", "venv", "--without-pip", str(where)], check=True)
    layer_python = where / "bin" / "python"
    own = Path(site_packages(str(layer_python)))
    base = site_packages(python)
    (own / "_colab_check_base.pth").write_text(f"import site; site.addsitedir({base!r})\n")
    # `!pip install ...` in a cell finds pip on the PATH: this one installs into the layer too
    for name in ("pip", "pip3"):
        shim = where / "bin" / name
        shim.write_text(f'#!/bin/sh\nexec "{layer_python}" -m pip "$@"\n')
        shim.chmod(0o755)
    return layer_python


def kernel_environment(layer: Path, scratch: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in DROPPED_VARIABLES}
    # the layer's bin first; no directory of the repository (such as .venv/bin) on the PATH
    path = [str(layer / "bin")] + [entry for entry in env.get("PATH", "").split(os.pathsep)
                                   if entry and not Path(entry).resolve().is_relative_to(ROOT)]
    env["PATH"] = os.pathsep.join(path)
    env["IPYTHONDIR"] = str(scratch / "ipython")  # no startup files of the user's profile
    # old ipykernels start debugpy, which warns about frozen modules on each start
    env["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"
    return env


class _Client(NotebookClient):
    """Remembers which cell ran last, to name it when the run fails."""

    current_cell = -1

    async def async_execute_cell(self, cell, cell_index, *args, **kwargs):
        self.current_cell = cell_index
        return await super().async_execute_cell(cell, cell_index, *args, **kwargs)


def check(notebook: Path, python: str, timeout: int = 900) -> tuple[bool, float, str]:
    """Run `notebook` alone; returns (passed, seconds, what failed)."""
    with tempfile.TemporaryDirectory(prefix="colab-check-") as tmp:
        scratch = Path(tmp)
        content = scratch / "content"
        content.mkdir()
        copy = content / notebook.name
        shutil.copyfile(notebook, copy)
        layer_python = layered_env(python, scratch / "env")
        spec = scratch / "jupyter" / "kernels" / KERNEL_NAME
        spec.mkdir(parents=True)
        (spec / "kernel.json").write_text(json.dumps({
            "argv": [str(layer_python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": f"colab-check ({python})", "language": "python",
        }))
        nb = nbformat.read(copy, as_version=4)
        client = _Client(nb, timeout=timeout, kernel_name=KERNEL_NAME, allow_errors=False,
                         resources={"metadata": {"path": str(content)}})
        saved = os.environ.get("JUPYTER_PATH")
        os.environ["JUPYTER_PATH"] = str(scratch / "jupyter")  # where the runner looks for the kernelspec
        start = time.perf_counter()
        try:
            client.execute(env=kernel_environment(scratch / "env", scratch))
        except CellExecutionError as exc:
            return False, time.perf_counter() - start, f"cell {client.current_cell}: {exc.ename}: {_first_line(exc.evalue)}"
        except (CellTimeoutError, DeadKernelError) as exc:
            return False, time.perf_counter() - start, f"cell {client.current_cell}: {type(exc).__name__}: {_first_line(str(exc))}"
        except Exception as exc:  # the kernel did not start, or the notebook is unreadable
            return False, time.perf_counter() - start, f"before any cell ran: {type(exc).__name__}: {_first_line(str(exc))}"
        finally:
            if saved is None:
                os.environ.pop("JUPYTER_PATH", None)
            else:
                os.environ["JUPYTER_PATH"] = saved
        return True, time.perf_counter() - start, ""


def _first_line(text: str) -> str:
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return lines[0][:300] if lines else ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="*", type=Path,
                        help="book/NN_name.ipynb (or its .md twin; default: every book/*.ipynb)")
    parser.add_argument("--python", required=True,
                        help="the Python of the environment the notebooks must run in (with ipykernel)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds a cell may take (default 900)")
    args = parser.parse_args(argv)
    python = shutil.which(args.python) or args.python
    if not Path(python).exists():
        parser.error(f"no such Python: {args.python}")
    python = str(Path(python).absolute())  # a venv's bin/python symlink, kept (resolving it leaves the venv)
    notebooks = [p.with_suffix(".ipynb") for p in args.notebooks] or sorted(BOOK.glob("*.ipynb"))
    version = subprocess.run([python, "-c", "import sys, torch; print(f'Python {sys.version.split()[0]}, torch {torch.__version__}')"],
                             capture_output=True, text=True)
    print(f"colab-check: each notebook alone, kernel on {python} "
          f"({version.stdout.strip() or 'torch not importable'})", flush=True)
    failed, begin = [], time.perf_counter()
    for notebook in notebooks:
        if not notebook.exists():
            print(f"{notebook.name:40s} failed   0.0 s  no such notebook: {notebook}", flush=True)
            failed.append(notebook.name)
            continue
        passed, seconds, problem = check(notebook, python, args.timeout)
        print(f"{notebook.name:40s} {'passed' if passed else 'failed'} {seconds:6.1f} s"
              + (f"  {problem}" if problem else ""), flush=True)
        if not passed:
            failed.append(notebook.name)
    print(f"colab-check: {len(notebooks) - len(failed)} of {len(notebooks)} notebooks ran alone "
          f"in {time.perf_counter() - begin:.0f} s" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
