"""Generate book/08_recipe_box.md from every cell tagged `recipe` in the chapters, in _toc.yml order.

    python -m scripts.build_recipe_box           # write book/08_recipe_box.md

The box is never edited by hand: tests/test_recipe_box.py fails when a chapter's recipe and the box
differ. After regenerating, store its outputs with `make outputs NB=book/08_recipe_box.md`.

What the page holds, all computed here:
- a setup cell importing what the recipes use and do not import themselves (found with `ast`, so no
  import appears twice), and the shared basics (book/_shared/basics.py: device, make, matches), folded;
- the plain `vmap(grad(functional_call))` idiom in one short executed cell, checked against a loop;
- a table of which recipe calls which, and which cells each one needs, computed from the sources;
- per source page: its recipe cells, each preceded by the cells it needs from other pages, then one
  executed usage example (USAGE below) on a tiny model, checked against a plain computation.
Every public recipe must be called by some usage example, and every name the recipes use must be
imported, defined by a recipe, or a builtin: otherwise generation stops and says which.
"""
from __future__ import annotations

import ast
import builtins
import re
import sys
from pathlib import Path

import jupytext
import yaml

from scripts import build_shared  # the shared basics, from the real book even when ROOT is pointed at a scratch copy

ROOT = Path(__file__).resolve().parents[1]
BOX = ROOT / "book" / "08_recipe_box.md"

FRONT_MATTER = '''---
jupytext:
  text_representation:
    extension: .md
    format_name: myst
    format_version: 0.13
    jupytext_version: 1.19.6
kernelspec:
  display_name: Python 3
  language: python
  name: python3
---
'''

INTRO = '''
# The recipe box

Every reusable function the book teaches, collected from the chapters' cells tagged `recipe` by
`scripts/build_recipe_box.py` (never edited by hand: a test fails if a chapter and this page drift
apart). Run this page, or copy the cells you need: the table below says which cells each recipe
needs. Each page's recipes are followed by a short example on a tiny model, checked against a plain
computation; `tests/test_recipes.py` tests them further, on models beyond their chapters' examples.
'''

# Where each name the recipes or the examples use comes from, when they do not import it themselves.
IMPORTS = {
    "copy": "import copy",
    "math": "import math",
    "numbers": "import numbers",
    "torch": "import torch",
    "nn": "import torch.nn as nn",
    "F": "import torch.nn.functional as F",
    "NamedTuple": "from typing import NamedTuple",
    "TorchDispatchMode": "from torch.utils._python_dispatch import TorchDispatchMode",
    "tree_flatten": "from torch.utils._pytree import tree_flatten",
    **{name: f"from torch.func import {name}" for name in (
        "functional_call", "grad", "grad_and_value", "hessian", "jacfwd", "jacrev", "jvp",
        "stack_module_state", "vjp", "vmap")},
}
# Names the shared basics cell defines (book/_shared/basics.py).
BASICS = {"device", "make", "matches", "hardware", "os", "platform", "warnings", "Callable", "Iterable", "Sequence", "Any"}

IDIOM = '''\
torch.manual_seed(0)  # the tiny model's initial weights, the same on every run
tiny = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).to(device, torch.float64)
xs, ys = make(6, 3, seed=1), make(6, 2, seed=2)
params = {name: p.detach() for name, p in tiny.named_parameters()}


def loss_of_one(params, x, y):  # one example: no batch dimension inside
    return F.mse_loss(functional_call(tiny, params, (x,)), y)


per_example = vmap(grad(loss_of_one), in_dims=(None, 0, 0))(params, xs, ys)  # {name: (6, *shape)}
loop = [torch.autograd.grad(F.mse_loss(tiny(x), y), list(tiny.parameters())) for x, y in zip(xs, ys)]
print({name: tuple(g.shape) for name, g in per_example.items()},
      all(matches(per_example[name], torch.stack([row[i] for row in loop])) for i, name in enumerate(params)))'''

# One executed example per source page, on the tiny model of the idiom cell (tiny, xs, ys, params,
# per_example): each calls the page's public recipes and checks them against a plain computation.
USAGE = {
    "01_vmap_basics.md": '''\
A, B = make(4, 3, seed=3), make(5, 3, seed=4)
print(pairwise(torch.dot)(A, B).shape, matches(pairwise(torch.dot)(A, B), A @ B.T))''',
    "02_jacobians_hessians.md": '''\
def f(x):
    return torch.sin(x).cumsum(0) * x.sum()


x, v = make(4, seed=5), make(4, seed=6)
print(matches(jacobian_via_vjp(f, x, chunk_size=3), torch.autograd.functional.jacobian(f, x)),
      matches(hvp(lambda x: f(x).sum(), x, v), torch.autograd.functional.hessian(lambda x: f(x).sum(), x) @ v))''',
    "03_per_sample_gradients.md": '''\
grads, how = per_sample_grads(tiny, F.mse_loss, xs, ys, report=True)
print(how.path, all(matches(grads[name], per_example[name]) for name in params))
step = clip_and_noise(grads, max_norm=0.1, noise_multiplier=0.0)  # no noise: clipped mean alone
norms = torch.cat([g.flatten(1) for g in grads.values()], dim=1).norm(dim=1)
scale = (0.1 / (norms + 1e-6)).clamp(max=1.0)  # each example's gradient clipped to norm 0.1 (1e-6 as Opacus)
print(all(matches(step[name], (grads[name] * scale.view(-1, *[1] * (g.dim() - 1))).sum(0) / len(xs))
          for name, g in grads.items()))''',
    "04_output_jacobians.md": '''\
J = output_jacobian(tiny, xs)  # (B, Y, P)
dense = torch.stack([torch.cat([j.flatten(1) for j in jacrev(lambda p: functional_call(tiny, p, (x,)))(params).values()], 1)
                     for x in xs])  # one example at a time
print(tuple(J.shape), matches(J, dense), {name: tuple(j.shape) for name, j in split_by_parameter(J, tiny).items()})
print(matches(empirical_ntk(tiny, xs[:2], xs[:3]), torch.einsum("aip,bjp->abij", J[:2], J[:3])))''',
    "11_real_models.md": '''\
norms, how = per_sample_grad_norms(tiny, F.mse_loss, xs, ys, report=True)  # no (B, P) tensor held
print(how.path, matches(norms, torch.cat([g.flatten(1) for g in per_example.values()], dim=1).norm(dim=1)))
step = clipped_noisy_gradient(tiny, F.mse_loss, xs, ys, max_norm=0.1, noise_multiplier=0.0)  # norms computed inside
scale = (0.1 / (norms + 1e-6)).clamp(max=1.0)
print(all(matches(step[n], (per_example[n] * scale.view(-1, *[1] * (g.dim() - 1))).sum(0) / len(xs)) for n, g in per_example.items()))
halves = [clipped_grad_sum(tiny, F.mse_loss, xs[rows], ys[rows], max_norm=0.1) for rows in (slice(0, 2), slice(2, None))]
accumulated = noised_mean({n: halves[0][n] + halves[1][n] for n in step}, max_norm=0.1, noise_multiplier=0.0,
                          expected_batch_size=len(xs))  # two micro-batches, one step
print(all(matches(accumulated[n], step[n]) for n in step))''',
    "10_curvature.md": '''\
# F.mse_loss's mean fails under forward-over-reverse in torch 2.13 (pytorch/pytorch#123996): the same loss, written out
mse = lambda out, y: ((out - y) ** 2).mean()
names, sizes = list(params), [p.numel() for p in params.values()]
flat = torch.cat([p.reshape(-1) for p in params.values()])
unflat = lambda w: {n: piece.view(params[n].shape) for n, piece in zip(names, w.split(sizes))}
flatten = lambda d: torch.cat([d[n].reshape(-1) for n in names])
loss_of = lambda w, x=xs, y=ys: mse(functional_call(tiny, unflat(w), (x,)), y)
H, g = torch.func.hessian(loss_of)(flat), torch.func.grad(loss_of)(flat)  # dense, P x P
Jf = jacrev(lambda w: functional_call(tiny, unflat(w), (xs,)))(flat).reshape(-1, flat.numel())
G = 2 / Jf.shape[0] * Jf.T @ Jf  # Gauss-Newton of a mean squared error: J^T (2/(B*Y) I) J
per = torch.cat([per_example[n].flatten(1) for n in names], 1)
v = make(flat.numel(), seed=7)
print(matches(flatten(param_hvp(tiny, mse, xs, ys, unflat(v))), H @ v),
      matches(flatten(ggn_vp(tiny, mse, xs, ys, unflat(v))), G @ v),
      matches(flatten(empirical_fisher_vp(tiny, mse, xs, ys, unflat(v))), per.T @ (per @ v) / len(xs)),
      matches(flatten(ggn_diagonal(tiny, mse, xs, ys)), G.diagonal()))
damped = G + 1e-2 * torch.eye(len(flat), dtype=flat.dtype, device=device)
# solves in another space (output space, Lanczos): agreement to 1e-10, not to the last bits
print(matches(flatten(gauss_newton_step(tiny, mse, xs, ys, damping=1e-2)), -torch.linalg.solve(damped, g), rtol=1e-10),
      matches(top_hessian_eigenvalues(tiny, mse, xs, ys, k=2, iterations=len(flat)),
              torch.linalg.eigvalsh(H).flip(0)[:2], rtol=1e-10))
# conjugate gradients stop at a relative residual tol (1e-12 here, 1e-10 by default): 1e-8 leaves room for conditioning
spd = H @ H + torch.eye(len(flat), dtype=flat.dtype, device=device)
print(matches(conjugate_gradient(lambda p: spd @ p, v, tol=1e-12), torch.linalg.solve(spd, v), rtol=1e-8))
x_test, y_test = make(2, 3, seed=8), make(2, 2, seed=9)
test_gradient = torch.func.grad(lambda w: loss_of(w, x_test, y_test))(flat)
damping = 1.0 - min(0.0, torch.linalg.eigvalsh(H)[0].item())  # H + damping I positive definite, as CG needs
exact = per @ torch.linalg.solve(H + damping * torch.eye(len(flat), dtype=flat.dtype, device=device), test_gradient) / len(xs)
# CG again (tol 1e-12); scores near zero are compared at the scale of the largest
print(matches(influence_scores(tiny, mse, xs, ys, x_test, y_test, damping=damping, tol=1e-12), exact,
              rtol=1e-8, atol=1e-8 * exact.abs().max().item()))
trace = hessian_trace(tiny, mse, xs, ys, samples=8, generator=torch.Generator().manual_seed(0))
diagonal = hessian_diagonal(tiny, mse, xs, ys, samples=8, generator=torch.Generator().manual_seed(0))
print("estimates (random):", type(trace).__name__, {n: tuple(d.shape) for n, d in diagonal.items()} == {n: tuple(p.shape) for n, p in params.items()})''',
    "05_model_ensembling.md": '''\
members = []
for seed in range(3):
    torch.manual_seed(seed)
    members.append(nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).to(device, torch.float64))
forward, stacked_params, stacked_buffers = stack_models(members)
print(forward(stacked_params, stacked_buffers, xs).shape,
      matches(forward(stacked_params, stacked_buffers, xs), torch.stack([m(xs) for m in members])))''',
    "12_migration_from_functorch.md": '''\
old_style = tuple(p.detach() for p in tiny.parameters())  # what functorch.make_functional returned
named = named_like_parameters(tiny, old_style)
print(list(named), matches(functional_call(tiny, named, (xs,)), tiny(xs)))''',
}


class Cell:
    """One recipe cell (or example), with what its source defines and uses."""

    def __init__(self, page: str, source: str):
        self.page, self.source = page, source
        self.defines: list[str] = []            # top-level functions, classes and private assigned names, in order
        self.imports: set[str] = set()          # names bound by its top-level imports
        self.uses: dict[str, set[str]] = {}     # top-level definition -> free names it uses
        self.free: set[str] = set()             # every free name of the cell


def _bound_names(tree: ast.AST) -> set[str]:
    """Every name the code binds anywhere: assignments, arguments, imports, defs, loop and with targets."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return bound


def _free_names(tree: ast.AST) -> set[str]:
    loaded = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return loaded - _bound_names(tree) - set(dir(builtins))


def analyse(page: str, source: str) -> Cell:
    tree = ast.parse(source)
    cell = Cell(page, source)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            cell.defines.append(node.name)
            cell.uses[node.name] = _free_names(node)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            cell.imports.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):  # a private module-level name (_RULES, a type alias)
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for bound in ast.walk(target):
                    if isinstance(bound, ast.Name) and bound.id.startswith("_") and bound.id not in cell.defines:
                        cell.defines.append(bound.id)
                        cell.uses[bound.id] = _free_names(node.value) if node.value is not None else set()
    top_level = _bound_names(ast.Module(body=[n for n in tree.body if not isinstance(
        n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))], type_ignores=[])) | set(cell.defines)
    cell.free = (_free_names(tree) | set().union(*cell.uses.values())) - top_level
    return cell


def toc_pages() -> list[tuple[str, bool]]:
    """(file, numbered?) for every page of _toc.yml but the box itself, in book order."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    return [(entry["file"], bool(part.get("numbered"))) for part in toc.get("parts", [])
            for entry in part.get("chapters", []) if not entry["file"].endswith("08_recipe_box")]


def page_title(path: Path, numbered: bool) -> str:
    """'Chapter 2: Jacobians and Hessians from vmap of vjp', or the bare title for an unnumbered page."""
    nb = jupytext.read(path)
    title = next((c.source.lstrip("# ").splitlines()[0] for c in nb.cells
                  if c.cell_type == "markdown" and c.source.startswith("# ")), path.stem).replace("`", "")
    number = re.match(r"(\d+)_", path.name)
    return f"Chapter {int(number.group(1))}: {title}" if numbered and number else title


def recipe_cells() -> list[tuple[str, str, str]]:
    """(chapter file name, page heading, cell source) for every recipe cell, in book order."""
    found = []
    for name, numbered in toc_pages():
        path = ROOT / f"{name}.md"
        heading = page_title(path, numbered)
        for cell in jupytext.read(path).cells:
            if cell.cell_type == "code" and "recipe" in cell.metadata.get("tags", []):
                found.append((path.name, heading, cell.source.strip()))
    return found


class BoxError(ValueError):
    pass


def plan(found):
    """Analyse the recipe cells and examples: (cells, examples, owner of each definition, setup imports)."""
    cells = [analyse(page, source) for page, _, source in found]
    owner = {}
    for index, cell in enumerate(cells):
        for name in cell.defines:
            if name in owner:
                raise BoxError(f"{name} is defined by two recipe cells ({cells[owner[name]].page} and {cell.page})")
            owner[name] = index
    pages = list(dict.fromkeys(cell.page for cell in cells))
    missing_examples = [page for page in pages if page not in USAGE]
    if missing_examples:
        raise BoxError(f"no usage example for the recipes of {missing_examples}: add one to USAGE in scripts/build_recipe_box.py")
    examples = {page: analyse(page, USAGE[page]) for page in pages}
    idiom = analyse("idiom", IDIOM)
    called = set().union(*(e.free for e in examples.values()))
    public = [name for cell in cells for name in cell.defines if not name.startswith("_")]
    classes = {n.name for cell in cells for n in ast.parse(cell.source).body if isinstance(n, ast.ClassDef)}
    uncalled = [name for name in public if name not in called and name not in classes]
    if uncalled:
        raise BoxError(f"recipes with no usage example: {uncalled}; call them in USAGE in scripts/build_recipe_box.py")

    # The setup imports every name used before a recipe cell of its own page (or an earlier page) imports it.
    first_import = {}
    for cell in cells:
        for name in cell.imports:
            first_import.setdefault(name, pages.index(cell.page))
    defined_by_examples = set(idiom.defines) | set().union(*(_bound_names(ast.parse(e.source)) for e in examples.values()))
    defined_by_examples |= _bound_names(ast.parse(IDIOM))
    needed, unknown = set(), set()
    ordered = [(-1, idiom)] + [(pages.index(c.page), c) for c in cells] + [(pages.index(p), e) for p, e in examples.items()]
    for position, cell in ordered:
        for name in cell.free - set(owner) - BASICS - defined_by_examples:
            if name in first_import and first_import[name] <= position:
                continue
            (needed if name in IMPORTS else unknown).add(name)
    if unknown:
        raise BoxError(f"names used but never imported or defined: {sorted(unknown)}; add them to IMPORTS")
    return cells, examples, owner, needed


def setup_imports(needed: set[str]) -> str:
    """Each needed import once: the standard library, then torch; `from m import` lines merged per module."""
    plain, froms = set(), {}
    for name in needed:
        words = IMPORTS[name].split()
        if words[0] == "import":
            plain.add(IMPORTS[name])
        else:
            froms.setdefault(words[1], set()).add(name)
    lines = sorted(plain) + [f"from {module} import {', '.join(sorted(names))}" for module, names in sorted(froms.items())]
    is_torch = lambda line: line.split()[1].split(".")[0] == "torch"
    blocks = [[line for line in lines if not is_torch(line)], [line for line in lines if is_torch(line)]]
    return "\n\n".join("\n".join(block) for block in blocks if block)


def reachable(name: str, cells, owner) -> set[str]:
    """Every recipe definition `name` calls, directly or through others."""
    seen, stack = set(), [name]
    while stack:
        current = stack.pop()
        for used in cells[owner[current]].uses.get(current, set()):
            if used in owner and used not in seen and used != name:
                seen.add(used)
                stack.append(used)
    return seen


def cell_labels(cells, links) -> list[str]:
    """'recipe cell 2 of [Chapter 3](...) (`per_sample_grads`, `clip_and_noise` and 6 helpers)' for each cell."""
    labels, counts = [], {}
    for cell in cells:
        counts[cell.page] = counts.get(cell.page, 0) + 1
        public = [n for n in cell.defines if not n.startswith("_")] or cell.defines[:1]
        helpers = len(cell.defines) - len(public)
        names = ", ".join(f"`{n}`" for n in public) + (f" and {helpers} helper{'s' * (helpers > 1)}" if helpers else "")
        labels.append(f"recipe cell {counts[cell.page]} of {links[cell.page]} ({names})")
    return labels


def code_cell(source: str, tags: list[str] | None = None) -> str:
    head = f":tags: [{', '.join(tags)}]\n\n" if tags else ""
    return f"\n```{{code-cell}} ipython3\n{head}{source}\n```\n"


def render() -> str:
    found = recipe_cells()
    cells, examples, owner, needed = plan(found)
    headings = {page: heading for page, heading, _ in found}
    links = {page: f"[{headings[page].split(':')[0]}]({Path(page).stem}.ipynb)" for page in headings}
    labels = cell_labels(cells, links)

    parts = [FRONT_MATTER, INTRO]
    parts.append("\nThe imports the recipes need, and, folded, the book's shared basics: `device` (a GPU when there\n"
                 "is one), `make` (seeded float64 data) and `matches` (equal to a relative `1e-12`, as a bool).\n")
    parts.append(code_cell(setup_imports(needed) + '\n\nprint("recipes loaded with torch >= 2.6:", '
                           'tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 6))'))
    basics = build_shared.cell_text("basics", build_shared.shared_sources()["basics"])  # as in the chapters
    parts.append(code_cell(basics, ["shared-basics", "hide-input"]))

    parts.append("\n## The idiom behind the recipes\n\nMost recipes below grow from one line: `vmap` over the "
                 "examples of `grad` of a loss\nwritten with `functional_call`. Here it is alone, on the tiny "
                 "model the examples below reuse,\nchecked against a loop of ordinary backward passes.\n")
    parts.append(code_cell(IDIOM))

    parts.append("\n## Which recipe needs which\n\nComputed from the recipes' sources: the recipes each one "
                 "calls, directly or through helpers,\nand the other cells you need to copy with it.\n\n"
                 "| recipe | from | calls recipes | needs |\n|---|---|---|---|\n")
    for index, cell in enumerate(cells):
        for name in cell.defines:
            if name.startswith("_"):
                continue
            calls = reachable(name, cells, owner)
            public_calls = sorted(c for c in calls if not c.startswith("_"))
            other_cells = sorted({owner[c] for c in calls} - {index})
            needs = "; ".join(labels[i] for i in other_cells) or "none"
            parts.append(f"| `{name}` | {links[cell.page]} | {', '.join(f'`{c}`' for c in public_calls) or 'none'} "
                         f"| {needs} |\n")

    current = None
    for index, ((page, heading, source), cell) in enumerate(zip(found, cells)):
        if page != current:
            if current is not None:
                parts.append(f"\nUsing the recipes of {links[current]}:\n" + code_cell(USAGE[current]))
            parts.append(f"\n## {heading}\n\nFrom {links[page]} (`book/{page}`).\n")
            current = page
        needs = sorted({owner[c] for name in cell.defines for c in reachable(name, cells, owner)} - {index})
        if needs:
            parts.append("\nThis cell needs " + "; ".join(labels[i] for i in needs) + ".\n")
        parts.append(code_cell(source, ["recipe"]))
    if current is not None:
        parts.append(f"\nUsing the recipes of {links[current]}:\n" + code_cell(USAGE[current]))
    return "".join(parts)


def main() -> int:
    try:
        text = render()
    except BoxError as error:
        print(f"build_recipe_box: {error}", file=sys.stderr)
        return 2
    BOX.write_text(text)
    print(f"wrote {BOX.relative_to(ROOT)} with {len(recipe_cells())} recipe cells")
    return 0


if __name__ == "__main__":
    sys.exit(main())
