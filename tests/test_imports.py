"""The package's imports form layers: no module reaches, directly or through others, back to itself. Read from the
source (ast), so an import inside a function counts as much as one at the top: hiding a cycle inside a function is how
the lowest layer (config) came to reach the top (issue 32)."""

import ast
from pathlib import Path

import course_lib

PACKAGE = Path(course_lib.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """The course_lib modules `path` imports, anywhere in it (`from . import x` names module x where x is one)."""
    name, tree = module_name(path), ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("course_lib")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{base}.{node.module}" if node.module else base
            elif node.module and node.module.startswith("course_lib"):
                base = node.module
            else:
                continue
            if node.module:  # `from .config import X`: the module config
                out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}  # `from . import config`: the module config, if it is one
    return out


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in imports_of(path) if m in files and m != name} for name, path in files.items()}


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


def test_the_reader_sees_every_kind_of_import():
    g = graph()
    assert "course_lib.config" in g["course_lib.ladder"]  # `from . import config as C`
    assert "course_lib.capabilities" in g["course_lib.ladder"]  # `from .capabilities import ...`
    assert {"course_lib.tf32", "course_lib.timing"} <= g["course_lib.capabilities"]


def test_an_import_inside_a_function_closing_a_loop_is_found(tmp_path):
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(g) == [["a", "b", "c"]]


def test_course_lib_has_no_import_cycle():
    assert cycles(graph()) == []


def test_config_the_lowest_layer_imports_no_other_course_module_but_the_cache():
    assert graph()["course_lib.config"] <= {"course_lib.cache"}
