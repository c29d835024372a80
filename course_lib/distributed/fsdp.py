"""ZeRO stage 3 with FSDP2 (torch.distributed.fsdp.fully_shard), through the course's one training loop
(train.train with data_parallel="fsdp"), beside plain DDP in the same processes.

fully_shard is applied to every block and then to the whole model: each rank keeps 1/N of every parameter,
of its gradient and of its Adam state. Before a block runs, its parameters are all-gathered; after it, they are
freed again; in backward they are gathered once more and the gradients are reduce-scattered, so each rank
receives only the gradient of its own shard. The collectives FSDP2 issues are counted as they reach the dispatcher
(_common.CollectiveCounter, the same counter as every ZeRO stage's).

Rank results: per-rank bytes of parameters, gradients and optimizer state under DDP and under FSDP2, step
times, losses, all-gather and reduce-scatter calls and bytes per step, CUDA peaks when on a GPU.

Options: {"steps": int}
"""

from __future__ import annotations

from dataclasses import replace

from .. import measure
from . import _common


def run(ctx: _common.Ctx, cfg, at, label: str) -> dict:
    import torch

    counter = _common.CollectiveCounter()
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    with counter.last_step_of(cfg.steps) as callback:
        result, setup = _common.train_rank(ctx, cfg, at, label, on_build=lambda _setup: None, callback=callback)
    params = list({id(p): p for p in setup.model.parameters()}.values())
    return {
        "result": result.to_dict(),
        "memory": measure.static_bytes(setup.model, setup.optimizer),
        "collectives_last_step": dict(counter.counts),
        "written_last_step": counter.written if ctx.backend == "gloo" else None,
        "n_params": sum(p.numel() for p in params),
        **_common.cuda_peak(ctx.device),
    }


# What --options may set, with the defaults (_common.check_options checks a launch's options against it).
OPTIONS = {"steps": 3}


def main(argv=None) -> None:
    ctx = _common.start(argv, OPTIONS, "fsdp")
    steps = int(ctx.options.get("steps", 3))
    cfg = replace(ctx.cfg, steps=steps, timing_warmup=1, grad_accum_steps=1, batch_size=ctx.cfg.micro_batch_size)
    _splits, at = _common.global_batches(cfg, ctx.world, seed=cfg.seed)
    ddp = run(ctx, replace(cfg, data_parallel="ddp", steps=2), at, f"DDP x{ctx.world}")
    fsdp = run(ctx, replace(cfg, data_parallel="fsdp"), at, f"FSDP2 x{ctx.world}")
    _common.write(ctx, {"strategy": "fsdp", "steps": steps, "ddp": ddp, "fsdp": fsdp})
    _common.finish()


if __name__ == "__main__":
    main()
