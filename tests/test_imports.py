"""The package's imports form layers (docs/architecture.md draws them): every import points down or stays in its layer,
and no module reaches, directly or through others, back to itself. Read from the source (ast), so an import inside a
function counts as much as one at the top: hiding a cycle inside a function is how the lowest layer (config) once
came to reach the top."""

import ast
from pathlib import Path

import course_lib

PACKAGE = Path(course_lib.__file__).parent

# Bottom to top, as DESIGN.md draws them. A module may import from its own layer or those below; a new module must be
# placed here.
LAYERS = (
    (
        "config and capabilities",
        "config capabilities cache timing tf32 cpu_allocator bpe budget codegen distributed distributed.zero_memory",
    ),
    ("model, data and measure", "model data distributed.moe flash_attention measure results"),
    (
        "techniques",
        "techniques "
        + " ".join(f"techniques.{p.stem}" for p in (PACKAGE / "techniques").glob("*.py") if p.stem != "__init__"),
    ),
    ("train", "train"),
    (
        "ladder, export, memory estimate, profiling, distributed",
        "ladder export train_template memory_formula memory_estimate presets profiling reference "
        "plots distributed._common distributed.ddp distributed.ddp_by_hand distributed.expert_parallel "
        "distributed.fsdp distributed.pipeline distributed.resume distributed.selftest distributed.series "
        "distributed.tensor_parallel distributed.zero_stages distributed.launch distributed.collectives "
        "distributed.zero1_by_hand",
    ),
    (
        "lessons",
        # distributed.ring_attention: a torchrun program only notebook 08 uses, built on lessons.attention_by_hand
        "lessons distributed.ring_attention "
        + " ".join(f"lessons.{p.stem}" for p in (PACKAGE / "lessons").glob("*.py") if p.stem != "__init__"),
    ),
    (
        "the exercises",
        "exercises "
        + " ".join(f"exercises.{p.stem}" for p in (PACKAGE / "exercises").glob("*.py") if p.stem != "__init__"),
    ),
    (
        "cli and widgets",
        "widgets doctor distributed.strategy_panel __main__ course_lib "
        + " ".join(f"widgets.{p.stem}" for p in (PACKAGE / "widgets").glob("*.py") if p.stem != "__init__"),
    ),
)
LAYER = {name: i for i, (_, names) in enumerate(LAYERS) for name in names.split()}


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, package: Path = PACKAGE) -> set[str]:
    """The modules of the package that `path` imports, anywhere in it (`from . import x`: module x where x is one)."""
    root, name, tree = package.name, module_name(path, package), ast.parse(path.read_text())
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name == root or a.name.startswith(root + ".")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
                base = f"{base}.{node.module}" if node.module else base
            elif node.module and (node.module == root or node.module.startswith(root + ".")):
                base = node.module
            else:
                continue
            if node.module and base != root:  # `from .config import X`: the module config (the package's own
                out.add(base)  # __init__, the facade at the top, is not what `from course_lib import x` depends on)
            out |= {f"{base}.{a.name}" for a in node.names}  # `from . import config`: the module config, if it is one
    return out


def graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    files = {module_name(p, package): p for p in package.rglob("*.py")}
    return {n: {m for m in imports_of(p, package) if m in files and m != n} for n, p in files.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def test_the_reader_sees_every_kind_of_import(tmp_path):
    """A made-up package with each way of importing, at the top and inside functions, two levels deep."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "import pkg.b as bee\n",
        "b.py": "def f():\n    from pkg import c\n",
        "c.py": "def f():\n    from .sub import deep\n",
        "d.py": "import os\nfrom collections import OrderedDict\n",
        "sub/__init__.py": "",
        "sub/deep.py": "def g():\n    from .. import d\n    from ..a import x\n",
    }
    for name, src in files.items():
        (pkg / name).write_text(src)
    g = graph(pkg)
    assert g["pkg.a"] == {"pkg.b"} and g["pkg.b"] == {"pkg.c"} and g["pkg.c"] == {"pkg.sub", "pkg.sub.deep"}
    assert g["pkg.sub.deep"] == {"pkg.d", "pkg.a"} and g["pkg.d"] == set()  # outside the package: not edges
    assert cycles(g) == [["pkg.a", "pkg.b", "pkg.c", "pkg.sub.deep"]]  # closed by imports inside functions


def test_course_lib_has_no_import_cycle():
    assert cycles(graph()) == []


def test_every_import_points_down_or_stays_in_its_layer():
    g = {
        name.removeprefix("course_lib."): {m.removeprefix("course_lib.") for m in deps}
        for name, deps in graph().items()
    }
    g["course_lib"] = g.pop("course_lib", set())
    unplaced = sorted(set(g) - set(LAYER))
    assert not unplaced, f"place these modules in a layer of tests/test_imports.py LAYERS: {unplaced}"
    upward = [(a, b) for a, deps in g.items() for b in deps if LAYER[b] > LAYER[a]]
    assert not upward, [f"{a} ({LAYERS[LAYER[a]][0]}) imports {b} ({LAYERS[LAYER[b]][0]})" for a, b in upward]
