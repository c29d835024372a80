"""The runner and plots of notebooks 07's and 08's panels (widgets.Panel): a strategy run for real under torchrun.

`strategy_runner()` returns runner(cfg, label, callback, strategy, processes, microbatches), which launches
`processes` torchrun processes (course_lib.distributed.launch) running one strategy on cfg's model and batch.
Notebook 07's strategies (DATA_PARALLEL), each rank training on its slice of a global batch of processes x batch_size
sequences with the course's one loop:

    "ddp", "zero1", "zero2", "fsdp"   ZeRO stages 0 to 3 (zero_stages.py: DDP, DDP + ZeroRedundancyOptimizer, FSDP2
                                      keeping the gathered parameters from forward to backward, FSDP2)
    "resume"                          FSDP2 saving a sharded checkpoint halfway (DCP) and resuming from it in a new
                                      model and optimizer (resume.py)

Notebook 08's (MODEL_PARALLEL):

    "gpipe", "1f1b"    the model cut into one stage per process, the batch_size sequences of a step cut into
                       `microbatches` micro-batches, run with that schedule (pipeline.py)
    "tp", "tp_sp"      every block's matmuls split across the processes, without and with sequence parallelism, all on
                       the same batch (tensor_parallel.py; forward + backward, no optimizer)
    "moe"              the model's MLPs made 4 experts, top-2, split across the processes (expert_parallel.py; forward +
                       backward, each rank on its slice of the batch)

Every run becomes one row: a RunResult whose details["ranks"] holds, per rank, the bytes it measured by category
("memory"), the bytes it sent by kind of collective ("sent": the counted collectives of one step times the ring
algorithms' share, zero_memory.bytes_sent; all-to-all: the bytes expert parallelism itself handed to other ranks), what
it wrote to its sockets meanwhile ("written": measured, gloo on Linux; None elsewhere) and its step time. That is what
`plot_rank_memory` and `plot_rank_bytes` draw. A config the strategy cannot run is a "skipped" row with the reason, a
failed launch an "error" row with the ranks' errors. The runner's `export_config` tells the panel's code view and export
button what a run trains: DDP and FSDP2 are the course's loop with data_parallel set (a torchrun script); the other
strategies run course_lib.distributed's own programs, not exported."""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Callable

from ..config import ConfigError, TrainConfig
from ..plots import CATEGORY_COLORS, devices_text
from ..results import RunResult
from . import launch as L, pipeline as P, zero_memory as Z

DATA_PARALLEL = {
    "ddp": "DDP (ZeRO-0)",
    "zero1": "ZeRO-1",
    "zero2": "ZeRO-2",
    "fsdp": "FSDP2 (ZeRO-3)",
    "resume": "checkpoint/resume (FSDP2)",
}
MODEL_PARALLEL = {
    "gpipe": "pipeline, GPipe",
    "1f1b": "pipeline, 1F1B",
    "tp": "tensor parallel",
    "tp_sp": "tensor + sequence parallel",
    "moe": "MoE, expert parallel",
}
STRATEGIES = {**DATA_PARALLEL, **MODEL_PARALLEL}
ZERO_STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "fsdp": 3}
MOE_EXPERTS, MOE_TOP_K, MOE_CAPACITY = 4, 2, 1.25
RANK_CATEGORIES = (
    "parameters",
    "expert parameters",
    "gradients",
    "optimizer state",
    "gathered for the step",
    "allocated during the step",
    "activations saved for backward",
)
RANK_COLORS = {
    **CATEGORY_COLORS,
    "expert parameters": "#8172b3",
    "gathered for the step": "#c6d5ea",
    "allocated during the step": "#a0a0a0",
    "activations saved for backward": CATEGORY_COLORS.get("activations", "#c44e52"),
}
KIND_COLORS = {
    "all-reduce": "C0",
    "all-gather": "C1",
    "reduce-scatter": "C2",
    "broadcast": "C3",
    "send": "C4",
    "all-to-all": "C5",
    "receive": "C7",
}


def why_not(cfg: TrainConfig, strategy: str, processes: int, microbatches: int) -> str | None:
    """Why this strategy cannot run cfg on `processes` processes (None: it can)."""
    if strategy not in STRATEGIES:
        return f"unknown strategy {strategy!r}: one of {', '.join(STRATEGIES)}"
    # resume: a step before the checkpoint, and two after it (the last one counted)
    least = 3 if strategy == "resume" else 2
    if (strategy in ZERO_STAGE or strategy == "resume") and cfg.steps < least:
        return (
            f"{STRATEGIES[strategy]} counts the collectives of a last step after a first one: "
            f"steps >= {least}, got {cfg.steps}"
        )
    if strategy in ("gpipe", "1f1b"):
        if microbatches < processes:
            return f"{processes} stages need at least {processes} micro-batches (one per stage), got {microbatches}"
        if cfg.batch_size % microbatches:
            return f"batch_size={cfg.batch_size} does not split into {microbatches} equal micro-batches"
        if cfg.model.n_layer < processes:
            return f"{processes} stages need at least {processes} blocks, the model has {cfg.model.n_layer}"
    if strategy in ("tp", "tp_sp") and cfg.model.n_head % processes:
        return (
            f"tensor parallelism splits the heads: n_head={cfg.model.n_head} is not divisible by {processes} processes"
        )
    if strategy == "tp_sp" and cfg.context % processes:
        return (
            f"sequence parallelism splits the sequence: context={cfg.context} is not divisible by {processes} processes"
        )
    if strategy == "moe" and MOE_EXPERTS % processes:
        return (
            f"expert parallelism splits the {MOE_EXPERTS} experts of each layer evenly: not over {processes} processes"
        )
    return None


def _median_ms(times: list[float], skip: int = 1) -> float | None:
    kept = times[skip:] or times
    return 1e3 * statistics.median(kept) if kept else None


def _sent(collectives: dict, n: int) -> dict[str, float]:
    """Bytes this rank sent, by kind: the counted bytes times each kind's ring share for the size of the group each call
    ran on (zero_memory.sent_by_kind; n, the world's size, where the record has no group sizes)."""
    return {kind: b for kind, b in Z.sent_by_kind(collectives, n).items() if b}


def rank_rows(strategy: str, ranks: list[dict], microbatches: int) -> list[dict]:
    """Per rank: {"rank", "memory": {category: bytes}, "sent": {kind: bytes}, "written": bytes or None, "step_ms"}
    from the JSON each rank wrote."""
    rows, n = [], len(ranks)
    for r in ranks:
        if strategy in ZERO_STAGE or strategy == "resume":
            run = r["runs"][str(ZERO_STAGE[strategy])] if strategy in ZERO_STAGE else r["resumed_in_place"]
            held = run["memory"]
            between = held.get("parameters between steps", held.get("parameters"))
            mem = {"parameters": between, "gradients": held["gradients"], "optimizer state": held["optimizer state"]}
            # what the step gathered beyond the rank's own (ZeRO-2 keeps it to backward)
            if "parameters after forward" in held:
                mem["gathered for the step"] = max(0, held["parameters after forward"] - between)
            res = run["result"]
            kept = [t for i, t in enumerate(res["step_times"]) if i not in set(res["excluded_steps"])] or res[
                "step_times"
            ]
            step_ms = _median_ms(kept, skip=0)
            sent, written = _sent(run["collectives_last_step"], n), run["written_last_step"]
        elif strategy in ("gpipe", "1f1b"):
            run = r["runs"][f"{strategy}/m={microbatches}"]
            mem = {"parameters": run["parameter_bytes"], "allocated during the step": run["step_peak_bytes"]}
            step_ms = _median_ms(run["step_times"])
            sent, written = _sent(run["collectives_last_step"], n), run["written_last_step"]
        elif strategy in ("tp", "tp_sp"):
            v = r if strategy == "tp" else r["sequence_parallel"]
            mem = {"parameters": r["parameter_bytes_sharded_local"] + r["parameter_bytes_replicated"]}
            if "sequence_parallel" in r:  # the CPU ledger's activations of one forward and backward (dropout on)
                mem["activations saved for backward"] = r["sequence_parallel"]["memory"][strategy][
                    "saved_for_backward_bytes"
                ]
            step_ms = _median_ms(
                r["fwd_bwd_s_tp"] if strategy == "tp" else r["sequence_parallel"]["fwd_bwd_s_tp_sp"], skip=0
            )
            sent, written = _sent(v["collectives_fwd_bwd"], n), v["written_fwd_bwd"]
        else:  # moe: what expert parallelism handed to other ranks, counted by its own exchange
            mem = {
                "parameters": r["parameter_bytes_expert_parallel"] - r["expert_bytes_local"],
                "expert parameters": r["expert_bytes_local"],
            }
            sent = {"all-to-all": sum(ph["bytes_to_other_ranks"] for ph in r["all_to_all"].values())}
            written, step_ms = r["written_fwd_bwd"], 1e3 * r["fwd_bwd_s"]
        rows.append({"rank": r["rank"], "memory": mem, "sent": sent, "written": written, "step_ms": step_ms})
    return rows


def launch_strategy(
    cfg: TrainConfig, strategy: str, processes: int, microbatches: int, timeout_s: float = 300
) -> L.LaunchResult:
    """One torchrun launch of `strategy` on cfg (see the module docstring)."""
    if strategy in ZERO_STAGE:
        return L.launch(
            "zero_stages",
            processes,
            cfg=cfg,
            timeout_s=timeout_s,
            options={"steps": cfg.steps, "stages": [ZERO_STAGE[strategy]], "reference": False},
        )
    if strategy == "resume":
        return L.launch(
            "resume",
            processes,
            cfg=cfg,
            timeout_s=timeout_s,
            options={
                "steps": cfg.steps,
                "global_batch": processes * cfg.batch_size,
                "save_at": [cfg.steps // 2],
                "resume_in_place": True,
            },
        )
    if strategy in ("gpipe", "1f1b"):
        opts = {
            "microbatches": [microbatches],
            "schedules": [strategy],
            "steps": cfg.steps,
            "batch_size": cfg.batch_size,
            "n_layer": cfg.model.n_layer,
        }
        return L.launch("pipeline", processes, cfg=cfg, options=opts, timeout_s=timeout_s)
    if strategy in ("tp", "tp_sp"):
        return L.launch(
            "tensor_parallel",
            processes,
            cfg=cfg,
            timeout_s=timeout_s,
            # with sequence parallelism the launch also measures both variants' activations (the memory
            # plot)
            options={"repeats": cfg.steps, "sequence_parallel": strategy == "tp_sp" or cfg.context % processes == 0},
        )
    return L.launch(
        "expert_parallel",
        processes,
        cfg=cfg,
        timeout_s=timeout_s,
        options={"n_experts": MOE_EXPERTS, "top_k": MOE_TOP_K, "capacity_factor": MOE_CAPACITY},
    )


def export_config(cfg: TrainConfig, strategy: str = "ddp", processes: int = 2, microbatches: int = 2) -> TrainConfig:
    """The config a DDP or FSDP2 run of the panel trains with (what course_lib.export writes as a torchrun script)."""
    if strategy not in ("ddp", "fsdp"):
        raise ConfigError(
            f"{STRATEGIES.get(strategy, strategy)} runs course_lib.distributed's own program, not the course's loop: "
            "only DDP and FSDP2 are exported as training scripts"
        )
    return replace(cfg, data_parallel=strategy)


def _note(
    strategy: str, processes: int, microbatches: int, cfg: TrainConfig, rank0: dict, rows: list[dict], ranks: list[dict]
) -> tuple[str, dict]:
    """The row's note (what the run shows beyond the plots) and the details behind it."""
    sent = sum(sum(r["sent"].values()) for r in rows) / len(rows)
    written = [r["written"] for r in rows]
    wire = f", written to sockets {sum(written) / len(rows) / 2**20:.2f} MiB (measured)" if None not in written else ""
    traffic = f"sent per rank {sent / 2**20:.2f} MiB (counted x ring share){wire}"
    if strategy in ("gpipe", "1f1b"):
        bubble = {
            "formula": P.bubble_fraction(processes, microbatches),
            "measured": P.measured_bubble(ranks, f"{strategy}/m={microbatches}"),
        }
        return (
            f"bubble: measured {bubble['measured']:.2f}, formula (p-1)/(m+p-1) = {bubble['formula']:.2f}; {traffic}",
            {"bubble": bubble},
        )
    if strategy in ("tp", "tp_sp"):
        v = rank0 if strategy == "tp" else rank0["sequence_parallel"]
        return f"forward + backward; logits differ from one process by {v['max_abs_logit_diff']:.1e}; {traffic}", {}
    if strategy == "moe":
        kept = sum(sum(ld["kept"]) for ld in rank0["expert_load"])
        chosen = sum(sum(ld["chosen"]) for ld in rank0["expert_load"])
        return (
            f"forward + backward, {MOE_EXPERTS} experts top-{MOE_TOP_K} c={MOE_CAPACITY}: "
            f"rank 0 kept {kept} of {chosen} assignments; "
            f"logits differ from one process by {max(r['max_abs_logit_diff'] for r in ranks):.1e}; {traffic}",
            {},
        )
    if strategy == "resume":
        whole = [r["run"]["result"]["losses"][cfg.steps // 2 :] for r in ranks]
        again = [r["resumed_in_place"]["result"]["losses"] for r in ranks]
        diff = max(abs(a - b) for w, g in zip(whole, again) for a, b in zip(w, g))
        files = [r["checkpoint_rank_bytes"][f"step_{cfg.steps // 2:06d}"] for r in ranks]
        return (
            f"resumed at step {cfg.steps // 2} in a new model and optimizer: "
            f"largest |loss - uninterrupted| {diff:.1e}; "
            f"checkpoint files per rank {', '.join(f'{b / 2**20:.2f}' for b in files)} MiB; {traffic}",
            {"resumed_loss_diff": diff, "checkpoint_rank_bytes": files},
        )
    return f"global batch {processes} x {cfg.batch_size} sequences; {traffic}", {}


def strategy_runner(timeout_s: float = 300) -> Callable[..., RunResult]:
    """runner(cfg, label, callback, strategy, processes, microbatches) for widgets.Panel (module docstring)."""

    def runner(
        cfg: TrainConfig, label: str, callback, strategy: str = "ddp", processes: int = 2, microbatches: int = 2
    ) -> RunResult:
        label = f"{label} ({STRATEGIES.get(strategy, strategy)} x{processes})"
        reason = why_not(cfg, strategy, processes, microbatches)
        if reason:
            return RunResult.failed(cfg, label, "skipped", reason)
        res = launch_strategy(cfg, strategy, processes, microbatches, timeout_s)
        if not res.ok:
            return RunResult.failed(cfg, label, "error", res.why()[:400])
        rows = rank_rows(strategy, res.ranks, microbatches)
        rank0 = res.ranks[0]
        times = [r["step_ms"] for r in rows if r["step_ms"] is not None]
        step_s = max(times) / 1e3 if times else None  # a step is as slow as its slowest rank
        # Tokens one step trains on: data parallel (and MoE) a slice per rank; pipeline and tensor parallel one batch
        # for all.
        tokens = cfg.tokens_per_step * (processes if strategy in DATA_PARALLEL or strategy == "moe" else 1)
        totals = [sum(v for v in r["memory"].values() if v) for r in rows]
        biggest = rows[totals.index(max(totals))]
        result = RunResult(
            label=label,
            status="ok",
            config=cfg.to_dict(),
            provenance=rank0["provenance"],
            median_step_s=step_s,
            tokens_per_step=tokens,
            tokens_per_s=tokens / step_s if step_s else None,
            memory={
                "peak_bytes": max(totals),
                "by_category": dict(biggest["memory"]),
                "saved_for_backward_bytes": None,
                "reserved_bytes": None,
                "method": f"largest rank (rank {biggest['rank']}): {', '.join(biggest['memory'])}",
            },
        )
        if strategy in ZERO_STAGE:
            r0 = rank0["runs"][str(ZERO_STAGE[strategy])]["result"]
            result.losses, result.step_times, result.excluded_steps = (
                r0["losses"],
                r0["step_times"],
                r0["excluded_steps"],
            )
        result.reason, more = _note(strategy, processes, microbatches, cfg, rank0, rows, res.ranks)
        details = {
            "strategy": strategy,
            "processes": processes,
            "microbatches": microbatches,
            "ranks": rows,
            "launch_wall_s": res.wall_s,
            **more,
        }
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


def _stacked(ax, bars, key: str, order, colors) -> set:
    """One stacked bar per rank of row[key] ({name: bytes}), in MiB; returns the names drawn."""
    seen: set = set()
    for x, _r, row in bars:
        bottom = 0.0
        for name in [*order, *sorted(set(row[key]) - set(order))]:
            v = row[key].get(name)
            if v:
                ax.bar(
                    x,
                    v / 2**20,
                    bottom=bottom,
                    color=colors.get(name, "#888888"),
                    label=None if name in seen else name,
                    width=0.9,
                )
                seen.add(name)
                bottom += v / 2**20
        ax.annotate(str(row["rank"]), (x, bottom), ha="center", va="bottom", fontsize=6)
    return seen


def _finish(ax, ticks, results, ylabel: str, title: str, legend: bool) -> None:
    ax.set_xticks([t for t, _ in ticks], [lab for _, lab in ticks], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{title}\n{devices_text(results)}", fontsize=9)
    if legend:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.margins(y=0.15)


def plot_rank_memory(results: list[RunResult], ax):
    """Bytes per rank, stacked by what each strategy measured (ZeRO stages: parameters held between steps, what the
    step gathered beyond them, gradients, optimizer state; pipeline: the stage's parameters and what a step allocated;
    tensor parallel: the rank's parameters and the activations one forward saved; MoE: replicated and expert
    parameters)."""
    bars, ticks = _rank_bars(results)
    seen = _stacked(ax, bars, "memory", RANK_CATEGORIES, RANK_COLORS)
    _finish(ax, ticks, results, "MiB per rank (number: the rank)", "Memory per rank, measured", bool(seen))
    return ax.figure


def plot_rank_bytes(results: list[RunResult], ax):
    """Bytes each rank sent in one step (tensor parallel and MoE: one forward and backward), stacked by kind of
    collective: the counted bytes times the ring algorithms' share (zero_memory.sent_share; all-to-all as expert
    parallelism counted it). A black tick: what the rank wrote to its sockets meanwhile, measured (gloo on Linux)."""
    bars, ticks = _rank_bars(results)
    seen = _stacked(ax, bars, "sent", tuple(KIND_COLORS), KIND_COLORS)
    measured = [(x, row["written"]) for x, _r, row in bars if row.get("written") is not None]
    if measured:
        ax.plot(
            [x for x, _ in measured],
            [w / 2**20 for _, w in measured],
            "k_",
            ms=14,
            mew=2,
            label="written to sockets (measured)",
        )
    _finish(ax, ticks, results, "MiB sent per rank and step", "Bytes communicated per rank", bool(seen or measured))
    return ax.figure


def shipped_runs(strategies, folder=None) -> list[tuple]:
    """(file, run, metadata) for every shipped reference run (reference.load_reference; default folder data/reference/)
    that this runner made with one of `strategies` (its details["strategy"]): a panel's results saved on a GPU node
    (widgets.Panel's save_to) and committed there. The shipped ladders (`ladder --json`) hold no such run."""
    from .. import reference

    return [
        (f, r, meta)
        for f, results, meta in reference.load_reference(folder=folder)
        for r in results
        if r.details.get("strategy") in strategies
    ]
