"""Climb the ladder of techniques from naive fp32, and keep what helps on this device.

Every rung adds one technique to the best loop so far and is one run of the course's loop (course_lib.train). Its
timed steps are paired with steps of the best loop so far, each taken right after one of the rung's on the same
machine, so that a machine that speeds up or slows down over the minutes (a laptop warming up, a shared VM) moves
both alike. The rung's factor is the median of the paired ratios, and its spread their interquartile range.

What is kept (`judge`):
- a speed technique (TF32, 16-bit autocast, compile, vocabulary padding, fused AdamW) where it made the step faster by
  more than the noise. Where the machine measured its own noise (on a CPU, the TF32 rung is the same step timed
  against itself, `same_step_noise`), a factor within twice that noise is timed again in a second window of pairs,
  and stands only if both windows agree (`second_window`);
- a memory technique (set_to_none, checkpointing, the chunked loss) where it made the peak smaller; what it cost in
  time is reported (the climb's loop becomes the leanest one; the optimised loop leaves out what cost time);
- SDPA, which aims at both, where it helped one without hurting the other.

A rung that did not help stays in the table, not kept, with its measured factor and the device's reason (bf16 on a
CPU without bf16 instructions), and the next rung climbs from the best loop so far. A speed rung not kept for a reason
other than missing hardware gets a second look at the end, on top of the loop the climb reached (its row named
"<rung>, again"): what came after it can change its verdict. A speed rung far slower than the
best loop in each of its first timed steps is stopped there: its verdict is already clear. On a GPU, where a profile
of the climb's compiled loop shows the device idle long enough (it waits on the CPU's launches), one more rung tries
CUDA graphs (compile's reduce-overhead mode: `tries_cuda_graphs`).

Two rows end the table, each timed once more against naive fp32 in pairs (`final_rows`):
- `= optimised here`, the fastest loop that fits: the climb's loop without the memory techniques that cost measurable
  time at their rung, unless the loop does not fit without them (one is put back, in ladder order, until it fits);
- `= leanest here`, the loop with the least memory: the climb's loop, every memory technique that made it leaner kept,
  with what that costs in time against the optimised loop.
`fixed=True` climbs the fixed ladder instead: every rung the device can run is kept, whatever it measured, for
comparison (both final rows are then that loop).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from . import config as C, cpu_allocator, profiling, techniques as T
from .capabilities import Capabilities, capabilities, efficiency, measured_tflops
from .memory_estimate import check_cpu_memory
from .results import RunResult, efficiency_text, fmt, provenance, text_table
from .train import StopRun, Trainer, catching_oom, free_memory, unless_it_fails

MIN_SPEED_CHANGE = 0.03  # a speed change below 3% is reported as none: it is within what repeated runs differ by
MIN_MEMORY_CHANGE = 0.01  # the same for the peak (the CPU ledger is exact; CUDA's allocator rounds blocks)
MIN_PAIRS = 3  # fewer paired steps cannot tell a change from noise
GIVE_UP_SLOWER = 1.5  # a speed rung this much slower in each of its first GIVE_UP_AFTER paired steps is stopped there
GIVE_UP_AFTER = MIN_PAIRS  # enough pairs for a verdict
OPTIMISED = "= optimised here"  # the fastest loop that fits, on this device
LEANEST = "= leanest here"  # the loop with the least memory, on this device (the last row)
FINAL_ROWS = (OPTIMISED, LEANEST)

# how a row's speed-up over naive fp32 (its ladder["speedup"]) was found: naive itself, the product of the paired
# factors of the rungs up to it, or its own steps timed in pairs with naive's
BASELINE, PRODUCT, PAIRED = "baseline", "product of paired factors", "paired with naive"
FASTER, SLOWER, NO_CHANGE, TOO_FEW = "faster", "slower", "no measurable change", "too few timed steps to tell"
LEANER, FATTER, NOT_MEASURED = "leaner", "more memory", "not measured"


# ---- the decision, from measurements alone (unit-tested with made-up timings) ------------------------------------


@dataclass(frozen=True)
class SpeedChange:
    """A rung against the best loop so far, from paired step times (best_s, rung_s): factor > 1 is faster."""

    factor: float | None  # median of best_s / rung_s
    low: float | None  # the interquartile range of those ratios
    high: float | None
    pairs: int
    verdict: str  # FASTER, SLOWER, NO_CHANGE or TOO_FEW

    def text(self) -> str:
        if self.factor is None:
            return f"{self.verdict} ({self.pairs} paired)"
        return f"{self.factor:.2f}x ({self.low:.2f}-{self.high:.2f}, {self.pairs} paired steps)"


def speed_change(pairs: list[tuple[float, float]]) -> SpeedChange:
    """Faster when three quarters of the pairs say so and the median by at least MIN_SPEED_CHANGE; slower the same way
    round; otherwise no measurable change. One slow step (a page fault, another process) moves neither."""
    ratios = [best / rung for best, rung in pairs if best > 0 and rung > 0]
    if not ratios:
        return SpeedChange(None, None, None, 0, TOO_FEW)
    factor = statistics.median(ratios)
    low, high = (
        (statistics.quantiles(ratios, n=4, method="inclusive")[i] for i in (0, 2))
        if len(ratios) > 1
        else (factor, factor)
    )
    if len(ratios) < MIN_PAIRS:
        verdict = TOO_FEW
    elif low > 1 and factor >= 1 + MIN_SPEED_CHANGE:
        verdict = FASTER
    elif high < 1 and factor <= 1 - MIN_SPEED_CHANGE:
        verdict = SLOWER
    else:
        verdict = NO_CHANGE
    return SpeedChange(factor, low, high, len(ratios), verdict)


def same_step_noise(results: list[RunResult]) -> float | None:
    """How far apart this machine timed one step against itself, as a factor >= 1, from the rungs that run the same
    computation as the loop before them (TF32 on a CPU): the larger of their median's distance from 1 and half their
    interquartile range (1.19 for 1.19x (1.09-1.22); 1.05 for 0.95x (0.94-1.04)), and at least 1 + MIN_SPEED_CHANGE.
    None where no such rung ran: nothing here measured the noise."""
    spreads = [
        max(abs(math.log(lad["same_step_factor"])), math.log(lad["factor_iqr"][1] / lad["factor_iqr"][0]) / 2)
        for lad in (r.ladder or {} for r in results)
        if lad.get("same_step_factor")
    ]
    return max(math.exp(max(spreads)), 1 + MIN_SPEED_CHANGE) if spreads else None


NOISE_MULTIPLE = 2  # one window of the same step against itself says only roughly how wide the noise is: twice it


def within_noise(speed: SpeedChange, noise: float | None) -> bool:
    """Whether a verdict of faster or slower rests on a factor within NOISE_MULTIPLE times (on a log scale) what the
    same step measured against itself on this machine (`same_step_noise`): one window of pairs cannot tell it from
    noise."""
    if noise is None or speed.verdict not in (FASTER, SLOWER):
        return False
    return abs(math.log(speed.factor)) <= NOISE_MULTIPLE * math.log(noise)


def second_window(first: SpeedChange, pairs: list[tuple[float, float]], more: list[tuple[float, float]]) -> SpeedChange:
    """The verdict from two windows of pairs, `pairs` then `more`: it stands where the second window alone and both
    together say the same (faster, or slower), else no measurable change; the factor and spread are of both windows."""
    pooled, second = speed_change(pairs + more), speed_change(more)
    agree = first.verdict == second.verdict == pooled.verdict
    return dataclasses.replace(pooled, verdict=first.verdict if agree else NO_CHANGE)


def memory_change(factor: float | None) -> tuple[float | None, str]:
    """(the rung's peak over the best loop's, RunResult.peak_ratio; LEANER / FATTER / NO_CHANGE / NOT_MEASURED, the
    last where either peak is unmeasured or they are of two kinds)."""
    if not factor:
        return None, NOT_MEASURED
    return (
        factor,
        LEANER if factor <= 1 - MIN_MEMORY_CHANGE else FATTER if factor >= 1 + MIN_MEMORY_CHANGE else NO_CHANGE,
    )


def judge(
    aims: tuple[str, ...],
    speed: SpeedChange,
    memory: tuple[float | None, str],
    device_note: str = "",
    fixed: bool = False,
) -> tuple[bool, str]:
    """(kept, why) for a rung that aims at `aims` (techniques.SPEED or MEMORY), measured as `speed` and `memory`
    against the best loop so far. `device_note` is what the device says of the technique (no bf16 instructions),
    added where it was not kept. `fixed`: kept whatever it measured (the fixed ladder). A memory technique is kept
    where it made the peak smaller, whatever it cost in time: the optimised loop leaves out those that cost time
    (final_rows)."""
    mem_factor, mem_verdict = memory
    if speed.verdict in (FASTER, SLOWER):  # (a factor exists only where there were pairs)
        speed_text = f"{speed.factor:.2f}x faster" if speed.verdict == FASTER else f"{1 / speed.factor:.2f}x slower"
    else:
        speed_text = "no measurable change in speed" if speed.verdict == NO_CHANGE else TOO_FEW
    mem_text = (
        f"{mem_factor:.2f}x the memory"
        if mem_verdict in (LEANER, FATTER)
        else "no measurable change in memory"
        if mem_verdict == NO_CHANGE
        else "memory not measured"
    )
    helped = (T.SPEED in aims and speed.verdict == FASTER) or (T.MEMORY in aims and mem_verdict == LEANER)
    hurt = (T.SPEED in aims and speed.verdict == SLOWER) or (T.MEMORY in aims and mem_verdict == FATTER)
    # a memory technique trades time for memory by design: it is kept for memory
    if T.MEMORY in aims and T.SPEED not in aims:
        kept, what = mem_verdict == LEANER, f"{mem_text}, {speed_text}"
    else:
        kept, what = helped and not hurt, f"{speed_text}, {mem_text}" if T.MEMORY in aims else speed_text
    if fixed:
        return True, f"kept (fixed ladder): {what}"
    if kept:
        return True, f"kept: {what}"
    return False, f"not kept: {what}" + (f"; {device_note}" if device_note else "")


def _precision_support(cfg: C.TrainConfig, rung: T.Rung, caps: Capabilities):
    """What the device says of the precision a precision rung sets (capabilities.Support), or None for other rungs."""
    return caps.supports(cfg.precision) if rung.technique is not None and rung.technique.name == "precision" else None


def device_note(cfg: C.TrainConfig, rung: T.Rung, caps: Capabilities) -> str:
    """What the device says of a rung's technique when it has no hardware for it (bf16 converted in software, TF32 on a
    CPU), or "". ("<precision> here:" is what reference.other_cpu_lines rewords as "there" for another CPU's climb.)"""
    support = _precision_support(cfg, rung, caps)
    return f"{cfg.precision} here: {support.note}" if support is not None and support.native is False else ""


def _no_effect(cfg: C.TrainConfig, rung: T.Rung, caps: Capabilities) -> bool:
    """Whether the device runs a rung's technique as the same computation as without it (TF32 on a CPU)."""
    support = _precision_support(cfg, rung, caps)
    return support is not None and support.no_effect


# ---- the climb ---------------------------------------------------------------------------------------------------


@dataclass
class _Loop:
    """A loop that has run: its trainer (kept to take more steps), result, and speed-up over naive fp32."""

    trainer: Trainer
    result: RunResult
    # over naive fp32: the product of the paired factors of the rungs kept on the way up (1 for naive)
    speedup: float | None

    @property
    def cfg(self) -> C.TrainConfig:
        return self.trainer.cfg


def ladder_configs(
    base: C.TrainConfig,
    options: dict[str, object] | None = None,
    leave_out: dict[str, str] | None = None,
    on_this_machine: bool = True,
) -> list[tuple[T.Rung, C.TrainConfig | C.ConfigError]]:
    """The fixed ladder: each rung's config, cumulative from the naive baseline, every rung the device can run switched
    on (run_ladder climbs it keeping only what helps). A rung the device cannot run gives its ConfigError,
    and so does a rung left out by choice (`leave_out` {rung name: why}); the climb goes on from the rung below it.
    `options` {technique: value} makes that technique's rung set another value
    (activation_checkpointing="selective"). `on_this_machine=False`: for a device this machine does not have (a GPU
    script written on a laptop), every rung is applied unchecked: the script will run elsewhere."""
    T.check_ladder_arguments(options, leave_out)
    caps, leave_out = capabilities(base.device) if on_this_machine else None, leave_out or {}
    out, cfg = [], T.naive(base)
    for rung in T.LADDER:
        if rung.name in leave_out:
            out.append((rung, C.ConfigError(leave_out[rung.name])))
            continue
        up = T.rung_up(cfg, rung, caps, options)
        out.append((rung, up))
        # a rung the device cannot run is skipped: the climb goes on from the one below
        if isinstance(up, C.TrainConfig):
            cfg = up
    return out


def rung_config(base: C.TrainConfig, rung: str, options: dict | None = None) -> C.TrainConfig:
    """The ladder's cumulative config at the rung named: ladder_configs, what `ladder` runs there (a rung this
    device cannot run is skipped). For a device this machine does not have (a GPU config written on a laptop), every
    rung up to the one named is applied: the script will run elsewhere, and nothing here can say what to skip."""
    T.check_rung_name(rung)
    try:
        capabilities(base.device)
        here = True
    except C.ConfigError:  # not on this machine
        here = False
    cfg = dict((r.name, c) for r, c in ladder_configs(base, options, on_this_machine=here))[rung]
    if isinstance(cfg, C.ConfigError):
        raise C.ConfigError(f"the rung {rung!r} cannot run on this device: {cfg}")
    return cfg


def check_options(base: C.TrainConfig, options: dict[str, object] | None) -> None:
    """A value a technique's field rejects (`--rung-value loss_chunks=0`) is a ConfigError now, not a skipped rung
    minutes later."""
    for name, value in (options or {}).items():
        T.TECHNIQUE[name].set(T.naive(base), value)


def check_climb_options(base: C.TrainConfig, options: dict[str, object] | None) -> None:
    """check_options' ConfigError for a value refused, and then, for a climb, one for an option that makes its rung
    change nothing (compile=False would measure naive against itself; a config at --rung may turn a technique off that
    way, a climb may not)."""
    check_options(base, options)  # every value first, so the error does not depend on the options' order
    naive = T.naive(base)
    for name, value in (options or {}).items():
        if T.TECHNIQUE[name].set(naive, value) == naive:
            rung = T.option_rung(name)
            raise C.ConfigError(
                f"--rung-value {name}={value!r} is what naive fp32 already runs: the rung would change nothing; leave "
                f"it out with --leave-out {T.LADDER.index(rung)} ({rung.name}) instead"
            )


def left_out(rungs: list[str] | None, leave_out: dict[str, str] | None) -> dict[str, str]:
    """{rung: why} of the rungs a climb leaves out: those of `leave_out`, and where `rungs` names the rungs to measure,
    every other one."""
    out = dict(leave_out or {})
    for rung in T.LADDER[1:] if rungs is not None else []:
        if rung.name not in rungs:
            out.setdefault(rung.name, "left out: not among the rungs asked for")
    return out


def prepare_climb(
    base: C.TrainConfig,
    rungs: list[str] | None = None,
    leave_out: dict[str, str] | None = None,
    options: dict[str, object] | None = None,
) -> tuple[C.TrainConfig, dict[str, str], str]:
    """What a climb checks before its first rung, a ConfigError that says what to change (run_ladder asks it; the
    command line asks first, to refuse before its banner), and what it climbs with: (base with enough steps to judge a
    rung, every rung left out {name: why}, how the steps were raised or "")."""
    for name in rungs or []:
        T.check_rung_name(name)
    leave_out = left_out(rungs, leave_out)
    T.check_ladder_arguments(options, leave_out)
    check_climb_options(base, options)
    base, raised = enough_steps(base)
    return base, leave_out, raised


def run_ladder(
    base: C.TrainConfig,
    steps: int | None = None,
    progress: Callable[[str], None] | None = None,
    rungs: list[str] | None = None,
    leave_out: dict[str, str] | None = None,
    options: dict[str, object] | None = None,
    fixed: bool = False,
    on_result: Callable[[list[RunResult]], None] | None = None,
) -> list[RunResult]:
    """Climb techniques.LADDER from naive fp32 (the module docstring says how), one result per rung in order, then the
    two final rows, OPTIMISED (the fastest loop that fits) and LEANEST (the least memory). Each row's `ladder` dict
    holds its verdict.

    A rung the device cannot run, or one left out by choice (`leave_out` {rung name: why}: a test budget, a technique
    you want to see the ladder without; `rungs`: measure only these names, the others are left out) is 'skipped' with
    the reason; an out-of-memory rung is 'oom', any other failure 'error'; the climb goes on either way. `options`
    {technique: value} changes what a technique's rung sets (activation_checkpointing="selective"). `progress(text)`
    hears "rung i of N" with the time left, and draws each rung's steps on stderr; `on_result(results so far)` is called
    after every rung (the command line saves them there, so an interrupted climb keeps what it measured)."""
    if steps is not None:
        base = dataclasses.replace(base, steps=steps)
    base, leave_out, raised = prepare_climb(base, rungs, leave_out, options)
    if raised and progress:
        progress(f"steps per rung {raised}")
    if (note := cpu_allocator.not_glibcs_own_rule(base.device, keep=False)) and progress:
        progress(f"note: {note}")  # each result's details["allocator"] holds it too
    caps = capabilities(base.device)
    refresh_peaks(caps)
    prov = provenance(caps.name)
    results: list[RunResult] = []
    naive_loop = best = None
    # "rung i of n" counts the rungs not left out by choice (one the device refuses is counted, and passes at once),
    # the second looks and the final rows (one count)
    started, n, done = time.perf_counter(), sum(r.name not in leave_out for r in T.LADDER) + 1, 0

    def climb_one(label: str, rung: T.Rung, why_not: str | None = None) -> None:
        """One rung, or a second look, on top of the best loop so far: its row, measured and judged, or why not."""
        nonlocal best
        cfg = T.rung_up(best.cfg, rung, caps, options)
        if why_not or isinstance(cfg, C.ConfigError):
            why = why_not or str(cfg)
            results.append(_not_run(label, why, prov, {"kept": False, "why": f"not run: {why}"}))
        else:
            noise = same_step_noise(results)
            result, best = _climb(cfg, label, rung, best, naive_loop, caps, fixed, progress, noise)
            results.append(result)

    for i, rung in enumerate(T.LADDER):
        if progress and rung.name not in leave_out:
            progress(_progress_text(done, n, rung.name, started))
            done += 1
        if best is not None:
            climb_one(rung.name, rung, leave_out.get(rung.name))
        else:  # naive fp32, the baseline (check_ladder_arguments refuses to leave it out)
            result, trainer, _ = _measure(T.naive(base), rung.name, None, progress, give_up=False)
            result.reason = result.reason or rung.what_changed
            result.ladder = {
                "kept": result.ok,
                "why": "the baseline" if result.ok else f"the baseline failed: {result.reason}",
                "speedup": 1.0 if result.ok else None,
                "speedup_basis": BASELINE,
                "memory_vs_naive": 1.0 if result.ok else None,
            }
            results.append(result)
            if not result.ok:  # nothing to climb from
                why = "no baseline to climb from: naive fp32 did not finish"
                results += [_not_run(later.name, why, prov, {"kept": False}) for later in T.LADDER[i + 1 :]]
                if on_result:  # the file says this climb failed, not what an earlier one found
                    on_result(results)
                break
            naive_loop = best = _Loop(trainer, result, 1.0)
        if on_result:
            on_result(results)
    if best is not None and not fixed:
        # A second look: a speed rung not kept on the way up is tried once more on top of the loop the climb ended
        # with, since what came after it can change its verdict: bf16 autocast can lose to fp32 while attention is still
        # naive, and SDPA comes after it.
        again = second_look(results)
        n += len(again)
        for rung in again:
            if progress:
                progress(_progress_text(done, n, again_label(rung.name), started))
                done += 1
            climb_one(again_label(rung.name), rung)
            if on_result:
                on_result(results)
    if best is not None and not fixed:
        # On a GPU that waits for the CPU's launches (a model too small for it), a step recorded once as a CUDA graph
        # and replayed may help: tried where the profile of the climb's loop shows the device idle long enough.
        try_it, why = tries_cuda_graphs(best.cfg, *_idle_share_of(best.cfg, caps))
        if progress and caps.type == "cuda":
            progress(f"{CUDA_GRAPHS}: {why}")
        if try_it:
            n += 1
            if progress:
                progress(_progress_text(done, n, CUDA_GRAPHS, started))
                done += 1
            noise = same_step_noise(results)
            cfg = dataclasses.replace(best.cfg, compile_mode="reduce-overhead")
            result, best = _climb(cfg, CUDA_GRAPHS, CUDA_GRAPHS_RUNG, best, naive_loop, caps, fixed, progress, noise)
            result.details["device_idle_share"] = why
            results.append(result)
            if on_result:
                on_result(results)
    if best is not None:
        if progress:
            progress(_progress_text(done, n, f"{OPTIMISED} and {LEANEST}", started))
        results += final_rows(naive_loop, best, results, caps, fixed, progress)
        if on_result:
            on_result(results)
    return results


CUDA_GRAPHS = "+ CUDA graphs"  # a rung of its own, after the climb: only where the device waits on launches
CUDA_GRAPHS_RUNG = T.Rung(
    CUDA_GRAPHS,
    "compile's reduce-overhead mode: the compiled step recorded once as a CUDA graph and replayed, one launch for many",
    T.TECHNIQUE["compile"],
    True,
)


def tries_cuda_graphs(cfg: C.TrainConfig, idle: float | None, measured: str = "") -> tuple[bool, str]:
    """(whether the ladder tries CUDA graphs on top of `cfg`, why), from the share of its step the device sat idle
    (profiling.device_idle_share): only a compiled loop in compile's default mode on a GPU, and only where it waits
    on launches (profiling.launch_bound). `measured`: why the share is missing, where it is. A pure function."""
    if torch.device(cfg.device).type != "cuda":
        return False, "a CPU has no kernel launches to save"
    if not cfg.compile or cfg.compile_mode != "default":
        return False, "not tried: the loop is not compiled in compile's default mode"
    if idle is None:
        return False, f"not tried: the device's idle share was not measured ({measured or 'no profile'})"
    share = f"the GPU sat idle {idle:.0%} of the optimised loop's step"
    if profiling.launch_bound(idle):
        return True, f"{share}, waiting on launches (at least {profiling.LAUNCH_BOUND_IDLE:.0%}): tried"
    return False, f"not tried: {share}, under the {profiling.LAUNCH_BOUND_IDLE:.0%} that says it waits on launches"


def _idle_share_of(cfg: C.TrainConfig, caps: Capabilities) -> tuple[float | None, str]:
    """(the share of a step of `cfg` the GPU sat idle, from a short profile; "" or why it is missing). Not profiled
    where tries_cuda_graphs would say no anyway (a CPU, a loop not compiled)."""
    if caps.type != "cuda" or not cfg.compile or cfg.compile_mode != "default":
        return None, ""
    profiled, failed = unless_it_fails(lambda: profiling.profile_run(cfg, active=2, name_kernels=False))
    if failed:
        return None, failed
    idle = profiling.device_idle_share(profiled)
    del profiled  # its run's model and optimizer go before the rung builds its own
    free_memory()
    return idle, ""


def refresh_peaks(caps: Capabilities) -> None:
    """Every rung's efficiency is over this machine's measured matmul peak, which is cached. A peak first measured while
    the machine was busy would make them all too high, so a climb measures it again first (a second or two), in fp32,
    TF32 where it is a mode of its own (a GPU's) and the device's fast 16-bit format; the cache keeps the higher.
    Nothing where a data sheet gives the peak."""
    if caps.datasheet is not None:
        return
    tf32 = "tf32" if caps.type == "cuda" and caps.supports("tf32").ok else None
    for precision in ("fp32", tf32, caps.fast_16bit()[0]):
        if precision:
            measured_tflops(caps.device, precision, refresh=True)


def _climb(
    cfg: C.TrainConfig,
    label: str,
    rung: T.Rung,
    best: _Loop,
    naive_loop: _Loop,
    caps: Capabilities,
    fixed: bool,
    progress,
    noise: float | None = None,
) -> tuple[RunResult, _Loop]:
    """One rung on top of `best`: measured in pairs with it and judged. (Its result, the best loop after it.) The loop
    that loses goes: a rung not kept drops its model and optimizer here, before the next rung builds its own."""
    result, trainer, pairs = _measure(cfg, label, best, progress, give_up=not fixed and rung.aims == (T.SPEED,))
    result.reason = result.reason or rung.what_changed
    loop = _judged(result, trainer, pairs, rung, best, naive_loop, caps, fixed, noise, progress)
    if loop is None:
        return result, best
    if best is not naive_loop:
        best.trainer = None  # the superseded loop's model and optimizer can go
    return result, loop


AGAIN = ", again"  # a second look's label: the rung's name and this


def again_label(name: str) -> str:
    return name + AGAIN


def rung_name(result: RunResult) -> str:
    """The rung a climb's result measured: its label, less AGAIN for a second look (the label is all a saved
    climb's JSON records of it)."""
    return result.label.removesuffix(AGAIN)


def second_look(results: list[RunResult]) -> list[T.Rung]:
    """The speed rungs of a climb worth a second look on top of its last loop: run, not kept, and neither for want of
    hardware (bf16 converted in software stays slow whatever comes after it) nor before a climb that kept nothing
    after them (the loop they would meet again is the one they lost to)."""
    out = []
    for i, r in enumerate(results):
        rung = T.RUNGS.get(r.label)
        if rung is None or T.SPEED not in rung.aims or not r.ok or r.ladder.get("kept", True):
            continue
        if r.ladder.get("device_note") or not any(later.ladder.get("kept") for later in results[i + 1 :]):
            continue
        out.append(rung)
    return out


def _not_run(label: str, why: str, prov: dict, ladder: dict) -> RunResult:
    """The row of a rung the climb did not run, saying why."""
    return RunResult(label=label, status="skipped", config={}, provenance=prov, reason=why, ladder=ladder)


def enough_steps(cfg: C.TrainConfig) -> tuple[C.TrainConfig, str]:
    """`cfg` with at least steps_to_judge steps (a verdict needs MIN_PAIRS timed steps), and what was raised ("" when
    nothing was)."""
    if cfg.steps >= (needed := steps_to_judge(cfg)):
        return cfg, ""
    return dataclasses.replace(cfg, steps=needed), (
        f"raised from {cfg.steps} to {needed}: a rung needs {MIN_PAIRS} timed steps to be judged"
    )


def steps_to_judge(cfg: C.TrainConfig) -> int:
    """The fewest steps per rung that leave MIN_PAIRS timed steps: the warm-up, and the memory ledger's on a CPU."""
    return cfg.fewest_steps(timed=MIN_PAIRS)


def _progress_text(i: int, n: int, name: str, started: float) -> str:
    elapsed = time.perf_counter() - started
    left = f", about {_minutes(elapsed / i * (n - i))} left" if i else ""
    return f"rung {i + 1} of {n}: {name} ({_minutes(elapsed)} so far{left})"


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def _measure(
    cfg: C.TrainConfig, label: str, best: _Loop | None, progress, give_up: bool
) -> tuple[RunResult, Trainer | None, list[tuple[float, float]]]:
    """One run of `cfg`, each of its timed steps followed by a step of `best`'s loop: (result, its trainer, the pairs
    (best_s, rung_s)). With `give_up`, a rung slower than GIVE_UP_SLOWER in each of its first GIVE_UP_AFTER pairs is
    stopped there."""
    pairs: list[tuple[float, float]] = []
    made: dict[str, Trainer] = {}
    printer = _step_printer(label, cfg.steps) if progress else None

    def after_step(step: int, result: RunResult) -> None:
        if printer:
            printer(step, result)
        if best is None or not made["trainer"].is_timed(step):
            return
        try:
            if not pairs and not made.get("rewarmed"):
                # untimed: building this rung reset the compiler, so a compiled best loop compiles again
                best.trainer.step()
                made["rewarmed"] = True
            pairs.append((best.trainer.step(), result.step_times[-1]))
        except Exception as e:  # noqa: BLE001 - the best loop's failure is not this rung's: stop pairing, say whose it was
            made["best_failed"] = (
                f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
            )
            raise StopRun(f"the best loop so far failed while paired with this rung ({made['best_failed']})") from None
        if give_up and len(pairs) >= GIVE_UP_AFTER and all(rung > GIVE_UP_SLOWER * b for b, rung in pairs):
            raise StopRun(
                f"stopped after {len(pairs)} timed steps, "
                f"each over {GIVE_UP_SLOWER:g}x slower than the best loop so far"
            )

    def attempt() -> RunResult:
        check_cpu_memory(cfg)  # a CPU step past the free memory: an "oom" row, not a killed process
        made["trainer"] = Trainer(cfg)
        return made["trainer"].fit(label, after_step)

    try:
        result = catching_oom(attempt, cfg, label)
    except Exception as e:  # noqa: BLE001 - a rung that fails is a row that says why; the climb goes on
        made.clear()
        free_memory()
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        result = RunResult.failed(cfg, label, "error", f"{type(e).__name__}: {first}")
    if printer and len(result.step_times) < cfg.steps:  # stopped early: end the step bar's line
        sys.stderr.write("\n")
    if not result.ok:
        made.clear()
        free_memory()
    # (an OOM in the middle of its step can leave its optimizer or scaler half-way): a fresh one
    if "best_failed" in made:
        cfg_best, best.trainer = best.cfg, None
        free_memory()
        best.trainer = Trainer(cfg_best)
    return result, made.get("trainer"), pairs


def _judged(
    result: RunResult,
    trainer: Trainer | None,
    pairs,
    rung: T.Rung,
    best: _Loop,
    naive_loop: _Loop,
    caps: Capabilities,
    fixed: bool,
    noise: float | None = None,
    progress=None,
) -> _Loop | None:
    """Fill in `result.ladder` (the verdict against `best`); the rung's loop when it is kept, else None. `noise`: how
    far apart this machine timed a step and itself (same_step_noise): a speed verdict within it (within_noise) is timed
    again in a second window of pairs, and stands only if both windows agree."""
    if not result.ok:
        result.ladder = {"kept": False, "why": f"not kept: {result.status} ({result.reason})", "vs": best.result.label}
        return None
    speed = speed_change(pairs)
    more: list[tuple[float, float]] = []
    window = ""
    if T.SPEED in rung.aims and not fixed and not _no_effect(trainer.cfg, rung, caps) and within_noise(speed, noise):
        first = speed
        if progress:
            progress(
                f"  {first.factor:.2f}x is within this machine's noise (a step measured {noise:.2f}x apart from "
                f"itself): {len(pairs)} more paired steps"
            )
        more, failed = _paired(best.trainer, trainer, len(pairs))
        if failed:  # one window cannot tell it from noise, and the second could not be taken
            speed = dataclasses.replace(first, verdict=NO_CHANGE)
            window = f"{first.factor:.2f}x, not confirmed: {failed} in a second window of paired steps"
        else:
            speed = second_window(first, pairs, more)
            window = (
                f"{first.factor:.2f}x, then {speed_change(more).factor:.2f}x in a second window of paired steps: "
                + ("they agree" if speed.verdict == first.verdict else "they disagree")
            )
        window += f"; this machine measured a step up to {noise:.2f}x apart from itself"
    memory = memory_change(result.peak_ratio(best.result))
    note = device_note(trainer.cfg, rung, caps)
    speedup = best.speedup * speed.factor if best.speedup and speed.factor else None
    kept, why = judge(rung.aims, speed, memory, note, fixed)
    if window:
        why += f" ({window})"
    same_step = _no_effect(trainer.cfg, rung, caps) and speed.factor
    if same_step:
        # the same computation timed against itself: whatever the pairs say is this machine's noise, not the technique,
        # and the loop's speed-up over naive stays what it was
        kept, speed, speedup = fixed, dataclasses.replace(speed, verdict=NO_CHANGE), best.speedup
        why = (
            f"{'kept (fixed ladder)' if fixed else 'not kept'}: {note}; the same step measured {speed.factor:.2f}x "
            f"({speed.low:.2f}-{speed.high:.2f}) against itself: the noise of this machine"
        )
    if result.stopped_early:
        why += f" ({result.stopped_early})"
    result.ladder = {
        "kept": kept,
        "why": why,
        "vs": best.result.label,
        "aims": list(rung.aims),
        "speed": speed.verdict,
        "factor": speed.factor,
        "factor_iqr": [speed.low, speed.high],
        "pairs": [list(p) for p in pairs],
        "memory": memory[1],
        "memory_factor": memory[0],
        "speedup": speedup,
        "speedup_basis": PRODUCT,
        "memory_vs_naive": result.peak_ratio(naive_loop.result),
        "device_note": note,
        "pairs_again": [list(p) for p in more],  # a second window of (best_s, rung_s), where the first was within noise
        # the factor between a step and itself (a rung with no effect here), from which later rungs read the noise
        "same_step_factor": speed.factor if same_step else None,
    }
    return _Loop(trainer, result, speedup) if kept else None


def _paired(first: Trainer, second: Trainer, n: int) -> tuple[list[tuple[float, float]], str]:
    """(n steps of two loops in alternation, (first_s, second_s) each, ""), or ([], the error's name) where a step
    fails (out of memory with several loops' state held), the memory freed. A loop whose step failed half-way is kept:
    the ladder only times it from then on, and a failure that recurs is caught where it pairs again (_measure)."""
    # any failure of a timing step is caught: the caller says what it means for the verdict
    pairs, failed = unless_it_fails(
        lambda: [(first.step(), second.step()) for _ in range(n)], lambda e: type(e).__name__
    )
    return pairs or [], failed or ""


def memory_rungs_that_cost_time(results: list[RunResult]) -> list[RunResult]:
    """The kept rungs whose only aim is memory and whose step was not as fast as the loop before it (slower, or too few
    pairs to say): the optimised loop leaves these out where it fits without them. A pure function of the rows."""
    return [
        r
        for r in results
        if r.ladder.get("kept")
        and r.ladder.get("aims") == [T.MEMORY]
        and r.ladder.get("speed") not in (NO_CHANGE, FASTER)
    ]


def without_rungs(cfg: C.TrainConfig, rows: list[RunResult]) -> C.TrainConfig:
    """`cfg` with the technique of each row's rung switched off (back to naive's value)."""
    for r in rows:
        t = T.RUNGS[rung_name(r)].technique
        cfg = t.set(cfg, t.off)
    return cfg


def optimised_candidates(
    leanest_cfg: C.TrainConfig, costly: list[RunResult]
) -> list[tuple[C.TrainConfig, list[RunResult]]]:
    """The loops the optimised one is tried as, fastest first: the leanest loop without every costly memory rung, then
    with the first of them put back (ladder order), and so on to the leanest loop itself; each with the rungs put
    back (those the loop does not fit without, when it is the one that runs)."""
    return [(without_rungs(leanest_cfg, costly[k:]), costly[:k]) for k in range(len(costly) + 1)]


def _slower_text(r: RunResult) -> str:
    f = r.ladder.get("factor")
    return f"{1 / f:.2f}x slower at its rung" if f and r.ladder.get("speed") == SLOWER else r.ladder.get("speed", "")


def final_rows(
    naive_loop: _Loop, best: _Loop, results: list[RunResult], caps: Capabilities, fixed: bool = False, progress=None
) -> list[RunResult]:
    """[OPTIMISED, LEANEST]. The climb's loop (`best`) is the leanest: it is timed in pairs against naive fp32. The
    optimised loop is that loop without the memory techniques that cost time (memory_rungs_that_cost_time), run and
    timed in pairs against naive fp32 on its own (the leanest loop's model and optimizer freed first); where it runs out
    of memory, those techniques are put back one at a time (optimised_candidates). Where none cost time (or on the
    fixed ladder) the two are one loop, and both rows say so."""
    kept = [r.label for r in results[1:] if r.ladder.get("kept")]
    lean = _confirm(naive_loop, best, LEANEST, kept, caps, any(r.status != "skipped" for r in results[1:]))
    costly = [] if fixed else memory_rungs_that_cost_time(results)
    free = [r.label for r in results if r.ladder.get("kept") and r.ladder.get("aims") == [T.MEMORY] and r not in costly]
    free_text = "; ".join(f"{label.removeprefix('+ ')} kept: no measurable cost in time" for label in free)
    opt, leanest_cfg, failed = None, best.cfg, ""
    for cfg, put_back in optimised_candidates(leanest_cfg, costly) if costly else []:
        if cfg == leanest_cfg:  # nothing fits without all of them: the leanest loop is also the fastest that fits
            break
        left = [r for r in costly if r not in put_back]
        if progress:
            progress(f"{OPTIMISED}: the loop without {', '.join(rung_name(r) for r in left)}")
        if best.trainer is not None and best is not naive_loop:
            best.trainer = None  # the leanest loop is timed: its model and optimizer make room for this one
            free_memory()
        result, trainer, pairs = _measure(cfg, OPTIMISED, naive_loop, progress, give_up=False)
        if result.status == "oom":
            continue
        if not result.ok:  # another failure: the leanest loop stands in, and its row says why
            failed = f"the loop without them failed ({result.status}: {result.reason})"
            break
        opt, speed = result, speed_change(pairs)
        opt.reason = "naive fp32 " + " ".join(k for k in kept if k not in {r.label for r in left})
        notes = [f"{rung_name(r).removeprefix('+ ')} left out: {_slower_text(r)}" for r in left]
        notes += [f"{rung_name(r).removeprefix('+ ')} kept: the loop does not fit without it" for r in put_back]
        opt.ladder = _timed_against_naive(
            speed,
            pairs,
            naive_loop.result,
            [k for k in kept if k not in {r.label for r in left}],
            result.peak_ratio(naive_loop.result),
            left_out={r.label: _slower_text(r) for r in left},
            put_back=[r.label for r in put_back],
        )
        opt.ladder["why"] += "; " + "; ".join(notes + ([free_text] if free_text else []))
        del trainer
        break
    if opt is None:  # the leanest loop is the optimised one
        opt = dataclasses.replace(lean, label=OPTIMISED, ladder=dict(lean.ladder), details=dict(lean.details))
        if failed:
            why = failed
        elif costly:
            why = "the loop does not fit without " + ", ".join(rung_name(r).removeprefix("+ ") for r in costly)
        elif fixed:
            why = "the fixed ladder keeps every rung"
        else:
            why = "every memory technique kept costs no measurable time" if free else "no memory technique was kept"
        opt.ladder["why"] += f"; the same loop as {LEANEST}: {why}"
        lean.ladder["why"] += f"; the same loop as {OPTIMISED}"
        lean.ladder["vs_optimised"] = 1.0
        return [opt, lean]
    if opt.ok and lean.ladder.get("speedup") and opt.ladder.get("speedup"):
        cost = opt.ladder["speedup"] / lean.ladder["speedup"]
        lean.ladder["vs_optimised"] = 1 / cost
        lean.ladder["why"] += (
            f"; {cost:.2f}x slower than {OPTIMISED} (the ratio of their factors over naive)"
            if cost >= 1
            else f"; {1 / cost:.2f}x faster than {OPTIMISED} (the ratio of their factors over naive): timing noise"
        )
    return [opt, lean]


def _confirm(
    naive_loop: _Loop, best: _Loop, label: str, kept: list[str], caps: Capabilities, measured: bool = True
) -> RunResult:
    """A final row: `best`'s loop, timed once more in pairs against naive fp32 (as many pairs as a rung has timed
    steps). Its memory is the one measured at the rung that made it the best (the same config)."""
    naive_r, top = naive_loop.result, best.result
    row = RunResult(
        label=label,
        status="ok",
        config=dict(top.config),
        provenance=provenance(caps.name),
        reason="naive fp32 " + " ".join(kept) if kept else "naive fp32: no rung helped here",
        tokens_per_step=top.tokens_per_step,
        n_params=top.n_params,
        flops_per_token=top.flops_per_token,
        memory=top.memory,
        details={"memory_measured_at": top.label},
    )
    if best is naive_loop:
        _timed_as(row, top)
        row.ladder = {
            "kept": True,
            "why": "nothing was kept: naive fp32 is the best of the loops measured here"
            if measured
            else "no rung was measured: the loop is naive fp32 by default",
            "speedup": 1.0,
            "speedup_basis": BASELINE,
            "memory_vs_naive": 1.0,
            "factor": 1.0,
            "kept_rungs": [],
        }
        return row
    n = max(MIN_PAIRS, len(top.step_times) - len(top.excluded_steps))
    # one untimed pair first: a compiled loop compiles again after a later rung reset the compiler
    pairs, failed = _paired(naive_loop.trainer, best.trainer, n + 1)
    pairs = pairs[1:]
    if failed:  # (out of memory with both loops held) the best rung's own run, and the product of the kept factors
        _timed_as(row, top)
        row.ladder = {
            "kept": True,
            "why": f"not timed against naive fp32 ({failed} when paired): {fmt(best.speedup, '.2f')}x, the product "
            "of the kept rungs' factors",
            "vs": naive_r.label,
            "speedup": best.speedup,
            "speedup_basis": PRODUCT,
            "kept_rungs": kept,
            "memory_vs_naive": top.peak_ratio(naive_r),
        }
        return row
    speed = speed_change(pairs)
    row.step_times = [b for _, b in pairs]
    row.median_step_s = statistics.median(row.step_times)
    row.tokens_per_s = top.tokens_per_step / row.median_step_s
    row.mfu, row.mfu_basis = efficiency(row.tokens_per_s, top.flops_per_token, best.cfg.device, best.cfg.precision)
    row.ladder = _timed_against_naive(speed, pairs, naive_r, kept, top.peak_ratio(naive_r))
    return row


def _timed_against_naive(
    speed: SpeedChange, pairs, naive_r: RunResult, kept: list[str], memory_vs_naive: float | None, **more
) -> dict:
    """A final row's `ladder` dict: its speed-up over naive fp32 from (naive_s, loop_s) pairs, and what it holds."""
    return {
        "kept": True,
        "why": f"{speed.text()} naive fp32, timed in pairs with it",
        "vs": naive_r.label,
        "speed": speed.verdict,
        "factor": speed.factor,
        "factor_iqr": [speed.low, speed.high],
        "pairs": [list(p) for p in pairs],
        "speedup": speed.factor,
        "speedup_basis": PAIRED,
        "kept_rungs": kept,
        "memory_vs_naive": memory_vs_naive,
        **more,
    }


def _timed_as(row: RunResult, source: RunResult) -> None:
    """The last row takes `source`'s own timed steps and what follows from them: where naive is the best loop, or the
    best loop could not be timed in pairs."""
    row.step_times, row.excluded_steps = list(source.step_times), list(source.excluded_steps)
    row.median_step_s, row.tokens_per_s, row.mfu, row.mfu_basis = (
        source.median_step_s,
        source.tokens_per_s,
        source.mfu,
        source.mfu_basis,
    )


def _step_printer(name: str, total: int):
    def callback(step: int, _r) -> None:
        done = step + 1
        bar = "#" * (20 * done // total)
        sys.stderr.write(f"\r  {name:<18} [{bar:<20}] {done}/{total}")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return callback


def everything_on(base: C.TrainConfig) -> C.TrainConfig:
    """The fixed ladder's top config as this device would run it, without climbing: every rung it can run, the 16-bit
    rung only where it has 16-bit hardware (fp32 stays where it has none), TF32 only where it does something (not on a
    CPU). A guess at the optimised loop, for a first look (notebook 01); run_ladder measures which rungs help here."""
    caps = capabilities(base.device)
    leave_out = {} if caps.fast_16bit()[0] else {T.AUTOCAST_RUNG: caps.fast_16bit()[1]}
    if caps.supports("tf32").no_effect:
        leave_out["+ tf32"] = caps.supports("tf32").note
    return [cfg for _, cfg in ladder_configs(base, leave_out=leave_out) if isinstance(cfg, C.TrainConfig)][-1]


# ---- reading a climb ---------------------------------------------------------------------------------------------


def optimised(results: list[RunResult]) -> RunResult | None:
    """The OPTIMISED row of a climb: the fastest loop that fits (None for a climb that did not get that far)."""
    return next((r for r in reversed(results) if r.label == OPTIMISED), None)


def leanest(results: list[RunResult]) -> RunResult | None:
    """The LEANEST row of a climb: the loop with the least memory (None for a climb that did not get that far, or one
    saved before the ladder had that row)."""
    return next((r for r in reversed(results) if r.label == LEANEST), None)


def baseline_failure(results: list[RunResult]) -> str | None:
    """Why a climb had nothing to climb from, when its first row, naive fp32, failed (out of memory, diverged, an
    error); else None."""
    if not results or results[0].label != T.LADDER[0].name or results[0].status in ("ok", "skipped"):
        return None
    r = results[0]
    hint = " A smaller model or batch (a smaller preset) may fit." if r.status == "oom" else ""
    return f"naive fp32, the baseline, did not finish ({r.status}: {r.reason}): there is nothing to climb from.{hint}"


def _final_config(results: list[RunResult], label: str, what: str) -> C.TrainConfig:
    row = next((r for r in reversed(results) if r.label == label), None)
    if row is None and (failed := baseline_failure(results)):
        raise C.ConfigError(f"these results hold no {what}: {failed}")
    if row is None or not row.config:
        raise C.ConfigError(
            f"these results hold no {what} (no {label!r} row): run the whole ladder"
            + (" again (this climb was saved before the ladder had that row)" if label == LEANEST else "")
        )
    return C.TrainConfig.from_dict(row.config)


def optimised_config(results: list[RunResult]) -> C.TrainConfig:
    """The config of the fastest loop that fits (the OPTIMISED row): what `export --ladder` writes by default and
    notebook 09's panel starts from."""
    return _final_config(results, OPTIMISED, "optimised loop")


def leanest_config(results: list[RunResult]) -> C.TrainConfig:
    """The config of the loop with the least memory (the LEANEST row): `export --ladder F --loop leanest`."""
    return _final_config(results, LEANEST, "leanest loop")


def final_config(results: list[RunResult], loop: str = "optimised") -> C.TrainConfig:
    """optimised_config or leanest_config, by name ("optimised" or "leanest"); a ConfigError for another name."""
    loops = {"optimised": optimised_config, "leanest": leanest_config}
    if loop not in loops:
        raise C.ConfigError(f"loop={loop!r}: choose 'optimised' (the fastest that fits) or 'leanest' (least memory)")
    return loops[loop](results)


def rungs_of(results: list[RunResult]) -> list[RunResult]:
    """The rungs of a climb, without the final rows."""
    return [r for r in results if r.label not in FINAL_ROWS]


def speedup_basis(r: RunResult) -> str:
    """How a row's speed-up over naive was found (BASELINE, PRODUCT or PAIRED); for a climb saved before rows said so,
    from what the row holds (a final row timed in pairs, a memory rung once timed against naive directly)."""
    lad = r.ladder or {}
    if "speedup_basis" in lad:
        return lad["speedup_basis"]
    if r.label == T.LADDER[0].name:
        return BASELINE
    if (r.label in FINAL_ROWS and lad.get("pairs")) or lad.get("pairs_vs_naive"):
        return PAIRED
    return PRODUCT


def spread_text(r: RunResult) -> str:
    """ms per step as min-median-max over the timed steps."""
    timed = [t for i, t in enumerate(r.step_times) if i not in set(r.excluded_steps)]
    if not timed:
        return ""
    return f"{min(timed) * 1e3:.1f}-{r.median_step_s * 1e3:.1f}-{max(timed) * 1e3:.1f}"


LADDER_COLUMNS = {  # each column's header, and what it holds all the way down
    "vs best so far, paired": "a rung's step time against the best loop so far, timed in pairs (median, IQR)",
    "vs naive, product of pairs": "the loop's speed-up over naive fp32: the product of the paired factors up to it",
    "vs naive, paired": "a final loop's speed-up over naive fp32, its steps timed in pairs with naive's (median, IQR)",
    "memory vs naive": "the measured peak over naive fp32's",
}


def _factor_text(factor: float | None, iqr) -> str:
    iqr = iqr or [None, None]
    return (
        f"{factor:.2f}x ({iqr[0]:.2f}-{iqr[1]:.2f})"
        if factor and iqr[0]
        else fmt(factor, ".2f", "") + ("x" if factor else "")
    )


def ladder_rows(results: list[RunResult]) -> list[dict[str, str]]:
    """One row per rung, then the final rows; each column means one thing all the way down (LADDER_COLUMNS): the
    verdict, the factor against the best loop so far, the speed-up over naive fp32 as the product of paired factors
    (rungs) or timed in pairs with naive (the final loops), memory against naive, ms per step as min-median-max,
    efficiency, compile time and why."""
    rows = []
    for r in results:
        lad = r.ladder or {}
        basis, final = speedup_basis(r), r.label in FINAL_ROWS
        rows.append(
            {
                "rung": r.label,
                "kept": ("yes" if lad.get("kept") else "no") if r.ok or r.status != "skipped" else "-",
                "vs best so far, paired": "" if final else _factor_text(lad.get("factor"), lad.get("factor_iqr")),
                "vs naive, product of pairs": _factor_text(lad.get("speedup"), None) if basis == PRODUCT else "",
                "vs naive, paired": _factor_text(lad.get("factor"), lad.get("factor_iqr"))
                if final and basis == PAIRED
                else _factor_text(lad.get("speedup"), None)
                if basis == PAIRED
                else "",
                "ms/step min-med-max": spread_text(r) if r.ok else r.status.upper(),
                "peak GiB": r.peak_text() if r.ok else "",
                "memory vs naive": _factor_text(lad.get("memory_vs_naive"), None),
                "efficiency": efficiency_text(r) if r.ok else "",
                "compile s": fmt(r.compile_s, ".1f", ""),
                "why": lad.get("why") or r.reason,
            }
        )
    return rows


def ladder_table(results: list[RunResult]) -> str:
    return text_table(ladder_rows(results))


def _loop_line(row: RunResult, what: str) -> str:
    lad = row.ladder
    if lad.get("pairs") and speedup_basis(row) == PAIRED:
        speed = (
            f"{lad['factor']:.2f}x naive fp32's speed ({lad['factor_iqr'][0]:.2f}-{lad['factor_iqr'][1]:.2f} over "
            f"{len(lad['pairs'])} steps timed in pairs with naive)"
        )
    elif speedup_basis(row) == BASELINE:
        speed = "naive fp32 itself"
    else:
        speed = f"{fmt(lad.get('speedup'), '.2f')}x naive fp32's speed (the product of its rungs' factors)"
    memory = f" in {lad['memory_vs_naive']:.2f}x its peak memory" if lad.get("memory_vs_naive") else ""
    return f"{what} is {speed}{memory}"


def verdict(results: list[RunResult]) -> str:
    """What this device needs, in a few lines: each final loop against naive (one figure each, timed in pairs with
    naive), what was kept and what not, and why."""
    row, lean = optimised(results), leanest(results)
    rungs = [r for r in rungs_of(results)[1:]]
    if row is None:
        return baseline_failure(results) or "The climb did not finish: no verdict."
    kept = [r.label.removeprefix("+ ") for r in rungs if r.ladder.get("kept")]
    dropped = [r for r in rungs if r.status != "skipped" and not r.ladder.get("kept")]
    first = f"On {row.provenance['device']}: " + _loop_line(row, "the optimised loop") + ", the fastest that fits"
    if lean is not None and lean.ladder.get("vs_optimised") == 1.0 and lean.config == row.config:
        first += ", and it is also the leanest."
    elif lean is not None:
        first += "; " + _loop_line(lean, "the leanest loop") + "."
    else:
        first += "."
    lines = [first, "kept: " + (", ".join(kept) if kept else "nothing")]
    for label, why in (row.ladder.get("left_out") or {}).items():
        lines.append(f"left out of the optimised loop, kept in the leanest: {label.removeprefix('+ ')} ({why})")
    for r in dropped:
        lines.append(
            f"not kept: {r.label.removeprefix('+ ')}: {r.ladder.get('why', r.reason).removeprefix('not kept: ')}"
        )
    skipped = [r for r in rungs if r.status == "skipped"]
    if skipped:
        lines.append("not run: " + "; ".join(f"{r.label.removeprefix('+ ')} ({r.reason})" for r in skipped))
    return "\n".join(lines)
