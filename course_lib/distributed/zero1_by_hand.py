"""ZeRO-1 written by hand (notebook 07): AdamW's state sharded across the data-parallel ranks, run through the course's
one loop beside the same loop with unsharded torch.optim.AdamW on every rank, on the same batches.

Each step, each rank
1. runs forward and backward on its slice of the global batch (the loop's own `accumulate_micro_batches`);
2. averages the gradients with the other ranks through the loop's own hand-written DDP (data_parallel="bucketed":
   gradients all-reduced in flat buckets, then / world; one bucket for the course's small models). Every rank then
   holds the whole averaged gradient, so the loop's global-norm clipping needs nothing more;
3. updates only its shard of the parameters with AdamW, keeping AdamW's two moments for that shard alone;
4. all-gathers the updated shards, so that every rank holds the whole updated model again.

The shards: every parameter (the tied embedding once) laid end to end in one flat buffer, one parameter group after
the other, padded with zeros to a multiple of the world's size; each of the model's parameters becomes a view of its
piece of the buffer, so the all-gather writes the model's weights in place. With N parameters and W ranks, rank r
owns elements [r S, (r+1) S), S = ceil(N / W). A parameter group is one run of the buffer, so a shard meets each group
in one slice, updated with that group's hyperparameters (weight decay on the >=2-D tensors only).

The update is torch.optim.AdamW's for-loop implementation, written out element by element, so a shard's elements get
the same bits an unsharded AdamW gives them:

    p <- p (1 - lr wd);  m <- lerp(m, g, 1 - beta1);  v <- beta2 v + (1 - beta2) g^2
    p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

Memory: AdamW keeps 8 bytes per parameter (two fp32 moments) and a step counter per tensor; each rank here keeps 8 S
bytes, 8 N / W plus the padding's share (under 8 bytes per rank; 8 (W-1) at most over all ranks), and one counter.
Traffic per step: the all-reduce of the gradients (as DDP), and the all-gather of the parameters, 1.5x DDP's bytes
(ZeRO's paper counts a reduce-scatter in place of the all-reduce, since a rank needs only its shard's gradient: the same
bytes as an all-reduce's first half; here the whole gradient is kept for clipping).

Measured per rank, for both runs: losses, step times, the bytes held (parameters, gradients, optimizer state) and the
collectives of the last step; and the largest difference between the two runs' parameters after the last step.

Options: {"steps": int}
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.distributed as dist

from .. import measure, techniques
from ..config import ConfigError
from . import _common


def shard_bounds(n: int, world: int, rank: int) -> tuple[int, int]:
    """The elements [lo, hi) of a flat buffer of n elements, padded to a multiple of world, that rank owns."""
    size = math.ceil(n / world)
    return rank * size, (rank + 1) * size


class Zero1AdamW(torch.optim.Optimizer):
    """AdamW with its state sharded over the ranks of `group` (ZeRO stage 1): `step()` updates this rank's shard of the
    flat parameters and all-gathers the rest. Give it the gradients averaged over the ranks (every rank the same). A
    torch Optimizer (param_groups, zero_grad, an lr scheduler), so the course's loop steps it as any other.

    `world` and `rank` default to the process group's; world=1 runs without any collective (the whole buffer is the
    shard)."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        group=None,
        world: int | None = None,
        rank: int | None = None,
    ):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.group = group
        self.world = world if world is not None else dist.get_world_size(group)
        self.rank = rank if rank is not None else dist.get_rank(group)
        params = [p for g in self.param_groups for p in g["params"]]
        if len({id(p) for p in params}) != len(params):
            raise ValueError("a parameter appears twice in the groups: list each once (the tied embedding too)")
        if len({(p.dtype, p.device) for p in params}) != 1:
            raise ValueError("the flat buffer holds one dtype on one device: every parameter must share them")
        self.n_params = sum(p.numel() for p in params)
        self.lo, self.hi = shard_bounds(self.n_params, self.world, self.rank)
        self.flat = torch.zeros(self.world * (self.hi - self.lo), dtype=params[0].dtype, device=params[0].device)
        self.pieces: list[tuple[torch.Tensor, int]] = []  # (parameter, its offset in the buffer)
        self.group_ranges: list[tuple[int, int]] = []
        offset = 0
        with torch.no_grad():
            for g in self.param_groups:
                start = offset
                for p in g["params"]:
                    piece = self.flat[offset : offset + p.numel()]
                    piece.copy_(p.reshape(-1))
                    p.data = piece.view_as(p)  # the model's weights now live in the buffer
                    self.pieces.append((p, offset))
                    offset += p.numel()
                self.group_ranges.append((start, offset))
        if self.world > 1:
            dist.broadcast(self.flat, src=dist.get_global_rank(group, 0) if group else 0, group=group)
        size = self.hi - self.lo
        # This rank's state, one entry: the step counter (a tensor, as torch's AdamW keeps it) and the two moments.
        self.state[self.flat] = {
            "step": torch.tensor(0.0),
            "exp_avg": torch.zeros(size, dtype=self.flat.dtype, device=self.flat.device),
            "exp_avg_sq": torch.zeros(size, dtype=self.flat.dtype, device=self.flat.device),
        }

    def shard_grad(self) -> torch.Tensor:
        """The gradient of this rank's shard, gathered from the parameters' .grad (zeros for padding and missing
        gradients)."""
        g = torch.zeros(self.hi - self.lo, dtype=self.flat.dtype, device=self.flat.device)
        for p, offset in self.pieces:
            a, b = max(offset, self.lo), min(offset + p.numel(), self.hi)
            if a < b and p.grad is not None:
                g[a - self.lo : b - self.lo] = p.grad.reshape(-1)[a - offset : b - offset]
        return g

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        state = self.state[self.flat]
        state["step"] += 1
        t = state["step"].item()
        grad = self.shard_grad()
        for g, (start, end) in zip(self.param_groups, self.group_ranges):
            a, b = max(start, self.lo), min(end, self.hi)
            if a >= b:
                continue
            lr, (beta1, beta2), eps, wd = g["lr"], g["betas"], g["eps"], g["weight_decay"]
            param = self.flat[a:b]
            grad_, exp_avg, exp_avg_sq = (
                x[a - self.lo : b - self.lo] for x in (grad, state["exp_avg"], state["exp_avg_sq"])
            )
            # torch.optim.AdamW (foreach=False), operation for operation
            if wd != 0:
                param.mul_(1 - lr * wd)
            exp_avg.lerp_(grad_, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad_, grad_, value=1 - beta2)
            bias_correction1, bias_correction2 = 1 - beta1**t, 1 - beta2**t
            denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
            param.addcdiv_(exp_avg, denom, value=-(lr / bias_correction1))
        if self.world > 1:  # every rank's updated shard to every rank: the whole model again
            dist.all_gather_into_tensor(self.flat, self.flat[self.lo : self.hi].clone(), group=self.group)
        return loss


def run_variant(ctx: _common.Ctx, cfg, at, variant: str) -> dict:
    """One run of the course's loop with its hand-written DDP (data_parallel="bucketed": rank 0's weights broadcast,
    the gradients averaged in buckets, one here for a model this small): "replicated" (the loop's torch.optim.AdamW on
    every rank) or "zero1" (Zero1AdamW)."""

    def on_build(setup):
        if variant == "zero1":
            groups = techniques.param_groups(setup.model, cfg.weight_decay, cfg.decay_2d_only)
            setup.optimizer = Zero1AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
            setup.scheduler = techniques.make_scheduler(cfg, setup.optimizer)

    counter = _common.CollectiveCounter()
    with counter.last_step_of(cfg.steps) as count:
        result, setup = _common.train_rank(ctx, replace(cfg, data_parallel="bucketed"), at, variant, on_build, count)
    held = measure.static_bytes(setup.model, setup.optimizer)  # between steps (gradients: set_to_none frees them)
    return {
        "variant": variant,
        "losses": result.losses,
        "step_s": result.step_times,
        "median_step_s": result.median_step_s,
        "bytes_held": held,
        "optimizer_state_bytes": held["optimizer state"],
        "collectives_last_step": dict(counter.counts),
        "written_last_step": counter.written if ctx.backend == "gloo" else None,
        "params": {n: p.detach().clone() for n, p in setup.model.named_parameters()},
    }


def plot_state_bytes(ranks: list[dict], ax=None):
    """Per rank, two stacked bars (AdamW on every rank, ZeRO-1 by hand): the parameters and the optimizer state each
    holds between steps, measured from the tensors; a dotted line at AdamW's 8 bytes per parameter divided by the
    ranks. `ranks`: a zero1_by_hand launch's rank JSONs (LaunchResult.ranks)."""
    from ..plots import new_figure

    if ax is None:
        ax = new_figure((6, 3.2)).subplots()
    width, world = 0.38, len(ranks)
    for i, variant in enumerate(("replicated", "zero1")):
        x = [r["rank"] + (i - 0.5) * width for r in ranks]
        params = [r["runs"][variant]["bytes_held"]["parameters"] / 2**20 for r in ranks]
        state = [r["runs"][variant]["optimizer_state_bytes"] / 2**20 for r in ranks]
        ax.bar(x, params, width, color="#4c72b0", label="parameters" if i == 0 else None)
        ax.bar(
            x,
            state,
            width,
            bottom=params,
            color="#55a868" if i == 0 else "#c44e52",
            label="AdamW state, every rank" if i == 0 else "AdamW state, ZeRO-1 by hand",
        )
    n = ranks[0]["n_params"]
    ax.axhline(
        (ranks[0]["runs"]["zero1"]["bytes_held"]["parameters"] + 8 * n / world) / 2**20,
        color="k",
        ls=":",
        lw=0.8,
        label="parameters + 8 bytes x N / ranks",
    )
    ax.set_xticks([r["rank"] for r in ranks], [f"rank {r['rank']}" for r in ranks])
    ax.set_ylabel("MiB held between steps")
    ax.set_title(f"AdamW's state sharded over {world} ranks - {ranks[0]['provenance']['device']}", fontsize=9)
    ax.legend(fontsize=7)
    return ax.figure


# What --options may set, with the defaults (_common.check_options checks a launch's options against it).
OPTIONS = {"steps": 4}


def main(argv=None) -> None:
    ctx = _common.start(argv, OPTIONS, "zero1_by_hand")
    steps = int(ctx.options["steps"])
    if ctx.cfg.optimizer != "adamw":
        raise ConfigError(f"zero1_by_hand shards AdamW's state: set optimizer='adamw' (got {ctx.cfg.optimizer!r})")
    cfg = replace(ctx.cfg, steps=steps, timing_warmup=1, grad_accum_steps=1, measure_memory=False, compile=False)
    _splits, at = _common.global_batches(cfg, ctx.world, seed=cfg.seed)
    runs = {v: run_variant(ctx, cfg, at, v) for v in ("replicated", "zero1")}
    reference, sharded = runs["replicated"].pop("params"), runs["zero1"].pop("params")
    n = sum(t.numel() for t in reference.values())  # named_parameters lists the tied embedding once
    lo, hi = shard_bounds(n, ctx.world, ctx.rank)
    payload = {
        "strategy": "zero1_by_hand",
        "steps": steps,
        "n_params": n,
        "shard_elements": hi - lo,
        "padding_elements": ctx.world * (hi - lo) - n,
        # AdamW: 2 fp32 moments per parameter (8 bytes), and a 4-byte step counter per tensor (one here)
        "optimizer_state_bytes_formula": {
            "replicated": 8 * n + 4 * len(reference),
            "zero1": 8 * (hi - lo) + 4,
        },
        "max_abs_param_diff": max((sharded[k] - reference[k]).abs().max().item() for k in reference),
        "runs": runs,
    }
    _common.write(ctx, payload)
    _common.finish()


if __name__ == "__main__":
    main()
