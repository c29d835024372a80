"""ZeRO stages 0 to 3, each run for real on the same processes and the same global batches, through the course's
one training loop:

    stage 0  DDP: everything replicated, gradients all-reduced in buckets
    stage 1  DDP for the gradients + torch.distributed.optim.ZeroRedundancyOptimizer around AdamW: each rank keeps
             the Adam state of its share of the parameters (whole tensors, balanced by size), updates only those,
             and broadcasts them to the others after its step
    stage 2  FSDP2 with reshard_after_forward=False: parameters are all-gathered once in forward and stay gathered
             through backward; gradients are reduce-scattered, so each rank keeps the gradient and the Adam state of
             its shard only
    stage 3  FSDP2 as it comes (reshard_after_forward=True): parameters freed after each block's forward and
             gathered again for its backward

Measured per rank: the bytes of parameters, gradients and optimizer state held, read from the tensors themselves
(a DTensor's local shard) at two moments of the last step (the end of forward, and the optimizer step, when the
gradients exist); the collectives of the last step, counted as they reach the dispatcher (kind, calls, bytes);
step times and losses; and (rank 0) the largest difference of each stage's final parameters from one process
trained on the whole global batch.

Options: {"steps": int, "stages": [0, 1, 2, 3], "reference": bool, "offload": bool (stage 3 again with FSDP2's
CPUOffloadPolicy; measured on CUDA only: on a CPU there is nothing to offload to)}
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .. import measure, techniques
from . import _common, zero_memory
from .fsdp import fsdp_model

STAGE_NAMES = {
    0: "DDP",
    1: "ZeRO-1: DDP + ZeroRedundancyOptimizer",
    2: "ZeRO-2: FSDP2, reshard_after_forward=False",
    3: "ZeRO-3: FSDP2",
}


def zero1_optimizer(cfg, model: torch.nn.Module):
    """ZeRO-1: the course's optimizer (techniques.optimizer_for) built by ZeroRedundancyOptimizer for this rank's
    share of the parameter groups only. parameters_as_bucket_view: each rank's parameters live in one flat buffer,
    so the update is one broadcast per rank instead of one per tensor."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    def local(params, **_defaults):
        return techniques.optimizer_for(
            cfg.optimizer, params, cfg.lr, betas=cfg.betas, eps=cfg.eps, momentum=cfg.momentum, fused=cfg.fused_adamw
        )

    return ZeroRedundancyOptimizer(
        techniques.param_groups(model, cfg.weight_decay, cfg.decay_2d_only),
        optimizer_class=local,
        parameters_as_bucket_view=True,
        lr=cfg.lr,
    )


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose state this rank holds (ZeroRedundancyOptimizer keeps it in `.optim`)."""
    return getattr(optimizer, "optim", optimizer)


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (a DTensor is all-gathered: every rank must call this, in the same order)."""
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()
    }


def run_stage(ctx: _common.Ctx, cfg, at, stage: int, offload: bool = False) -> tuple[dict, dict]:
    """One training run at `stage`; returns (what this rank measured, its final parameters, whole)."""
    held: dict = {}
    counter = _common.CollectiveCounter()
    model = fsdp_model(cfg, reshard_after_forward=stage == 3, offload=offload) if stage >= 2 else None
    run_cfg = replace(cfg, data_parallel="ddp" if stage <= 1 else "none")  # stages 2-3: the model comes sharded

    def on_build(setup):
        if stage == 1:
            setup.optimizer = zero1_optimizer(cfg, setup.model)
            setup.scheduler = techniques.make_scheduler(cfg, setup.optimizer)
        opt = setup.optimizer

        def after_forward(_module, _inputs, _output):
            # Parameters held at the end of forward: what the modules hold now (FSDP2: the gathered ones, where
            # not freed again) and the shards the optimizer updates; each storage once.
            held["parameters after forward"] = measure.tensor_bytes(
                list(setup.model.parameters()) + [p for g in opt.param_groups for p in g["params"]]
            )

        def before_step(_opt, _args, _kwargs):  # gradients exist now: backward is over, zero_grad comes after
            held["at the optimizer step"] = measure.static_bytes(setup.model, local_optimizer(opt))

        setup.model.register_forward_hook(after_forward)
        opt.register_step_pre_hook(before_step)

    with counter.last_step_of(cfg.steps) as callback:
        result, setup = _common.train_rank(ctx, run_cfg, at, STAGE_NAMES[stage], on_build, callback, model=model)
    at_step = held["at the optimizer step"]
    out = {
        "stage": stage,
        "name": STAGE_NAMES[stage],
        "offload": offload,
        "result": result.to_dict(),
        "memory": {
            "parameters between steps": at_step["parameters"],
            "parameters after forward": held["parameters after forward"],
            "gradients": at_step["gradients"],
            "optimizer state": at_step["optimizer state"],
        },
        "collectives_last_step": dict(counter.counts),
        "written_last_step": ctx.socket_bytes(counter),
        **_common.cuda_peak(ctx.device),
    }
    return out, full_parameters(setup.model)


def one_process_params(cfg, at, world: int) -> tuple[dict, dict]:
    """One process trained on the whole global batch (every rank's slice together), the same steps: its result and
    its final parameters."""
    from ..train import Trainer

    one = Trainer(
        replace(cfg, data_parallel="none", batch_size=world * cfg.batch_size),
        batches=lambda step: [(torch.cat([x for x, _ in at(step)]), torch.cat([y for _, y in at(step)]))],
    )
    result = one.fit("one process, global batch")
    return result.to_dict(), {n: p.detach() for n, p in one.setup.model.named_parameters()}


# What --options may set, with the defaults (_common.check_options checks a launch's options against it).
OPTIONS = {"steps": 3, "stages": list(zero_memory.STAGES), "offload": False, "reference": True}


def main(argv=None) -> None:
    ctx = _common.start(argv, OPTIONS, "zero_stages")
    steps = ctx.options["steps"]
    stages = [int(s) for s in ctx.options["stages"]]
    cfg = replace(ctx.cfg, steps=steps, timing_warmup=1, grad_accum_steps=1, batch_size=ctx.cfg.micro_batch_size)
    _splits, at = _common.global_batches(cfg, ctx.world, seed=cfg.seed)
    runs, finals = {}, {}
    for stage in stages:
        runs[stage], finals[stage] = run_stage(ctx, cfg, at, stage)
    if ctx.options.get("offload") and ctx.device.type == "cuda":
        runs["3+offload"], _ = run_stage(ctx, cfg, at, 3, offload=True)
    n_params = runs[stages[0]]["result"]["n_params"]
    payload = {
        "strategy": "zero_stages",
        "steps": steps,
        "n_params": n_params,
        "runs": runs,
        "formula": {
            s: zero_memory.zero_parts(n_params, ctx.world, s, **zero_memory.FP32_ADAMW) for s in zero_memory.STAGES
        },
    }
    if ctx.is_first and ctx.options["reference"]:
        ref_result, ref = one_process_params(cfg, at, ctx.world)
        scale = max(p.abs().max().item() for p in ref.values())
        payload["reference"] = {
            "result": ref_result,
            "max_abs_param": scale,
            "max_abs_param_diff": {
                s: max((p - ref[n]).abs().max().item() for n, p in final.items()) for s, final in finals.items()
            },
        }
    _common.finish(ctx, payload)


if __name__ == "__main__":
    main()
