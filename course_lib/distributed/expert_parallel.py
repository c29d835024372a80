"""Expert parallelism: the experts of every MoE layer (distributed/moe.py) split across the ranks, tokens sent to
them with all-to-all and back.

Each of the N ranks holds E/N experts of every MoE layer and a full copy of everything else (attention,
embeddings, LayerNorms, routers), and takes its own slice of the global batch, as under data parallelism. In each
MoE layer a rank routes its own tokens, then:

  1. all-to-all of the counts: how many tokens each rank sends to each expert (E integers);
  2. all-to-all of the tokens: the rows for expert e go to the rank that holds e;
  3. each expert runs once on everything it received, from every rank;
  4. all-to-all back: each output row returns to the rank its token came from, where the gates combine them.

In backward, the gradient of an all-to-all is the all-to-all the other way (the split sizes swapped): two more
exchanges of the same size per layer. `AllToAll` below is that pair, counting every byte it hands over.

Capacity is per rank (GShard's "group"): an expert takes at most C of the tokens each rank offers it. So the
single-process model equal to expert parallelism routes each rank's slice as its own group: the check below
runs the whole MoE GPT (all experts, same weights) on every rank's slice in turn.

Rank results: the largest difference of logits and of gradients from that single-process model (experts: this
rank's experts against the same experts there; replicated parameters: after the all-reduce that data parallelism
would do), all-to-all calls and bytes in forward and backward, the bytes of parameters held (experts sharded
against every expert replicated), each layer's expert load, and the bytes the rank wrote to its sockets in forward
and backward (gloo: _common.CollectiveCounter.written) and the time they took (after a warm-up pass).

Options: {"n_experts": int, "top_k": int, "capacity_factor": float, "aux_coef": float}
"""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist

from .. import measure
from ..data import count_targets
from ..techniques import loss_sum
from . import _common, moe


def _log_exchange(log: dict, phase: str, rows: list[int], row_bytes: int, rank: int) -> None:
    entry = log.setdefault(phase, {"calls": 0, "bytes_to_other_ranks": 0, "bytes_kept_on_this_rank": 0})
    entry["calls"] += 1
    entry["bytes_to_other_ranks"] += sum(n for r, n in enumerate(rows) if r != rank) * row_bytes
    entry["bytes_kept_on_this_rank"] += rows[rank] * row_bytes


def all_to_all(x: torch.Tensor, out_rows: list[int], in_rows: list[int], log: dict, phase: str) -> torch.Tensor:
    """dist.all_to_all_single: rows in_rows[r] of x go to rank r; out_rows[r] rows come from rank r. Logged."""
    out = x.new_empty((sum(out_rows),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_rows, in_rows)
    _log_exchange(
        log, phase, in_rows, x[0].numel() * x.element_size() if x.dim() > 1 else x.element_size(), dist.get_rank()
    )
    return out


class AllToAll(torch.autograd.Function):
    """The tokens' exchange, differentiable: backward sends each row's gradient back to where the row came from."""

    @staticmethod
    def forward(ctx, x, out_rows, in_rows, log):
        ctx.rows, ctx.log = (out_rows, in_rows), log
        return all_to_all(x, out_rows, in_rows, log, "forward")

    @staticmethod
    def backward(ctx, grad):
        out_rows, in_rows = ctx.rows
        return all_to_all(grad, in_rows, out_rows, ctx.log, "backward"), None, None, None


class ExpertParallelMoE(moe.MoE):
    """An MoE layer holding this rank's E/N experts; the rest run on the other ranks. The same routing and the same
    combination as moe.MoE: only where the experts run differs."""

    def __init__(self, layer: moe.MoE, rank: int, world: int, log: dict):
        if layer.n_experts % world:
            raise ValueError(f"{layer.n_experts} experts cannot be split evenly across {world} ranks")
        self.local = layer.n_experts // world
        first = rank * self.local
        super().__init__(
            layer.router,
            list(layer.experts)[first : first + self.local],
            layer.top_k,
            layer.capacity_factor,
            layer.aux_coef,
            first_expert=first,
        )
        self.world, self.log = world, log

    def expert_outputs(self, flat: torch.Tensor, routing: moe.Routing) -> list[torch.Tensor]:
        send_counts = torch.tensor([len(t) for t in routing.tokens])  # per global expert: experts of rank 0 first
        recv_counts = all_to_all(send_counts, [self.local] * self.world, [self.local] * self.world, self.log, "counts")
        in_rows = send_counts.view(self.world, self.local).sum(1).tolist()  # rows for each rank
        out_rows = recv_counts.view(self.world, self.local).sum(1).tolist()  # rows from each rank
        received = AllToAll.apply(torch.cat([flat[idx] for idx in routing.tokens]), out_rows, in_rows, self.log)
        # received holds rank 0's rows for my experts 0..local-1, then rank 1's, ...: each expert runs once on all of
        # its rows
        parts = list(received.split(recv_counts.tolist()))
        for j, expert in enumerate(self.experts):
            mine = [src * self.local + j for src in range(self.world)]
            y = expert(torch.cat([parts[i] for i in mine]))
            for i, part in zip(mine, y.split([len(parts[i]) for i in mine])):
                parts[i] = part
        returned = AllToAll.apply(torch.cat(parts), in_rows, out_rows, self.log)
        return list(returned.split(send_counts.tolist()))


def parallelize(model, rank: int, world: int, log: dict):
    """Every MoE layer of `model` keeps only this rank's experts (in place)."""
    for block in model.blocks:
        block.mlp = ExpertParallelMoE(block.mlp, rank, world, log)
    return model


# What --options may set, with the defaults (_common.check_options checks a launch's options against it).
OPTIONS = {"n_experts": 4, "top_k": 2, "capacity_factor": 1.25, "aux_coef": 0.01}


def main(argv=None) -> None:
    ctx = _common.start(argv, OPTIONS, "expert_parallel")
    o, cfg = ctx.options, ctx.cfg
    torch.manual_seed(cfg.seed)  # the same seed on every rank: the same weights everywhere
    full = moe.moe_gpt(cfg.model, o["n_experts"], o["top_k"], float(o["capacity_factor"]), float(o["aux_coef"]))
    full = full.to(ctx.device)
    log: dict = {}
    ep = parallelize(copy.deepcopy(full), ctx.rank, ctx.world, log)
    _splits, at = _common.global_batches(cfg, ctx.world, seed=cfg.seed)
    batch = tuple(t.to(ctx.device) for t in at(0)[0])  # the global batch: world x micro_batch_size sequences
    n_targets = count_targets(batch[1])  # each rank's loss over the global count: the ranks' losses sum to the mean
    x, y = _common.shard(batch, ctx.rank, ctx.world)
    logits_ep, loss_ep, fwd_bwd_s, counter = _timed_forward_backward(ep, x, y, n_targets, log)
    loss_full, logits_ref = _single_process(full, batch, n_targets, ctx)
    loss_sum_ranks = loss_ep.detach().clone()
    dist.all_reduce(loss_sum_ranks)
    local_experts = [p for layer in moe.moe_blocks(ep) for p in layer.experts.parameters()]
    all_experts = [p for layer in moe.moe_blocks(full) for p in layer.experts.parameters()]
    payload = {
        "strategy": "expert_parallel",
        "n_layer": cfg.model.n_layer,
        "n_embd": cfg.model.n_embd,
        "n_experts": o["n_experts"],
        "top_k": o["top_k"],
        "capacity_factor": float(o["capacity_factor"]),
        "experts_per_rank": o["n_experts"] // ctx.world,
        "tokens_per_rank": x.numel(),
        "batch_size_per_rank": x.size(0),
        "context": cfg.context,
        "max_abs_logit_diff": (logits_ep.detach() - logits_ref).abs().max().item(),
        "max_abs_logit": logits_ref.abs().max().item(),
        "loss_sum_of_ranks": loss_sum_ranks.item(),
        "loss_single_process": loss_full.item(),
        "max_abs_grad_diff": _grad_diffs(ep, full),
        "max_abs_grad": max(p.grad.abs().max().item() for p in full.parameters()),
        "all_to_all": log,
        "written_fwd_bwd": ctx.socket_bytes(counter),
        "fwd_bwd_s": fwd_bwd_s,
        "bytes_per_token_row": cfg.model.n_embd * logits_ep.element_size(),
        "expert_load": [
            {"chosen": ld.chosen.tolist(), "kept": ld.kept.tolist(), "capacity": ld.capacity}
            for ld in (layer.last_load for layer in moe.moe_blocks(ep))
        ],
        "parameter_bytes_expert_parallel": measure.tensor_bytes(ep.parameters()),
        "parameter_bytes_replicated_model": measure.tensor_bytes(full.parameters()),
        "expert_bytes_local": measure.tensor_bytes(local_experts),
        "expert_bytes_all": measure.tensor_bytes(all_experts),
    }
    _common.finish(ctx, payload)


def _timed_forward_backward(ep, x, y, n_targets: int, log: dict):
    """The expert-parallel model's forward and backward on this rank's slice, timed and counted after a warm-up pass
    (the first exchange sets up gloo's connections): (logits, loss, seconds, CollectiveCounter)."""
    (loss_sum(ep(x), y) / n_targets).backward()
    ep.zero_grad(set_to_none=True)
    log.clear()
    counter = _common.CollectiveCounter()  # what this rank wrote to its sockets in forward and backward (gloo)
    t0 = time.perf_counter()
    with counter:
        logits = ep(x)
        loss = loss_sum(logits, y) / n_targets
        loss.backward()
    return logits, loss, time.perf_counter() - t0, counter


def _single_process(full, batch, n_targets: int, ctx: _common.Ctx):
    """The single process equal to expert parallelism: all experts, every rank's slice routed as its own group, one
    loss over the global batch, backward done. Returns (that loss, the logits of this rank's slice)."""
    loss = 0.0
    for r in range(ctx.world):
        xr, yr = _common.shard(batch, r, ctx.world)
        logits = full(xr)
        loss = loss + loss_sum(logits, yr) / n_targets
        if r == ctx.rank:
            mine = logits.detach()
    loss.backward()
    return loss, mine


def _grad_diffs(ep, full) -> dict[str, float]:
    """The largest gradient differences from the single process: the replicated parameters' after the all-reduce data
    parallelism would do (each rank's gradient covers its own tokens), this rank's experts' against the same experts."""
    expert_params = {id(p) for layer in moe.moe_blocks(ep) for p in layer.experts.parameters()}
    full_params = dict(full.named_parameters())
    diffs = {"replicated": 0.0, "experts": 0.0}
    for name, p in ep.named_parameters():
        if id(p) not in expert_params:
            dist.all_reduce(p.grad)
            diffs["replicated"] = max(diffs["replicated"], (p.grad - full_params[name].grad).abs().max().item())
    for layer, ref in zip(moe.moe_blocks(ep), moe.moe_blocks(full)):
        for j, expert in enumerate(layer.experts):
            for p, q in zip(expert.parameters(), ref.experts[layer.first_expert + j].parameters()):
                diffs["experts"] = max(diffs["experts"], (p.grad - q.grad).abs().max().item())
    return diffs


if __name__ == "__main__":
    main()
