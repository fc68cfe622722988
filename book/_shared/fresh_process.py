import json
import linecache
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def cell_of(obj):
    """The whole notebook cell that defined a function or class, as Jupyter keeps it for tracebacks."""
    functions = [obj] if hasattr(obj, "__code__") else [f for f in vars(obj).values() if hasattr(f, "__code__")]
    lines = linecache.getlines(functions[0].__code__.co_filename) if functions else []
    if not lines:
        raise OSError(f"the cell that defined {obj.__name__} is not known; run the notebook's cells in order")
    return "".join(lines)


def run_fresh(name, cells, call, *, huge_pages=False):
    """Write the given cells, whole and in order, then print(json.dumps(<call>)), to the script
    <temporary directory>/torch-func-book/<name>.py (<name>_huge_pages.py with huge_pages=True); run it
    as `python <script>` in a new interpreter and return the JSON it prints. The script can be opened
    and rerun as it is: its first lines set THP_MEM_ALLOC_ENABLE (to 1 with huge_pages, else unset),
    which torch reads when it is imported.
    """
    script = Path(tempfile.gettempdir()) / "torch-func-book" / f"{name}{'_huge_pages' if huge_pages else ''}.py"
    setting = 'os.environ["THP_MEM_ALLOC_ENABLE"] = "1"' if huge_pages else 'os.environ.pop("THP_MEM_ALLOC_ENABLE", None)'
    header = f"# Written by run_fresh from a notebook's cells; rerun with: python {script}\nimport os\n\n{setting}\n"
    script.parent.mkdir(parents=True, exist_ok=True)
    draft = script.with_name(f"{script.stem}.{os.getpid()}.tmp")  # then renamed: a run elsewhere never reads half a file
    body = "\n\n".join([header, *(cell_of(obj) for obj in cells), f"import json\nprint(json.dumps({call}))\n"])
    # a cell may start with a __future__ import (the package's does), which Python accepts only at the top of a file
    future = sorted({line for line in body.splitlines() if line.startswith("from __future__ import ")})
    body = "\n".join(future + [line for line in body.splitlines() if line not in future]) + "\n"
    draft.write_text(body)
    os.replace(draft, script)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"python {script} failed (open it to see the code it ran):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
