"""Climb the ladder of techniques from naive fp32, and keep what helps on this device.

Each rung adds one technique to the best loop so far, each timed step paired with one of the best loop's (a drifting
machine moves both alike); its factor is the median of the paired ratios, and `judge` decides; a kept rung's loop is
timed in pairs with naive fp32 too, for a figure of its own. Speed rungs not kept get a second look at the top; a GPU
waiting on launches tries CUDA graphs. Two rows end the table, timed in pairs against naive fp32: `= optimised here`
(the fastest loop that fits) and `= leanest here` (the climb's loop itself). One loop, one figure: a final row whose
loop a rung ran pools both rows' pairs.
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
NOISE_MULTIPLE = 2  # one window of the same step against itself says only roughly how wide the noise is: twice it
FINAL_PAIRS = 3  # a final row takes this many times a rung's timed steps: the figure handed to the learner must hold
OPTIMISED = "= optimised here"  # the fastest loop that fits, on this device
LEANEST = "= leanest here"  # the loop with the least memory, on this device (the last row)
FINAL_ROWS = (OPTIMISED, LEANEST)
AGAIN = ", again"  # a second look's label: the rung's name and this

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
    """Faster when three quarters of the pairs say so and the median by MIN_SPEED_CHANGE: one slow step cannot."""
    ratios = [best / rung for best, rung in pairs if best > 0 and rung > 0]
    if not ratios:
        return SpeedChange(None, None, None, 0, TOO_FEW)
    factor = statistics.median(ratios)
    low, _, high = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else (factor,) * 3
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
    """How far apart this machine timed a step against itself (a rung that changes nothing here, TF32 on a CPU), as a
    factor >= 1 + MIN_SPEED_CHANGE; None where not measured."""
    spreads = [
        max(abs(math.log(lad["same_step_factor"])), math.log(lad["factor_iqr"][1] / lad["factor_iqr"][0]) / 2)
        for lad in (r.ladder or {} for r in results)
        if lad.get("same_step_factor")
    ]
    return max(math.exp(max(spreads)), 1 + MIN_SPEED_CHANGE) if spreads else None


def within_noise(speed: SpeedChange, noise: float | None) -> bool:
    """Whether a faster or slower verdict rests on a factor within NOISE_MULTIPLE times `noise` (on a log scale)."""
    decided = noise is not None and speed.verdict in (FASTER, SLOWER)
    return decided and abs(math.log(speed.factor)) <= NOISE_MULTIPLE * math.log(noise)


def second_window(first: SpeedChange, pairs: list[tuple[float, float]], more: list[tuple[float, float]]) -> SpeedChange:
    """Both windows' factor, with `first`'s verdict only where the second alone and both together agree with it."""
    pooled, second = speed_change(pairs + more), speed_change(more)
    agree = first.verdict == second.verdict == pooled.verdict
    return dataclasses.replace(pooled, verdict=first.verdict if agree else NO_CHANGE)


def memory_change(factor: float | None) -> tuple[float | None, str]:
    """(the rung's peak over the best loop's, its verdict); NOT_MEASURED where either peak is not (or of two kinds)."""
    if not factor:
        return None, NOT_MEASURED
    verdict = LEANER if factor <= 1 - MIN_MEMORY_CHANGE else FATTER if factor >= 1 + MIN_MEMORY_CHANGE else NO_CHANGE
    return factor, verdict


def judge(
    aims: tuple[str, ...], speed: SpeedChange, memory: tuple[float | None, str], device_note: str = "", fixed=False
) -> tuple[bool, str]:
    """(kept, why) for a rung that aims at `aims` (techniques.SPEED, MEMORY), measured against the best loop so far.
    `device_note` (no bf16 instructions) is added where it was not kept; `fixed` keeps it whatever it measured."""
    mem_factor, mem_verdict = memory
    if speed.verdict in (FASTER, SLOWER):  # (a factor exists only where there were pairs)
        speed_text = f"{speed.factor:.2f}x faster" if speed.verdict == FASTER else f"{1 / speed.factor:.2f}x slower"
    else:
        speed_text = "no measurable change in speed" if speed.verdict == NO_CHANGE else TOO_FEW
    mem_text = f"{mem_factor:.2f}x the memory" if mem_verdict in (LEANER, FATTER) else "memory not measured"
    mem_text = "no measurable change in memory" if mem_verdict == NO_CHANGE else mem_text
    for_speed, for_memory = T.SPEED in aims, T.MEMORY in aims
    if for_memory and not for_speed:  # a memory technique trades time for memory by design: it is kept for memory
        kept, what = mem_verdict == LEANER, f"{mem_text}, {speed_text}"
    else:
        helped = (for_speed and speed.verdict == FASTER) or (for_memory and mem_verdict == LEANER)
        hurt = (for_speed and speed.verdict == SLOWER) or (for_memory and mem_verdict == FATTER)
        kept, what = helped and not hurt, f"{speed_text}, {mem_text}" if for_memory else speed_text
    if fixed:
        return True, f"kept (fixed ladder): {what}"
    return kept, f"kept: {what}" if kept else f"not kept: {what}" + (f"; {device_note}" if device_note else "")


# ---- the climb ---------------------------------------------------------------------------------------------------


def ladder_configs(
    base: C.TrainConfig, options: dict | None = None, leave_out: dict[str, str] | None = None, on_this_machine=True
) -> list[tuple[T.Rung, C.TrainConfig | C.ConfigError]]:
    """Each rung's config, cumulative from naive, or its ConfigError where the device cannot run it or it is left out
    (`leave_out` {rung: why}). `on_this_machine=False` (a script for a GPU written on a laptop) checks none."""
    T.check_ladder_arguments(options, leave_out)
    caps, leave_out = capabilities(base.device) if on_this_machine else None, leave_out or {}
    out, cfg = [], T.naive(base)
    for rung in T.LADDER:
        up = C.ConfigError(leave_out[rung.name]) if rung.name in leave_out else T.rung_up(cfg, rung, caps, options)
        out.append((rung, up))
        cfg = up if isinstance(up, C.TrainConfig) else cfg
    return out


def rung_config(base: C.TrainConfig, rung: str, options: dict | None = None) -> C.TrainConfig:
    """The ladder's cumulative config at the rung named; on a device this machine lacks, every rung up to it applies."""
    T.check_rung_name(rung)
    try:
        here = bool(capabilities(base.device))
    except C.ConfigError:  # not on this machine
        here = False
    cfg = dict((r.name, c) for r, c in ladder_configs(base, options, on_this_machine=here))[rung]
    if isinstance(cfg, C.ConfigError):
        raise C.ConfigError(f"the rung {rung!r} cannot run on this device: {cfg}")
    return cfg


def prepare_climb(
    base: C.TrainConfig, rungs: list[str] | None = None, leave_out: dict | None = None, options: dict | None = None
) -> tuple[C.TrainConfig, dict[str, str], str]:
    """A climb's checks (the command line runs them before its banner): (base with enough steps to judge a rung, every
    rung left out {name: why}, how steps were raised or ""). `rungs` names the only rungs to measure."""
    for name in rungs or []:
        T.check_rung_name(name)
    leave_out = dict(leave_out or {})
    for rung in T.LADDER[1:] if rungs is not None else []:
        if rung.name not in rungs:
            leave_out.setdefault(rung.name, "left out: not among the rungs asked for")
    T.check_ladder_arguments(options, leave_out)
    naive = T.naive(base)  # every value is checked first: which error comes does not depend on the options' order
    unchanged = [(n, value) for n, value in (options or {}).items() if T.TECHNIQUE[n].set(naive, value) == naive]
    if unchanged:  # compile=False would measure naive against itself
        name, value = unchanged[0]
        rung = T.option_rung(name)
        raise C.ConfigError(
            f"--rung-value {name}={value!r} is what naive fp32 already runs: the rung would change nothing; leave "
            f"it out with --leave-out {T.LADDER.index(rung)} ({rung.name}) instead"
        )
    needed = base.fewest_steps(timed=MIN_PAIRS)  # the warm-up, and the memory ledger's on a CPU, are not timed
    if base.steps >= needed:
        return base, leave_out, ""
    raised = f"raised from {base.steps} to {needed}: a rung needs {MIN_PAIRS} timed steps to be judged"
    return dataclasses.replace(base, steps=needed), leave_out, raised


def run_ladder(
    base: C.TrainConfig, steps: int | None = None, progress: Callable[[str], None] | None = None,
    rungs: list[str] | None = None, leave_out: dict[str, str] | None = None, options: dict | None = None,
    fixed: bool = False, on_result: Callable[[list[RunResult]], None] | None = None,
) -> list[RunResult]:  # fmt: skip
    """One row per rung of techniques.LADDER (its verdict in its `ladder` dict), any second looks and CUDA graphs, then
    OPTIMISED and LEANEST. A rung the device cannot run or left out is 'skipped' with why; out of memory 'oom', another
    failure 'error'. `progress(text)` hears "rung i of n"; `on_result(rows so far)` follows every rung (to save)."""
    base = dataclasses.replace(base, steps=steps) if steps is not None else base
    base, leave_out, raised = prepare_climb(base, rungs, leave_out, options)
    if raised and progress:
        progress(f"steps per rung {raised}")
    if (note := cpu_allocator.not_glibcs_own_rule(base.device, keep=False)) and progress:
        progress(f"note: {note}")  # each result's details["allocator"] holds it too
    caps = capabilities(base.device)
    refresh_peaks(caps)
    # "rung i of n" counts the rungs not left out (one the device refuses passes at once) and the final rows as one
    n = sum(r.name not in leave_out for r in T.LADDER) + 1
    climb = _Climb(caps, options, fixed, progress, on_result, n)
    if not climb.baseline(base):
        return climb.results
    for rung in T.LADDER[1:]:
        climb.rung(rung.name, rung, leave_out.get(rung.name))
    if not fixed:
        climb.second_looks()
        climb.cuda_graphs()
    climb.announce(f"{OPTIMISED} and {LEANEST}")
    climb.results += climb.final_rows()
    climb.saved()
    return climb.results


@dataclass
class _Loop:
    """A loop that has run: its config, trainer (kept to take more steps), result, and speed-up over naive fp32."""

    cfg: C.TrainConfig
    trainer: Trainer | None
    result: RunResult
    speedup: float | None


@dataclass
class _Climb:
    """A climb under way: what it was asked, its rows so far, naive's loop and the best so far, its progress count."""

    caps: Capabilities
    options: dict | None
    fixed: bool
    progress: Callable[[str], None] | None
    on_result: Callable[[list[RunResult]], None] | None
    n: int  # "rung i of n"
    done: int = 0
    started: float = dataclasses.field(default_factory=time.perf_counter)
    results: list[RunResult] = dataclasses.field(default_factory=list)
    naive_loop: _Loop | None = None
    best: _Loop | None = None

    def announce(self, name: str) -> None:
        if self.progress:
            self.progress(_progress_text(self.done, self.n, name, self.started))
            self.done += 1

    def saved(self) -> None:
        if self.on_result:
            self.on_result(self.results)

    def not_run(self, label: str, why: str, ladder: dict) -> RunResult:
        prov = provenance(self.caps.name)
        return RunResult(label=label, status="skipped", config={}, provenance=prov, reason=why, ladder=ladder)

    def baseline(self, base: C.TrainConfig) -> bool:
        """Naive fp32, which every rung climbs from; False where it failed (every later rung then says so)."""
        naive = T.LADDER[0]  # (check_ladder_arguments refuses to leave it out)
        self.announce(naive.name)
        result, trainer, _ = _measure(T.naive(base), naive.name, None, self.progress, give_up=False)
        result.reason, ok = result.reason or naive.what_changed, result.ok
        why = "the baseline" if ok else f"the baseline failed: {result.reason}"
        result.ladder = {"kept": ok, "why": why, "speedup": 1.0 if ok else None, "speedup_basis": BASELINE}
        result.ladder["memory_vs_naive"] = 1.0 if ok else None
        self.results.append(result)
        if ok:
            self.naive_loop = self.best = _Loop(trainer.cfg, trainer, result, 1.0)
        else:  # nothing to climb from: the file says this climb failed, not what an earlier one found
            why = "no baseline to climb from: naive fp32 did not finish"
            self.results += [self.not_run(r.name, why, {"kept": False}) for r in T.LADDER[1:]]
        self.saved()
        return ok

    def rung(self, label: str, rung: T.Rung, why_not: str | None = None, cfg=None, details=None) -> None:
        """One rung (or a second look) on top of the best loop so far: its row, measured and judged, or why not."""
        if not why_not:  # a rung left out passes without a count
            self.announce(label)
        if cfg is None:
            cfg = C.ConfigError(why_not) if why_not else T.rung_up(self.best.cfg, rung, self.caps, self.options)
        if isinstance(cfg, C.ConfigError):
            self.results.append(self.not_run(label, str(cfg), {"kept": False, "why": f"not run: {cfg}"}))
            self.saved()
            return
        give_up = not self.fixed and rung.aims == (T.SPEED,)
        result, trainer, pairs = _measure(cfg, label, self.best, self.progress, give_up)
        result.reason = result.reason or rung.what_changed
        loop = self.judged(result, trainer, pairs, rung)
        if loop is not None:
            if self.best is not self.naive_loop:
                self.best.trainer = None  # the loop that lost goes, before the next rung builds its own
            self.best = loop
        result.details.update(details or {})
        self.results.append(result)
        self.saved()

    def judged(self, result: RunResult, trainer: Trainer | None, pairs, rung: T.Rung) -> _Loop | None:
        """Fill in `result.ladder`, its verdict against the best loop so far; the rung's loop where it is kept."""
        best, fixed = self.best, self.fixed
        if not result.ok:
            why = f"not kept: {result.status} ({result.reason})"
            result.ladder = {"kept": False, "why": why, "vs": best.result.label}
            return None
        note, no_effect = _device_says(trainer.cfg, rung, self.caps)
        speed, more, window = speed_change(pairs), [], ""
        noise = same_step_noise(self.results)
        if T.SPEED in rung.aims and not fixed and not no_effect and within_noise(speed, noise):
            speed, more, window = _timed_again(speed, pairs, best.trainer, trainer, noise, self.progress)
        memory = memory_change(result.peak_ratio(best.result))
        speedup = best.speedup * speed.factor if best.speedup and speed.factor else None
        kept, why = judge(rung.aims, speed, memory, note, fixed)
        why += f" ({window})" if window else ""
        same_step = no_effect and speed.factor
        if same_step:  # what the pairs say is this machine's noise, and the speed-up over naive stays what it was
            kept, speed, speedup = fixed, dataclasses.replace(speed, verdict=NO_CHANGE), best.speedup
            why = f"{'kept (fixed ladder)' if fixed else 'not kept'}: {note}; the same step measured "
            why += f"{speed.factor:.2f}x ({speed.low:.2f}-{speed.high:.2f}) against itself: the noise of this machine"
        why += f" ({result.stopped_early})" if result.stopped_early else ""
        lad = {"kept": kept, "why": why, "vs": best.result.label, "aims": list(rung.aims)}
        lad |= _speed_fields(speed, [list(p) for p in pairs])
        lad |= {"memory": memory[1], "memory_factor": memory[0], "speedup": speedup, "speedup_basis": PRODUCT}
        lad |= {"memory_vs_naive": result.peak_ratio(self.naive_loop.result), "device_note": note}
        # a second window where the first was within noise; a step against itself, later rungs' same_step_noise
        lad |= {"pairs_again": [list(p) for p in more], "same_step_factor": speed.factor if same_step else None}
        result.ladder = lad | (self.timed_with_naive(trainer, len(pairs)) if kept and not same_step else {})
        return _Loop(trainer.cfg, trainer, result, result.ladder["speedup"]) if kept else None

    def timed_with_naive(self, trainer: Trainer, n: int) -> dict:
        """A kept loop's own figure: its speed-up over naive fp32 from `n` steps of each in turn ({}: the product)."""
        pairs, failed = _paired(self.naive_loop.trainer, trainer, n)
        speed = speed_change(pairs)
        if failed or speed.factor is None:
            return {}
        lad = {"speedup": speed.factor, "speedup_iqr": [speed.low, speed.high], "speedup_basis": PAIRED}
        return lad | {"pairs_vs_naive": [list(p) for p in pairs]}

    def second_looks(self) -> None:
        """Speed rungs not kept, tried again on top of the loop the climb reached: what came after can change their
        verdict (bf16 autocast can lose to fp32 while attention is still naive; SDPA comes after it)."""
        again = second_look(self.results)
        self.n += len(again)
        for rung in again:
            self.rung(again_label(rung.name), rung)

    def cuda_graphs(self) -> None:
        """CUDA graphs, tried where a profile of the climb's loop shows the GPU waiting on the CPU's launches."""
        try_it, why = tries_cuda_graphs(self.best.cfg, *_idle_share_of(self.best.cfg, self.caps))
        if self.progress and self.caps.type == "cuda":
            self.progress(f"{CUDA_GRAPHS}: {why}")
        if try_it:
            self.n += 1
            cfg = dataclasses.replace(self.best.cfg, compile_mode="reduce-overhead")
            self.rung(CUDA_GRAPHS, CUDA_GRAPHS_RUNG, cfg=cfg, details={"device_idle_share": why})

    def final_rows(self) -> list[RunResult]:
        """[OPTIMISED, LEANEST]: the climb's loop less the memory rungs that cost time, and the loop itself."""
        results, fixed = self.results, self.fixed
        kept = [r.label for r in results[1:] if r.ladder.get("kept")]
        lean = self.leanest_row(kept, measured=any(r.status != "skipped" for r in results[1:]))
        costly = [] if fixed else memory_rungs_that_cost_time(results)
        free = [r for r in _memory_rungs_kept(results) if r not in costly]
        free_notes = [f"{_short(r.label)} kept: no measurable cost in time" for r in free]
        opt, failed = self.optimised_row(kept, costly, free_notes)
        if opt is None:  # the leanest loop is the optimised one
            opt = dataclasses.replace(lean, label=OPTIMISED, ladder=dict(lean.ladder), details=dict(lean.details))
            if failed or costly:
                why = failed or "the loop does not fit without " + ", ".join(_short(rung_name(r)) for r in costly)
            elif fixed:
                why = "the fixed ladder keeps every rung"
            else:
                why = "every memory technique kept costs no measurable time" if free else "no memory technique was kept"
            opt.ladder["why"] += f"; the same loop as {LEANEST}: {why}"
            lean.ladder["why"] += f"; the same loop as {OPTIMISED}"
            lean.ladder["vs_optimised"] = 1.0
        elif lean.ladder.get("speedup") and opt.ladder.get("speedup"):
            cost = opt.ladder["speedup"] / lean.ladder["speedup"]
            lean.ladder["vs_optimised"] = 1 / cost
            than = f"than {OPTIMISED} (the ratio of their factors over naive)"
            slower, faster = f"{cost:.2f}x slower {than}", f"{1 / cost:.2f}x faster {than}: timing noise"
            lean.ladder["why"] += "; " + (slower if cost >= 1 else faster)
        return [opt, lean]

    def optimised_row(self, kept: list[str], costly: list[RunResult], notes: list[str]) -> tuple[RunResult | None, str]:
        """(the OPTIMISED row: the first of optimised_candidates that fits, timed in pairs with naive, ""), or (None,
        why not): only the leanest loop fits (""), or one failed otherwise."""
        best, naive = self.best, self.naive_loop
        for cfg, put_back in optimised_candidates(best.cfg, costly):
            if cfg == best.cfg:  # nothing fits without all of them: the leanest loop is also the fastest that fits
                return None, ""
            left = [r for r in costly if r not in put_back]
            if self.progress:
                self.progress(f"{OPTIMISED}: the loop without {', '.join(rung_name(r) for r in left)}")
            if best.trainer is not None and best is not naive:
                best.trainer = None  # the leanest loop is timed: its model and optimizer make room for this one
                free_memory()
            result, trainer, pairs = _measure(cfg, OPTIMISED, naive, self.progress, give_up=False)
            if result.status == "oom":
                continue
            if not result.ok:  # another failure: the leanest loop stands in, and its row says why
                return None, f"the loop without them failed ({result.status}: {result.reason})"
            more, _ = _paired(naive.trainer, trainer, len(pairs) * (FINAL_PAIRS - 1))  # (failed: the fit's pairs)
            pairs += more
            _times_from_pairs(result, pairs, cfg)
            opt_kept = [k for k in kept if k not in {r.label for r in left}]
            result.reason = "naive fp32 " + " ".join(opt_kept)
            result.ladder = _timed_against_naive(pairs, naive.result, opt_kept, result.peak_ratio(naive.result))
            self.pool_with_its_rung(result)
            result.ladder["left_out"] = {r.label: _slower_text(r) for r in left}
            result.ladder["put_back"] = [r.label for r in put_back]
            why = [f"{_short(rung_name(r))} left out: {_slower_text(r)}" for r in left]
            why += [f"{_short(rung_name(r))} kept: the loop does not fit without it" for r in put_back]
            result.ladder["why"] += "; " + "; ".join(why + notes)
            return result, ""
        return None, ""

    def pool_with_its_rung(self, row: RunResult) -> None:
        """One loop, one figure: where a kept rung ran the final row's loop (just timed in pairs with naive), both
        quote the pairs of both windows; the rows priced from that rung's figure, or from one priced from it, follow."""
        same = (r for r in reversed(self.results) if r.config == row.config and r.ladder.get("pairs_vs_naive"))
        rung = next(same, None)
        if rung is None:
            return
        own, old = speed_change(row.ladder["pairs"]), rung.ladder["speedup"]
        speed = speed_change(row.ladder["pairs"] + rung.ladder["pairs_vs_naive"])
        iqr = [speed.low, speed.high]
        row.ladder |= {"speedup": speed.factor, "factor": speed.factor, "factor_iqr": iqr, "pooled_with": rung.label}
        row.ladder["pooled_pairs"] = speed.pairs
        rung.ladder |= {"speedup": speed.factor, "speedup_iqr": iqr, "pooled_with": row.label}
        here = f"({own.pairs} here, {speed.pairs - own.pairs} at {rung.label})"
        row.ladder["why"] = f"{_paired_with_naive_text(speed)} {here}"
        priced_from = {rung.label}
        for r in self.results:  # in climb order: a row priced from a rescaled one follows it too
            if r.ladder.get("vs") in priced_from and speedup_basis(r) == PRODUCT and r.ladder.get("speedup"):
                r.ladder["speedup"] *= speed.factor / old
                priced_from.add(r.label)

    def leanest_row(self, kept: list[str], measured: bool) -> RunResult:
        """The climb's loop timed once more in pairs against naive fp32 (FINAL_PAIRS times a rung's timed steps); its
        memory is the one measured at the rung that made it the best (the same config)."""
        naive, best, top = self.naive_loop, self.best, self.best.result
        reason = "naive fp32 " + " ".join(kept) if kept else "naive fp32: no rung helped here"
        same = {k: getattr(top, k) for k in ("tokens_per_step", "n_params", "flops_per_token", "memory")}
        row = RunResult(LEANEST, "ok", dict(top.config), provenance(self.caps.name), reason, **same)
        row.details = {"memory_measured_at": top.label}
        if best is naive:
            why = "nothing was kept: naive fp32 is the best of the loops measured here"
            why = why if measured else "no rung was measured: the loop is naive fp32 by default"
            row.ladder = {"kept": True, "why": why, "speedup": 1.0, "speedup_basis": BASELINE, "memory_vs_naive": 1.0}
            return _timed_as(row, top, factor=1.0, kept_rungs=[])
        n = FINAL_PAIRS * max(MIN_PAIRS, len(top.step_times) - len(top.excluded_steps))
        # one untimed pair first: a compiled loop compiles again after a later rung reset the compiler
        pairs, failed = _paired(naive.trainer, best.trainer, n + 1)
        pairs = pairs[1:]
        if failed:  # (out of memory with both loops held) the best rung's own run and figure
            why = f"not timed against naive fp32 ({failed} when paired): {fmt(best.speedup, '.2f')}x, {top.label}'s"
            row.ladder = {"kept": True, "why": why, "vs": naive.result.label}
            row.ladder |= {"speedup": best.speedup, "speedup_basis": speedup_basis(top), "kept_rungs": kept}
            if top.ladder.get("pairs_vs_naive"):  # the same loop, timed in pairs with naive at its rung: that figure
                row.ladder |= {"factor": best.speedup, "factor_iqr": top.ladder.get("speedup_iqr")}
                row.ladder["pairs"] = top.ladder["pairs_vs_naive"]
            row.ladder["memory_vs_naive"] = top.peak_ratio(naive.result)
            return _timed_as(row, top)
        _times_from_pairs(row, pairs, best.cfg)
        row.ladder = _timed_against_naive(pairs, naive.result, kept, top.peak_ratio(naive.result))
        self.pool_with_its_rung(row)
        return row


CUDA_GRAPHS = "+ CUDA graphs"  # a rung of its own, after the climb: only where the device waits on launches
_GRAPHS_WHAT = (
    "compile's reduce-overhead mode: the compiled step recorded once as a CUDA graph and replayed, one launch for many"
)
CUDA_GRAPHS_RUNG = T.Rung(CUDA_GRAPHS, _GRAPHS_WHAT, T.TECHNIQUE["compile"], True)


def tries_cuda_graphs(cfg: C.TrainConfig, idle: float | None, measured: str = "") -> tuple[bool, str]:
    """(whether to try CUDA graphs on top of `cfg`, why), from the share of its step the GPU sat idle (`measured`)."""
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
    """(the share of a step of `cfg` the GPU sat idle, from a short profile; "" or why it is missing)."""
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
    """Measure again the matmul peaks every rung's efficiency is over (the cache keeps the higher): one measured on a
    busy machine would make them all too high."""
    if caps.datasheet is not None:
        return
    tf32 = "tf32" if caps.type == "cuda" and caps.supports("tf32").ok else None  # a mode of its own on a GPU
    for precision in ("fp32", tf32, caps.fast_16bit()[0]):
        if precision:
            measured_tflops(caps.device, precision, refresh=True)


def again_label(name: str) -> str:
    return name + AGAIN


def rung_name(result: RunResult) -> str:
    """The rung a climb's result measured: its label less AGAIN (the label is all a saved climb records of it)."""
    return result.label.removesuffix(AGAIN)


def second_look(results: list[RunResult]) -> list[T.Rung]:
    """The speed rungs worth a second look on top of the climb's last loop: run, not kept, not for want of hardware
    (bf16 converted in software stays slow), and with a rung kept after them (else they would meet the same loop)."""
    last_kept = max((i for i, r in enumerate(results) if r.ladder.get("kept")), default=-1)
    lost = [r for r in results[:last_kept] if r.ok and not r.ladder.get("kept", True) and r.label in T.RUNGS]
    lost = [r for r in lost if not r.ladder.get("device_note")]  # (bf16 converted in software stays slow)
    return [T.RUNGS[r.label] for r in lost if T.SPEED in T.RUNGS[r.label].aims]


def _progress_text(i: int, n: int, name: str, started: float) -> str:
    def minutes(seconds: float) -> str:
        return f"{int(seconds // 60)}:{int(seconds % 60):02d}"

    elapsed = time.perf_counter() - started
    left = f", about {minutes(elapsed / i * (n - i))} left" if i else ""
    return f"rung {i + 1} of {n}: {name} ({minutes(elapsed)} so far{left})"


def _error_line(e: BaseException, limit: int) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:limit] if text else ''}"


def _measure(
    cfg: C.TrainConfig, label: str, best: _Loop | None, progress, give_up: bool
) -> tuple[RunResult, Trainer | None, list[tuple[float, float]]]:
    """One run of `cfg`, each timed step followed by a step of `best`'s loop: (result, its trainer, the pairs (best_s,
    rung_s)). With `give_up`, a rung over GIVE_UP_SLOWER slower in each of its first GIVE_UP_AFTER pairs is stopped."""
    pairs: list[tuple[float, float]] = []
    made: dict[str, object] = {}

    def after_step(step: int, result: RunResult) -> None:
        if progress:
            _draw_steps(label, step + 1, cfg.steps)
        if best is None or not made["trainer"].is_timed(step):
            return
        try:
            if not pairs:  # one untimed step first: building this rung reset the compiler
                best.trainer.step()
            pairs.append((best.trainer.step(), result.step_times[-1]))
        except Exception as e:  # noqa: BLE001 - the best loop's failure is not this rung's: stop pairing, say whose
            made["best_failed"] = _error_line(e, 200)
            raise StopRun(f"the best loop so far failed while paired with this rung ({made['best_failed']})") from None
        if give_up and len(pairs) >= GIVE_UP_AFTER and all(rung > GIVE_UP_SLOWER * b for b, rung in pairs):
            slower = f"each over {GIVE_UP_SLOWER:g}x slower than the best loop so far"
            raise StopRun(f"stopped after {len(pairs)} timed steps, {slower}")

    def attempt() -> RunResult:
        check_cpu_memory(cfg)  # a CPU step past the free memory: an "oom" row, not a killed process
        made["trainer"] = Trainer(cfg)
        return made["trainer"].fit(label, after_step)

    try:
        result = catching_oom(attempt, cfg, label)
    except Exception as e:  # noqa: BLE001 - a rung that fails is a row that says why; the climb goes on
        result = RunResult.failed(cfg, label, "error", _error_line(e, 300))
    if progress and len(result.step_times) < cfg.steps:  # stopped early: end the step bar's line
        sys.stderr.write("\n")
    if not result.ok:
        made.clear()
        free_memory()
    if "best_failed" in made:  # its step may have failed half-way (an optimizer or scaler mid-update): a fresh one
        best.trainer = None
        free_memory()
        best.trainer = Trainer(best.cfg)
    return result, made.get("trainer"), pairs


def _device_says(cfg: C.TrainConfig, rung: T.Rung, caps: Capabilities) -> tuple[str, bool]:
    """(what the device says of the precision a precision rung sets where it has no hardware for it, or ""; whether it
    runs it as the same computation as without it, TF32 on a CPU). reference.other_cpu_lines rewords "here:"."""
    if rung.technique is None or rung.technique.name != "precision":
        return "", False
    support = caps.supports(cfg.precision)
    return (f"{cfg.precision} here: {support.note}" if support.native is False else ""), support.no_effect


def _short(label: str) -> str:
    return label.removeprefix("+ ")


def _timed_again(first: SpeedChange, pairs, best: Trainer, trainer: Trainer, noise: float, progress):
    """(the verdict of a second window of pairs, its pairs, what the row says of it), for a factor within the noise."""
    if progress:
        apart = f"a step measured {noise:.2f}x apart from itself"
        progress(f"  {first.factor:.2f}x is within this machine's noise ({apart}): {len(pairs)} more paired steps")
    more, failed = _paired(best, trainer, len(pairs))
    if failed:  # one window cannot tell it from noise, and the second could not be taken
        speed = dataclasses.replace(first, verdict=NO_CHANGE)
        window = f"{first.factor:.2f}x, not confirmed: {failed} in a second window of paired steps"
    else:
        speed = second_window(first, pairs, more)
        agree = "they agree" if speed.verdict == first.verdict else "they disagree"
        then = speed_change(more).factor
        window = f"{first.factor:.2f}x, then {then:.2f}x in a second window of paired steps: {agree}"
    return speed, more, window + f"; this machine measured a step up to {noise:.2f}x apart from itself"


def _paired(first: Trainer, second: Trainer, n: int) -> tuple[list[tuple[float, float]], str]:
    """(n pairs (first_s, second_s) of the loops' steps in turn, ""), or ([], the error's name), the memory freed."""
    pairs, failed = unless_it_fails(
        lambda: [(first.step(), second.step()) for _ in range(n)], lambda e: type(e).__name__
    )
    return pairs or [], failed or ""


# ---- the two final rows ------------------------------------------------------------------------------------------


def memory_rungs_that_cost_time(results: list[RunResult]) -> list[RunResult]:
    """The kept memory-only rungs not as fast as the loop before them (slower, or too few pairs to say)."""
    return [r for r in _memory_rungs_kept(results) if r.ladder.get("speed") not in (NO_CHANGE, FASTER)]


def _memory_rungs_kept(results: list[RunResult]) -> list[RunResult]:
    return [r for r in results if r.ladder.get("kept") and r.ladder.get("aims") == [T.MEMORY]]


def optimised_candidates(leanest_cfg: C.TrainConfig, costly: list[RunResult]) -> list[tuple[C.TrainConfig, list]]:
    """The loops the optimised one is tried as, fastest first: the leanest loop without every costly rung, then with the
    first put back (ladder order), and so on to the leanest loop itself; each with the rungs it put back."""
    out = []
    for k in range(len(costly) + 1):
        cfg = leanest_cfg
        for r in costly[k:]:  # switched off: back to naive's value
            technique = T.RUNGS[rung_name(r)].technique
            cfg = technique.set(cfg, technique.off)
        out.append((cfg, costly[:k]))
    return out


def _slower_text(r: RunResult) -> str:
    f = r.ladder.get("factor")
    return f"{1 / f:.2f}x slower at its rung" if f and r.ladder.get("speed") == SLOWER else r.ladder.get("speed", "")


def _speed_fields(speed: SpeedChange, pairs) -> dict:
    """What a row's `ladder` dict holds of its paired steps and their verdict."""
    return {"speed": speed.verdict, "factor": speed.factor, "factor_iqr": [speed.low, speed.high], "pairs": pairs}


def _timed_against_naive(pairs, naive: RunResult, kept: list[str], memory_vs_naive: float | None) -> dict:
    """A final row's `ladder` dict: its speed-up over naive fp32 from (naive_s, loop_s) pairs, its rungs and peak."""
    speed = speed_change(pairs)
    lad = {"kept": True, "why": _paired_with_naive_text(speed), "vs": naive.label}
    lad |= _speed_fields(speed, [list(p) for p in pairs])
    lad |= {"speedup": speed.factor, "speedup_basis": PAIRED, "kept_rungs": kept}
    return lad | {"memory_vs_naive": memory_vs_naive}


def _paired_with_naive_text(speed: SpeedChange) -> str:
    return f"{speed.text()} naive fp32, timed in pairs with it"


def _times_from_pairs(row: RunResult, pairs, cfg: C.TrainConfig) -> None:
    """A final row's step times: its loop's side of the (naive_s, loop_s) pairs, every one timed."""
    row.step_times, row.excluded_steps = [b for _, b in pairs], []
    row.median_step_s = statistics.median(row.step_times)
    row.tokens_per_s = row.tokens_per_step / row.median_step_s
    row.mfu, row.mfu_basis = efficiency(row.tokens_per_s, row.flops_per_token, cfg.device, cfg.precision)


def _timed_as(row: RunResult, source: RunResult, **ladder) -> RunResult:
    """`row` with `source`'s own timed steps (where it was not timed in pairs), and `ladder` added to its ladder."""
    row.step_times, row.excluded_steps = list(source.step_times), list(source.excluded_steps)
    row.median_step_s, row.tokens_per_s = source.median_step_s, source.tokens_per_s
    row.mfu, row.mfu_basis = source.mfu, source.mfu_basis
    row.ladder.update(ladder)
    return row


def _draw_steps(name: str, done: int, total: int) -> None:
    bar = f"\r  {name:<18} [{'#' * (20 * done // total):<20}] {done}/{total}"
    sys.stderr.write(bar + ("\n" if done == total else ""))
    sys.stderr.flush()


def everything_on(base: C.TrainConfig) -> C.TrainConfig:
    """The fixed ladder's top config as this device would run it, without climbing: the 16-bit rung only with 16-bit
    hardware, TF32 only where it does something. A first guess at the optimised loop (notebook 01)."""
    caps = capabilities(base.device)
    leave_out = {} if caps.fast_16bit()[0] else {T.AUTOCAST_RUNG: caps.fast_16bit()[1]}
    if caps.supports("tf32").no_effect:
        leave_out["+ tf32"] = caps.supports("tf32").note
    return [cfg for _, cfg in ladder_configs(base, leave_out=leave_out) if isinstance(cfg, C.TrainConfig)][-1]


# ---- reading a climb ---------------------------------------------------------------------------------------------


def _last_row(results: list[RunResult], label: str) -> RunResult | None:
    return next((r for r in reversed(results) if r.label == label), None)


def optimised(results: list[RunResult]) -> RunResult | None:
    """The OPTIMISED row of a climb (None for a climb that did not get that far)."""
    return _last_row(results, OPTIMISED)


def leanest(results: list[RunResult]) -> RunResult | None:
    """The LEANEST row of a climb (None for one that did not get that far, or saved before the ladder had that row)."""
    return _last_row(results, LEANEST)


def baseline_failure(results: list[RunResult]) -> str | None:
    """Why a climb had nothing to climb from (its first row, naive fp32, failed), else None."""
    if not results or results[0].label != T.LADDER[0].name or results[0].status in ("ok", "skipped"):
        return None
    r = results[0]
    hint = " A smaller model or batch (a smaller preset) may fit." if r.status == "oom" else ""
    return f"naive fp32, the baseline, did not finish ({r.status}: {r.reason}): there is nothing to climb from.{hint}"


def final_config(results: list[RunResult], loop: str = "optimised") -> C.TrainConfig:
    """The config of the "optimised" loop (the fastest that fits: what `export --ladder` writes by default) or the
    "leanest" (least memory); a ConfigError for another name or a climb without that row."""
    label = {"optimised": OPTIMISED, "leanest": LEANEST}.get(loop)
    if label is None:
        raise C.ConfigError(f"loop={loop!r}: choose 'optimised' (the fastest that fits) or 'leanest' (least memory)")
    row = _last_row(results, label)
    if row is None and (failed := baseline_failure(results)):
        raise C.ConfigError(f"these results hold no {loop} loop: {failed}")
    if row is None or not row.config:
        again = " again (this climb was saved before the ladder had that row)" if label == LEANEST else ""
        raise C.ConfigError(f"these results hold no {loop} loop (no {label!r} row): run the whole ladder{again}")
    return C.TrainConfig.from_dict(row.config)


def optimised_config(results: list[RunResult]) -> C.TrainConfig:
    return final_config(results, "optimised")


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
    return PAIRED if (r.label in FINAL_ROWS and lad.get("pairs")) or lad.get("pairs_vs_naive") else PRODUCT


def spread_text(r: RunResult) -> str:
    """ms per step as min-median-max over the timed steps."""
    timed = [t for i, t in enumerate(r.step_times) if i not in set(r.excluded_steps)]
    return f"{min(timed) * 1e3:.1f}-{r.median_step_s * 1e3:.1f}-{max(timed) * 1e3:.1f}" if timed else ""


LADDER_COLUMNS = {  # each column's header, and what it holds all the way down
    "vs best so far, paired": "a rung's step time against the best loop so far, timed in pairs (median, IQR)",
    "vs naive, product of pairs": "a rung not kept (or not timed with naive): the best loop's figure times its factor",
    "vs naive, paired": "a kept or final loop's speed-up over naive fp32, its steps timed in pairs with naive's (one "
    "loop, one figure: a final row and the rung that ran its loop pool their pairs)",
    "memory vs naive": "the measured peak over naive fp32's",
}


def _factor_text(factor: float | None, iqr=None) -> str:
    if factor and iqr and iqr[0]:
        return f"{factor:.2f}x ({iqr[0]:.2f}-{iqr[1]:.2f})"
    return fmt(factor, ".2f", "") + ("x" if factor else "")


def ladder_rows(results: list[RunResult]) -> list[dict[str, str]]:
    """One row per rung, then the final rows; each column means one thing all the way down (LADDER_COLUMNS)."""
    rows = []
    for r in results:
        lad = r.ladder or {}
        basis, final = speedup_basis(r), r.label in FINAL_ROWS
        paired = _factor_text(lad.get("factor"), lad.get("factor_iqr"))
        own = paired if final else _factor_text(lad.get("speedup"), lad.get("speedup_iqr"))  # its pairs with naive
        rows.append(
            {
                "rung": r.label,
                "kept": ("yes" if lad.get("kept") else "no") if r.ok or r.status != "skipped" else "-",
                "vs best so far, paired": "" if final else paired,
                "vs naive, product of pairs": _factor_text(lad.get("speedup")) if basis == PRODUCT else "",
                "vs naive, paired": own if basis == PAIRED else "",
                "ms/step min-med-max": spread_text(r) if r.ok else r.status.upper(),
                "peak GiB": r.peak_text() if r.ok else "",
                "memory vs naive": _factor_text(lad.get("memory_vs_naive")),
                "efficiency": efficiency_text(r) if r.ok else "",
                "compile s": fmt(r.compile_s, ".1f", ""),
                "why": lad.get("why") or r.reason,
            }
        )
    return rows


def ladder_table(results: list[RunResult]) -> str:
    return text_table(ladder_rows(results))


def _loop_line(row: RunResult, what: str) -> str:
    lad, basis = row.ladder, speedup_basis(row)
    if lad.get("pairs") and basis == PAIRED:
        low, high = lad["factor_iqr"]
        n, where = lad.get("pooled_pairs", len(lad["pairs"])), lad.get("pooled_with")
        speed = f"{lad['factor']:.2f}x naive fp32's speed ({low:.2f}-{high:.2f} over {n} steps timed in pairs "
        speed += f"with naive{f', here and at {where}' if where else ''})"
    elif basis == BASELINE:
        speed = "naive fp32 itself"
    else:
        speed = f"{fmt(lad.get('speedup'), '.2f')}x naive fp32's speed (the product of its rungs' factors)"
    memory = f" in {lad['memory_vs_naive']:.2f}x its peak memory" if lad.get("memory_vs_naive") else ""
    return f"{what} is {speed}{memory}"


def verdict(results: list[RunResult]) -> str:
    """What this device needs, in a few lines: each final loop against naive, what was kept and what not, and why."""
    row, lean, rungs = optimised(results), leanest(results), rungs_of(results)[1:]
    if row is None:
        return baseline_failure(results) or "The climb did not finish: no verdict."
    first = f"On {row.provenance['device']}: " + _loop_line(row, "the optimised loop") + ", the fastest that fits"
    if lean is not None and lean.ladder.get("vs_optimised") == 1.0 and lean.config == row.config:
        first += ", and it is also the leanest."
    else:
        first += "; " + _loop_line(lean, "the leanest loop") + "." if lean is not None else "."
    kept = [_short(r.label) for r in rungs if r.ladder.get("kept")]
    lines = [first, "kept: " + (", ".join(kept) if kept else "nothing")]
    for label, why in (row.ladder.get("left_out") or {}).items():
        lines.append(f"left out of the optimised loop, kept in the leanest: {_short(label)} ({why})")
    for r in rungs:
        if r.status != "skipped" and not r.ladder.get("kept"):
            why = r.ladder.get("why", r.reason).removeprefix("not kept: ")
            lines.append(f"not kept: {_short(r.label)}: {why}")
    if skipped := [r for r in rungs if r.status == "skipped"]:
        lines.append("not run: " + "; ".join(f"{_short(r.label)} ({r.reason})" for r in skipped))
    return "\n".join(lines)
