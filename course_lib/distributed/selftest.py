"""The smallest distributed program: every rank all-reduces its rank number. Options: {"mode": "ok"}, or
"fail" (the last rank raises) or "hang" (the last rank never reaches the collective) to show how the launcher
reports a failed or hung run and stops every process."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from . import _common


# What --options may set, with the defaults (_common.check_options checks a launch's options against it).
OPTIONS = {"mode": "ok"}


def main(argv=None) -> None:
    ctx = _common.start(argv, OPTIONS, "selftest")
    mode = ctx.options.get("mode", "ok")
    if mode == "fail" and ctx.is_last:
        raise RuntimeError(f"rank {ctx.rank} fails on purpose (selftest mode 'fail')")
    if mode == "hang" and ctx.is_last:
        time.sleep(3600)
    t = torch.tensor([float(ctx.rank)], device=ctx.device)
    t0 = time.perf_counter()
    dist.all_reduce(t)
    _common.write(ctx, {"sum_of_ranks": t.item(), "all_reduce_s": time.perf_counter() - t0})
    _common.finish()


if __name__ == "__main__":
    main()
