"""Source to source, for the exported script (course_lib.export): a Python file whose module-level constants are
known becomes the file those constants make, with nothing in it that they switch off.

- `set_constants`: `NAME = <value>` lines given new values (their comments kept).
- `fold`: every `if TEST:` and `a if TEST else b` whose TEST the constants decide is replaced by the branch it takes
  (`X or Y` with X known true is true; `X and Y` with X known true is Y), comments included: a cut on the source's own
  lines, not a rewrite of its syntax tree.
- `drop_unused`: module-level functions, classes, constants and imports that nothing reads any more go.
- `inline`: each `from course_lib.M import f` becomes f's own source, and that of what f reads from course_lib,
  dependencies first; the other imports they need join the file's import block.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re

_LITERALS = (str, int, float, bool, type(None))


def _is_literal(value) -> bool:
    return isinstance(value, _LITERALS) or (isinstance(value, tuple) and all(map(_is_literal, value)))


def _offset(lines: list[str], line: int, col: int) -> int:
    return sum(len(x) for x in lines[: line - 1]) + col


def _span(src: str, node: ast.AST) -> tuple[int, int]:
    lines = src.splitlines(keepends=True)
    return _offset(lines, node.lineno, node.col_offset), _offset(lines, node.end_lineno, node.end_col_offset)


def set_constants(src: str, values: dict[str, object]) -> str:
    """`src` with each module-level `NAME = ...` of `values` set to repr(value); every name must be there once."""
    found = {}
    for node in ast.parse(src).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in values:
                found[node.targets[0].id] = node.value
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
    for node in _module_statements(ast.parse(src)):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name.isupper() and name not in known and (value := _evaluate(node.value, known)) is not _UNKNOWN:
                known[name] = value
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("course_lib"):
            module = importlib.import_module(node.module)
            known.update(
                (a.name, getattr(module, a.name)) for a in node.names if _is_literal(getattr(module, a.name, object()))
            )
    return known


def _module_statements(tree: ast.Module):
    """The module's statements, and those inside its module-level `if`s."""
    todo = list(tree.body)
    while todo:
        node = todo.pop(0)
        yield node
        if isinstance(node, ast.If):
            todo[:0] = node.body + node.orelse


_UNKNOWN = object()


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
    left, shortened = [], False
    for operand in node.values:
        v = _partial(operand, known, src)
        if v is _UNKNOWN or isinstance(v, _Left):
            text = ast.get_source_segment(src, operand) if v is _UNKNOWN else v
            left.append(text)
            shortened |= isinstance(v, _Left)
        elif bool(v) == isinstance(node.op, ast.Or):  # True in an `or`, False in an `and`: decides the whole
            return v
        else:
            shortened = True
    if not left:
        return isinstance(node.op, ast.And)
    if not shortened:
        return _UNKNOWN
    if len(left) == 1:
        return _Left(left[0])
    joiner = " or " if isinstance(node.op, ast.Or) else " and "
    return _Left(joiner.join(f"({x})" if " or " in x or " and " in x else x for x in left))


def _text(src: str, node: ast.expr) -> str:
    text = ast.get_source_segment(src, node)
    return f"({text})" if isinstance(node, ast.BoolOp) else text


def _lines_of(lines: list[str], first: int, last: int, dedent: int) -> list[str]:
    """Lines first..last (0-based, inclusive), `dedent` columns to the left (blank lines as they are)."""
    return [x[dedent:] if x[:dedent].strip() == "" else x for x in lines[first : last + 1]]


def _fold_if(src: str, node: ast.If, taken: bool) -> str:
    lines = src.splitlines(keepends=True)
    start, end = node.lineno - 1, node.end_lineno - 1
    if taken:
        branch, first = node.body, node.test.end_lineno  # the lines after the header
    elif node.orelse and lines[node.orelse[0].lineno - 1].lstrip().startswith("elif"):
        elif_line = node.orelse[0].lineno - 1  # `elif T:` becomes `if T:`, folded in its turn
        lines[elif_line] = lines[elif_line].replace("elif", "if", 1)
        return "".join(lines[:start] + lines[elif_line : end + 1] + lines[end + 1 :])
    elif node.orelse:
        branch = node.orelse
        first = next(i for i in range(node.body[-1].end_lineno, end) if lines[i].strip().startswith("else:")) + 1
    else:
        return "".join(lines[:start] + lines[end + 1 :])
    kept = _lines_of(lines, first, branch[-1].end_lineno - 1, branch[0].col_offset - node.col_offset)
    return "".join(lines[:start] + kept + lines[end + 1 :])


def _fold_once(src: str, known: dict) -> str | None:
    lines = src.splitlines(keepends=True)
    for node in ast.walk(ast.parse(src)):
        if not isinstance(node, (ast.If, ast.IfExp)):
            continue
        if isinstance(node, ast.If) and lines[node.lineno - 1].lstrip().startswith("elif"):
            continue  # folded with the `if` it belongs to
        value = _partial(node.test, known, src)
        if value is _UNKNOWN:
            continue
        if isinstance(value, _Left):  # the test, shortened to the operands the constants do not decide
            start, end = _span(src, node.test)
            return src[:start] + value + src[end:]
        if isinstance(node, ast.If):
            return _fold_if(src, node, bool(value))
        start, end = _span(src, node)
        return src[:start] + _text(src, node.body if value else node.orelse) + src[end:]
    return None


def fold(src: str, known: dict[str, object]) -> str:
    """`src` with every branch the `known` constants decide replaced by the one taken (module docstring)."""
    if not src.isascii():
        raise ValueError("fold works on ASCII source (its column offsets are bytes)")
    while (folded := _fold_once(src, known)) is not None:
        src = folded
    return src


# ---- unused names ---------------------------------------------------------------------------------------------------


def _bound(node: ast.stmt, constants) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        return [node.targets[0].id] if node.targets[0].id in constants else []
    if isinstance(node, (ast.Import, ast.ImportFrom)) and getattr(node, "module", None) != "__future__":
        return [_alias_name(a) for a in node.names]
    return []


def _alias_name(alias: ast.alias) -> str:
    return alias.asname or alias.name.split(".")[0]


def _drop_once(src: str, constants) -> str | None:
    tree = ast.parse(src)
    read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    for node in reversed(tree.body):
        unused = [name for name in _bound(node, constants) if name not in read]
        if not unused:
            continue
        lines = src.splitlines(keepends=True)
        if isinstance(node, (ast.Import, ast.ImportFrom)) and len(unused) < len(node.names):
            node.names = [a for a in node.names if _alias_name(a) not in unused]
            kept = [ast.unparse(node) + "\n"]
        else:
            kept = []
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        return "".join(lines[: first - 1] + kept + lines[node.end_lineno :])
    return None


def drop_unused(src: str, constants) -> str:
    """`src` without the module-level functions, classes, imports and assignments of `constants` that nothing reads."""
    while (dropped := _drop_once(src, constants)) is not None:
        src = dropped
    return src


# ---- inlining course_lib's code -------------------------------------------------------------------------------------


class _Module:
    """One course_lib module's top-level definitions and imports, read from its source."""

    def __init__(self, name: str):
        self.name = name
        self.src = inspect.getsource(importlib.import_module(name))
        self.lines = self.src.splitlines(keepends=True)
        self.defs: dict[str, ast.stmt] = {}
        self.imports: dict[str, tuple] = {}  # name -> ("course", module, name) or the import's (module, name, as)
        for node in ast.parse(self.src).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                self.defs[node.name] = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for name_node in target.elts if isinstance(target, ast.Tuple) else [target]:
                        self.defs[name_node.id] = node
            elif isinstance(node, ast.Import):
                self.imports.update((_alias_name(a), (None, a.name, a.asname)) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                module = importlib.util.resolve_name("." * node.level + (node.module or ""), name.rpartition(".")[0])
                ours = module.startswith("course_lib")
                for a in node.names:
                    self.imports[_alias_name(a)] = ("course", module, a.name) if ours else (module, a.name, a.asname)

    def source(self, node: ast.stmt) -> str:
        """node's lines, with its decorators and the comment lines just above it."""
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1
        while first > 0 and self.lines[first - 1].lstrip().startswith("#"):
            first -= 1
        return "".join(self.lines[first : node.end_lineno])


class _Inliner:
    def __init__(self, defined_here: set[str]):
        self.defined_here = defined_here  # the file's own names: what it defines, course_lib's code does not bring
        self.modules: dict[str, _Module] = {}
        self.done: set[tuple[str, str]] = set()
        self.imports: set[tuple] = set()

    def code(self, module: str, name: str) -> list[str]:
        """The sources of module.name and of what it reads from course_lib not yet written, dependencies first."""
        if (module, name) in self.done:
            return []
        self.done.add((module, name))
        if module not in self.modules:
            self.modules[module] = _Module(module)
        m = self.modules[module]
        if name not in m.defs:
            raise RuntimeError(f"export: {module} defines no {name!r} at its top level")
        node, out = m.defs[name], []
        for read in sorted({n.id for n in ast.walk(node) if isinstance(n, ast.Name)}, key=str):
            if read in self.defined_here or read == name:
                continue
            if read in m.defs:
                out += self.code(module, read)
            elif read in m.imports and m.imports[read][0] == "course":
                out += self.code(*m.imports[read][1:])
            elif read in m.imports:
                self.imports.add(m.imports[read])
        return out + [m.source(node)]


def _import_lines(imports: set[tuple]) -> list[str]:
    """import statements for (module or None, name, asname) triples: stdlib first, then torch and tiktoken."""
    plain = sorted({f"import {n}" + (f" as {a}" if a else "") for m, n, a in imports if m is None})
    names: dict[str, set[str]] = {}
    for m, n, a in imports:
        if m is not None:
            names.setdefault(m, set()).add(n + (f" as {a}" if a else ""))
    froms = [f"from {m} import {', '.join(sorted(n))}" for m, n in sorted(names.items())]
    third = ("torch", "tiktoken")
    ordered = []
    for group in (False, True):
        part = [x for x in plain + froms if (x.split()[1].split(".")[0] in third) == group]
        ordered += ([""] if group and ordered and part else []) + sorted(part, key=lambda x: (x.startswith("from"), x))
    return ordered


def inline(src: str) -> str:
    """`src` with each module-level `from course_lib... import` replaced by that code (module docstring), and its
    import block rewritten to hold what all of it needs."""
    tree = ast.parse(src)
    own = {name for node in tree.body for name in _defined(node)}
    inliner = _Inliner(own)
    head = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)) and not _is_course(n)]
    head = [n for n in head if not (isinstance(n, ast.ImportFrom) and n.module == "__future__")]
    for node in head:
        for a in node.names:
            inliner.imports.add((node.module if isinstance(node, ast.ImportFrom) else None, a.name, a.asname))
    lines = src.splitlines(keepends=True)
    pieces: list[tuple[int, int, str]] = []  # (first line, last line, text), 0-based
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and _is_course(node):
            code = [c for a in node.names for c in inliner.code(node.module, a.name)]
            text = "\n\n\n".join(c.strip("\n") for c in code)
            pieces.append((node.lineno - 1, node.end_lineno - 1, f"\n\n{text}\n\n\n"))
    if head:
        block = "\n".join(_import_lines(inliner.imports)) + "\n"
        pieces.append((head[0].lineno - 1, head[-1].end_lineno - 1, block))
    for first, last, text in sorted(pieces, reverse=True):
        lines[first : last + 1] = [text]
    return tidy("".join(lines))


def _is_course(node: ast.stmt) -> bool:
    return isinstance(node, ast.ImportFrom) and (node.module or "").startswith("course_lib")


def _defined(node: ast.stmt) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    return []


def tidy(src: str) -> str:
    """At most two blank lines in a row, one inside an indented block, no trailing spaces, one final newline."""
    src = "\n".join(line.rstrip() for line in src.splitlines()) + "\n"
    src = re.sub(r"\n{4,}", "\n\n\n", src)
    return re.sub(r"\n\n\n+(?=[ \t])", "\n\n", src).lstrip("\n")
