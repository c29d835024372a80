"""ZeRO-1 written by hand (notebook 07): AdamW's state sharded across the data-parallel ranks, run through the course's
one loop beside the same loop with unsharded torch.optim.AdamW on every rank, on the same batches.

Each step, each rank
1. runs forward and backward on its slice of the global batch (the loop's own step, train.train_step);
2. averages the gradients with the other ranks through the loop's own hand-written DDP (data_parallel="bucketed":
   gradients all-reduced in flat buckets, then / world; one bucket for the course's small models). Every rank then
   holds the whole averaged gradient, so the loop's global-norm clipping needs nothing more;
3. updates only its shard of the parameters with AdamW, keeping AdamW's two moments for that shard alone;
4. all-gathers the updated shards, so that every rank holds the whole updated model again.

The shards: every parameter (the tied embedding once) laid end to end in one flat buffer, one parameter group after
the other, padded with zeros to a multiple of the world's size; each of the model's parameters becomes a view of its
piece of the buffer, so the all-gather writes the model's weights in place. With N parameters and W ranks, rank r
owns elements [r S, (r+1) S), S = ceil(N / W). A shard meets a parameter in one slice at most (a parameter may be cut
by a shard's edge), updated with its group's hyperparameters (weight decay on the >=2-D tensors only).

The update is torch.optim.AdamW's for-loop implementation, written out element by element, so a shard's elements get
the same bits an unsharded AdamW gives them (a parameter whose .grad is None is skipped, as torch skips it):

    p <- p (1 - lr wd);  m <- lerp(m, g, 1 - beta1);  v <- beta2 v + (1 - beta2) g^2
    p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

Memory: AdamW keeps 8 bytes per parameter (two fp32 moments) and a step counter per tensor; each rank here keeps 8 S
bytes, 8 N / W plus the padding's share (under 8 bytes per rank; 8 (W-1) at most over all ranks), and a counter per
tensor it has a share of.
Traffic per step: the all-reduce of the gradients (as DDP), and the all-gather of the parameters, 1.5x DDP's bytes
(ZeRO's paper counts a reduce-scatter in place of the all-reduce, since a rank needs only its shard's gradient: the same
bytes as an all-reduce's first half; here the whole gradient is kept for clipping).

Measured per rank, for both runs: losses, step times, the bytes held (parameters, gradients, optimizer state) and the
collectives of the last step; the largest difference between the two runs' parameters after the last step; and
Zero1AdamW beside torch's AdamW on a small model with a frozen weight, a branch unused every other step and tied weights
(`compare_with_torch_adamw`).

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

    A parameter whose .grad is None (frozen, or unused this step) is skipped as torch.optim.AdamW skips it: no weight
    decay, no update, and its step counter stays, so each parameter keeps its own count for the bias correction.

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
        # (parameter, its group, the slice [a, b) of the buffer it shares with this rank's shard, its offset)
        self.pieces: list[tuple[torch.Tensor, dict, int, int, int]] = []
        offset = 0
        with torch.no_grad():
            for g in self.param_groups:
                for p in g["params"]:
                    piece = self.flat[offset : offset + p.numel()]
                    piece.copy_(p.reshape(-1))
                    p.data = piece.view_as(p)  # the model's weights now live in the buffer
                    a, b = max(offset, self.lo), min(offset + p.numel(), self.hi)
                    if a < b:
                        self.pieces.append((p, g, a, b, offset))
                    offset += p.numel()
        if self.world > 1:
            dist.broadcast(self.flat, src=dist.get_global_rank(group, 0) if group else 0, group=group)
        size = self.hi - self.lo
        # This rank's state, one entry: a step counter per parameter it has a share of (a 4-byte tensor each, as torch's
        # AdamW keeps one per parameter) and the two moments of the shard.
        self.state[self.flat] = {
            "step": torch.zeros(len(self.pieces)),
            "exp_avg": torch.zeros(size, dtype=self.flat.dtype, device=self.flat.device),
            "exp_avg_sq": torch.zeros(size, dtype=self.flat.dtype, device=self.flat.device),
        }

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        state = self.state[self.flat]
        for i, (p, g, a, b, offset) in enumerate(self.pieces):
            if p.grad is None:  # frozen, or no gradient this step: torch's AdamW leaves it and its state alone
                continue
            state["step"][i] += 1
            t = state["step"][i].item()
            lr, (beta1, beta2), eps, wd = g["lr"], g["betas"], g["eps"], g["weight_decay"]
            param = self.flat[a:b]
            grad = p.grad.reshape(-1)[a - offset : b - offset]
            exp_avg, exp_avg_sq = (state[k][a - self.lo : b - self.lo] for k in ("exp_avg", "exp_avg_sq"))
            # torch.optim.AdamW (foreach=False), operation for operation
            if wd != 0:
                param.mul_(1 - lr * wd)
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            bias_correction1, bias_correction2 = 1 - beta1**t, 1 - beta2**t
            denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
            param.addcdiv_(exp_avg, denom, value=-(lr / bias_correction1))
        if self.world > 1:  # every rank's updated shard to every rank: the whole model again
            _common.all_gather_single(self.flat, self.flat[self.lo : self.hi].clone(), group=self.group)
        return loss


class FrozenAndTied(torch.nn.Module):
    """A small model with what a fine-tuning run has: a frozen weight (requires_grad=False), a branch that gets no
    gradient on odd steps (`forward(x, use_branch)`), and an output layer tied to the embedding."""

    def __init__(self, vocab: int = 13, width: int = 8):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width)
        self.frozen = torch.nn.Linear(width, width)
        self.frozen.weight.requires_grad_(False)
        self.sometimes = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = self.frozen(self.emb(x))
        if use_branch:
            h = h + self.sometimes(h)
        return self.head(self.norm(h))


def compare_on_frozen_and_tied(make_mine, make_torch, steps: int = 5, weight_decay: float = 0.1, device="cpu"):
    """Two copies of FrozenAndTied trained side by side, one with `make_mine(groups)`, one with `make_torch(groups)`,
    on the same batches (on every rank: the gradients need no averaging); the groups hold every parameter, the frozen
    one too, with weight decay on the >=2-D tensors. Returns (whether every parameter was equal to the bit after every
    step, the largest difference, whether mine never moved the frozen weight and moved the branch only on the steps
    that used it), `make_mine`'s optimizer and its model."""
    torch.manual_seed(0)
    ref, mine = FrozenAndTied().to(device), FrozenAndTied().to(device)
    mine.load_state_dict(ref.state_dict())

    def groups(model):
        params = list(model.parameters())  # the tied weight once, the frozen one included
        return [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]

    theirs, ours = make_torch(groups(ref)), make_mine(groups(mine))
    frozen0, branch = mine.frozen.weight.detach().clone(), mine.sometimes.weight.detach().clone()
    gen = torch.Generator().manual_seed(1)
    equal, diff, branch_kept = True, 0.0, True
    for step in range(steps):
        x, y = (torch.randint(0, 13, (4, 6), generator=gen).to(device) for _ in range(2))
        use_branch = step % 2 == 0
        for model, opt in ((ref, theirs), (mine, ours)):
            torch.nn.functional.cross_entropy(model(x, use_branch).flatten(0, 1), y.flatten()).backward()
            opt.step()
            opt.zero_grad()  # set_to_none: the branch's .grad is None on the steps it is not used
        for p, q in zip(ref.parameters(), mine.parameters()):
            equal &= torch.equal(p, q)
            diff = max(diff, (p - q).abs().max().item())
        if not use_branch:
            branch_kept &= torch.equal(mine.sometimes.weight, branch)
        branch = mine.sometimes.weight.detach().clone()
    result = {
        "steps": steps,
        "bit_equal_every_step": equal,
        "max_abs_diff": diff,
        "frozen_unchanged": torch.equal(mine.frozen.weight, frozen0),
        "branch_unchanged_when_unused": branch_kept,
    }
    return result, ours, mine


def compare_with_torch_adamw(steps: int = 5, world: int | None = None, rank: int | None = None, device="cpu") -> dict:
    """Zero1AdamW beside torch.optim.AdamW (foreach=False) on FrozenAndTied (compare_on_frozen_and_tied); every rank
    calls it. Adds which parameters this rank's shard splits (cut by a shard's edge)."""
    hyper = {"lr": 1e-2, "betas": (0.9, 0.95)}
    result, zero1, model = compare_on_frozen_and_tied(
        lambda groups: Zero1AdamW(groups, **hyper, world=world, rank=rank),
        lambda groups: torch.optim.AdamW(groups, **hyper, foreach=False),
        steps,
        device=device,
    )
    names = {id(p): n for n, p in model.named_parameters()}
    split = [names[id(p)] for p, _group, a, b, offset in zero1.pieces if (a, b) != (offset, offset + p.numel())]
    return result | {"split_by_this_shard": split}


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
        "parameters_in_shard": len(setup.optimizer.pieces) if variant == "zero1" else None,
        "collectives_last_step": dict(counter.counts),
        "written_last_step": ctx.socket_bytes(counter),
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
        # AdamW: 2 fp32 moments per parameter (8 bytes), and a 4-byte step counter per tensor (ZeRO-1: per tensor
        # this rank has a share of)
        "optimizer_state_bytes_formula": {
            "replicated": 8 * n + 4 * len(reference),
            "zero1": 8 * (hi - lo) + 4 * runs["zero1"]["parameters_in_shard"],
        },
        "max_abs_param_diff": max((sharded[k] - reference[k]).abs().max().item() for k in reference),
        "runs": runs,
        "frozen_and_tied": compare_with_torch_adamw(device=ctx.device),
    }
    _common.finish(ctx, payload)


if __name__ == "__main__":
    main()
