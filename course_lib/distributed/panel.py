"""The runner and plots of notebooks 07's and 08's panels (widgets.Panel): a strategy run for real under torchrun.

`strategy_runner()` returns runner(cfg, label, callback, strategy, processes, microbatches), which launches
`processes` torchrun processes (course_lib.distributed.launch) running one strategy on cfg's model and batch:

    "ddp", "fsdp"      the course's one loop under DistributedDataParallel / FSDP2 (fsdp.py, {"only": ...}):
                       each rank trains on its slice of a global batch of processes x batch_size sequences
    "gpipe", "1f1b"    the model cut into one stage per process, the batch_size sequences of a step cut into
                       `microbatches` micro-batches, run with that schedule (pipeline.py)
    "tp"               every block's matmuls split across the processes, all on the same batch (tensor_parallel.py;
                       forward + backward timed, no optimizer)

and turns what every rank wrote into one row: a RunResult whose details["ranks"] holds, per rank, the
bytes it measured by category and its median step time (what `plot_rank_memory` and `plot_rank_step_times`
draw). A config the strategy cannot run (pipeline: fewer micro-batches than stages; tensor parallel: heads not
divisible by the processes) is a "skipped" row with the reason, a failed launch an "error" row with the ranks'
errors. The runner's `export_config` tells the panel's code view and export button what a run trains: DDP and FSDP2
are the course's loop with data_parallel set (a torchrun script); the pipeline and tensor parallel runs are
course_lib.distributed's own programs, not exported.
"""
from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Callable

from ..config import ConfigError, TrainConfig
from ..plots import CATEGORY_COLORS
from ..results import RunResult, provenance
from . import launch as L
from . import pipeline as P

STRATEGIES = {"ddp": "DDP", "fsdp": "FSDP2", "gpipe": "pipeline, GPipe", "1f1b": "pipeline, 1F1B", "tp": "tensor parallel"}
RANK_CATEGORIES = ("parameters", "gradients", "optimizer state", "allocated during the step")
RANK_COLORS = {**CATEGORY_COLORS, "allocated during the step": "#a0a0a0"}


def why_not(cfg: TrainConfig, strategy: str, processes: int, microbatches: int) -> str | None:
    """Why this strategy cannot run cfg on `processes` processes (None: it can)."""
    if strategy not in STRATEGIES:
        return f"unknown strategy {strategy!r}: one of {', '.join(STRATEGIES)}"
    if strategy in ("gpipe", "1f1b"):
        if microbatches < processes:
            return f"{processes} stages need at least {processes} micro-batches (one per stage), got {microbatches}"
        if cfg.batch_size % microbatches:
            return f"batch_size={cfg.batch_size} does not split into {microbatches} equal micro-batches"
        if cfg.model.n_layer < processes:
            return f"{processes} stages need at least {processes} blocks, the model has {cfg.model.n_layer}"
    if strategy == "tp" and cfg.model.n_head % processes:
        return f"tensor parallelism splits the heads: n_head={cfg.model.n_head} is not divisible by {processes} processes"
    return None


def _median_ms(times: list[float], skip: int = 1) -> float:
    kept = times[skip:] or times
    return 1e3 * statistics.median(kept)


def rank_rows(strategy: str, ranks: list[dict], microbatches: int) -> list[dict]:
    """Per rank: {"rank", "memory": {category: bytes}, "step_ms"} from the JSON each rank wrote."""
    rows = []
    for r in ranks:
        if strategy in ("ddp", "fsdp"):
            run = r[strategy]
            res = run["result"]
            mem = {k: v for k, v in run["memory"].items() if k in RANK_CATEGORIES}
            kept = [t for i, t in enumerate(res["step_times"]) if i not in set(res["excluded_steps"])] or res["step_times"]
            step_ms = 1e3 * statistics.median(kept)
        elif strategy in ("gpipe", "1f1b"):
            run = r["runs"][f"{strategy}/m={microbatches}"]
            mem = {"parameters": run["parameter_bytes"], "allocated during the step": run["step_peak_bytes"]}
            step_ms = _median_ms(run["step_times"])
        else:
            mem = {"parameters": r["parameter_bytes_sharded_local"] + r["parameter_bytes_replicated"]}
            step_ms = _median_ms(r["fwd_bwd_s_tp"], skip=0)
        rows.append({"rank": r["rank"], "memory": mem, "step_ms": step_ms})
    return rows


def launch_strategy(cfg: TrainConfig, strategy: str, processes: int, microbatches: int, timeout_s: float = 300) -> L.LaunchResult:
    """One torchrun launch of `strategy` on cfg (see the module docstring)."""
    if strategy in ("ddp", "fsdp"):
        return L.launch("fsdp", processes, cfg=export_config(cfg, strategy), options={"only": strategy}, timeout_s=timeout_s)
    if strategy in ("gpipe", "1f1b"):
        opts = {"microbatches": [microbatches], "schedules": [strategy], "steps": cfg.steps, "batch_size": cfg.batch_size,
                "n_layer": cfg.model.n_layer}
        return L.launch("pipeline", processes, cfg=cfg, options=opts, timeout_s=timeout_s)
    return L.launch("tensor_parallel", processes, cfg=cfg, options={"repeats": cfg.steps}, timeout_s=timeout_s)


def export_config(cfg: TrainConfig, strategy: str = "ddp", processes: int = 2, microbatches: int = 2) -> TrainConfig:
    """The config a DDP or FSDP2 run of the panel trains with (what course_lib.export writes as a torchrun script)."""
    if strategy not in ("ddp", "fsdp"):
        raise ConfigError(f"{STRATEGIES.get(strategy, strategy)} runs course_lib.distributed's own program, not the course's loop: "
                          "only DDP and FSDP2 are exported as training scripts")
    return replace(cfg, data_parallel=strategy)


def strategy_runner(timeout_s: float = 300) -> Callable[..., RunResult]:
    """runner(cfg, label, callback, strategy, processes, microbatches) for widgets.Panel (module docstring)."""
    from ..measure import device_name

    def runner(cfg: TrainConfig, label: str, callback, strategy: str = "ddp", processes: int = 2, microbatches: int = 2) -> RunResult:
        label = f"{label} ({STRATEGIES.get(strategy, strategy)} x{processes})"
        reason = why_not(cfg, strategy, processes, microbatches)
        if reason:
            return RunResult(label=label, status="skipped", config=cfg.to_dict(), provenance=provenance(device_name(cfg.device)), reason=reason)
        res = launch_strategy(cfg, strategy, processes, microbatches, timeout_s)
        if not res.ok:
            return RunResult(label=label, status="error", config=cfg.to_dict(), provenance=provenance(device_name(cfg.device)),
                             reason=res.why()[:400])
        ranks = rank_rows(strategy, res.ranks, microbatches)
        rank0 = res.ranks[0]
        step_s = max(r["step_ms"] for r in ranks) / 1e3  # a step is as slow as its slowest rank
        # Tokens one step trains on: DDP/FSDP a slice per rank; pipeline and tensor parallel one batch for all.
        tokens = cfg.tokens_per_step * (processes if strategy in ("ddp", "fsdp") else 1)
        totals = [sum(v for v in r["memory"].values() if v) for r in ranks]
        biggest = ranks[totals.index(max(totals))]
        result = RunResult(label=label, status="ok", config=cfg.to_dict(), provenance=rank0["provenance"], median_step_s=step_s,
                           tokens_per_step=tokens, tokens_per_s=tokens / step_s,
                           memory={"peak_bytes": max(totals), "by_category": dict(biggest["memory"]), "saved_for_backward_bytes": None,
                                   "reserved_bytes": None, "method": f"largest rank (rank {biggest['rank']}): {', '.join(biggest['memory'])}"})
        if strategy in ("ddp", "fsdp"):
            r0 = rank0[strategy]["result"]
            result.losses, result.step_times, result.excluded_steps = r0["losses"], r0["step_times"], r0["excluded_steps"]
        details = {"strategy": strategy, "processes": processes, "microbatches": microbatches, "ranks": ranks,
                   "launch_wall_s": res.wall_s}
        if strategy in ("gpipe", "1f1b"):
            key = f"{strategy}/m={microbatches}"
            details["bubble"] = {"formula": P.bubble_fraction(processes, microbatches), "measured": P.measured_bubble(res.ranks, key)}
            result.reason = (f"bubble: measured {details['bubble']['measured']:.2f}, formula (p-1)/(m+p-1) = "
                             f"{details['bubble']['formula']:.2f}")
        elif strategy == "tp":
            result.reason = f"forward + backward only; logits differ from one process by {rank0['max_abs_logit_diff']:.1e}"
        else:
            result.reason = f"global batch {processes} x {cfg.batch_size} sequences"
        callback(cfg.steps - 1, result)
        return result.with_details(**details)

    runner.export_config = export_config  # what widgets.Panel's code view and export button write
    return runner


def _rank_bars(results: list[RunResult]):
    """(x position, run, rank row) for every rank of every run with rank details, runs separated by a gap."""
    x, out, ticks = 0.0, [], []
    for r in results:
        ranks = getattr(r, "details", {}).get("ranks")
        if not ranks:
            continue
        start = x
        for row in ranks:
            out.append((x, r, row))
            x += 1
        ticks.append(((start + x - 1) / 2, r.label))
        x += 0.8
    return out, ticks


def plot_rank_memory(results: list[RunResult], ax):
    """Bytes per rank, stacked by what each strategy measured (DDP/FSDP2: parameters, gradients, optimizer state;
    pipeline: the stage's parameters and what a step allocated; tensor parallel: the rank's parameters)."""
    bars, ticks = _rank_bars(results)
    seen = set()
    for x, _r, row in bars:
        bottom = 0.0
        for cat in RANK_CATEGORIES:
            v = row["memory"].get(cat)
            if v:
                ax.bar(x, v / 2**20, bottom=bottom, color=RANK_COLORS[cat], label=None if cat in seen else cat, width=0.9)
                seen.add(cat)
                bottom += v / 2**20
        ax.annotate(str(row["rank"]), (x, bottom), ha="center", va="bottom", fontsize=6)
    ax.set_xticks([t for t, _ in ticks], [lab for _, lab in ticks], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("MiB per rank (number: the rank)")
    ax.set_title(f"Memory per rank\n{_devices(results)}", fontsize=9)
    if seen:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.margins(y=0.15)
    return ax.figure


def plot_rank_step_times(results: list[RunResult], ax):
    """Median step time of every rank of every run (tensor parallel: forward + backward), in ms."""
    bars, ticks = _rank_bars(results)
    colors = {s: f"C{i}" for i, s in enumerate(STRATEGIES)}
    for x, r, row in bars:
        ax.bar(x, row["step_ms"], color=colors.get(r.details["strategy"], "#888888"), width=0.9)
        ax.annotate(str(row["rank"]), (x, row["step_ms"]), ha="center", va="bottom", fontsize=6)
    ax.set_xticks([t for t, _ in ticks], [lab for _, lab in ticks], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("median step time per rank (ms)")
    ax.set_title(f"Step time per rank\n{_devices(results)}", fontsize=9)
    ax.margins(y=0.15)
    return ax.figure


def _devices(results: list[RunResult]) -> str:
    return " / ".join(sorted({r.provenance.get("device", "?") for r in results})) or "?"
