"""Source to source for the exported script (course_lib.export): a file whose module-level constants are known becomes
the file those constants make. `set_constants` gives them values; `fold` replaces each `if TEST:` and `a if TEST else b`
whose TEST they decide by the branch taken (a cut on the source's lines, so comments stay); `drop_unused` removes the
module-level names nothing reads; `inline` writes the course_lib code the file imports into it, dependencies first."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re

_UNKNOWN = object()


def _span(src: str, node: ast.AST) -> tuple[int, int]:  # where node starts and ends in src, as string offsets
    lines = src.splitlines(keepends=True)
    start = sum(map(len, lines[: node.lineno - 1])) + node.col_offset
    return start, sum(map(len, lines[: node.end_lineno - 1])) + node.end_col_offset


def _assigned(node: ast.stmt) -> str | None:
    """NAME of a `NAME = ...` statement, else None."""
    simple = isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
    return node.targets[0].id if simple else None


def _is_course(node: ast.stmt) -> bool:
    return isinstance(node, ast.ImportFrom) and (node.module or "").startswith("course_lib")


def _alias_name(alias: ast.alias) -> str:
    return alias.asname or alias.name.split(".")[0]


def _first_line(node: ast.stmt) -> int:  # its decorators' included
    return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])


def set_constants(src: str, values: dict[str, object]) -> str:
    """`src` with each module-level `NAME = ...` of `values` set to its value's literal; every name must be there."""
    found = {name: node.value for node in ast.parse(src).body if (name := _assigned(node)) in values}
    if missing := set(values) - set(found):
        raise RuntimeError(f"the template has no setting {sorted(missing)}: add a line NAME = <default> for each")
    for name in sorted(found, key=lambda n: -found[n].lineno):  # from the bottom up: earlier offsets stay valid
        start, end = _span(src, found[name])
        src = src[:start] + literal(values[name]) + src[end:]
    return src


def literal(value) -> str:
    """value as Python source, a string in double quotes (as the course's code writes them)."""
    plain = isinstance(value, str) and not any(c in value for c in '"\\\n')
    return f'"{value}"' if plain else repr(value)


def known_constants(src: str, given: dict[str, object]) -> dict[str, object]:
    """`given`, the UPPER_CASE module-level names whose value follows from them (DEVICE_TYPE = DEVICE.split(":")[0]),
    and the literal constants the file imports from course_lib, looked up there."""
    known = dict(given)
    for node in _module_statements(ast.parse(src).body):
        name = _assigned(node)
        if name and name.isupper() and name not in known and (value := _evaluate(node.value, known)) is not _UNKNOWN:
            known[name] = value
        elif _is_course(node):
            module = importlib.import_module(node.module)
            values = {a.name: getattr(module, a.name) for a in node.names}
            known.update((k, v) for k, v in values.items() if isinstance(v, (str, int, float, bool, tuple, type(None))))
    return known


def _module_statements(body: list[ast.stmt]):
    """The statements, and those inside their `if`s, in order."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from _module_statements(node.body + node.orelse)


def _evaluate(node: ast.expr, known: dict):
    """node's value where every name it reads is known (no builtins), else _UNKNOWN."""
    if any(isinstance(n, ast.Name) and n.id not in known for n in ast.walk(node)):
        return _UNKNOWN
    try:
        return eval(compile(ast.Expression(node), "<setting>", "eval"), {"__builtins__": {}}, known)
    except Exception:  # noqa: BLE001 - an expression the constants do not decide stays as written
        return _UNKNOWN


class _Left(str):
    """What is left of a test the constants decide in part: its source, shortened."""


def _partial(node: ast.expr, known: dict, src: str):
    """node's value, _UNKNOWN, or for `and` / `or` with some operands known, the operands left (_Left)."""
    value = _evaluate(node, known)
    if value is not _UNKNOWN or not isinstance(node, ast.BoolOp):
        return value
    is_or, left = isinstance(node.op, ast.Or), []  # the operands left: those the constants do not decide
    for operand in node.values:
        v = _partial(operand, known, src)
        if v is _UNKNOWN or isinstance(v, _Left):
            left.append(ast.get_source_segment(src, operand) if v is _UNKNOWN else v)
        elif bool(v) == is_or:  # True in an `or`, False in an `and`: decides the whole
            return v
    if not left:
        return not is_or
    if len(left) == len(node.values) and not any(isinstance(x, _Left) for x in left):
        return _UNKNOWN  # nothing shortened
    if len(left) == 1:
        return _Left(left[0])
    return _Left((" or " if is_or else " and ").join(f"({x})" if " or " in x or " and " in x else x for x in left))


def _fold_if(src: str, node: ast.If, taken: bool) -> str:
    """src with the `if` statement node replaced by the branch it takes (its `elif` becomes an `if`, folded later)."""
    lines = src.splitlines(keepends=True)
    start, end = node.lineno - 1, node.end_lineno
    if taken:
        branch, first = node.body, node.test.end_lineno  # the lines after the header
    elif node.orelse and lines[node.orelse[0].lineno - 1].lstrip().startswith("elif"):
        elif_line = node.orelse[0].lineno - 1
        lines[elif_line] = lines[elif_line].replace("elif", "if", 1)
        return "".join(lines[:start] + lines[elif_line:])
    elif node.orelse:
        branch = node.orelse
        first = next(i for i in range(node.body[-1].end_lineno, end) if lines[i].strip().startswith("else:")) + 1
    else:
        return "".join(lines[:start] + lines[end:])
    dedent = branch[0].col_offset - node.col_offset  # blank lines kept as they are
    kept = [x[dedent:] if x[:dedent].strip() == "" else x for x in lines[first : branch[-1].end_lineno]]
    return "".join(lines[:start] + kept + lines[end:])


def _fold_once(src: str, known: dict) -> str | None:
    lines = src.splitlines(keepends=True)
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.If) and lines[node.lineno - 1].lstrip().startswith("elif"):
            continue  # folded with the `if` it belongs to
        if not isinstance(node, (ast.If, ast.IfExp)) or (value := _partial(node.test, known, src)) is _UNKNOWN:
            continue
        if isinstance(value, _Left):  # the test, shortened to the operands the constants do not decide
            start, end = _span(src, node.test)
            return src[:start] + value + src[end:]
        if isinstance(node, ast.If):
            return _fold_if(src, node, bool(value))
        start, end = _span(src, node)
        kept = node.body if value else node.orelse
        text = ast.get_source_segment(src, kept)
        return src[:start] + (f"({text})" if isinstance(kept, ast.BoolOp) else text) + src[end:]
    return None


def fold(src: str, known: dict[str, object]) -> str:
    """`src` with every branch the `known` constants decide replaced by the one taken (`X or Y` with X known true is
    true; `X and Y` with X known true is Y)."""
    if not src.isascii():
        raise ValueError("fold works on ASCII source (its column offsets are bytes)")
    while (folded := _fold_once(src, known)) is not None:
        src = folded
    return src


def _bound(node: ast.stmt) -> list[str]:
    """The names a module-level def, class, import or `NAME = ...` binds."""
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, (ast.Import, ast.ImportFrom)) and getattr(node, "module", None) != "__future__":
        return [_alias_name(a) for a in node.names]
    return [name] if (name := _assigned(node)) else []


def _drop_once(src: str, constants) -> str | None:
    tree = ast.parse(src)
    read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    for node in reversed(tree.body):
        unused = [n for n in _bound(node) if n not in read and (n in constants or not isinstance(node, ast.Assign))]
        if not unused:
            continue
        kept = []
        if isinstance(node, (ast.Import, ast.ImportFrom)) and len(unused) < len(node.names):
            node.names = [a for a in node.names if _alias_name(a) not in unused]
            kept = [ast.unparse(node) + "\n"]
        lines = src.splitlines(keepends=True)
        return "".join(lines[: _first_line(node) - 1] + kept + lines[node.end_lineno :])
    return None


def drop_unused(src: str, constants) -> str:
    """`src` without the module-level functions, classes, imports and assignments of `constants` that nothing reads."""
    while (dropped := _drop_once(src, constants)) is not None:
        src = dropped
    return src


def _read_module(name: str) -> tuple[list[str], dict[str, ast.stmt], dict[str, tuple]]:
    """A course_lib module's source lines, its top-level definitions by name, and its imports by name: ("course",
    module, name) for course_lib's, else the import's (module or None, name, asname)."""
    lines = inspect.getsource(importlib.import_module(name)).splitlines(keepends=True)
    defs, imports = {}, {}
    for node in ast.parse("".join(lines)).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defs[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):  # the names it assigns, `a, b = ...` too (not `a.b = ...`)
            assigned = node.targets if isinstance(node, ast.Assign) else [node.target]
            targets = [t for x in assigned for t in getattr(x, "elts", [x])]
            defs.update((t.id, node) for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.Import):
            imports.update((_alias_name(a), (None, a.name, a.asname)) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = importlib.util.resolve_name("." * node.level + (node.module or ""), name.rpartition(".")[0])
            for a in node.names:
                ours = module.startswith("course_lib")
                imports[_alias_name(a)] = ("course", module, a.name) if ours else (module, a.name, a.asname)
    return lines, defs, imports


def _import_lines(imports: set[tuple]) -> list[str]:
    """The import block of (module or None, name, asname) triples: the standard library, then torch and tiktoken."""
    named = {(m, n + (f" as {a}" if a else "")) for m, n, a in imports}
    plain = {f"import {n}" for m, n in named if m is None}
    plain |= {f"from {m} import {', '.join(sorted(n for k, n in named if k == m))}" for m, _ in named if m}
    ordered = sorted(plain, key=lambda x: (_third_party(x), x.startswith("from"), x))
    first = next((i for i, x in enumerate(ordered) if _third_party(x)), 0)
    return ordered[:first] + [""] * (first > 0) + ordered[first:]


def _third_party(import_line: str) -> bool:
    return import_line.split()[1].split(".")[0] in ("torch", "tiktoken")


def inline(src: str) -> str:
    """`src` with each module-level `from course_lib... import` replaced by that code (module docstring), and its
    import block rewritten to hold what all of it needs."""
    tree = ast.parse(src)
    own = {n for node in tree.body if not isinstance(node, (ast.Import, ast.ImportFrom)) for n in _bound(node)}
    head = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)) and not _is_course(n)]
    imports = {(getattr(node, "module", None), a.name, a.asname) for node in head for a in node.names}
    modules, done = {}, set()

    def code(module: str, name: str) -> list[str]:
        """The sources of module.name and of what it reads from course_lib not yet written, dependencies first."""
        if module not in modules:
            modules[module] = _read_module(module)
        lines, defs, imported = modules[module]
        if name not in defs:
            raise RuntimeError(f"export: {module} defines no {name!r} at its top level")
        if (module, defs[name].lineno) in done:  # a statement binding several names (`a, b = ...`) is written once
            return []
        done.add((module, defs[name].lineno))
        out = []
        for read in sorted({n.id for n in ast.walk(defs[name]) if isinstance(n, ast.Name)} - own - {name}):
            if read in defs:
                out += code(module, read)
            elif read in imported and imported[read][0] == "course":
                out += code(*imported[read][1:])
            elif read in imported:
                imports.add(imported[read])
        node = defs[name]  # its lines, with its decorators and the comment lines just above it
        first = _first_line(node) - 1
        while first > 0 and lines[first - 1].lstrip().startswith("#"):
            first -= 1
        return out + ["".join(lines[first : node.end_lineno])]

    lines = src.splitlines(keepends=True)
    pieces = []  # (first line, last line, text), 0-based
    for node in filter(_is_course, tree.body):
        text = "\n\n\n".join(c.strip("\n") for a in node.names for c in code(node.module, a.name))
        pieces.append((node.lineno - 1, node.end_lineno - 1, f"\n\n{text}\n\n\n"))
    if head:
        pieces.append((head[0].lineno - 1, head[-1].end_lineno - 1, "\n".join(_import_lines(imports)) + "\n"))
    for first, last, text in sorted(pieces, reverse=True):
        lines[first : last + 1] = [text]
    return tidy("".join(lines))


def tidy(src: str) -> str:
    """At most two blank lines in a row, one inside an indented block, no trailing spaces, one final newline."""
    src = "\n".join(line.rstrip() for line in src.splitlines()) + "\n"
    src = re.sub(r"\n{4,}", "\n\n\n", src)
    return re.sub(r"\n\n\n+(?=[ \t])", "\n\n", src).lstrip("\n")
