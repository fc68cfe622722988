import json
import linecache
import os
import subprocess
import sys


def cell_of(obj):
    """The whole notebook cell that defined a function or class, as Jupyter keeps it for tracebacks."""
    functions = [obj] if hasattr(obj, "__code__") else [f for f in vars(obj).values() if hasattr(f, "__code__")]
    lines = linecache.getlines(functions[0].__code__.co_filename) if functions else []
    if not lines:
        raise OSError(f"the cell that defined {obj.__name__} is not known; run the notebook's cells in order")
    return "".join(lines)


def run_fresh(cells, call, *, huge_pages=False):
    """Run the given cells' code, then print(json.dumps(<call>)), in a new Python interpreter; return that JSON.

    A new interpreter reads THP_MEM_ALLOC_ENABLE when torch is imported: huge_pages=True sets it to 1,
    False removes it. Cells run in the order given, each whole, with no other code added.
    """
    script = "\n\n".join([*(cell_of(obj) for obj in cells), f"import json\nprint(json.dumps({call}))"])
    env = {key: value for key, value in os.environ.items() if key != "THP_MEM_ALLOC_ENABLE"}
    if huge_pages:
        env["THP_MEM_ALLOC_ENABLE"] = "1"
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the fresh process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
