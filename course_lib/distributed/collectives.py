"""The collectives, benchmarked (notebook 07; the GPU run's NCCL benchmark): all-reduce, all-gather, reduce-scatter and
all-to-all of float32 messages, by size, on the processes of one launch (gloo on CPU processes, NCCL with a GPU each;
launch it at 2 and at 4 processes for two world sizes).

Sizes, times and bandwidths follow nccl-tests (its doc/PERFORMANCE.md), so that a number here reads like theirs:

- `bytes`, the size of a message, is the whole buffer the operation works on: all-reduce, the tensor every rank holds
  (input and output); all-gather, the gathered output (each rank gives bytes/n); reduce-scatter, the unreduced input
  (each rank keeps bytes/n of the sum); all-to-all, one rank's whole send buffer (bytes/n to each rank, itself
  included). The float32 element count is rounded down to a multiple of the world size, and the bytes record it.
- time: each repetition starts after a barrier, and counts as long as its slowest rank took (a collective is done when
  the last rank is done); the median over the repetitions is quoted, the quartiles are its spread.
- algorithm bandwidth, algbw = bytes / time; bus bandwidth, busbw = algbw x BUS_FACTOR: 2(n-1)/n for all-reduce,
  (n-1)/n for the others. busbw is what each rank's link carries in the ring algorithms (notebook 07, section 1), so it
  does not depend on n and compares with a link's peak: the number to read off the plot's plateau. (This torch's gloo
  sends an all-reduce's bytes for a reduce-scatter, notebook 07 measures: its reduce-scatter busbw understates its
  traffic 2x.)

Options: {"min_bytes": 1024, "max_bytes": ..., "factor": 4 (each size this many times the one before), "warmup": 3,
"repeats": 10, "ops": [names in OPS]}. Each rank writes its table (the same on every rank: the slowest rank's times).
`predict_allreduce_s` and `fit_allreduce` are the alpha-beta model of an all-reduce, time = latency + bytes on the bus /
busbw, and its fit to the measured points.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

from ..config import ConfigError, did_you_mean
from . import _common

OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")

# What --options may set, with the defaults (_common.check_options checks a launch's options against it). 16 MiB: a few
# seconds of gloo on a CPU, and a largest message whose time stands well above gloo's noise of a few ms on 2 busy cores,
# so that the fit finds a bandwidth; a GPU run asks for more (.ci/gpu: 256 MiB).
OPTIONS = {"min_bytes": 1024, "max_bytes": 16 * 2**20, "factor": 4, "warmup": 3, "repeats": 10, "ops": list(OPS)}


def bus_factor(op: str, world: int) -> float:
    """busbw / algbw, as nccl-tests defines it: the share of a message each rank's link carries in a ring."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}{did_you_mean(op, OPS)}: one of {', '.join(OPS)}")
    return (2 if op == "all-reduce" else 1) * (world - 1) / world


def sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """min_bytes, min_bytes * factor, ... up to max_bytes."""
    out = [min_bytes]
    while out[-1] * factor <= max_bytes:
        out.append(out[-1] * factor)
    return out


def check(options: dict) -> None:
    """A ConfigError for options that are of the right kind but make no benchmark (launch asks before any process
    starts)."""
    o = {**OPTIONS, **options}
    if o["min_bytes"] < 4 or o["max_bytes"] < o["min_bytes"]:
        raise ConfigError(f"collectives: need 4 <= min_bytes <= max_bytes, got {o['min_bytes']} and {o['max_bytes']}")
    if o["factor"] < 2 or o["warmup"] < 0 or o["repeats"] < 1:
        raise ConfigError(
            f"collectives: factor >= 2, warmup >= 0, repeats >= 1; got {o['factor']}, {o['warmup']}, {o['repeats']}"
        )
    bad = [op for op in o["ops"] if op not in OPS]
    if bad or not o["ops"]:
        raise ConfigError(
            f"collectives: ops are some of {', '.join(OPS)}; got {o['ops']}"
            + (did_you_mean(str(bad[0]), OPS) if bad else "")
        )


def _operation(op: str, n_bytes: int, world: int, device: torch.device):
    """(the call, the bytes it moves in nccl-tests' convention) for one message of about n_bytes."""
    elements = max(world, n_bytes // 4 // world * world)
    whole = torch.ones(elements, device=device)
    part = torch.ones(elements // world, device=device)
    out = torch.empty_like(whole)
    calls = {
        "all-reduce": lambda: dist.all_reduce(whole),
        "all-gather": lambda: _common.all_gather_single(whole, part),
        "reduce-scatter": lambda: _common.reduce_scatter_single(part, whole),
        "all-to-all": lambda: dist.all_to_all_single(out, whole),
    }
    return calls[op], elements * 4


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_op(ctx: _common.Ctx, op: str, n_bytes: int, warmup: int, repeats: int) -> dict:
    """One row: the op on one message size, timed `repeats` times after `warmup`, each time the slowest rank's."""
    call, moved = _operation(op, n_bytes, ctx.world, ctx.device)
    times = []
    for i in range(warmup + repeats):
        dist.barrier()
        _sync(ctx.device)
        t0 = time.perf_counter()
        call()
        _sync(ctx.device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # after the timing: every rank then writes the same row
    times = slowest.tolist()
    q1, median, q3 = statistics.quantiles(times, n=4) if len(times) > 1 else (times[0],) * 3
    median = statistics.median(times)
    algbw = moved / median
    return {
        "op": op,
        "bytes": moved,
        "times_s": times,
        "median_s": median,
        "q1_s": q1,
        "q3_s": q3,
        "algbw_Bps": algbw,
        "busbw_Bps": algbw * bus_factor(op, ctx.world),
    }


def predict_allreduce_s(n_bytes: float, world: int, latency_s: float, bus_bw: float) -> float:
    """The alpha-beta model of a ring all-reduce: a fixed cost per call (latency_s) plus the bytes each rank's link
    carries, 2(n-1)/n of the message, at the bus bandwidth (bytes/s)."""
    return latency_s + n_bytes * bus_factor("all-reduce", world) / bus_bw


def fit_allreduce(n_bytes, times_s, world: int) -> tuple[float, float]:
    """(latency_s, bus_bw in bytes/s) of the alpha-beta model through measured all-reduce points (bytes, median time).
    Least squares on the relative error, so that the small messages (which set the latency) weigh as much as the large
    ones (which set the bandwidth); a latency that would come out negative is taken as 0."""
    if world < 2:
        raise ValueError("an all-reduce on one process moves nothing: fit a launch of 2 or more processes")
    if len(n_bytes) != len(times_s) or len(n_bytes) < 2:
        raise ValueError(f"need two or more (bytes, time) points, as many of each: got {len(n_bytes)}, {len(times_s)}")
    x = torch.tensor([b * bus_factor("all-reduce", world) for b in n_bytes], dtype=torch.float64)
    t = torch.tensor(list(times_s), dtype=torch.float64)
    a = torch.stack([torch.ones_like(x), x], dim=1) / t[:, None]  # rows scaled by 1/t: relative error
    latency, per_byte = torch.linalg.lstsq(a, torch.ones_like(t)[:, None]).solution[:, 0].tolist()
    if latency < 0:  # through the origin: bandwidth only
        latency, per_byte = 0.0, float((x / t).sum() / (x * x / (t * t)).sum())
    if per_byte <= 0:
        raise ValueError("the times do not grow with the message size: no bandwidth to fit (larger max_bytes?)")
    return latency, 1.0 / per_byte


def main(argv=None) -> None:
    ctx = _common.start(argv, OPTIONS, "collectives")
    o = ctx.options
    try:
        check(o)
    except ConfigError as e:
        if ctx.is_first:
            print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    rows = [
        time_op(ctx, op, n, o["warmup"], o["repeats"])
        for op in o["ops"]
        for n in sizes(o["min_bytes"], o["max_bytes"], o["factor"])
    ]
    bus = {op: bus_factor(op, ctx.world) for op in o["ops"]}
    _common.finish(ctx, {"strategy": "collectives", "options": o, "bus_factor": bus, "rows": rows})


if __name__ == "__main__":
    main()
