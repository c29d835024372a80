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

Sequence parallelism (Korthikanti et al., 2022), with {"sequence_parallel": true}: outside the four matmuls, in
the LayerNorms, the dropouts and the residual additions, tensor parallelism leaves every rank doing the same work
on the same (b, s, h) activations and storing them N times. Sequence parallelism cuts those regions along the
sequence instead: the residual stream between blocks is each rank's s/N positions. Entering attention or the MLP,
an all-gather assembles the whole sequence (DTensor's PrepareModuleInput, Shard(1) -> Replicate); leaving it, the
row-parallel matmul's all-reduce becomes a reduce-scatter that hands each rank the sum for its own positions only
(RowwiseParallel(output_layouts=Shard(1))). An all-reduce is a reduce-scatter followed by an all-gather, so the
traffic stays the same while the LayerNorm and dropout activations shrink N-fold. The LayerNorms run on sequence
shards (SequenceParallel); their weights stay replicated and their gradients are summed over the ranks. The first
block takes its shard of the embeddings (a slice, no communication) and the output layer gets the whole sequence
back with one all-gather, so the logits and the loss are the unsharded model's.

Rank results: the largest difference between the sharded and the unsharded model's logits and gradients,
per-rank parameter bytes (sharded and replicated), collectives counted with CommDebugMode, forward+backward
times; with sequence parallelism, the same checks for it and the activation memory of one forward and backward
(the CPU ledger: bytes saved for backward, peak of activations) for the unsharded model, tensor parallelism
and tensor + sequence parallelism.

Options: {"repeats": int, "sequence_parallel": bool, "memory_dropout": float (dropout while the memory is measured)}
"""

from __future__ import annotations

import copy
import functools
from dataclasses import replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import measure
from ..data import IGNORE_INDEX
from ..model import GPT
from ..timing import StepTimer
from . import _common


def _qkv_order(rows: int, world: int) -> torch.Tensor:
    """The row order [q_0; k_0; v_0; q_1; k_1; v_1; ...] of a fused [q; k; v] weight of `rows` rows."""
    d = rows // 3
    return torch.arange(rows).view(3, world, d // world).transpose(0, 1).reshape(-1)


def reorder_qkv(linear: nn.Linear, world: int) -> None:
    """Rows [q; k; v] to [q_0; k_0; v_0; q_1; k_1; v_1; ...] so that shard r of a column split holds whole heads."""
    idx = _qkv_order(linear.out_features, world)
    with torch.no_grad():
        linear.weight.copy_(linear.weight[idx])
        if linear.bias is not None:
            linear.bias.copy_(linear.bias[idx])


def parallelize(model: GPT, mesh, sequence_parallel: bool = False) -> GPT:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    world = mesh.size()
    if model.config.n_head % world:
        raise ValueError(f"n_head={model.config.n_head} must be divisible by the {world} tensor-parallel ranks")
    # Sequence parallel: the matmuls' region starts with an all-gather of the sequence and ends with a reduce-scatter.
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    out = Shard(1) if sequence_parallel else Replicate()
    for block in model.blocks:
        reorder_qkv(block.attn.c_attn, world)
        plan = {
            "attn.c_attn": ColwiseParallel(),
            "attn.c_proj": RowwiseParallel(output_layouts=out),
            "mlp.c_fc": ColwiseParallel(),
            "mlp.c_proj": RowwiseParallel(output_layouts=out),
        }
        if sequence_parallel:
            plan |= {"ln_1": SequenceParallel(), "attn": gather, "ln_2": SequenceParallel(), "mlp": gather}
        parallelize_module(block, mesh, plan)
        # this rank's heads: c_attn now yields [q | k | v] of n_head/N heads (as torchtitan)
        block.attn.n_head //= world
    if sequence_parallel:
        parallelize_module(
            model,
            mesh,
            {
                # the embeddings are replicated: the first block takes this rank's slice of positions (no communication)
                "blocks.0": PrepareModuleInput(
                    input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
                ),
                "ln_f": SequenceParallel(),
                # the output layer (tied to the embedding, replicated) gets the whole sequence back: one all-gather
                "lm_head": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
                ),
            },
        )
    return model


def _counts(mode) -> dict[str, int]:
    return {str(getattr(k, "__name__", k)).split(".")[-1]: int(v) for k, v in mode.get_comm_counts().items()}


def _expected_grad(name: str, g_full: torch.Tensor, p_tp: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """The part of the unsharded model's gradient that rank `rank` of the sharded model should hold for parameter
    `name`."""
    from torch.distributed.tensor import Shard

    placements = getattr(p_tp, "placements", ())
    if not any(isinstance(pl, Shard) for pl in placements):
        return g_full  # replicated: the whole gradient
    if ".attn.c_attn." in name:  # its rows were reordered so that a shard holds whole heads
        g_full = g_full[_qkv_order(g_full.size(0), world)]
    return g_full.chunk(world, dim=placements[0].dim)[rank]


def _grad_as_placed(p: torch.Tensor) -> torch.Tensor:
    """This rank's gradient of `p`, laid out as `p` is. Under sequence parallelism a replicated LayerNorm weight's
    gradient comes out of backward as a partial sum (each rank's own positions); redistributing it sums the ranks'
    parts, the all-reduce an optimizer step on a DTensor does."""
    g = p.grad
    if hasattr(g, "redistribute") and tuple(g.placements) != tuple(p.placements):
        g = g.redistribute(g.device_mesh, p.placements)
    return _common.local_tensor(g)


def activation_memory(model, x, y) -> dict:
    """One forward and backward under the CPU ledger: bytes saved for backward, and the step's peak split by
    category."""
    from ..techniques import loss_sum

    ledger = measure.MemoryLedger(keep_timeline=False)
    with ledger.watch(model.lm_head):
        with ledger.phase("forward"):
            loss = loss_sum(model(x), y)
        with ledger.phase("backward"):
            loss.backward()
    report = ledger.report()
    return {
        "saved_for_backward_bytes": report.saved_for_backward_bytes,
        "peak_bytes": report.peak_bytes,
        "by_category": report.by_category,
    }


def compare(ctx, full: GPT, tp: GPT, loss_of, logits_full, loss_full) -> dict:
    """Forward and backward of the sharded model, checked against the unsharded one's (already backward-ed)."""
    from torch.distributed.tensor.debug import CommDebugMode

    fwd_mode, bwd_mode, counter = CommDebugMode(), CommDebugMode(), _common.CollectiveCounter()
    with counter:  # the bytes of forward and backward (CommDebugMode counts calls only)
        with fwd_mode:
            logits_tp, loss_tp = loss_of(tp)
        with bwd_mode:
            loss_tp.backward()
    full_params = dict(full.named_parameters())
    grad_diffs = {
        name: (_grad_as_placed(p) - _expected_grad(name, full_params[name].grad, p, ctx.world, ctx.rank))
        .abs()
        .max()
        .item()
        for name, p in tp.named_parameters()
    }
    sharded = [p for p in tp.parameters() if hasattr(p, "to_local") and p.to_local().numel() < p.numel()]
    replicated = [p for p in tp.parameters() if not any(p is q for q in sharded)]
    return {
        "max_abs_logit_diff": (_common.local_tensor(logits_tp) - logits_full).abs().max().item(),
        "loss_full": loss_full.item(),
        "loss_tp": loss_tp.item(),
        "max_abs_grad_diff": max(grad_diffs.values()),
        "grad_diffs": grad_diffs,
        "max_abs_grad": max(p.grad.abs().max().item() for p in full.parameters()),
        "forward_collectives": _counts(fwd_mode),
        "backward_collectives": _counts(bwd_mode),
        "collectives_fwd_bwd": dict(counter.counts),
        "written_fwd_bwd": ctx.socket_bytes(counter),
        "parameter_bytes_sharded_local": measure.tensor_bytes(sharded),
        "parameter_bytes_replicated": measure.tensor_bytes(replicated),
    }


# What --options may set, with the defaults (_common.check_options checks a launch's options against it).
OPTIONS = {"repeats": 3, "sequence_parallel": False, "memory_dropout": 0.1}


def main(argv=None) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    ctx = _common.start(argv, OPTIONS, "tensor_parallel")
    cfg, sequence_parallel = ctx.cfg, ctx.options["sequence_parallel"]
    if sequence_parallel and cfg.context % ctx.world:
        raise ValueError(
            f"sequence parallelism splits the sequence: context {cfg.context} must be divisible by {ctx.world} ranks"
        )
    torch.manual_seed(cfg.seed)
    full = GPT(cfg.model).to(ctx.device)
    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    variants = {"tp": parallelize(copy.deepcopy(full), mesh)}
    if sequence_parallel:
        variants["tp_sp"] = parallelize(copy.deepcopy(full), mesh, sequence_parallel=True)
    _splits, at = _common.global_batches(cfg, 1, seed=cfg.seed)
    x, y = (t.to(ctx.device) for t in at(0)[0])  # every rank sees the same batch: TP splits the layers, not the data
    loss_of = functools.partial(_loss_of, x=x, y=y)
    logits_full, loss_full = loss_of(full)
    loss_full.backward()
    checks = {name: compare(ctx, full, model, loss_of, logits_full, loss_full) for name, model in variants.items()}
    payload = {
        "strategy": "tensor_parallel",
        "n_layer": cfg.model.n_layer,
        "n_head": cfg.model.n_head,
        "n_embd": cfg.model.n_embd,
        "batch_size": cfg.micro_batch_size,
        "context": cfg.context,
        **checks["tp"],
        "max_abs_logit": logits_full.abs().max().item(),
        "activation_all_reduce_bytes_per_call": cfg.micro_batch_size
        * cfg.context
        * cfg.model.n_embd
        * logits_full.element_size(),
        "parameter_bytes_full": measure.tensor_bytes(full.parameters()),
        "fwd_bwd_s_full": _timed(ctx, full, loss_of),
        "fwd_bwd_s_tp": _timed(ctx, variants["tp"], loss_of),
    }
    if sequence_parallel:
        p_drop = float(ctx.options["memory_dropout"])
        payload["sequence_parallel"] = {
            **checks["tp_sp"],
            "memory": _memory_by_variant(ctx, mesh, x, y, p_drop),
            "memory_dropout": p_drop,
            "fwd_bwd_s_tp_sp": _timed(ctx, variants["tp_sp"], loss_of),
        }
    _common.finish(ctx, payload)


def _memory_by_variant(ctx: _common.Ctx, mesh, x, y, p_drop: float) -> dict:
    """activation_memory of the unsharded model, TP and TP + SP, each a fresh copy of one model in training mode with
    dropout on (its masks are activations too)."""
    torch.manual_seed(ctx.cfg.seed)
    dropped = GPT(replace(ctx.cfg.model, dropout=p_drop)).to(ctx.device)
    return {
        "full": activation_memory(copy.deepcopy(dropped), x, y),
        "tp": activation_memory(parallelize(copy.deepcopy(dropped), mesh), x, y),
        "tp_sp": activation_memory(parallelize(copy.deepcopy(dropped), mesh, sequence_parallel=True), x, y),
    }


def _loss_of(model, x, y):
    """The model's logits, and its mean cross-entropy on the batch."""
    logits = model(x)
    return logits, F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), ignore_index=IGNORE_INDEX)


def _timed(ctx: _common.Ctx, model, loss_of) -> list[float]:
    """Seconds of each of `repeats` forward and backward passes, after one warm-up pass."""
    timer = StepTimer(ctx.device)
    for _ in range(ctx.options["repeats"] + 1):
        model.zero_grad()
        with timer.step():
            loss_of(model)[1].backward()
    return timer.times[1:]


if __name__ == "__main__":
    main()
