"""Data parallelism with DistributedDataParallel, through the course's one training loop (train.train with
data_parallel="ddp").

Every rank holds the whole model and trains on its own slice of the same global batch; in backward, DDP
all-reduces the gradients in buckets (a comm hook here counts them), so every rank applies the same averaged
gradient. With gradient accumulation only the last micro-batch communicates (no_sync for the others).

Rank results: step times, losses, per-rank memory of parameters, gradients and optimizer state, all-reduce
calls and bytes per step with and without no_sync, and (rank 0) the largest difference between the DDP
parameters and a single process trained on the same global batch.

Options: {"steps": int, "accum": int, "reference": bool}
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from .. import measure
from ..train import Trainer
from . import _common


def _counting_hook(stats: dict):
    def hook(state, bucket):
        buf = bucket.buffer()
        stats["calls"] += 1
        stats["bytes"] += buf.numel() * buf.element_size()
        stats["bucket_bytes"].append(buf.numel() * buf.element_size())
        return default_hooks.allreduce_hook(None, bucket)

    return hook


def run_ddp(ctx: _common.Ctx, cfg, at, no_sync: bool, label: str) -> dict:
    """One DDP training run; returns what this rank measured."""
    stats = {"calls": 0, "bytes": 0, "bucket_bytes": []}
    per_step: list[dict] = []

    def on_build(setup):
        wrapper = setup.loss_module.model  # techniques.SyncOnLastMicroBatch around the DDP module
        wrapper.enabled = no_sync
        wrapper.wrapped.register_comm_hook(None, _counting_hook(stats))

    def callback(step, _result):
        per_step.append({"calls": stats["calls"], "bytes": stats["bytes"]})

    result, setup = _common.train_rank(ctx, cfg, at, label, on_build, callback)
    calls = [b["calls"] - a["calls"] for a, b in zip([{"calls": 0, "bytes": 0}] + per_step, per_step)]
    nbytes = [b["bytes"] - a["bytes"] for a, b in zip([{"calls": 0, "bytes": 0}] + per_step, per_step)]
    grad_bytes = measure.tensor_bytes([p for p in setup.model.parameters()])  # gradients have the parameters' size
    return {
        "result": result.to_dict(),
        "no_sync": no_sync,
        "allreduce_calls_per_step": calls,
        "allreduce_bytes_per_step": nbytes,
        "bucket_bytes_first_step": stats["bucket_bytes"][: calls[0]] if calls else [],
        "gradient_bytes": grad_bytes,
        "memory": measure.static_bytes(setup.model, setup.optimizer),
        "params": {n: p.detach().clone() for n, p in setup.model.named_parameters()},
    }


# What --options may set, with the defaults (_common.check_options checks a launch's options against it).
OPTIONS = {"steps": 4, "accum": 2, "reference": True}


def main(argv=None) -> None:
    ctx = _common.start(argv, OPTIONS, "ddp")
    steps = ctx.options["steps"]
    accum = ctx.options["accum"]
    base = ctx.cfg
    mb = base.micro_batch_size
    cfg = replace(
        base, data_parallel="ddp", steps=steps, timing_warmup=1, grad_accum_steps=accum, batch_size=mb * accum
    )
    _splits, at = _common.global_batches(cfg, ctx.world, seed=cfg.seed)

    with_sync = run_ddp(ctx, cfg, at, no_sync=True, label=f"DDP x{ctx.world}, accum {accum}, no_sync")
    # The same run letting every micro-batch all-reduce: same result, more traffic (only 2 steps: it is for counting).
    without = run_ddp(
        ctx, replace(cfg, steps=2, timing_warmup=1), at, no_sync=False, label="every micro-batch all-reduces"
    )
    payload = {
        "strategy": "ddp",
        "steps": steps,
        "accum": accum,
        "micro_batch_size": mb,
        "global_batch_sequences": ctx.world * mb * accum,
        "tokens_per_step_global": ctx.world * cfg.tokens_per_step,
        "run": {k: v for k, v in with_sync.items() if k != "params"},
        "run_without_no_sync": {k: v for k, v in without.items() if k not in ("params", "result")},
    }
    payload["run_without_no_sync"]["median_step_s"] = without["result"]["median_step_s"]

    if ctx.is_first and ctx.options["reference"]:
        # One process, the whole global batch (all ranks' micro-batches together), the same steps.
        ref_cfg = replace(cfg, data_parallel="none", grad_accum_steps=1, batch_size=ctx.world * mb * accum)
        one = Trainer(
            ref_cfg, batches=lambda step: [(torch.cat([x for x, _ in at(step)]), torch.cat([y for _, y in at(step)]))]
        )
        ref = one.fit("one process, global batch")
        ref_params = dict(one.setup.model.named_parameters())
        diffs = {n: (p - ref_params[n].detach()).abs().max().item() for n, p in with_sync["params"].items()}
        scale = max(p.detach().abs().max().item() for p in ref_params.values())
        payload["reference"] = {
            "result": ref.to_dict(),
            "max_abs_param_diff": max(diffs.values()),
            "max_abs_param": scale,
            "worst_param": max(diffs, key=diffs.get),
        }
    _common.finish(ctx, payload)


if __name__ == "__main__":
    main()
