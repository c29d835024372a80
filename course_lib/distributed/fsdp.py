"""ZeRO stage 3 with FSDP2 (torch.distributed.fsdp.fully_shard), through the course's one training loop, in fp32 and
in mixed precision, beside plain DDP in the same processes.

fully_shard is applied to every block and then to the whole model (techniques.shard_with_fsdp2): each rank keeps 1/N
of every parameter, of its gradient and of its Adam state. Before a block runs, its parameters are all-gathered; after
it, they are freed again; in backward they are gathered once more and the gradients are reduce-scattered, so each rank
receives only the gradient of its own shard. The collectives FSDP2 issues are counted as they reach the dispatcher
(_common.CollectiveCounter, the same counter as every ZeRO stage's).

Mixed precision (ZeRO's own setting): a MixedPrecisionPolicy with param_dtype=bf16 gathers the parameters in bf16 and
computes in bf16, while the shards the optimizer updates stay fp32 (the master weights) and the gradients are
reduce-scattered in fp32 (reduce_dtype) into them. So the gathered copy of a block, and the traffic of the gathers,
take half the bytes of fp32's; the shards, their gradients and the Adam state do not change.

Rank results: per run (DDP; FSDP2 in each precision asked for), the bytes of parameters, gradients and optimizer state
held between steps, the dtype and bytes of each block's gathered parameters while it runs (the largest block), the
dtype of the master shards, step times, losses, all-gather and reduce-scatter calls and bytes per step, CUDA peaks
when on a GPU. With "replicate_norms", also a model whose LayerNorms stay plain tensors on every rank (not sharded,
their gradients averaged by a hook) trained a few plain steps beside one sharding everything
(`replicated_norms_check`).

Options: {"steps": int, "precisions": ["fp32", "bf16"], "replicate_norms": bool}
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .. import measure, techniques
from ..config import ConfigError
from ..model import GPT
from . import _common

PRECISIONS = ("fp32", "bf16")


def mixed_precision(precision: str):
    """FSDP2's policy for `precision`: None for fp32 (the parameters' own dtype throughout); bf16 parameters for the
    computation, with the gradients reduced in fp32 into the fp32 master shards."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision not in PRECISIONS:
        raise ConfigError(f"precision={precision!r}: use one of {', '.join(PRECISIONS)}")
    return None if precision == "fp32" else MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def fsdp_model(
    cfg,
    reshard_after_forward: bool | None = None,
    offload: bool = False,
    precision: str = "fp32",
    replicate_norms: bool = False,
) -> torch.nn.Module:
    """The course's GPT sharded by FSDP2 (techniques.shard_with_fsdp2), the same initial weights on every rank and in
    every run. replicate_norms: the LayerNorms stay whole on every rank."""
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model).to(cfg.device)
    norms = tuple(m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)) if replicate_norms else ()
    techniques.shard_with_fsdp2(
        model,
        techniques.ModelParts.of(model),
        torch.device(cfg.device).type,
        reshard_after_forward=reshard_after_forward,
        offload=offload,
        mp_policy=mixed_precision(precision),
        replicated=norms,
    )
    return model


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "to_local")


def watch_gathered_blocks(model: torch.nn.Module) -> dict:
    """Hooks that record, while each block runs, the bytes of its parameters by dtype (FSDP2 has swapped in the
    gathered copy by then: a pre-hook on the block's first child runs after the block's all-gather). Returns the dict
    the hooks fill: {"bytes": {dtype: largest block's bytes}}."""
    seen: dict = {"bytes": {}}
    for block in model.blocks:

        def record(_module, _inputs, block=block):
            by_dtype: dict[str, int] = {}
            for p in block.parameters():
                if not _is_dtensor(p):  # a sharded parameter not gathered (none, while its block runs)
                    key = str(p.dtype).removeprefix("torch.")
                    by_dtype[key] = by_dtype.get(key, 0) + p.numel() * p.element_size()
            for k, v in by_dtype.items():
                seen["bytes"][k] = max(seen["bytes"].get(k, 0), v)

        next(block.children()).register_forward_pre_hook(record)
    return seen


def run(ctx: _common.Ctx, cfg, at, label: str, model=None) -> dict:
    counter = _common.CollectiveCounter()
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    gathered = watch_gathered_blocks(model) if model is not None else None
    with counter.last_step_of(cfg.steps) as callback:
        result, setup = _common.train_rank(
            ctx, cfg, at, label, on_build=lambda _setup: None, callback=callback, model=model
        )
    params = list({id(p): p for p in setup.model.parameters()}.values())
    out = {
        "result": result.to_dict(),
        "memory": measure.static_bytes(setup.model, setup.optimizer),
        "collectives_last_step": dict(counter.counts),
        "written_last_step": ctx.socket_bytes(counter),
        "n_params": sum(p.numel() for p in params),
        **_common.cuda_peak(ctx.device),
    }
    if gathered is not None:
        out["gathered_block_bytes"] = gathered["bytes"]
        out["master_dtypes"] = sorted({str(_common.local_tensor(p).dtype).removeprefix("torch.") for p in params})
    return out


# What --options may set, with the defaults (_common.check_options checks a launch's options against it).
OPTIONS = {"steps": 3, "precisions": list(PRECISIONS), "replicate_norms": False}


def check(options: dict) -> None:
    """What the kinds alone cannot say: the precisions' names."""
    for p in options.get("precisions", ()):
        mixed_precision(p)


def train_outside_the_loop(ctx: _common.Ctx, cfg, at, model: torch.nn.Module, steps: int) -> None:
    """A few plain steps (forward, backward, AdamW) on this rank's slice of the global batches, without the course's
    loop: its gradient norm (torch.nn.utils.get_total_norm) refuses a mix of DTensor and plain gradients."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, foreach=False)
    for step in range(steps):
        x, y = (t.to(ctx.device) for t in _common.shard(at(step)[0], ctx.rank, ctx.world))
        (techniques.loss_sum(model(x), y) / y.numel()).backward()
        opt.step()
        opt.zero_grad()


def replicated_norms_check(ctx: _common.Ctx, cfg, at, precision: str, steps: int = 2) -> dict:
    """FSDP2 with the LayerNorms replicated (plain tensors on every rank) beside FSDP2 sharding everything, the same
    steps: which parameters are DTensors, the dtypes each block's parameters have while it runs, a checksum of each
    replicated parameter on this rank (equal on every rank: their gradients are averaged), the largest difference of
    the LayerNorms from the fully sharded model's, and how far they moved."""
    models, gathered = {}, {}
    for replicate in (True, False):
        models[replicate] = fsdp_model(cfg, precision=precision, replicate_norms=replicate)
        gathered[replicate] = watch_gathered_blocks(models[replicate])
        if replicate:
            start = {n: p.detach().clone() for n, p in models[True].named_parameters() if not _is_dtensor(p)}
        train_outside_the_loop(ctx, cfg, at, models[replicate], steps)
    named = dict(models[True].named_parameters())
    whole = {n: p.full_tensor() if _is_dtensor(p) else p for n, p in models[False].named_parameters()}
    norms = [n for n, p in named.items() if not _is_dtensor(p)]
    return {
        "steps": steps,
        "precision": precision,
        "dtensor": {n: _is_dtensor(p) for n, p in named.items()},
        "replicated_dtypes": sorted({str(named[n].dtype).removeprefix("torch.") for n in norms}),
        "gathered_block_bytes": gathered[True]["bytes"],
        "replicated_checksum": {n: float(named[n].detach().double().sum()) for n in norms},
        "max_abs_diff_from_all_sharded": max(float((named[n] - whole[n]).abs().max()) for n in norms),
        "max_abs_change": max(float((named[n] - start[n]).abs().max()) for n in norms),
    }


def main(argv=None) -> None:
    ctx = _common.start(argv, OPTIONS, "fsdp")
    steps = ctx.options["steps"]
    precisions = ctx.options["precisions"]
    cfg = replace(ctx.cfg, steps=steps, timing_warmup=1, grad_accum_steps=1, batch_size=ctx.cfg.micro_batch_size)
    _splits, at = _common.global_batches(cfg, ctx.world, seed=cfg.seed)
    payload = {"strategy": "fsdp", "steps": steps}
    payload["ddp"] = run(ctx, replace(cfg, data_parallel="ddp", steps=2), at, f"DDP x{ctx.world}")
    for precision in precisions:
        model = fsdp_model(cfg, precision=precision)
        key = "fsdp" if precision == "fp32" else f"fsdp_{precision}"  # "fsdp": fp32, as before mixed precision
        label = f"FSDP2 {precision} x{ctx.world}"
        payload[key] = run(ctx, replace(cfg, data_parallel="none"), at, label, model=model) | {"precision": precision}
    if ctx.options.get("replicate_norms"):
        payload["replicated_norms"] = replicated_norms_check(ctx, cfg, at, precisions[-1])
    _common.finish(ctx, payload)


if __name__ == "__main__":
    main()
