"""The register of private torch APIs (src/torch_func_recipes/_torch_private.py) against the installed
torch and against the package's source.

- Every entry resolves: one test per entry, its id the API's name, so a torch release that removes or
  renames one fails `test_private_api_resolves[<name>]` with the recipes that depend on it.
- Completeness: an ast scan of the package finds every private name it uses (imports from a module
  path with a `_` component or of a `_` name, attributes starting with one `_` that the package does
  not define itself), each where the register says, and no entry the package no longer uses.
- Can fail: a made-up name is reported missing by the same check; a scratch copy of the package with
  an extra private use, or one use removed, is reported by the same scan.
"""
import ast
import importlib
import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

from bookcheck import ROOT

PACKAGE = ROOT / "src" / "torch_func_recipes"
REGISTER = "_torch_private.py"  # the register itself: names as strings only, no use


def _load_register():
    """The register module, loaded from its file alone: `import torch_func_recipes` would fail first
    (an ImportError at collection) when torch drops a name the package imports, such as tree_flatten."""
    spec = importlib.util.spec_from_file_location("torch_func_recipes_private_register", PACKAGE / REGISTER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_register = _load_register()
PRIVATE_APIS, PrivateAPI = _register.PRIVATE_APIS, _register.PrivateAPI


def _follow(dotted: str) -> object:
    """The object a dotted path names: the longest importable module prefix, then attribute by attribute."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            target = getattr(target, part)
        return target
    raise ImportError(f"no module of {dotted} can be imported")


def unresolved(api: PrivateAPI) -> str | None:
    """None if the installed torch still has `api`, else a message naming it and the recipes that use it."""
    try:
        if api.kind == "object attribute":
            assert api.owner is not None, f"{api.name}: an object attribute needs an owner"
            cls, attr = api.name.rsplit(".", 1)
            owner = api.owner()
            if not hasattr(owner, attr):
                raise AttributeError(f"{type(owner).__name__} (standing for {cls}) has no attribute {attr}")
        elif api.kind in ("import", "module attribute", "aten operator"):
            _follow(api.name)
        else:
            return f"{api.name}: unknown kind {api.kind!r}"
    except Exception as error:  # any failure to resolve is the finding
        alternative = f"; public alternative: {api.public_alternative}" if api.public_alternative else ""
        return (f"torch {torch.__version__} no longer has the private {api.kind} {api.name} ({type(error).__name__}: {error}). "
                f"It is used by {', '.join(api.where_used)}. Why a private API: {api.reason}{alternative}. "
                "Adapt those recipes (and their chapters) and the register, src/torch_func_recipes/_torch_private.py")
    return None


def register_key(api: PrivateAPI) -> str:
    """How the scan names an entry: its dotted path, or '*._attr' for an attribute of some object."""
    return "*." + api.name.rsplit(".", 1)[1] if api.kind == "object attribute" else api.name


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


class _Scan(ast.NodeVisitor):
    """Collects {key: {module.qualname}} for one module's private names (see private_uses)."""

    def __init__(self, module: str, own: set[str]):
        self.module, self.own, self.scope = module, own, [module]
        self.aliases: dict[str, str] = {}        # local name -> dotted path it stands for
        self.private_aliases: dict[str, str] = {}  # local name bound by a private import -> its key
        self.uses: dict[str, set[str]] = {}

    def record(self, key: str) -> None:
        self.uses.setdefault(key, set()).add(".".join(self.scope))

    def dotted(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls") and node.attr in self.aliases:
                return self.aliases[node.attr]  # a class attribute such as `aten = torch.ops.aten`
            base = self.dotted(node.value)
            return None if base is None else f"{base}.{node.attr}"
        return None

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.asname:
                self.aliases[alias.asname] = alias.name
            else:
                root = alias.name.split(".")[0]
                self.aliases[root] = root
            if any(_private(part) for part in alias.name.split(".")):
                self.record(alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level or not node.module or node.module.split(".")[0] == "torch_func_recipes":
            return  # the package's own modules
        module_private = any(_private(part) for part in node.module.split("."))
        for alias in node.names:
            path = f"{node.module}.{alias.name}"
            self.aliases[alias.asname or alias.name] = path
            if module_private or _private(alias.name):
                self.private_aliases[alias.asname or alias.name] = path

    def visit_Assign(self, node: ast.Assign) -> None:
        path = self.dotted(node.value)
        for target in node.targets:
            if isinstance(target, ast.Name) and path is not None:
                self.aliases[target.id] = path  # e.g. aten = torch.ops.aten
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in self.private_aliases:
            self.record(self.private_aliases[node.id])

    def visit_Attribute(self, node: ast.Attribute) -> None:
        base = self.dotted(node.value)
        if base is not None and base.startswith("torch.ops.aten.") and base.count(".") == 3 and _private(base.rsplit(".", 1)[1]):
            self.record(f"{base}.{node.attr}")  # a private operator with its overload: aten._softmax.default
            return
        if _private(node.attr):
            if base is not None and base.split(".")[0] == "torch_func_recipes":
                pass
            elif base is not None:
                self.record(f"{base}.{node.attr}")
            elif node.attr not in self.own:
                self.record(f"*.{node.attr}")
        self.generic_visit(node)

    def visit_scope(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = visit_scope


def _own_names(trees: list[ast.Module]) -> set[str]:
    """Every name the package defines: functions, classes, assigned names and attributes, arguments."""
    own = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
    return own


def private_uses(package: Path = PACKAGE) -> dict[str, set[str]]:
    """{key: {module.qualname, ...}} for every private name the package's source uses that it does not
    define: a dotted path ('torch.utils._pytree.tree_flatten'; ATen operators with their overload,
    'torch.ops.aten._softmax.default'), or '*._attr' for an attribute of an object."""
    trees = {path.stem: ast.parse(path.read_text()) for path in sorted(package.glob("*.py")) if path.name != REGISTER}
    own = _own_names(list(trees.values()))
    found: dict[str, set[str]] = {}
    for module, tree in trees.items():
        scan = _Scan(module, own)
        scan.visit(tree)
        for key, where in scan.uses.items():
            found.setdefault(key, set()).update(where)
    return found


def register_mismatches(package: Path = PACKAGE, register: tuple[PrivateAPI, ...] = PRIVATE_APIS) -> list[str]:
    """What differs between the package's private uses and the register, one line each."""
    used = private_uses(package)
    listed = {register_key(api): api for api in register}
    problems = []
    for key, where in sorted(used.items()):
        if key not in listed:
            problems.append(f"{key} is used by {', '.join(sorted(where))} but is not in the register")
        elif set(listed[key].where_used) != where:
            problems.append(f"{listed[key].name}: the register says it is used by {', '.join(sorted(listed[key].where_used))}, "
                            f"the code uses it in {', '.join(sorted(where))}")
    problems += [f"{api.name} is in the register but the package no longer uses it" for key, api in listed.items() if key not in used]
    return problems


@pytest.mark.parametrize("api", PRIVATE_APIS, ids=[api.name for api in PRIVATE_APIS])
def test_private_api_resolves(api):
    problem = unresolved(api)
    if problem is not None:
        pytest.fail(problem, pytrace=False)


def test_register_is_well_formed():
    names = [api.name for api in PRIVATE_APIS]
    assert len(names) == len(set(names)), "an API is listed twice"
    for api in PRIVATE_APIS:
        assert api.kind in ("import", "module attribute", "object attribute", "aten operator"), api
        assert api.where_used and api.reason.strip(), api
        assert (api.owner is not None) == (api.kind == "object attribute"), api
        if api.kind == "aten operator":
            assert api.name.startswith("torch.ops.aten._") and api.name.count(".") in (3, 4), api


def test_register_lists_every_private_use_and_nothing_else():
    problems = register_mismatches()
    assert not problems, "update src/torch_func_recipes/_torch_private.py:\n" + "\n".join(problems)
    assert len(PRIVATE_APIS) >= 20


def test_a_missing_api_is_named():
    """A renamed import, attribute or operator is reported by the check the per-entry tests run."""
    by_name = {api.name: api for api in PRIVATE_APIS}
    renamed = by_name["torch.utils._pytree.tree_flatten"]._replace(name="torch.utils._pytree.tree_flatten_renamed")
    problem = unresolved(renamed)
    assert problem is not None and "torch.utils._pytree.tree_flatten_renamed" in problem
    assert "_batch._as_batch, _batch._check_parameters_reached" in problem  # it names the recipes that use it
    for name, new in [("Tensor._version", "Tensor._version_renamed"),
                      ("torch.ops.aten._softmax.default", "torch.ops.aten._softmax_renamed.default"),
                      ("torch.nn.modules.batchnorm._BatchNorm", "torch.nn.modules.batchnorm._BatchNormRenamed"),
                      ("torch.utils._python_dispatch.TorchDispatchMode", "torch.utils._python_dispatch_moved.TorchDispatchMode")]:
        problem = unresolved(by_name[name]._replace(name=new))
        assert problem is not None and new in problem and ", ".join(by_name[name].where_used) in problem, problem


def test_an_unlisted_private_use_is_named(tmp_path):
    """A scratch copy of the package with an extra private attribute and import, and one use removed."""
    shutil.copytree(PACKAGE, tmp_path / "package")
    with open(tmp_path / "package" / "migration.py", "a") as module:
        module.write("\n\ndef peek(x):\n    from torch._made_up_module import thing\n    return x._made_up_private, thing\n")
    vmap_gaps = tmp_path / "package" / "_vmap_gaps.py"
    text = vmap_gaps.read_text()
    assert text.count("module._flat_weights_names") == 1
    vmap_gaps.write_text(text.replace("module._flat_weights_names", "module.flat_weights_names"))
    assert register_mismatches(tmp_path / "package") == [
        "*._made_up_private is used by migration.peek but is not in the register",
        "torch._made_up_module.thing is used by migration.peek but is not in the register",
        "RNNBase._flat_weights_names is in the register but the package no longer uses it"]
    assert register_mismatches() == []  # the real package is unchanged
