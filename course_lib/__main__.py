"""The course's command line (also `course-lib`): its COMMANDS; `python -m course_lib COMMAND --help` explains one."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import signal
import sys
import threading
from pathlib import Path

from . import config as C, presets, techniques as T

# what a learner can fix (a name, a value, a path): said in one line with exit code 2, not a traceback
REFUSED = (C.ConfigError, TypeError, ValueError, OSError)


def _say(text: str) -> None:
    """Progress, notes and errors go to standard error; standard output holds only the results (a pipe reads them)."""
    print(text, file=sys.stderr)


def _error(e: object) -> int:
    _say(f"error: {e}")
    return 2


def cmd_ladder(args) -> int:
    from .ladder import baseline_failure, ladder_table, run_ladder, verdict
    from .results import ResultsFile, provenance

    try:
        base, caps, raised, out, climb = _ladder_plan(args)
    except REFUSED as e:
        return _error(e)
    _ladder_banner(args, base, caps.name, raised)
    cpu = {"cpu": caps.cpu.summary()} if caps.cpu else {}
    meta = dict(preset=args.preset, base_config=base.to_dict(), fixed=args.fixed, **provenance(caps.name), **cpu)
    # an earlier file (--force) is replaced only by a finished climb; a failed write is said once, the climb goes on
    kept = ResultsFile(out, replace=True, fallback_name="ladder", **meta) if out is not None else None
    saved: list = []

    def save(results) -> None:
        saved[:] = results
        if kept is not None:
            failing = kept.error
            kept.save(results)
            if kept.error and not failing:
                _say(f"warning: could not write {kept.writing} ({kept.error}); climbing on")

    def written(complete: bool) -> Path | None:
        where = kept.finish(complete) if kept is not None else None
        if kept is not None and kept.note:
            _say(kept.note + ("" if where else ": the table below has them"))
        return where

    try:
        results = run_ladder(base, progress=_say, on_result=save, **climb)
    except C.ConfigError as e:  # what run_ladder refuses before its first rung
        return _error(e)
    except KeyboardInterrupt:
        where = written(complete=False)
        again = "with --force (it replaces the file only once the climb finishes) or another --json path"
        _say(
            f"\ninterrupted: {len(saved)} rung(s) measured"
            + (f", saved in {where}" if where else "")
            + (f"; {out} is as it was" if kept and kept.replacing else "")
            + f". To climb again, run the same command {again if where or kept else 'again'}; --rungs measures "
            "some rungs only."
        )
        if saved:
            print(ladder_table(saved))
        return 130
    where = written(complete=True)
    print(f"{ladder_table(results)}\n\n{verdict(results)}")
    failed = baseline_failure(results) is not None
    if where is not None:
        export = f"`python -m course_lib export --ladder {where}` writes its optimised loop as a script"
        failure = "the baseline's failure is recorded there: no loop to export"
        _say(f"wrote {where} ({failure if failed else export})")
    return 1 if failed else 0


def _ladder_plan(args):
    """(base config, capabilities, values raised, --json path, run_ladder's arguments), checked before anything runs."""
    import torch

    from . import export
    from .capabilities import capabilities
    from .ladder import prepare_climb

    if args.threads is not None:
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        if not 1 <= args.threads <= usable:
            raise C.ConfigError(
                f"--threads takes a number of CPU threads from 1 to the {usable} this process may use, got "
                f"{args.threads}"
            )
        torch.set_num_threads(args.threads)
    base = presets.preset(args.preset, args.device)
    if args.steps is not None:
        base = dataclasses.replace(base, steps=args.steps)
    caps = capabilities(base.device)  # a device this machine lacks: a message, not a traceback
    rungs = _rung_names(args.rungs, "--rungs") if args.rungs is not None else None
    left_out = _rung_names(args.leave_out, "--leave-out") if args.leave_out is not None else []
    if both := [name for name in left_out if name in (rungs or [])]:
        raise C.ConfigError(f"{both[0]!r} is in --rungs and in --leave-out: name it in one of them")
    settings = parsed_settings(args.rung_value, techniques_only=True, flag="--rung-value")
    options = {technique.name: value for _, technique, value in settings}
    base = export.with_settings(base, climbed_from(args.set))
    leave_out = {name: "left out (--leave-out)" for name in left_out}
    # a --set for a rung left out, or one its technique refuses: said before the banner (run_ladder asks again)
    base, _, raised = prepare_climb(base, rungs, leave_out, options)
    out = _new_file(args.json, args.force, "--json")
    return base, caps, raised, out, dict(rungs=rungs, options=options, leave_out=leave_out, fixed=args.fixed)


def _ladder_banner(args, base: C.TrainConfig, device: str, raised: str) -> None:
    import torch

    if args.preset == "auto":
        _say(presets.auto_reason(base.device))
    raised = f", {raised}" if raised else ""  # said here, so run_ladder finds nothing to raise
    _say(
        f"Ladder on {device}, torch {torch.__version__}, preset {args.preset}: {_shape(base)}, {base.steps} steps per "
        f"rung ({base.timing_warmup} warm-up{raised}); "
        + ("the fixed ladder: every rung kept" if args.fixed else "a rung is kept only where it helps here")
    )


def _shape(c: C.TrainConfig) -> str:
    m = c.model
    return (
        f"{m.n_layer} blocks, width {m.n_embd}, {m.n_head} heads, vocabulary {m.vocab_size}, context {c.context}, "
        f"batch {c.batch_size}"
    )


def _rung_names(indices: str, flag: str, one: bool = False) -> list[str]:
    """'0,2,3' -> those rungs' names (`one`: --rung's single index, as its message says)."""
    try:
        picked = [int(i) for i in indices.split(",")]
        if any(not 0 <= i < len(T.LADDER) for i in picked):
            raise ValueError
    except ValueError:
        what = "an index" if one else "indices"
        raise ValueError(
            f"{flag} takes {what} 0..{len(T.LADDER) - 1}{'' if one else ' separated by commas'}, got {indices!r}"
        ) from None
    if len(set(picked)) < len(picked):
        raise ValueError(f"{flag} {indices}: a rung is named twice; name each once")
    return [T.LADDER[i].name for i in picked]


def climbed_from(items: list[str] | None) -> dict[str, object]:
    """`ladder --set FIELD=VALUE`: the preset's fields; a technique's is refused (--rung-value gives its rung's)."""
    settings = {}
    for name, technique, value in parsed_settings(items):
        if technique is not None:
            raise ValueError(
                f"--set {name}=...: the ladder climbs from naive fp32 and turns {technique.name} on at its rung; give "
                f"the rung's value with --rung-value {name}=..., or leave the rung out with --leave-out"
            )
        settings[name] = value
    return settings


def parsed_settings(items: list[str] | None, techniques_only: bool = False, flag: str = "--set") -> list[tuple]:
    """Each `--set NAME=VALUE` (or `flag`'s) as (name, its technique or None, value parsed); a ValueError otherwise."""
    techniques = ", ".join(T.TECHNIQUE)
    out, seen = [], set()
    for item in items or []:
        name, _, text = item.partition("=")
        name, text = _unquoted(name.strip()), _unquoted(text.strip())  # `--set "lr = 3e-4"`, `'precision="bf16"'`
        if not all(c.isalnum() or c in "._" for c in name):  # a newline, a space, a quote or a dash inside a name
            raise ValueError(
                f"{flag} {item!r}: {name!r} is no setting's name (letters, digits, '_' and '.'): write NAME=VALUE, "
                "e.g. --set batch_size=8"
            )
        technique = T.technique_named(name)
        if techniques_only and (technique is None or not text):
            raise ValueError(
                f"{flag} takes TECHNIQUE=VALUE with a technique of {techniques} (or its config field, e.g. "
                f"model.vocab_multiple), got {item!r}" + ("; --set changes other fields" if technique is None else "")
            )
        if not name or not text:
            raise ValueError(
                f"--set takes FIELD=VALUE (a technique of {techniques}, its config field, a TrainConfig field or "
                f"model.<field>), got {item!r}"
            )
        key = technique.name if technique else name.removeprefix("model.")  # n_head and model.n_head: one field
        if key in seen:
            raise ValueError(f"{flag} {name}: {key} is set twice; give it once")
        seen.add(key)
        out.append((name, technique, C.parse_setting(name, text)))
    return out


def _unquoted(text: str) -> str:
    """Without one pair of quotes around it (a shell that quotes twice, a value copied from Python)."""
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"" else text


def chosen_config(args) -> C.TrainConfig:
    """The config `export`, `profile` and `config` name: a preset, --rung or --ladder file's loop, changed by --set."""
    from . import export, ladder

    if args.ladder is not None:
        base = _ladder_file_config(args)
    elif args.loop is not None:
        raise ValueError("--loop picks one of a ladder file's two loops: give --ladder PATH too")
    else:
        base = presets.preset(args.preset or "cpu", args.device)
    if args.steps is not None:
        base = dataclasses.replace(base, steps=args.steps)
    settings, after = {}, {}  # with --rung: a technique's value goes on the rung, any other on the preset below it
    for name, technique, value in parsed_settings(args.set):
        (after if args.rung is not None and technique is not None else settings)[name] = value
    base = export.with_settings(base, settings)  # in any order: context=128 may come before model.block_size=128
    by_index = args.rung is not None and args.rung.isdigit()
    rung = _rung_names(args.rung, "--rung", one=True)[0] if by_index else args.rung  # or a name rung_config checks
    return export.with_settings(ladder.rung_config(base, rung), after) if rung is not None else base


def _ladder_file_config(args) -> C.TrainConfig:
    """--ladder PATH: the loop (--loop, default the optimised one) a ladder's results file holds."""
    from . import ladder
    from .results import load_results

    if not args.ladder:
        raise ValueError("--ladder: an empty path (an unset variable?): give the file `ladder --json PATH` wrote")
    if args.rung is not None:
        raise ValueError("--ladder and --rung both name a config: give one of them")
    if args.preset is not None:
        raise ValueError("--ladder and --preset both name a model: give one of them (the ladder's file names its own)")
    try:
        results, _meta = load_results(args.ladder)
    except ValueError as e:  # load_results says what the file is instead
        raise ValueError(
            f"--ladder {args.ladder}: not a ladder's results file ({e}); write one with "
            "`python -m course_lib ladder --json PATH`"
        ) from None
    try:
        base = ladder.final_config(results, args.loop or "optimised")
    except (C.ConfigError, TypeError, ValueError) as e:  # no loop in it, or a loop's config edited out of shape
        raise ValueError(f"--ladder {args.ladder}: {e}") from None
    return dataclasses.replace(base, device=args.device) if args.device else base


def _new_file(path: str | None, force: bool, flag: str) -> Path | None:
    """The path a command is to write (None where not given), checked before any work."""
    from .results import check_writable

    if path is None:
        return None
    out = check_writable(path)
    if out.exists() and not force:
        raise C.ConfigError(f"{out} exists: pass --force to replace it, or choose another {flag} path")
    return out


def _write(out: Path | None, text: str, flag: str, note: str = "") -> int:
    """`text` to standard output, or to `out` in one step (a full disk leaves the earlier file): the exit code."""
    from .cache import write_atomic

    if out is None:
        sys.stdout.write(text)
        return 0
    try:
        write_atomic(out, lambda f: f.write_text(text), strict=True)
    except OSError as e:
        return _error(f"could not write {out} ({e.strerror or e}): free some space, or choose another {flag} path")
    _say(f"wrote {out}{note}")
    return 0


def cmd_info(args) -> int:
    """What this machine supports, and the notebooks' budget (COURSE_BUDGET): a table, or JSON with --json."""
    import json
    import platform

    from . import __version__, budget
    from .capabilities import capabilities

    try:
        out = None if args.json == "-" else _new_file(args.json, args.force, "--json")
        caps = capabilities(args.device)
        rows = [*caps.rows(), ("notebooks' budget", budget.describe())]  # an unknown COURSE_BUDGET: said here first
    except REFUSED as e:
        return _error(e)
    if args.json is None:
        width = max(len(k) for k, _ in rows)
        print("\n".join(f"{k:>{width}}: {v}" for k, v in rows))
        return 0
    payload = dict(course_lib=__version__, python=platform.python_version(), budget=budget.budget())
    payload |= dict(rows=dict(rows), capabilities=caps.to_dict())
    return _write(out, json.dumps(payload, indent=1, default=str) + "\n", "--json")


def cmd_doctor(args) -> int:
    from .doctor import run_doctor

    try:
        _new_file(args.json, args.force, "--json")  # a folder, an unwritable path or an earlier file: said now
        report = run_doctor(
            args.device, quick=args.quick, json_path=args.json, progress=lambda name: _say(f"  checking {name} ...")
        )
    except REFUSED as e:
        return _error(e)
    print(report.table())
    if args.json:
        _say(f"wrote {args.json}")
    return 130 if report.interrupted else 1 if report.failed else 0


def cmd_profile(args) -> int:
    """torch.profiler over a few steps of the config `chosen_config` names, after its warm-up steps."""
    import torch

    from .lessons.kernel_floor import kernel_floor
    from .profiling import summary
    from .results import efficiency_text
    from .train import unless_it_fails

    try:
        cfg, trace, p, oom = _profiled(args)
    except REFUSED as e:
        return _error(e)
    if oom:
        _error(
            f"out of memory in the profiled steps of batch {cfg.batch_size} x context {cfg.context}: "
            "try a smaller --set batch_size=... or --set context=..."
        )
        return 1
    r = p.result
    print(
        f"{r.provenance['device']}, torch {torch.__version__}; batch {cfg.batch_size} x context {cfg.context}, "
        f"{cfg.model.n_layer} blocks, width {cfg.model.n_embd}; precision {cfg.precision}, compile {cfg.compile}, "
        f"attention {cfg.model.attention}"
    )
    print(
        f"steps: {len(r.step_times)} ({len(p.active)} recorded after {p.active[0]} warm-up); median step "
        f"{r.median_step_s * 1e3:.1f} ms with the profiler on; "
        f"{'MFU' if r.mfu_basis == 'data-sheet peak' else 'efficiency'} {efficiency_text(r)}"
    )
    print(summary(p, rows=args.rows))
    if not args.no_floor:
        floor, oom = unless_it_fails(lambda: kernel_floor(p).text())
        if oom:
            _say("kernel floor: out of memory while timing a call alone; the profile above stands")
        else:
            print(floor)
    if trace is not None:  # there: profile_run's write_atomic raises where it could not write it
        _say(f"wrote {trace} (open it in https://ui.perfetto.dev)")
    return 0


def _profiled(args):
    """(config, trace path, profile, out of memory?): --steps recorded steps (default 3) after the config's warm-up."""
    from .profiling import profile_run
    from .train import unless_it_fails

    trace = _new_file(args.trace, args.force, "--trace")
    cfg = chosen_config(args)
    if args.rows < 1:
        raise ValueError(f"--rows takes the number of operators to list, >= 1, got {args.rows}")
    active = args.steps if args.steps is not None else 3

    def progress(step: int, steps: int) -> None:
        _say(f"  step {step} of {steps}" + (" (warm-up)" if step <= steps - active else ""))

    try:
        p, oom = unless_it_fails(lambda: profile_run(cfg, active=active, trace=trace, progress=progress))
    except OSError as e:  # with a trace, most likely its write after the steps (a full disk): no part of it is left
        if trace is None:
            raise
        raise OSError(
            f"{e.strerror or e} while profiling with --trace {trace}: free some space, or choose another --trace path"
        ) from None
    return cfg, trace, p, oom


def cmd_export(args) -> int:
    """One standalone training script (course_lib.export) for the config `chosen_config` names."""
    from . import export

    try:
        cfg = chosen_config(args)
        text = export.script(cfg)
        out = None if args.out == "-" else _new_file(args.out, args.force, "--out")
    except REFUSED as e:
        return _error(e)
    note = f" ({len(text.splitlines())} lines): run it with `{export.run_command(cfg, str(out))}`"
    return _write(out, text, "--out", note)


def cmd_exercises(args) -> int:
    """The notebooks' exercises: listed, each checker --verify'd, their --status, or the teachers' --guide rewritten."""
    from .exercises import command

    if args.status is None and args.guide is None:
        return command.listing(args.verify)
    try:
        print(command.progress_table(args.status) if args.status is not None else command.rewrite_guide(args.guide))
    except (OSError, ValueError) as e:
        return _error(e)
    return 0


def cmd_config(args) -> int:
    """The config `chosen_config` names, section by section; a technique that is on says what it does and where."""
    try:
        cfg = chosen_config(args)
    except REFUSED as e:
        return _error(e)
    for section, values in cfg.by_section().items():
        print(f"{section}:")
        for name, value in values.items():
            t = T.technique_named(name)
            on = f"  <- on ({t.help}): {T.module_of(t)}" if t is not None and value != t.off else ""
            print(f"  {name:<28} {value!r}{on}")
    return 0


def cmd_bpe(args) -> int:
    from . import bpe, data

    try:  # a folder, an unwritable path or an earlier file: said now, not after minutes of training
        out = _new_file(args.out, args.force, "--out") if args.out is not None else _shipped_ranks(args.force)
    except REFUSED as e:
        return _error(e)
    if out.exists():  # said before the minutes of training, so that a Ctrl-C keeps the old file
        how = "(--force)" if args.out is not None else "(--force; git restores the shipped one)"
        _say(f"retraining the ranks; {out} will be replaced when done {how}")
    ranks = bpe.train_bpe(data.corpus_text(), data.N_RANKS)
    try:
        bpe.save_ranks(ranks, out)
    except OSError as e:
        elsewhere = "" if args.out is not None else ": pass `--out PATH` to write them elsewhere"
        return _error(f"could not write the ranks to {out} ({e}){elsewhere}")
    print(f"wrote {len(ranks)} ranks to {out}")
    return 0


def _shipped_ranks(force: bool) -> Path:
    """The shipped ranks' file, where a checkout may replace it (an editable install reads the repository's data/)."""
    from . import data
    from .results import check_writable

    out = data.RANKS_FILE.resolve()
    in_checkout = out.parent.name == "data" and (out.parent.parent / "pyproject.toml").is_file()
    try:
        writable = in_checkout and bool(check_writable(out))
    except OSError:
        writable = False
    if not writable:
        raise C.ConfigError(
            f"the tokenizer ranks are package data in {out.parent}, which is not a writable data/ folder of the "
            "course's repository (`pip install .` or a wheel puts it inside site-packages). Retrain them in a checkout "
            "installed with `pip install -e .`, or write them elsewhere with `python -m course_lib bpe --out PATH`."
        )
    if out.exists() and not force:  # the shipped ranks, replaced only when asked, as any other file
        raise C.ConfigError(
            f"{out} is the course's shipped tokenizer: pass --force to retrain and replace it (git restores it), or "
            "--out PATH to write the ranks elsewhere"
        )
    return out


def _rungs_and_presets() -> str:
    """The ladder's --help lists the rungs (by index, with their aims) and the presets (their sizes)."""
    rungs = "\n".join(
        f"  {i:>2}  {r.name:<18} {' and '.join(r.aims) or 'the baseline'}" for i, r in enumerate(T.LADDER)
    )
    named = "\n".join(f"  {name:<11} {_shape(C.preset(name, 'cpu'))}" for name in C.PRESETS)
    auto = "  auto        sized to the device: the cpu preset on a CPU, GPT-2 small's shape on a GPU where it fits"
    return f"rungs (--rungs, --leave-out take their indices):\n{rungs}\n\npresets (--preset):\n{auto}\n{named}"


# how an option is read where it is not a string: the commands' tables name the options and say what each is for
KINDS = {
    "--preset": dict(choices=presets.PRESET_NAMES),
    "--steps": dict(type=int),
    "--threads": dict(type=int),
    "--rows": dict(type=int, default=20),
    "--set": dict(action="append", metavar="FIELD=VALUE"),
    "--rung-value": dict(action="append", metavar="TECHNIQUE=VALUE"),
    "--leave-out": dict(metavar="INDICES"),
    "--rung": dict(metavar="NAME"),
    "--ladder": dict(metavar="PATH"),
    "--loop": dict(choices=["optimised", "leanest"]),
    "--status": dict(nargs="?", const="", metavar="NOTEBOOKS"),
    "--guide": dict(nargs="?", const="", metavar="PATH"),
    **{flag: dict(action="store_true") for flag in ("--force", "--quick", "--fixed", "--no-floor", "--verify")},
}
DEVICE = "cpu, cuda or mps (default: cuda when available)"
STEPS = "optimizer steps (default: the preset's)"
# the options `chosen_config` reads
CONFIG = {
    "--preset": "the model and batch (default: cpu)",
    "--device": DEVICE,
    "--set": "change the config: a technique (e.g. precision=bf16), any TrainConfig field (grad_accum_steps=4) or "
    "model.<field>; repeatable",
    "--rung": "the fixed ladder's cumulative config at this rung (its name, e.g. '+ compile', or index)",
    "--ladder": "the optimised loop a ladder run found on its device (the file `ladder --json PATH` wrote)",
    "--loop": "with --ladder: its fastest loop that fits (optimised, the default) or the one with the least memory",
}

# name: (what it does, examples, {option: its help, or (help, how it is read here)}), in the order a learner uses them
COMMANDS = {
    "info": (
        "what this machine supports",
        ["info", "info --json info.json"],
        {
            "--device": DEVICE,
            "--json": ("as JSON, to standard output or to PATH", dict(nargs="?", const="-", metavar="PATH")),
            "--force": "replace the --json file if it exists",
        },
    ),
    "doctor": (
        "exercise every device-specific path on this device: pass / fail / n/a",
        ["doctor --quick", "doctor --json doctor.json"],
        {
            "--device": DEVICE,
            "--quick": "leave out the slow checks (compile, the 2-process all-reduce)",
            "--json": "also write the table as JSON here",
            "--force": "replace the --json file if it exists",
        },
    ),
    "ladder": (
        "climb the techniques from naive fp32, keeping each one only where it helps on this device",
        ["ladder --json ladder.json", "ladder --preset tiny --steps 5 --rungs 0,2,3"],
        {
            "--preset": ("model and batch (default: auto)", dict(default="auto")),
            "--device": DEVICE,
            "--steps": "optimizer steps per rung (default: the preset's)",
            "--rungs": "only these rungs, by index (0 = naive fp32), e.g. 0,2,3",
            "--leave-out": "climb without these rungs, by index (e.g. 4: without compile); reported as skipped",
            "--rung-value": "a technique's value at its rung, by its name or config field, e.g. "
            "activation_checkpointing=selective; repeatable",
            "--set": "change the preset the climb starts from: a TrainConfig field or model.<field>; repeatable",
            "--threads": "CPU threads for torch (default: torch's choice)",
            "--fixed": "keep every rung this device can run, whether it helped or not (for comparison)",
            "--json": "write every result, with device, torch version, date and config, here (rung by rung)",
            "--force": "replace the --json file if it exists",
        },
    ),
    "profile": (
        "where a step's time goes: torch.profiler over a few steps of a config, after its warm-up",
        ["profile --preset tiny --steps 3", "profile --ladder ladder.json --trace trace.json"],
        {
            **CONFIG,
            "--steps": "steps to record (default: 3) after the config's warm-up (at least 2); no validation runs",
            "--rows": "operators to list, at least 1 (default: 20)",
            "--trace": "also write a Chrome trace here (open it in https://ui.perfetto.dev)",
            "--force": "replace the --trace file if it exists",
            "--no-floor": "leave out the kernel floor (each matmul and attention call timed again alone: seconds)",
        },
    ),
    "export": (
        "write one standalone training script (torch + tiktoken) for a config",
        ["export --ladder ladder.json --out train.py", "export --preset cpu --set precision=bf16 --out train.py"],
        {
            **CONFIG,
            "--steps": STEPS,
            "--out": "the script's path (default: standard output)",
            "--force": "replace the --out file if it exists",
        },
    ),
    "exercises": (  # one of its options, or none: the list
        "list the notebooks' exercises; --verify checks every checker",
        ["exercises --status", "exercises --verify"],
        {
            "--verify": "each checker against its reference and its recorded mistakes",
            "--status": "which exercises pass in the notebooks on disk (default: ./notebooks, else the course's)",
            "--guide": "rewrite the exercises' guide for teachers from the checkers (default: docs/exercises.md)",
        },
    ),
    "config": (
        "print a config section by section (a preset, changed by --set, or a --rung)",
        ["config --preset cpu --set batch_size=4", "config --rung 4"],
        {**CONFIG, "--steps": STEPS},
    ),
    "bpe": (
        "(maintainers) retrain the course tokenizer's BPE ranks from the corpus",
        ["bpe --out /tmp/ranks.tiktoken", "bpe --force   (replaces the shipped data/shakespeare_bpe.tiktoken)"],
        {
            "--out": "write the ranks here (default: the shipped file in data/)",
            "--force": "replace the file if it exists (the shipped one included)",
        },
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser, from COMMANDS; each command's --help ends with its examples, shown as written."""
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="python -m course_lib",
        description="Optimising the training loop: measurements from the command line",
        epilog="Start with `python -m course_lib info`; `python -m course_lib COMMAND --help` shows a command's "
        "options and an example.",
    )
    parser.add_argument("--version", action="version", version=f"course_lib {__version__}")
    raw = functools.partial(argparse.ArgumentParser, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=raw)
    for name, (about, examples, options) in COMMANDS.items():
        epilog = "examples:\n" + "\n".join(f"  python -m course_lib {line}" for line in examples)
        if name == "ladder":
            epilog += "\n\n" + _rungs_and_presets()
        p = sub.add_parser(name, help=about, epilog=epilog)
        p.set_defaults(func=globals()[f"cmd_{name}"])  # looked up now, so that a test may stand in for a command
        group = p.add_mutually_exclusive_group() if name == "exercises" else p
        for flag, text in options.items():
            text, kind = (text, {}) if isinstance(text, str) else text
            group.add_argument(flag, help=text, **KINDS.get(flag, {}) | kind)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # a bare call: what there is to do, not an error
        parser.print_help()
        return 0
    try:
        with stopped_as_interrupted() as stopped_by:
            status = args.func(args)
            sys.stdout.flush()  # here, where a closed pipe is caught, not at the interpreter's exit
        # a command that caught the interrupt itself (the ladder, the doctor) returns 130; a SIGTERM's code is 143
        return 128 + stopped_by[0] if status == 130 and stopped_by else status
    except KeyboardInterrupt:  # (the ladder catches its own, to save the rungs measured): one line, not a traceback
        signum = stopped_by[0] if stopped_by else signal.SIGINT
        _say(f"\ninterrupted: {args.command} stopped before it finished")
        return 128 + signum
    except BrokenPipeError:  # the output piped to a reader that stopped early (`| head`): nothing to say to it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit would fail again
        return 141


@contextlib.contextmanager
def stopped_as_interrupted():
    """SIGTERM (a job scheduler) and SIGHUP (a closed terminal) stop a command as Ctrl-C does; yields their numbers."""
    stopped_by: list[int] = []
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield stopped_by
        return

    def stop(signum, _frame):
        if signum != signal.SIGINT:  # a second Ctrl-C interrupts again; a second SIGTERM or SIGHUP ends the process
            signal.signal(signum, signal.SIG_DFL)
        stopped_by.append(signum)
        raise KeyboardInterrupt

    handled = [signal.SIGTERM, signal.SIGINT] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    # a signal ignored on purpose stays ignored (`nohup` ignores SIGHUP, a shell's `&` job SIGINT)
    before = {sig: signal.getsignal(sig) for sig in handled if signal.getsignal(sig) != signal.SIG_IGN}
    for sig in before:
        signal.signal(sig, stop)
    try:
        yield stopped_by
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
