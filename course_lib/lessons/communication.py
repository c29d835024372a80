"""Notebook 07's communication, shown: the collectives benchmark (course_lib.distributed.collectives) collected into one
table with where it came from, saved as JSON and plotted so that the latency (the small messages' floor) and the bus
bandwidth (the large messages' plateau) can be read off; the alpha-beta prediction of the hand-written naive DDP's
all-reduces; and the hand-written DDPs (course_lib.distributed.ddp_by_hand) drawn beside torch's, with the bucket sweep.

Nothing here launches a process: the notebook launches (course_lib.distributed.launch) and hands the ranks' JSON over.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch.nn as nn

from ..cache import write_atomic
from ..capabilities import cpu_model
from ..distributed.collectives import OPS, fit_allreduce, predict_allreduce_s
from ..plots import new_figure

OP_COLORS = dict(zip(OPS, ("C0", "C1", "C2", "C3")))
WORLD_STYLES = ("-", "--", ":", "-.")


# ---- the collectives ---------------------------------------------------------------------------------------------


def collect(*launches: list[dict]) -> dict:
    """One table from the ranks' JSON of one or more collectives launches (a LaunchResult's `.ranks` each, e.g. at 2 and
    at 4 processes): {"provenance" (device, CPU model, torch, date, commit), "backend", "worlds", "rows"}; a row per
    world size, op and message size, with the slowest rank's median time, its quartiles and the bandwidths in GB/s
    (1e9 bytes/s, as nccl-tests prints them). Every rank holds the same rows (collectives.py): rank 0's are taken."""
    if not launches or not all(launches):
        raise ValueError("collect needs the ranks of at least one finished collectives launch")
    first = launches[0][0]
    rows = []
    for ranks in launches:
        r0 = ranks[0]
        if r0.get("strategy") != "collectives":
            raise ValueError(f"not a collectives launch: strategy {r0.get('strategy')!r}")
        for row in r0["rows"]:
            rows.append(
                {
                    "world": r0["world_size"],
                    "op": row["op"],
                    "bytes": row["bytes"],
                    "median_s": row["median_s"],
                    "q1_s": row["q1_s"],
                    "q3_s": row["q3_s"],
                    "algbw_GBps": row["algbw_Bps"] / 1e9,
                    "busbw_GBps": row["busbw_Bps"] / 1e9,
                }
            )
    return {
        "provenance": {**first["provenance"], "cpu_model": cpu_model()},
        "backend": first["backend"],
        "worlds": sorted({r["world"] for r in rows}),
        "rows": rows,
    }


def save(table: dict, path: str | Path) -> Path:
    """The table as JSON, written in one step (a failed write raises and leaves an older file whole)."""
    path = Path(path)
    write_atomic(path, lambda p: p.write_text(json.dumps(table, indent=1)), strict=True)
    return path


def format_table(table: dict) -> str:
    """The table as text, one line per world size, op and size, units in the header."""
    lines = [
        f"{table['provenance']['device']}, {table['backend']}, torch {table['provenance']['torch']}, "
        f"{table['provenance']['date']}",
        f"{'N':>2} {'collective':<15}{'bytes':>10} {'median µs':>10} {'spread (IQR) µs':>17} {'algbw GB/s':>11} "
        f"{'busbw GB/s':>11}",
    ]
    for r in table["rows"]:
        spread = f"{r['q1_s'] * 1e6:.0f}-{r['q3_s'] * 1e6:.0f}"
        lines.append(
            f"{r['world']:>2} {r['op']:<15}{r['bytes']:>10,} {r['median_s'] * 1e6:>10.0f} {spread:>17} "
            f"{r['algbw_GBps']:>11.3f} {r['busbw_GBps']:>11.3f}"
        )
    return "\n".join(lines)


def fit(table: dict, world: int) -> tuple[float, float]:
    """(latency in s, bus bandwidth in bytes/s) of the alpha-beta model through the table's all-reduce points at
    `world` processes (collectives.fit_allreduce)."""
    points = [(r["bytes"], r["median_s"]) for r in table["rows"] if r["op"] == "all-reduce" and r["world"] == world]
    if not points:
        raise ValueError(f"no all-reduce measured at {world} processes in this table (worlds: {table['worlds']})")
    return fit_allreduce([b for b, _ in points], [t for _, t in points], world)


def plot(table: dict):
    """Two panels: time against message size (log-log; the quartiles as error bars, the fitted all-reduce model as a
    black line), where the flat start is the latency; and the bus bandwidth against size, whose plateau is the
    bandwidth. One colour per op, one line style per world size."""
    fig = new_figure((11, 3.8))
    ax_t, ax_bw = fig.subplots(1, 2)
    for i, world in enumerate(table["worlds"]):
        style = WORLD_STYLES[i % len(WORLD_STYLES)]
        for op in OPS:
            rows = [r for r in table["rows"] if r["op"] == op and r["world"] == world]
            if not rows:
                continue
            x = [r["bytes"] for r in rows]
            med = [r["median_s"] * 1e6 for r in rows]
            err = [[m - r["q1_s"] * 1e6 for m, r in zip(med, rows)], [r["q3_s"] * 1e6 - m for m, r in zip(med, rows)]]
            label = f"{op}, N={world}"
            ax_t.errorbar(x, med, yerr=err, fmt="o" + style, ms=3, capsize=2, color=OP_COLORS[op])  # legend: right
            ax_bw.plot(x, [r["busbw_GBps"] for r in rows], "o" + style, ms=3, color=OP_COLORS[op], label=label)
        if world > 1:
            latency, bw = fit(table, world)
            x = sorted({r["bytes"] for r in table["rows"] if r["world"] == world})
            ax_t.plot(
                x,
                [predict_allreduce_s(b, world, latency, bw) * 1e6 for b in x],
                "k" + style,
                lw=1,
                label=f"all-reduce model, N={world}: {latency * 1e6:.0f} µs + bytes x 2(N-1)/N / {bw / 1e9:.2f} GB/s",
            )
    ax_t.set(xscale="log", yscale="log", xlabel="message size (bytes, nccl-tests' convention)", ylabel="time (µs)")
    ax_t.set_title("Time per collective: the flat start is the latency", fontsize=9)
    ax_bw.set(xscale="log", xlabel="message size (bytes)", ylabel="bus bandwidth (GB/s, 1e9 bytes/s)")
    ax_bw.set_title("Bus bandwidth: the plateau is the link's bandwidth", fontsize=9)
    ax_bw.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax_t.legend(fontsize=6, loc="upper left")
    p = table["provenance"]
    fig.suptitle(f"{p['device']}, {table['backend']}, torch {p['torch']}, {p['date'][:10]}: measured", fontsize=9)
    return fig


def predict_naive_ddp_s(model: nn.Module, world: int, latency_s: float, bus_bw: float) -> float:
    """What the naive DDP's communication should cost by the alpha-beta model: one all-reduce per gradient tensor (each
    parameter once, as NaiveDDP sends them), each paying the latency and its bytes at the bus bandwidth."""
    return sum(
        predict_allreduce_s(p.numel() * p.element_size(), world, latency_s, bus_bw)
        for p in model.parameters()
        if p.requires_grad
    )


# ---- DDP by hand ---------------------------------------------------------------------------------------------------


def ddp_rows(ranks: list[dict]) -> list[dict]:
    """One row per run of a ddp_by_hand launch (the ranks' JSON): its name, bucket size (KiB, 0: none), the slowest
    rank's median step time and exposed communication (ms; None for torch's DDP, which does not expose it), all-reduce
    calls per step, and the largest parameter difference from torch's DDP over the ranks."""
    rows = []
    for i, r0 in enumerate(ranks[0]["runs"]):
        runs = [rank["runs"][i] for rank in ranks]
        kb = r0["bucket_bytes"] // 1024
        exposed = [r["exposed_comm_s"] for r in runs]
        rows.append(
            {
                "name": _run_name(r0),
                "variant": r0["variant"],
                "bucket_kb": kb,
                "step_ms": 1e3 * max(r["median_step_s"] for r in runs),
                "exposed_ms": None if None in exposed else 1e3 * max(exposed),
                "calls_per_step": r0["allreduce_calls_per_step"],
                "max_param_diff": max(r["max_abs_param_diff_vs_torch_ddp"] for r in runs),
            }
        )
    return rows


def plot_ddp_by_hand(ranks: list[dict]):
    """Left: each DDP's step time, with the part of it spent waiting for communication after backward (exposed);
    right: the bucketed DDP's step time and exposed communication against its bucket size, calls per step marked."""
    rows = ddp_rows(ranks)
    fig = new_figure((11, 3.6))
    ax, ax_b = fig.subplots(1, 2)
    names = [r["name"] for r in rows]
    ax.bar(names, [r["step_ms"] for r in rows], color="#c6d5ea", label="step time")
    ax.bar(names, [r["exposed_ms"] or 0 for r in rows], color="#c44e52", label="of which exposed communication")
    for i, r in enumerate(rows):
        if r["exposed_ms"] is None:
            ax.annotate("exposed: not\nmeasured", (i, 0), ha="center", va="bottom", fontsize=6)
    ax.tick_params(axis="x", labelrotation=30, labelsize=7)
    ax.set(ylabel="ms per step (slowest rank, median)")
    ax.set_title("Step time and the communication backward did not hide", fontsize=9)
    ax.legend(fontsize=7)
    buckets = [r for r in rows if r["variant"] == "bucketed"]
    if buckets:
        x = [r["bucket_kb"] for r in buckets]
        ax_b.plot(x, [r["step_ms"] for r in buckets], "o-", color="#4c72b0", label="step time")
        ax_b.plot(x, [r["exposed_ms"] for r in buckets], "s--", color="#c44e52", label="exposed communication")
        for r in buckets:
            n = r["calls_per_step"]
            ax_b.annotate(
                f"{n:g} call{'' if n == 1 else 's'}",
                (r["bucket_kb"], r["step_ms"]),
                ha="center",
                va="bottom",
                fontsize=7,
            )
        ax_b.set(xscale="log", xlabel="bucket size (KiB)", ylabel="ms per step (slowest rank, median)")
        ax_b.set_ylim(bottom=0)
        ax_b.margins(x=0.15)
        ax_b.legend(fontsize=7)
    ax_b.set_title("Bucket sweep: fewer, larger messages, or more overlap", fontsize=9)
    p = ranks[0]["provenance"]
    fig.suptitle(
        f"{len(ranks)} processes on {p['device']}, {ranks[0]['backend']}, torch {p['torch']}: measured", fontsize=9
    )
    return fig


def plot_overlap_timeline(ranks: list[dict]):
    """Each rank's last timed step, one row per hand-written DDP: forward and backward (blue), then the wait for the
    communication still in flight (red), and a tick where each all-reduce left the rank. The overlapped and bucketed
    DDPs send during backward (ticks inside the blue bar); the naive one sends only after it."""
    runs = [(rank["rank"], r) for rank in ranks for r in rank["runs"] if r.get("timeline_last_step")]
    fig = new_figure((9, 0.45 * len(runs) + 1.2))
    ax = fig.subplots()
    for y, (rank, r) in enumerate(runs):
        t = r["timeline_last_step"]
        ax.barh(y, 1e3 * t["backward_done"], color="#c6d5ea", edgecolor="white")
        ax.barh(y, 1e3 * (t["waited_until"] - t["backward_done"]), left=1e3 * t["backward_done"], color="#c44e52")
        ax.plot([1e3 * x for x in t["launches"]], [y] * len(t["launches"]), "|", color="black", markersize=9)
    ax.set_yticks(range(len(runs)), [f"rank {rank}: {_run_name(r)}" for rank, r in runs], fontsize=7)
    ax.invert_yaxis()
    ax.set(xlabel="ms from the step's forward (blue: forward and backward; red: the wait after it; |: an all-reduce)")
    ax.set_title("When each rank's gradients left it, in its last step", fontsize=9)
    return fig


def _run_name(r: dict) -> str:
    kb = r["bucket_bytes"] // 1024
    return {"bucketed": f"bucketed {kb} KiB", "torch": "torch DDP"}.get(r["variant"], r["variant"])
