"""The smallest distributed program: every rank all-reduces its rank number. Options: {"mode": "ok"}, or
"fail" (the last rank raises), "hang" (the last rank never reaches the collective) or "killed" (the last rank is
killed by SIGKILL, as the out-of-memory killer does, while the others wait in the collective) to show how the launcher
reports a failed, hung or killed run and stops every process; {"measure_bytes": B} also runs an all-reduce, an
all-gather, a reduce-scatter and a broadcast of B bytes each (the full side of the exchange, as
_common.CollectiveCounter counts it) and records, for each, the bytes this rank wrote to its sockets meanwhile (gloo on
Linux; None elsewhere): what one rank really sends, beside the ring algorithms' formula (zero_memory.sent_share)."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

from . import _common

# What --options may set, with the defaults (_common.check_options checks a launch's options against it).
OPTIONS = {"mode": "ok", "measure_bytes": 0}


def measure_sends(ctx: _common.Ctx, nbytes: int) -> dict:
    """{kind: {"counted": bytes the counter records, "written": bytes this rank wrote meanwhile}} for one collective of
    each kind over about `nbytes` bytes of fp32 (rounded down to a multiple of the ranks), after one warm-up round."""
    n = max(ctx.world, nbytes // 4 // ctx.world * ctx.world)
    whole, part = torch.ones(n, device=ctx.device), torch.ones(n // ctx.world, device=ctx.device)
    runs = {
        "all-reduce": lambda: dist.all_reduce(whole),
        "all-gather": lambda: _common.all_gather_single(whole, part),
        "reduce-scatter": lambda: _common.reduce_scatter_single(part, whole),
        "broadcast": lambda: dist.broadcast(whole, 0),
    }
    out = {}
    for warm_up in (True, False):
        for kind, run in runs.items():
            dist.barrier()  # nothing of another collective in flight while this one is measured
            counter = _common.CollectiveCounter()
            with counter:
                run()
            if not warm_up:
                written = ctx.socket_bytes(counter)
                out[kind] = {"counted": counter.counts[kind]["bytes"], "written": written}
    return out


def main(argv=None) -> None:
    ctx = _common.start(argv, OPTIONS, "selftest")
    mode = ctx.options["mode"]
    if mode == "fail" and ctx.is_last:
        raise RuntimeError(f"rank {ctx.rank} fails on purpose (selftest mode 'fail')")
    if mode == "hang" and ctx.is_last:
        time.sleep(3600)
    if mode == "killed" and ctx.is_last:
        time.sleep(1)  # the others are in the all-reduce by now
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.tensor([float(ctx.rank)], device=ctx.device)
    t0 = time.perf_counter()
    dist.all_reduce(t)
    elapsed = time.perf_counter() - t0
    sends = measure_sends(ctx, int(ctx.options["measure_bytes"])) if ctx.options.get("measure_bytes") else {}
    _common.finish(ctx, {"sum_of_ranks": t.item(), "all_reduce_s": elapsed, "sends": sends})


if __name__ == "__main__":
    main()
