"""Data parallelism written by hand (notebook 07), three ways, each run through the course's one loop beside torch's
DistributedDataParallel on the same batches:

- `NaiveDDP`: after backward, one blocking all-reduce per gradient. All communication waits for the whole backward.
- `OverlappedDDP`: a hook on every parameter (`register_post_accumulate_grad_hook`) launches its gradient's
  all-reduce asynchronously the moment backward has finished it, while backward goes on with the layers before; the
  step waits only for what is still in flight.
- `BucketedDDP`: the same, but gradients are packed into buckets of about `bucket_bytes` (in the order backward makes
  them, last layer first) and each bucket is all-reduced, flat, once all its gradients are ready: fewer, larger
  messages, as torch's DDP does (25 MiB buckets by default).

Each divides the summed gradients by the world size (the mean, what DDP applies), starts from rank 0's parameters
(broadcast) and leaves the optimizer untouched. Measured per rank: the step time, the communication the step still
waits for after backward ("exposed", the time in `finish`), all-reduce calls per step, and the largest difference
between its parameters and torch DDP's after the same steps. Gradient accumulation is off here (every backward
communicates).

Options: {"steps": int, "bucket_kb": [int, ...]} (the bucket sizes to sweep).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn as nn

from ..techniques.data_parallel import BucketedDDP, HandDDP
from . import _common


class NaiveDDP(HandDDP):
    def finish(self) -> None:
        for p in self.params:  # one blocking all-reduce per tensor, after the whole backward
            self._launching()
            dist.all_reduce(p.grad)
            p.grad /= self.world


class OverlappedDDP(HandDDP):
    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.in_flight: list = []
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._launch)

    def _launch(self, p: torch.Tensor) -> None:  # backward has finished p.grad: send it now, do not wait
        self._launching()
        self.in_flight.append(dist.all_reduce(p.grad, async_op=True))

    def finish(self) -> None:
        for work in self.in_flight:
            work.wait()
        self.in_flight.clear()
        for p in self.params:
            p.grad /= self.world


def run_variant(ctx: _common.Ctx, cfg, at, variant: str, bucket_bytes: int = 0) -> dict:
    """One run of the course's loop with `variant` ("torch": DistributedDataParallel; "naive", "overlapped",
    "bucketed": by hand); what this rank measured."""
    exposed: list[float] = []
    hand: dict = {}
    timelines: list[dict] = []  # per step: backward's end, the end of the wait, when each all-reduce left
    forward_began = [0.0]

    def on_build(setup):
        if variant == "torch":
            setup.loss_module.model.wrapped.register_comm_hook(None, _counting(hand))
            return
        by_hand = {"naive": NaiveDDP, "overlapped": OverlappedDDP}.get(variant)
        hand["ddp"] = ddp = by_hand(setup.model) if by_hand else BucketedDDP(setup.model, bucket_bytes)
        ddp.launched = []  # when each all-reduce leaves, for the timeline

        def mark_start(_module, _inputs):  # the step's first forward (grad_accum_steps=1: its only one)
            forward_began[0] = time.perf_counter()

        class TimedFinish:  # the loop calls setup.hand_ddp.finish() after the last backward: the wait, timed
            def finish(self):
                t0 = time.perf_counter()
                ddp.finish()
                t1 = time.perf_counter()
                start = forward_began[0]
                exposed.append(t1 - t0)
                launches = [t - start for t in ddp.launched]
                timelines.append({"backward_done": t0 - start, "waited_until": t1 - start, "launches": launches})
                ddp.launched.clear()

        setup.model.register_forward_pre_hook(mark_start)
        setup.hand_ddp = TimedFinish()

    run_cfg = replace(cfg, data_parallel="ddp" if variant == "torch" else "none")
    result, setup = _common.train_rank(ctx, run_cfg, at, variant, on_build, lambda step, r: None)
    calls = hand["ddp"].calls if "ddp" in hand else hand.get("calls", 0)
    return {
        "variant": variant,
        "bucket_bytes": bucket_bytes,
        "median_step_s": result.median_step_s,
        "step_s": result.step_times,
        "exposed_comm_s": statistics.median(exposed[cfg.timing_warmup :]) if exposed else None,
        "allreduce_calls_per_step": calls / cfg.steps,
        "timeline_last_step": timelines[-1] if timelines else None,  # seconds from the step's forward
        "losses": result.losses,
        "params": {n: p.detach().clone() for n, p in setup.model.named_parameters()},
    }


def _counting(stats: dict):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    stats["calls"] = 0

    def hook(state, bucket):
        stats["calls"] += 1
        return default_hooks.allreduce_hook(None, bucket)

    return hook


# What --options may set, with the defaults (_common.check_options checks a launch's options against it).
OPTIONS = {"steps": 6, "bucket_kb": [64, 1024]}


def main(argv=None) -> None:
    ctx = _common.start(argv, OPTIONS, "ddp_by_hand")
    steps = ctx.options["steps"]
    cfg = replace(ctx.cfg, steps=steps, timing_warmup=1, grad_accum_steps=1, measure_memory=False)
    _splits, at = _common.global_batches(cfg, ctx.world, seed=cfg.seed)
    runs = [run_variant(ctx, cfg, at, v) for v in ("torch", "naive", "overlapped")]
    runs += [run_variant(ctx, cfg, at, "bucketed", kb * 1024) for kb in ctx.options["bucket_kb"]]
    reference = runs[0]["params"]
    for r in runs:
        params = r.pop("params")
        r["max_abs_param_diff_vs_torch_ddp"] = max((params[n] - reference[n]).abs().max().item() for n in params)
    _common.finish(ctx, {"strategy": "ddp_by_hand", "steps": steps, "runs": runs})


if __name__ == "__main__":
    main()
