"""The package torch_func_recipes is the chapters' recipes: every function or class a cell tagged
`recipe` defines is, name for name, the package's definition (compared as syntax trees, so comments
and formatting may differ, code may not; docstrings without their `Example::` section), every definition
of the package is in some chapter (a `recipe` cell, or the whole package's folded `shared-package` cell,
which tests/test_shared_code.py keeps identical to the package), and it exports every public recipe."""
import ast
import inspect
import re
import shutil
from pathlib import Path

import jupytext

import torch_func_recipes
from bookcheck import BOOK, ROOT
from scripts.build_shared import without_examples

PACKAGE = ROOT / "src" / "torch_func_recipes"
DEFINITION = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def package_definitions(package: Path = PACKAGE) -> dict[str, tuple[str, ast.AST]]:
    """{name: (module file, node)} for every top-level function and class of the package's modules."""
    found: dict[str, tuple[str, ast.AST]] = {}
    for path in sorted(package.glob("*.py")):
        for node in ast.parse(without_examples(path.read_text())).body:
            if isinstance(node, DEFINITION):
                assert node.name not in found, f"{node.name} is defined in {found[node.name][0]} and {path.name}"
                found[node.name] = (path.name, node)
    return found


def recipe_definitions(book: Path = BOOK, tag: str = "recipe") -> list[tuple[str, ast.AST]]:
    """('NN_page.md cell K', node) for every top-level function and class of the chapters' cells tagged `tag`."""
    found = []
    for path in sorted(book.glob("*.md")):
        for index, cell in enumerate(jupytext.read(path).cells):
            if cell.cell_type == "code" and tag in cell.metadata.get("tags", []):
                found += [(f"{path.name} cell {index}", node) for node in ast.parse(cell.source).body
                          if isinstance(node, DEFINITION)]
    return found


def mismatches(book: Path = BOOK, package: Path = PACKAGE) -> list[str]:
    """What differs between the chapters' recipe cells and the package, one line per definition."""
    ours = package_definitions(package)
    problems, seen = [], set()
    for where, node in recipe_definitions(book):
        seen.add(node.name)
        if node.name not in ours:
            problems.append(f"{where}: {node.name} is not in the package")
        elif ast.dump(node) != ast.dump(ours[node.name][1]):
            problems.append(f"{where}: {node.name} differs from src/torch_func_recipes/{ours[node.name][0]}")
    seen |= {node.name for _, node in recipe_definitions(book, "shared-package")}
    problems += [f"src/torch_func_recipes/{module}: {name} is in no recipe cell"
                 for name, (module, _) in ours.items() if name not in seen]
    return problems


def test_recipe_cells_and_package_are_identical():
    problems = mismatches()
    assert not problems, "make the chapter and the package say the same:\n" + "\n".join(problems)
    assert len(recipe_definitions()) >= 5 and len(recipe_definitions(tag="shared-package")) >= 60


def test_the_package_exports_every_public_recipe():
    shown = recipe_definitions() + recipe_definitions(tag="shared-package")
    public = sorted({node.name for _, node in shown if not node.name.startswith("_")})
    assert sorted(torch_func_recipes.__all__) == public
    assert all(getattr(torch_func_recipes, name).__name__ == name for name in public)
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert torch_func_recipes.__version__ == version
    assert (PACKAGE / "py.typed").exists()
    assert Path(torch_func_recipes.__file__).resolve().parent == PACKAGE, "the tests must import this checkout's package"


def test_a_changed_recipe_is_named(tmp_path):
    """Edit one recipe in a scratch copy of the book, and add a function to another: each is named, and nothing else."""
    shutil.copytree(BOOK, tmp_path / "book", ignore=shutil.ignore_patterns("*.ipynb"))
    chapter = tmp_path / "book" / "02_jacobians_hessians.md"
    text = chapter.read_text()
    assert text.count("return jvp(grad(scalar_f), (x,), (v,))[1]") == 1
    chapter.write_text(text.replace("return jvp(grad(scalar_f), (x,), (v,))[1]", "return 2 * jvp(grad(scalar_f), (x,), (v,))[1]"))
    assert mismatches(tmp_path / "book") == [f"02_jacobians_hessians.md cell {cell_of('hvp')}: hvp differs from src/torch_func_recipes/transforms.py"]

    chapter = tmp_path / "book" / "05_model_ensembling.md"
    notebook = jupytext.read(chapter)
    cell = next(c for c in notebook.cells if "recipe" in c.metadata.get("tags", []))
    cell.source += "\n\n\ndef brand_new_recipe(x):\n    return x\n"
    jupytext.write(notebook, chapter, fmt="md:myst")
    problems = mismatches(tmp_path / "book")
    assert len(problems) == 2 and problems[1].startswith("05_model_ensembling.md cell ")
    assert problems[1].endswith(": brand_new_recipe is not in the package")


def test_a_function_only_the_package_has_is_named(tmp_path):
    shutil.copytree(PACKAGE, tmp_path / "package")
    with open(tmp_path / "package" / "migration.py", "a") as module:
        module.write("\n\ndef only_here():\n    pass\n")
    assert mismatches(package=tmp_path / "package") == ["src/torch_func_recipes/migration.py: only_here is in no recipe cell"]


def cell_of(name: str) -> int:
    """The index of the chapter cell that defines `name`."""
    where = next(where for where, node in recipe_definitions() if node.name == name)
    return int(where.rsplit(" ", 1)[1])


def test_every_public_recipe_is_annotated():
    """Each public function's parameters and return value carry type hints (mypy checks them); a missing one is named."""
    missing = []
    for name in torch_func_recipes.__all__:
        obj = getattr(torch_func_recipes, name)
        if inspect.isclass(obj):
            continue
        signature = inspect.signature(obj)
        missing += [f"{name}({p})" for p in signature.parameters if signature.parameters[p].annotation is inspect.Parameter.empty]
        if signature.return_annotation is inspect.Signature.empty:
            missing.append(f"{name} -> ?")
    assert not missing, "annotate: " + ", ".join(missing)
    unannotated = lambda x, y=1: x  # noqa: E731  (the check would name both: it can fail)
    assert [p for p, v in inspect.signature(unannotated).parameters.items() if v.annotation is inspect.Parameter.empty] == ["x", "y"]
