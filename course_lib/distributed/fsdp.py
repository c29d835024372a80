"""ZeRO stage 3 with FSDP2 (torch.distributed.fsdp.fully_shard), through the course's one training loop
(train.train with data_parallel="fsdp"), beside plain DDP in the same processes.

fully_shard is applied to every block and then to the whole model: each rank keeps 1/N of every parameter,
of its gradient and of its Adam state. Before a block runs, its parameters are all-gathered; after it, they are
freed again; in backward they are gathered once more and the gradients are reduce-scattered, so each rank
receives only the gradient of its own shard. The collectives FSDP2 issues are counted here by wrapping
torch.distributed.all_gather_single / reduce_scatter_single.

Rank results: per-rank bytes of parameters, gradients and optimizer state under DDP and under FSDP2, step
times, losses, all-gather and reduce-scatter calls and bytes per step, CUDA peaks when on a GPU.

Options: {"steps": int, "only": "ddp" | "fsdp" (one run with the config as given)}
"""
from __future__ import annotations

from dataclasses import replace

import torch.distributed as dist

from .. import measure
from . import _common

COUNTS = {"all_gather": [0, 0], "reduce_scatter": [0, 0]}  # calls, bytes of the full (unsharded) tensor


def _install_counters() -> None:
    """Count FSDP2's collectives by wrapping the functions it calls. torch 2.13 calls all_gather_single /
    reduce_scatter_single; older versions (2.11, 2.12) call all_gather_into_tensor / reduce_scatter_tensor.
    Each name that exists is wrapped; a deprecated one that forwards to the other does so inside
    distributed_c10d, not through these attributes, so nothing is counted twice."""
    names = {"all_gather": ("all_gather_single", "all_gather_into_tensor"),
             "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor")}

    def counting(kind: str, original):
        def wrapper(output, input, *args, **kwargs):
            full = output if kind == "all_gather" else input  # the unsharded side
            COUNTS[kind][0] += 1
            COUNTS[kind][1] += full.numel() * full.element_size()
            return original(output, input, *args, **kwargs)

        return wrapper

    for kind, candidates in names.items():
        for name in candidates:
            if hasattr(dist, name):
                setattr(dist, name, counting(kind, getattr(dist, name)))


def run(ctx: _common.Ctx, cfg, at, label: str) -> dict:
    import torch

    snapshots: list[dict] = []

    def callback(step, _r):
        snapshots.append({k: list(v) for k, v in COUNTS.items()})

    for v in COUNTS.values():
        v[:] = [0, 0]
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    result, setup = _common.train_rank(ctx, cfg, at, label, on_build=lambda _setup: None, callback=callback)
    last, prev = snapshots[-1], snapshots[-2] if len(snapshots) > 1 else {k: [0, 0] for k in COUNTS}
    per_step = {k: {"calls": last[k][0] - prev[k][0], "bytes": last[k][1] - prev[k][1]} for k in COUNTS}
    params = list({id(p): p for p in setup.model.parameters()}.values())
    return {"result": result.to_dict(), "memory": measure.static_bytes(setup.model, setup.optimizer),
            "collectives_last_step": per_step, "n_params": sum(p.numel() for p in params), **_common.cuda_peak(ctx.device)}


def main(argv=None) -> None:
    ctx = _common.start(argv)
    _install_counters()
    steps = int(ctx.options.get("steps", 3))
    cfg = replace(ctx.cfg, steps=steps, timing_warmup=1, grad_accum_steps=1, batch_size=ctx.cfg.micro_batch_size)
    _splits, at = _common.global_batches(cfg, ctx.world, seed=cfg.seed)
    only = ctx.options.get("only")  # "ddp" or "fsdp": just that run, with the config as given (the panel)
    if only:
        _common.write(ctx, {"strategy": "fsdp", "steps": ctx.cfg.steps, only: run(ctx, replace(ctx.cfg, data_parallel=only), at, f"{only} x{ctx.world}")})
        _common.finish()
        return
    ddp = run(ctx, replace(cfg, data_parallel="ddp", steps=2), at, f"DDP x{ctx.world}")
    fsdp = run(ctx, replace(cfg, data_parallel="fsdp"), at, f"FSDP2 x{ctx.world}")
    _common.write(ctx, {"strategy": "fsdp", "steps": steps, "ddp": ddp, "fsdp": fsdp})
    _common.finish()


if __name__ == "__main__":
    main()
