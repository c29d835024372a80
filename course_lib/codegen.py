"""What an exported script is assembled from: `Code`, the pieces one setting puts into the script, and the rendering
of the course's own source (`source`, `field_line`). The bottom of the exporter, below the techniques: each technique's
module (course_lib.techniques) writes its own piece of the script with these, and course_lib.export joins the pieces.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from dataclasses import dataclass, fields

# ---- rendering the course's own source -------------------------------------------------------------------------


def _drop_course_comments(src: str) -> str:
    """Leave out every block of whole-line comments that mentions course_lib (it points at code the script lacks)."""
    lines, out, block = src.splitlines(), [], []
    for line in lines + [""]:
        if line.strip().startswith("#"):
            block.append(line)
            continue
        if block and not any("course_lib" in b for b in block):
            out.extend(block)
        block = []
        out.append(line)
    return "\n".join(out[:-1]).rstrip() + "\n"


def _rename(src: str, names: dict[str, str]) -> str:
    for old, new in names.items():
        src = re.sub(rf"\b{re.escape(old)}\b", new, src)
    return src


def replace_all(src: str, old: str, new: str, where: str) -> str:
    if old not in src:
        raise RuntimeError(f"export: expected {old!r} in {where}; course_lib changed, update course_lib/export.py")
    return src.replace(old, new)


def source(obj, rename: dict[str, str] | None = None, drop_methods: tuple[str, ...] = ()) -> str:
    """obj's source, dedented, without course_lib comments; a class without the methods named."""
    src = textwrap.dedent(inspect.getsource(obj))
    if drop_methods:
        tree = ast.parse(src).body[0]
        lines = src.splitlines()
        cut = set()
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name in drop_methods:
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                cut.update(range(start - 1, node.end_lineno))
        missing = set(drop_methods) - {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        if missing:
            raise RuntimeError(f"export: {obj.__name__} has no method {sorted(missing)}; update course_lib/export.py")
        src = "\n".join(line for i, line in enumerate(lines) if i not in cut)
        src = re.sub(r"\n\s*\n(\s*\n)+", "\n\n", src)  # no run of blank lines where a method was
    src = _drop_course_comments(_rename(src, rename or {}))
    return re.sub(r"\n[ \t]*\n([ \t]*\n)+(?=[ \t])", "\n\n", src)  # one blank line where a comment block was


def field_line(cls, name: str, value) -> str:
    """The dataclass field's line from cls's source, with `value` as its default (its comment kept)."""
    src = textwrap.dedent(inspect.getsource(cls))
    lines = src.splitlines()
    for node in ast.parse(src).body[0].body:
        if isinstance(node, ast.AnnAssign) and node.target.id == name:
            line = lines[node.lineno - 1]
            return line[: node.value.col_offset] + repr(value) + line[node.value.end_col_offset :]
    raise RuntimeError(f"export: {cls.__name__} has no field {name!r}; update course_lib/export.py")


def raw(s: str) -> str:
    """A string as a raw triple-quoted literal where that says the same, else repr."""
    return f'r"""{s}"""' if '"""' not in s and not s.endswith(("\\", '"')) else repr(s)


def device_type(cfg) -> str:
    """ "cuda" or "cpu": the device type a TrainConfig's device names, as the script writes it."""
    return cfg.device.split(":")[0]


# ---- what a setting puts into the script --------------------------------------------------------------------------


@dataclass(frozen=True)
class Code:
    """The pieces one setting puts into the script, by place. A piece left empty puts nothing there.

    Several settings may add imports, constants, definitions and setup code (joined in declaration order); each of
    the single places (the autocast line, the backward, the optimizer step ...) belongs to one setting.
    """

    imports: tuple[str, ...] = ()  # import lines
    constants: tuple[str, ...] = ()  # lines of the settings block at the top of the script
    model_defs: tuple[str, ...] = ()  # module-level code before the model's classes (the attention function)
    model_edits: tuple[tuple[str, str], ...] = ()  # (old, new) text replacements in the model's source
    model_config: tuple[str, ...] = ()  # extra lines of the ModelConfig dataclass (fields, properties)
    # (placeholder, text): fills a place another snippet's code leaves ("<name>")
    fills: tuple[tuple[str, str], ...] = ()
    defs: tuple[str, ...] = ()  # module-level code after the model (techniques, loss, schedule, ...)
    init: str = ""  # first thing in main() (the process group)
    setup: str = ""  # main(), after the model is built: wrappers, optimizer, ... (declaration order = build order)
    loss_model: str = ""  # what the loss calls (default "model"; "ddp_model" under DDP)
    loss_fn: str = ""  # the loss function the loop calls (default "compute_loss"; "compiled_loss" with compile)
    step_start: str = ""  # a line before a step's first micro-batch (the CUDA-graph step mark)
    micro_sync: str = ""  # the context each micro-batch's forward and backward run in (DDP's no_sync)
    micro_start: str = ""  # a line before each micro-batch's forward (FSDP2's gradient-sync switch)
    autocast: str = ""  # the `with` line around forward and loss
    backward: str = ""  # default "loss.backward()"
    after_backward: str = ""  # after the step's last backward (a hand-written DDP waits for its all-reduces)
    unscale: str = ""  # before clipping (fp16)
    clip: str = ""  # gradient clipping
    step: str = ""  # default "optimizer.step()"
    zero_grad: str = ""
    schedule_step: str = ""
    after_step: str = ""  # in the loop, after the step's loss is printed (validation)
    teardown: str = ""  # last thing in main()


MULTI = ("imports", "constants", "model_defs", "model_edits", "model_config", "fills", "defs", "setup")


def merge(parts: dict[str, Code]) -> Code:
    merged: dict[str, object] = {}
    owner: dict[str, str] = {}
    for key, code in parts.items():
        for f in fields(Code):
            value = getattr(code, f.name)
            if not value:
                continue
            if f.name in MULTI:
                if f.name == "setup":
                    merged[f.name] = merged.get(f.name, ()) + (value,)
                else:
                    merged[f.name] = merged.get(f.name, ()) + tuple(value)
            elif f.name in merged:
                raise RuntimeError(f"export: both {owner[f.name]!r} and {key!r} write {f.name!r}")
            else:
                merged[f.name], owner[f.name] = value, key
    merged["setup"] = "\n\n".join(merged.get("setup", ()))
    for place, text in merged.get("fills", ()):
        merged["setup"] = merged["setup"].replace(place, text)
    if left := re.findall(r"<[a-z_]+>", merged["setup"]):
        raise RuntimeError(f"export: no snippet fills {left}")
    return Code(**merged)
