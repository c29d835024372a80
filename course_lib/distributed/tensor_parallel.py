"""Tensor parallelism with DTensor: every block's matmuls split across the ranks (Megatron-LM's layout).

MLP: c_fc is column-parallel (each rank computes its slice of the 4h hidden units; GELU is element-wise, so it
needs nothing from the others) and c_proj row-parallel (each rank multiplies its slice; the partial outputs
are summed by one all-reduce). Attention: c_attn column-parallel by heads (each rank gets the q, k and v of
its n_head/N heads; the fused q|k|v weight is reordered first so that a contiguous shard holds whole heads),
attention runs on local heads, c_proj row-parallel: one all-reduce. Forward: 2 all-reduces per block;
backward: 2 more (the gradient of a column-parallel layer's replicated input).

The sharded model is the course's GPT itself, running its own forward: `parallelize_module` replaces the four
Linear weights of each block by DTensor shards and hooks their inputs and outputs (ColwiseParallel returns
this rank's local slice, RowwiseParallel all-reduces its partial sums). The one other change is the one
torchtitan makes: each attention module's `n_head` is set to the local head count, n_head/N, after sharding,
since CausalSelfAttention reads the head count from that attribute and the widths from c_attn's output.

Rank results: the largest difference between the sharded and the unsharded model's logits and gradients,
per-rank parameter bytes (sharded and replicated), collectives counted with CommDebugMode, forward+backward
times.

Options: {"repeats": int}
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from .. import measure
from ..data import IGNORE_INDEX
from ..model import GPT
from . import _common


def reorder_qkv(linear: nn.Linear, world: int) -> None:
    """Rows [q; k; v] to [q_0; k_0; v_0; q_1; k_1; v_1; ...] so that shard r of a column split holds whole heads."""
    d = linear.out_features // 3
    idx = torch.arange(3 * d).view(3, world, d // world).transpose(0, 1).reshape(-1)
    with torch.no_grad():
        linear.weight.copy_(linear.weight[idx])
        if linear.bias is not None:
            linear.bias.copy_(linear.bias[idx])


def parallelize(model: GPT, mesh) -> GPT:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    world = mesh.size()
    if model.config.n_head % world:
        raise ValueError(f"n_head={model.config.n_head} must be divisible by the {world} tensor-parallel ranks")
    for block in model.blocks:
        reorder_qkv(block.attn.c_attn, world)
        parallelize_module(block, mesh, {"attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
                                         "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()})
        block.attn.n_head //= world  # this rank's heads: c_attn now yields [q | k | v] of n_head/N heads (as torchtitan)
    return model


def _counts(mode) -> dict[str, int]:
    return {str(getattr(k, "__name__", k)).split(".")[-1]: int(v) for k, v in mode.get_comm_counts().items()}


def main(argv=None) -> None:
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    ctx = _common.start(argv)
    repeats = int(ctx.options.get("repeats", 3))
    cfg = ctx.cfg
    torch.manual_seed(cfg.seed)
    full = GPT(cfg.model).to(ctx.device)
    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    tp = parallelize(copy.deepcopy(full), mesh)
    _splits, at = _common.global_batches(cfg, 1, seed=cfg.seed)
    x, y = (t.to(ctx.device) for t in at(0)[0])  # every rank sees the same batch: TP splits the layers, not the data

    def loss_of(model):
        logits = model(x)
        return logits, F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), ignore_index=IGNORE_INDEX)

    logits_full, loss_full = loss_of(full)
    loss_full.backward()
    fwd_mode, bwd_mode = CommDebugMode(), CommDebugMode()
    with fwd_mode:
        logits_tp, loss_tp = loss_of(tp)
    with bwd_mode:
        loss_tp.backward()

    # Gradients: each rank's shard against the matching slice of the unsharded gradient.
    grad_diffs = {}
    for i, (bf, bt) in enumerate(zip(full.blocks, tp.blocks)):
        for name, dim in (("attn.c_proj.weight", 1), ("mlp.c_fc.weight", 0), ("mlp.c_proj.weight", 1), ("attn.c_attn.weight", 0)):
            g_full = bf.get_parameter(name).grad
            if name == "attn.c_attn.weight":
                d = g_full.size(0) // 3
                idx = torch.arange(3 * d).view(3, ctx.world, d // ctx.world).transpose(0, 1).reshape(-1)
                g_full = g_full[idx]
            g_local = _common.local_tensor(bt.get_parameter(name).grad)
            expect = g_full.chunk(ctx.world, dim=dim)[ctx.rank]
            grad_diffs[f"blocks.{i}.{name}"] = (g_local - expect).abs().max().item()

    sharded = [p for p in tp.parameters() if hasattr(p, "to_local")]
    replicated = [p for p in tp.parameters() if not hasattr(p, "to_local")]

    def timed(model):
        timer = measure.StepTimer(ctx.device)
        for _ in range(repeats + 1):
            model.zero_grad()
            with timer.step():
                loss_of(model)[1].backward()
        return timer.times[1:]  # the first is warm-up

    _common.write(ctx, {
        "strategy": "tensor_parallel", "n_layer": cfg.model.n_layer, "n_head": cfg.model.n_head, "n_embd": cfg.model.n_embd,
        "batch_size": cfg.micro_batch_size, "context": cfg.context,
        "max_abs_logit_diff": (logits_tp - logits_full).abs().max().item(), "max_abs_logit": logits_full.abs().max().item(),
        "loss_full": loss_full.item(), "loss_tp": loss_tp.item(),
        "max_abs_grad_diff": max(grad_diffs.values()), "grad_diffs": grad_diffs,
        "forward_collectives": _counts(fwd_mode), "backward_collectives": _counts(bwd_mode),
        "activation_all_reduce_bytes_per_call": cfg.micro_batch_size * cfg.context * cfg.model.n_embd * logits_full.element_size(),
        "parameter_bytes_full": measure.tensor_bytes(full.parameters()),
        "parameter_bytes_sharded_local": measure.tensor_bytes(sharded), "parameter_bytes_replicated": measure.tensor_bytes(replicated),
        "fwd_bwd_s_full": timed(full), "fwd_bwd_s_tp": timed(tp)})
    _common.finish()


if __name__ == "__main__":
    main()
