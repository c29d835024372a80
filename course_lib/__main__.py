"""The course's command line (also installed as `course-lib`), its commands in the order a learner uses them:

    python -m course_lib info [--device D] [--json [PATH]]
    python -m course_lib doctor [--device D] [--quick] [--json PATH]
    python -m course_lib ladder [--preset P] [--device D] [--steps N] [--rungs I,J] [--leave-out I,J] [--fixed]
        [--rung-value TECHNIQUE=VALUE ...] [--set FIELD=VALUE ...] [--json PATH]
    python -m course_lib profile [--preset P [--rung NAME] | --ladder PATH] [--device D] [--steps N]
        [--set FIELD=VALUE ...] [--trace PATH [--force]] [--no-floor]
    python -m course_lib export [--preset P [--rung NAME] | --ladder PATH] [--device D] [--steps N]
        [--set FIELD=VALUE ...] [--out train.py [--force]]
    python -m course_lib exercises [--verify | --status [NOTEBOOKS] | --guide [PATH]]
    python -m course_lib config [--preset P [--rung NAME] | --ladder PATH] [--set FIELD=VALUE ...]
    python -m course_lib bpe [--out PATH] [--force]   (maintainers: retrain the tokenizer ranks from the corpus)

`python -m course_lib COMMAND --help` describes each command's options, with examples; `--version` says the version.
SIGTERM and SIGHUP stop a command as Ctrl-C does (stopped_as_interrupted): what it finished is kept.
"""

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


def cmd_ladder(args) -> int:
    import torch

    from . import export
    from .capabilities import capabilities
    from .ladder import baseline_failure, ladder_table, prepare_climb, run_ladder, verdict
    from .results import ResultsFile, check_writable, provenance

    try:
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
        # before anything runs: a device this machine lacks is a message, not a traceback
        caps = capabilities(base.device)
        rungs = _rung_names(args.rungs, "--rungs") if args.rungs is not None else None
        left_out = _rung_names(args.leave_out, "--leave-out") if args.leave_out is not None else []
        if both := [name for name in left_out if name in (rungs or [])]:
            raise C.ConfigError(f"{both[0]!r} is in --rungs and in --leave-out: name it in one of them")
        options = {
            technique.name: value
            for _, technique, value in parsed_settings(args.rung_value, techniques_only=True, flag="--rung-value")
        }
        base = export.with_settings(base, climbed_from(args.set))
        leave_out = {name: "left out (--leave-out)" for name in left_out}
        # a --set for a rung left out, or one its technique refuses: said before the banner (run_ladder asks again)
        base, _, raised = prepare_climb(base, rungs, leave_out, options)
        out = check_writable(args.json) if args.json is not None else None
        if out is not None and out.exists() and not args.force:
            raise C.ConfigError(f"{out} exists: pass --force to replace it, or choose another --json path")
    except (C.ConfigError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    raised = f", {raised}" if raised else ""  # said in the banner (run_ladder then finds nothing to raise)
    if args.preset == "auto":
        print(presets.auto_reason(base.device), file=sys.stderr)
    print(
        f"Ladder on {caps.name}, torch {torch.__version__}, preset {args.preset}: "
        f"{base.model.n_layer} blocks, width {base.model.n_embd}, {base.model.n_head} heads, context {base.context}, "
        f"batch {base.batch_size}, {base.steps} steps per rung ({base.timing_warmup} warm-up{raised}); "
        + ("the fixed ladder: every rung kept" if args.fixed else "a rung is kept only where it helps here"),
        file=sys.stderr,
    )
    meta = dict(
        preset=args.preset,
        base_config=base.to_dict(),
        fixed=args.fixed,
        **provenance(caps.name),
        **({"cpu": caps.cpu.summary()} if caps.cpu else {}),
    )
    # an earlier file (--force) is replaced only by a finished climb; a write that fails is said once, and the climb
    # goes on
    kept = ResultsFile(out, replace=True, fallback_name="ladder", **meta) if out is not None else None
    saved: list = []

    def save(results) -> None:
        saved[:] = results
        if kept is not None:
            failing = kept.error
            kept.save(results)
            if kept.error and not failing:
                print(f"warning: could not write {kept.writing} ({kept.error}); climbing on", file=sys.stderr)

    def written(complete: bool) -> Path | None:
        if kept is None:
            return None
        where = kept.finish(complete)
        if kept.note:
            print(kept.note + ("" if where else ": the table below has them"), file=sys.stderr)
        return where

    try:
        results = run_ladder(
            base,
            progress=lambda text: print(text, file=sys.stderr),
            rungs=rungs,
            options=options,
            leave_out=leave_out,
            fixed=args.fixed,
            on_result=save,
        )
    except C.ConfigError as e:  # what run_ladder refuses before its first rung
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        where = written(complete=False)
        again = "with --force (it replaces the file only once the climb finishes) or another --json path"
        print(
            f"\ninterrupted: {len(saved)} rung(s) measured"
            + (f", saved in {where}" if where else "")
            + (f"; {out} is as it was" if kept and kept.replacing else "")
            + f". To climb again, run the same command {again if where or kept else 'again'}; --rungs measures "
            "some rungs only.",
            file=sys.stderr,
        )
        if saved:
            print(ladder_table(saved))
        return 130
    where = written(complete=True)
    print(ladder_table(results))
    print()
    print(verdict(results))
    baseline_failed = baseline_failure(results) is not None
    if where is not None:
        print(
            f"wrote {where} "
            + (
                "(the baseline's failure is recorded there: no loop to export)"
                if baseline_failed
                else f"(`python -m course_lib export --ladder {where}` writes its optimised loop as a script)"
            ),
            file=sys.stderr,
        )
    return 1 if baseline_failed else 0


def _rung_names(indices: str, flag: str, one: bool = False) -> list[str]:
    """'0,2,3' -> those rungs' names ('3' only, where `one`)."""
    try:
        picked = [int(i) for i in indices.split(",")]
        if any(not 0 <= i < len(T.LADDER) for i in picked) or (one and len(picked) != 1):
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
    """`ladder --set FIELD=VALUE`: the fields of the preset the ladder climbs from. A technique's field is refused: the
    climb turns each technique on at its rung (--rung-value says with which value)."""
    settings = {}
    for name, technique, value in parsed_settings(items):
        if technique is not None:
            raise ValueError(
                f"--set {name}=...: the ladder climbs from naive fp32 and turns {technique.name} on at its rung; give "
                f"the rung's value with --rung-value {name}=..., or leave the rung out with --leave-out"
            )
        settings[name] = value
    return settings


def parsed_settings(
    items: list[str] | None, techniques_only: bool = False, flag: str = "--set"
) -> list[tuple[str, T.Technique | None, object]]:
    """Each `--set NAME=VALUE` (or, `flag`, --rung-value's): (the name as given, the technique it names by its name or
    config field, else None, the value parsed by the setting's declared type). A ValueError saying what to change for
    an item that is not NAME=VALUE, a setting given twice (by either spelling), or, with `techniques_only` (the
    ladder's rung values), a name of no technique."""
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
    """A value without one pair of quotes around it (they reach here when a shell quotes twice, or copied from
    Python)."""
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"" else text


def chosen_config(args) -> C.TrainConfig:
    """The config that `export`, `profile` and `config` name: the preset, the ladder's cumulative config at --rung, or a
    ladder file's loop, changed by --set (a field of no technique is set on the preset, before a rung, so that the
    rung sees the shapes it runs; a technique's is set on the config named). Raises ConfigError, TypeError or
    ValueError saying what to change."""
    from . import export, ladder

    if getattr(args, "ladder", None) is not None:
        if not args.ladder:
            raise ValueError("--ladder: an empty path (an unset variable?): give the file `ladder --json PATH` wrote")
        if args.rung is not None:
            raise ValueError("--ladder and --rung both name a config: give one of them")
        if args.preset is not None:
            raise ValueError(
                "--ladder and --preset both name a model: give one of them (the ladder's file names its own)"
            )
        from .results import load_results

        try:
            results, _meta = load_results(args.ladder)
        except ValueError as e:  # load_results says what the file is instead
            raise ValueError(
                f"--ladder {args.ladder}: not a ladder's results file ({e}); write one with "
                "`python -m course_lib ladder --json PATH`"
            ) from None
        try:
            base = ladder.final_config(results, getattr(args, "loop", None) or "optimised")
        except (C.ConfigError, TypeError, ValueError) as e:  # no loop in it, or a loop's config edited out of shape
            raise ValueError(f"--ladder {args.ladder}: {e}") from None
        if args.device:
            base = dataclasses.replace(base, device=args.device)
    else:
        if getattr(args, "loop", None) is not None:
            raise ValueError("--loop picks one of a ladder file's two loops: give --ladder PATH too")
        base = presets.preset(args.preset or "cpu", args.device)
    if args.steps is not None:
        base = dataclasses.replace(base, steps=args.steps)
    settings, after = {}, {}  # after: a technique's field at --rung, set on the rung's config (the rung sets its own)
    for name, technique, value in parsed_settings(args.set):
        (after if args.rung is not None and technique is not None else settings)[name] = value
    base = export.with_settings(base, settings)  # in any order: context=128 may come before model.block_size=128
    by_index = args.rung is not None and args.rung.isdigit()
    rung = _rung_names(args.rung, "--rung", one=True)[0] if by_index else args.rung  # or a name rung_config checks
    return export.with_settings(ladder.rung_config(base, rung), after) if rung is not None else base


def written_whole(out: Path, text: str, flag: str) -> bool:
    """Write `text` to `out` in one step (cache.write_atomic: a failed write, a full disk, leaves no part of it and any
    earlier file as it was); False, with one line saying why, where it could not be."""
    from .cache import write_atomic

    try:
        write_atomic(out, lambda f: f.write_text(text), strict=True)
        return True
    except OSError as e:
        print(
            f"error: could not write {out} ({e.strerror or e}): free some space, or choose another {flag} path",
            file=sys.stderr,
        )
        return False


def _new_file(path: str, force: bool, flag: str):
    """The path a command is to write, checked before any work: not a folder, writable, and not an existing file
    unless --force (a second run never replaces the first one's file without being asked)."""
    from .results import check_writable

    out = check_writable(path)
    if out.exists() and not force:
        raise C.ConfigError(f"{out} exists: pass --force to replace it, or choose another {flag} path")
    return out


def cmd_config(args) -> int:
    """The config `chosen_config` names, section by section (config.SECTIONS); a technique that is on says what it
    does and which module of course_lib.techniques holds it."""
    try:
        cfg = chosen_config(args)
    except (C.ConfigError, TypeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for section, values in cfg.by_section().items():
        print(f"{section}:")
        for name, value in values.items():
            t = T.technique_named(name)
            on = f"  <- on ({t.help}): {T.module_of(t)}" if t is not None and value != t.off else ""
            print(f"  {name:<28} {value!r}{on}")
    return 0


def exercises_status(folder: str) -> int:
    """`exercises --status [notebooks]`: which exercises pass in the notebooks on disk (course_lib.exercises.status)."""
    from pathlib import Path

    from .exercises import status

    here = Path(folder or "notebooks")
    if not folder and not here.is_dir():  # run from elsewhere: the course's own notebooks
        here = Path(__file__).resolve().parent.parent / "notebooks"
    try:
        rows = status.progress(here)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(status.table(rows))
    return 0


def exercises_guide(path: str) -> int:
    """`exercises --guide [PATH]`: rewrite the exercises' blocks of the teacher's guide from the exercises."""
    from pathlib import Path

    from .exercises import guide

    target = Path(path) if path else guide.GUIDE
    try:
        if not target.is_file():
            raise FileNotFoundError(f"{target} is not a file: give the exercises' guide (default: docs/exercises.md)")
        changed = guide.write(target)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{target}: " + ("the exercises' blocks rewritten" if changed else "up to date"))
    return 0


def cmd_exercises(args) -> int:
    """The exercises (course_lib.exercises); --verify runs every checker against its reference and its mistakes."""
    from . import exercises

    if args.status is not None:
        return exercises_status(args.status)
    if args.guide is not None:
        return exercises_guide(args.guide)
    if not args.verify:
        width = max(len(name) for name in exercises.EXERCISES)
        for ex in exercises.EXERCISES.values():
            print(f"  {ex.notebook}  {ex.name:<{width}} {ex.title} ({len(ex.mistakes)} typical mistakes recorded)")
        return 0
    rows = exercises.verify()
    width = max(len(name) for name in exercises.EXERCISES)
    for r in rows:
        mark = "ok  " if r["ok"] else "FAIL"
        what = "passes" if r["answer"] == "reference" else "caught, with its hint"
        print(f"{mark} {r['notebook']} {r['exercise']:<{width}} {r['answer']:<38} {what if r['ok'] else r['said']}")
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(bad)} of {len(rows)} as they must be")
    return 1 if bad else 0


def cmd_export(args) -> int:
    """One standalone training script for a config (course_lib.export), the config `chosen_config` names."""
    from . import export

    try:
        cfg = chosen_config(args)
        text = export.script(cfg)
    except (C.ConfigError, TypeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.out in (None, "-"):
        sys.stdout.write(text)
        return 0
    try:
        out = _new_file(args.out, args.force, "--out")
    except (C.ConfigError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not written_whole(out, text, "--out"):
        return 2
    how = export.run_command(cfg, str(out))
    print(f"wrote {out} ({len(text.splitlines())} lines): run it with `{how}`", file=sys.stderr)
    return 0


def cmd_profile(args) -> int:
    """torch.profiler over a few steps of the config `chosen_config` names, after its warm-up steps."""
    import torch

    from .profiling import kernel_floor, profile_run, summary
    from .results import efficiency_text
    from .train import unless_it_fails

    try:
        # before the run: checked, not found out after
        trace = _new_file(args.trace, args.force, "--trace") if args.trace is not None else None
        cfg = chosen_config(args)
        if args.rows < 1:
            raise ValueError(f"--rows takes the number of operators to list, >= 1, got {args.rows}")
        if trace is not None:
            trace.parent.mkdir(parents=True, exist_ok=True)
        # --steps counts the recorded steps here; the warm-up steps come first
        active = args.steps if args.steps is not None else 3
        try:
            p, oom = unless_it_fails(
                lambda: profile_run(
                    cfg,
                    active=active,
                    trace=trace,
                    progress=lambda step, steps: print(
                        f"  step {step} of {steps}" + (" (warm-up)" if step <= steps - active else ""), file=sys.stderr
                    ),
                )
            )
        except OSError as e:  # with a trace, most likely its write after the steps (a full disk): no part of it is left
            if trace is None:
                raise
            raise OSError(
                f"{e.strerror or e} while profiling with --trace {trace}: free some space, or choose another "
                "--trace path"
            ) from None
    except (C.ConfigError, TypeError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if oom:
        print(
            f"error: out of memory in the profiled steps of batch {cfg.batch_size} x context {cfg.context}: "
            "try a smaller --set batch_size=... or --set context=...",
            file=sys.stderr,
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
        f"{'MFU' if r.mfu_basis == 'data-sheet peak' else 'efficiency'} "
        f"{efficiency_text(r)}"
    )
    print(summary(p, rows=args.rows))
    if not args.no_floor:
        floor, oom = unless_it_fails(lambda: kernel_floor(p).text())
        if oom:
            print(
                "kernel floor: out of memory while timing a call alone; the profile above stands "
                "(--no-floor leaves the floor out)",
                file=sys.stderr,
            )
        else:
            print(floor)
    if trace is not None:
        if not trace.is_file():
            print(f"error: the profiler did not write {trace}", file=sys.stderr)
            return 1
        print(f"wrote {trace} (open it in https://ui.perfetto.dev)", file=sys.stderr)
    return 0


def cmd_info(args) -> int:
    """What this machine supports, and the notebooks' budget (COURSE_BUDGET): a table, or JSON with --json."""
    import json
    import platform

    from . import __version__, budget
    from .capabilities import capabilities

    try:
        out = None if args.json in (None, "-") else _new_file(args.json, args.force, "--json")
        caps = capabilities(args.device)
        rows = [*caps.rows(), ("notebooks' budget", budget.describe())]  # an unknown COURSE_BUDGET: said here first
    except (C.ConfigError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json is None:
        width = max(len(k) for k, _ in rows)
        for k, v in rows:
            print(f"{k:>{width}}: {v}")
        return 0
    payload = {
        "course_lib": __version__,
        "python": platform.python_version(),
        "budget": budget.budget(),
        "rows": dict(rows),
        "capabilities": caps.to_dict(),
    }
    text = json.dumps(payload, indent=1, default=str) + "\n"
    if out is None:
        sys.stdout.write(text)
        return 0
    if not written_whole(out, text, "--json"):
        return 2
    print(f"wrote {out}", file=sys.stderr)
    return 0


def cmd_doctor(args) -> int:
    from .doctor import run_doctor

    try:
        if args.json is not None:
            # a folder, an unwritable path or an earlier file: said now, not after
            _new_file(args.json, args.force, "--json")
        report = run_doctor(
            args.device,
            quick=args.quick,
            json_path=args.json,
            progress=lambda name: print(f"  checking {name} ...", file=sys.stderr),
        )
    except (C.ConfigError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report.table())
    if args.json:
        print(f"wrote {args.json}", file=sys.stderr)
    return 130 if report.interrupted else 1 if report.failed else 0


def cmd_bpe(args) -> int:
    from . import bpe, data
    from .results import check_writable

    if args.out is not None:
        try:  # a folder, an unwritable path or an earlier file: said now, not after minutes of training
            out = _new_file(args.out, args.force, "--out")
        except (C.ConfigError, ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    else:
        # The shipped ranks belong to the repository's data/: an editable install (or a source tree) reads them
        # from there. A strict editable install links the file, so resolve() writes through to the repository.
        out = data.RANKS_FILE.resolve()
        checkout = out.parent.name == "data" and (out.parent.parent / "pyproject.toml").is_file()
        try:
            check_writable(out)
            writable = True
        except OSError:
            writable = False
        if not checkout or not writable:
            print(
                f"error: the tokenizer ranks are package data in {out.parent}, which is not a writable data/ folder of "
                "the course's repository (`pip install .` or a wheel puts it inside site-packages). Retrain them in "
                "a checkout installed with `pip install -e .`, or write them elsewhere with "
                "`python -m course_lib bpe --out PATH`.",
                file=sys.stderr,
            )
            return 2
        if out.exists() and not args.force:  # the shipped ranks, replaced only when asked, as any other file
            print(
                f"error: {out} is the course's shipped tokenizer: pass --force to retrain and replace it (git restores "
                "it), or --out PATH to write the ranks elsewhere",
                file=sys.stderr,
            )
            return 2
    if out.exists():  # said before the minutes of training, so that a Ctrl-C keeps the old file
        print(
            f"retraining the ranks; {out} will be replaced when done "
            + ("(--force)" if args.out is not None else "(--force; git restores the shipped one)"),
            file=sys.stderr,
        )
    ranks = bpe.train_bpe(data.corpus_text(), data.N_RANKS)
    try:
        bpe.save_ranks(ranks, out)
    except OSError as e:
        print(
            f"error: could not write the ranks to {out} ({e})"
            + ("" if args.out is not None else ": pass `--out PATH` to write them elsewhere"),
            file=sys.stderr,
        )
        return 2
    print(f"wrote {len(ranks)} ranks to {out}")
    return 0


def add_config_arguments(p: argparse.ArgumentParser, steps: str) -> None:
    """The arguments `chosen_config` reads."""
    p.add_argument("--preset", default=None, choices=presets.PRESET_NAMES, help="the model and batch (default: cpu)")
    p.add_argument("--device", default=None, help="cpu, cuda or mps (default: cuda when available)")
    p.add_argument("--steps", type=int, default=None, help=steps)
    p.add_argument(
        "--set",
        action="append",
        metavar="FIELD=VALUE",
        help="change the config: a technique (e.g. precision=bf16, activation_checkpointing=selective), any "
        "TrainConfig field (grad_accum_steps=4, clip_norm=1.0) or model.<field>; repeatable",
    )
    p.add_argument(
        "--rung",
        default=None,
        metavar="NAME",
        help="the fixed ladder's cumulative config at this rung (its name, e.g. '+ compile', or index)",
    )
    p.add_argument(
        "--ladder",
        default=None,
        metavar="PATH",
        help="the optimised loop a ladder run found on its device (the file `ladder --json PATH` wrote)",
    )
    p.add_argument(
        "--loop",
        default=None,
        choices=["optimised", "leanest"],
        help="with --ladder: its fastest loop that fits (optimised, the default) or the one with the least memory",
    )


def example(*lines: str) -> str:
    """A command's --help ends with examples, one command a line (shown as written: RawDescriptionHelpFormatter)."""
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


def _rungs_and_presets() -> str:
    """--help's list of the ladder's rungs (by index, with what each is for) and of the presets (their sizes)."""
    rungs = "\n".join(
        f"  {i:>2}  {r.name:<18} {' and '.join(r.aims) or 'the baseline'}" for i, r in enumerate(T.LADDER)
    )
    named = "\n".join(
        f"  {name:<11} {c.model.n_layer} blocks, width {c.model.n_embd}, {c.model.n_head} heads, vocabulary "
        f"{c.model.vocab_size}, context {c.context}, batch {c.batch_size}"
        for name, c in ((name, C.preset(name, "cpu")) for name in C.PRESETS)
    )
    auto = "  auto        sized to the device: the cpu preset on a CPU, GPT-2 small's shape on a GPU where it fits"
    return f"rungs (--rungs, --leave-out take their indices):\n{rungs}\n\npresets (--preset):\n{auto}\n{named}"


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser: its commands in the order a learner uses them, maintainers' last."""
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="python -m course_lib",
        description="Optimising the training loop: measurements from the command line",
        epilog="Start with `python -m course_lib info`; `python -m course_lib COMMAND --help` shows a command's "
        "options and an example.",
    )
    parser.add_argument("--version", action="version", version=f"course_lib {__version__}")
    # every command's examples and lists shown as written
    raw = functools.partial(argparse.ArgumentParser, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=raw)
    p = sub.add_parser(
        "info",
        help="what this machine supports",
        epilog=example("python -m course_lib info", "python -m course_lib info --json info.json"),
    )
    p.add_argument("--device", default=None, help="cpu, cuda or mps (default: cuda when available)")
    p.add_argument(
        "--json", nargs="?", const="-", default=None, metavar="PATH", help="as JSON, to standard output or to PATH"
    )
    p.add_argument("--force", action="store_true", help="replace the --json file if it exists")
    p.set_defaults(func=cmd_info)
    p = sub.add_parser(
        "doctor",
        help="exercise every device-specific path on this device: pass / fail / n/a",
        epilog=example("python -m course_lib doctor --quick", "python -m course_lib doctor --json doctor.json"),
    )
    p.add_argument("--device", default=None, help="cpu, cuda or mps (default: cuda when available)")
    p.add_argument("--quick", action="store_true", help="leave out the slow checks (compile, the 2-process all-reduce)")
    p.add_argument("--json", default=None, help="also write the table as JSON here")
    p.add_argument("--force", action="store_true", help="replace the --json file if it exists")
    p.set_defaults(func=cmd_doctor)
    p = sub.add_parser(
        "ladder",
        help="climb the techniques from naive fp32, keeping each one only where it helps on this device",
        epilog=example(
            "python -m course_lib ladder --json ladder.json",
            "python -m course_lib ladder --preset tiny --steps 5 --rungs 0,2,3",
        )
        + "\n\n"
        + _rungs_and_presets(),
    )
    p.add_argument("--preset", default="auto", choices=presets.PRESET_NAMES, help="model and batch (default: auto)")
    p.add_argument("--device", default=None, help="cpu, cuda or mps (default: cuda when available)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per rung (default: the preset's)")
    p.add_argument("--rungs", default=None, help="only these rungs, by index (0 = naive fp32), e.g. 0,2,3")
    p.add_argument(
        "--leave-out",
        default=None,
        metavar="INDICES",
        help="climb without these rungs, by index (e.g. 4: the ladder without compile); they are reported as skipped",
    )
    p.add_argument(
        "--rung-value",
        action="append",
        metavar="TECHNIQUE=VALUE",
        help="what a technique's rung sets instead of its default, by the technique's name or config field, e.g. "
        "activation_checkpointing=selective or model.vocab_multiple=128; repeatable",
    )
    p.add_argument(
        "--set",
        action="append",
        metavar="FIELD=VALUE",
        help="change the preset the ladder climbs from: a TrainConfig field (batch_size=8, context=128) or "
        "model.<field>; repeatable (a technique's value at its rung is --rung-value's)",
    )
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    p.add_argument(
        "--fixed",
        action="store_true",
        help="climb the fixed ladder: keep every rung this device can run, whether it helped or not (for comparison)",
    )
    p.add_argument(
        "--json",
        default=None,
        help="write every result, with device, torch version, date and config, here (rung by rung)",
    )
    p.add_argument("--force", action="store_true", help="replace the --json file if it exists")
    p.set_defaults(func=cmd_ladder)
    p = sub.add_parser(
        "profile",
        help="where a step's time goes: torch.profiler over a few steps of a config, after its warm-up",
        epilog=example(
            "python -m course_lib profile --preset tiny --steps 3",
            "python -m course_lib profile --ladder ladder.json --trace trace.json",
        ),
    )
    add_config_arguments(
        p,
        steps="steps to record (default: 3), after the config's warm-up steps (at least 2: the first compiles, the "
        "profiler warms up on the last); no validation pass runs",
    )
    p.add_argument("--rows", type=int, default=20, help="operators to list, at least 1 (default: 20)")
    p.add_argument("--trace", default=None, help="also write a Chrome trace here (open it in https://ui.perfetto.dev)")
    p.add_argument("--force", action="store_true", help="replace the --trace file if it exists")
    p.add_argument(
        "--no-floor",
        action="store_true",
        help="leave out the kernel floor (each matmul and attention call of a step timed again alone: a few seconds)",
    )
    p.set_defaults(func=cmd_profile)
    p = sub.add_parser(
        "export",
        help="write one standalone training script (torch + tiktoken) for a config",
        epilog=example(
            "python -m course_lib export --ladder ladder.json --out train.py",
            "python -m course_lib export --preset cpu --set precision=bf16 --out train.py",
        ),
    )
    add_config_arguments(p, steps="optimizer steps (default: the preset's)")
    p.add_argument("--out", default=None, help="the script's path (default: standard output)")
    p.add_argument("--force", action="store_true", help="replace the --out file if it exists")
    p.set_defaults(func=cmd_export)
    p = sub.add_parser(
        "exercises",
        help="list the notebooks' exercises; --verify checks every checker",
        epilog=example("python -m course_lib exercises --status", "python -m course_lib exercises --verify"),
    )
    p = p.add_mutually_exclusive_group()  # one of them, or the list
    p.add_argument("--verify", action="store_true", help="each checker against its reference and its recorded mistakes")
    p.add_argument(
        "--status",
        nargs="?",
        const="",
        default=None,
        metavar="NOTEBOOKS",
        help="which exercises pass in the notebooks on disk (default folder: ./notebooks, else the course's)",
    )
    p.add_argument(
        "--guide",
        nargs="?",
        const="",
        default=None,
        metavar="PATH",
        help="rewrite the exercises' guide for teachers from the checkers (default: docs/exercises.md)",
    )
    p.set_defaults(func=cmd_exercises)  # (a group's defaults are its parser's)
    p = sub.add_parser(
        "config",
        help="print a config section by section (a preset, changed by --set, or a --rung)",
        epilog=example(
            "python -m course_lib config --preset cpu --set batch_size=4", "python -m course_lib config --rung 4"
        ),
    )
    add_config_arguments(p, steps="optimizer steps (default: the preset's)")
    p.set_defaults(func=cmd_config)
    p = sub.add_parser(
        "bpe",
        help="(maintainers) retrain the course tokenizer's BPE ranks from the corpus",
        epilog=example(
            "python -m course_lib bpe --out /tmp/ranks.tiktoken",
            "python -m course_lib bpe --force   (replaces the shipped data/shakespeare_bpe.tiktoken)",
        ),
    )
    p.add_argument("--out", default=None, help="write the ranks here (default: the shipped file in data/)")
    p.add_argument("--force", action="store_true", help="replace the file if it exists (the shipped one included)")
    p.set_defaults(func=cmd_bpe)
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
        print(f"\ninterrupted: {args.command} stopped before it finished", file=sys.stderr)
        return 128 + signum
    except BrokenPipeError:  # the output piped to a reader that stopped early (`| head`): nothing to say to it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit would fail again
        return 141


@contextlib.contextmanager
def stopped_as_interrupted():
    """Within it, SIGTERM (a job scheduler, a kernel restarted) and SIGHUP (a terminal closed) raise KeyboardInterrupt,
    as Ctrl-C does, so a command stops the same way: what it finished kept, one line said. Yields a list that gets
    the signal's number. A second one of them ends the process at once (the system's default)."""
    stopped_by: list[int] = []
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield stopped_by
        return

    def stop(signum, _frame):
        signal.signal(signum, signal.SIG_DFL)
        stopped_by.append(signum)
        raise KeyboardInterrupt

    def note_ctrl_c(signum, frame):
        stopped_by.append(signum)
        signal.default_int_handler(signum, frame)

    handled = [signal.SIGTERM, signal.SIGINT] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    # a signal ignored on purpose stays ignored (`nohup` ignores SIGHUP, a shell's `&` job SIGINT)
    before = {sig: signal.getsignal(sig) for sig in handled if signal.getsignal(sig) != signal.SIG_IGN}
    for sig in before:
        signal.signal(sig, note_ctrl_c if sig == signal.SIGINT else stop)
    try:
        yield stopped_by
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
