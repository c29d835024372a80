"""Pipeline parallelism with torch.distributed.pipelining: the GPT cut by layers into one stage per rank,
the batch cut into micro-batches, run with the GPipe and 1F1B schedules.

Stage 0 holds the embeddings and the first blocks, the last stage the last blocks, the final LayerNorm and
the output layer; the cut points balance an estimate of each part's work (the output layer of a small model
costs as much as several blocks). A stage is a slice of the course's GPT, not a re-implementation: it runs the
GPT's own `embed` (first stage), its own Block objects `blocks[lo:hi]` and its own `head` (last stage), so
dropout and everything else is the model's code (torchtitan splits its models the same way).

The tied input/output embedding: every rank builds the whole GPT from the same seed, so the first stage's
`wte.weight` and the last stage's `lm_head.weight` (on that rank the same Parameter as its own `wte.weight`) are
two copies, one per end of the pipeline, equal at the start. Each end's backward gives only its part of the
gradient (the embedding lookup's, or the output layer's), so after every backward the two ends all-reduce that
gradient between them, as Megatron-LM does: both then hold the unsplit model's gradient of the tied weight, take
the same AdamW step, and stay equal. (With one stage the tie is the model's own and nothing is sent.)

Rank results: for every schedule and micro-batch count, step times and a timeline of when this stage ran the
forward (F) and backward (B) of each micro-batch; the peak bytes allocated during a step (CPU ledger or CUDA
peak); parameter bytes of the stage; and (step 0) the pipeline's loss and gradients (blocks, and the tied
embedding on the end stages) against the unsplit model.

Options: {"microbatches": [2, 4, 8] (at least one per stage), "schedules": ["gpipe", "1f1b"], "n_layer": 8, "batch_size": 8, "steps": 3}

Its steps are not course_lib.train: a PipelineSchedule owns forward and backward across the stages (it calls
each stage's forward per micro-batch, receives and sends activations and gradients, and runs the backward
itself), which course_lib.train's step cannot hand over, so this module runs its own short AdamW loop (no
clipping, schedule or mixed precision) to time the stages. The network is still the model's own code.
"""
from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .. import measure
from ..data import IGNORE_INDEX
from ..model import GPT
from . import _common

SCHEDULES = ("gpipe", "1f1b")


def bubble_fraction(p: int, m: int) -> float:
    """Idle share of a GPipe or 1F1B step with p equal stages and m micro-batches: (p-1)/(m+p-1)."""
    return (p - 1) / (m + p - 1)


def split_points(n_layer: int, p: int, block_cost: float, head_cost: float) -> list[tuple[int, int]]:
    """Contiguous block ranges [lo, hi) per stage so that each stage's estimated work is near total/p; the last
    stage also carries the output layer (head_cost). Every stage gets at least one block."""
    if n_layer < p:
        raise ValueError(f"{p} stages need at least {p} blocks, the model has {n_layer}")
    best, best_cost = None, float("inf")

    def search(lo: int, stage: int, acc: list):
        nonlocal best, best_cost
        if stage == p - 1:
            ranges = acc + [(lo, n_layer)]
            costs = [(hi - l) * block_cost + (head_cost if i == p - 1 else 0) for i, (l, hi) in enumerate(ranges)]
            if max(costs) < best_cost:
                best, best_cost = ranges, max(costs)
            return
        for hi in range(lo + 1, n_layer - (p - 1 - stage) + 1):
            search(hi, stage + 1, acc + [(lo, hi)])

    search(0, 0, [])
    return best


class StageModule(nn.Module):
    """One stage of a GPT, cut out of the GPT itself: its `embed` if first, its Block objects blocks[lo:hi], its
    `head` (final LayerNorm and output layer) if last. No forward code of its own beyond choosing which of the
    model's pieces to run.

    Takes `gpt` over (pass a copy to keep the whole model, as `main` does): like torchtitan's pipeline split, the
    parts this stage does not run are dropped from it, so that the stage's parameters, and the memory it keeps,
    are its own part only; `gpt.blocks` becomes the stage's slice (the same Block objects)."""

    def __init__(self, gpt: GPT, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.first, self.last, self.lo, self.hi = first, last, lo, hi
        gpt.blocks = nn.ModuleList(gpt.blocks[lo:hi])
        if not first:
            gpt.wte = gpt.wpe = gpt.drop = None  # on the last stage lm_head keeps the tied weight, as its own copy
        if not last:
            gpt.ln_f = gpt.lm_head = None
        self.gpt = gpt

    @property
    def blocks(self) -> nn.ModuleList:
        return self.gpt.blocks

    def tied_weight(self) -> torch.Tensor | None:
        """This stage's copy of the tied input/output embedding, if it holds one (first or last stage)."""
        return self.gpt.wte.weight if self.first else self.gpt.lm_head.weight if self.last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.gpt.embed(x)  # token ids (b, s) -> (b, s, d)
        for block in self.gpt.blocks:
            x = block(x)
        return self.gpt.head(x) if self.last else x  # logits (b, s, padded_vocab) or activations (b, s, d)


def tie_group(world: int):
    """The process group of the first and the last stage, which share the tied embedding; None with one stage.
    Every rank must call this (torch.distributed.new_group is collective)."""
    return dist.new_group([0, world - 1]) if world > 1 else None


def all_reduce_tied_grad(stage_mod: StageModule, group) -> None:
    """Sum the two ends' gradients of the tied embedding: each then holds the unsplit model's gradient."""
    w = stage_mod.tied_weight()
    if group is not None and w is not None:
        dist.all_reduce(w.grad, group=group)


def mean_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX)


def _record(stage, events: list):
    """Wrap the stage's per-micro-batch forward and backward to log (kind, micro-batch, start, end)."""
    fwd, bwd = stage.forward_one_chunk, stage.backward_one_chunk

    def forward_one_chunk(chunk_id, *args, **kwargs):
        t0 = time.time()
        out = fwd(chunk_id, *args, **kwargs)
        events.append(("F", chunk_id, t0, time.time()))
        return out

    def backward_one_chunk(chunk_id, *args, **kwargs):
        t0 = time.time()
        out = bwd(chunk_id, *args, **kwargs)
        events.append(("B", chunk_id, t0, time.time()))
        return out

    stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk


def measured_bubble(ranks: list[dict], key: str, step: int = -1) -> float:
    """1 - (busy time summed over stages) / (stages x the step's span), from every rank's timeline."""
    timelines = [r["runs"][key]["timelines"][step] for r in ranks]
    start = min(e[2] for tl in timelines for e in tl)
    end = max(e[3] for tl in timelines for e in tl)
    busy = sum(e[3] - e[2] for tl in timelines for e in tl)
    return 1 - busy / (len(timelines) * (end - start))


def main(argv=None) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    ctx = _common.start(argv)
    o = ctx.options
    ms = [int(m) for m in o.get("microbatches", [2, 4, 8])]
    schedules = o.get("schedules", list(SCHEDULES))
    steps = int(o.get("steps", 3))
    batch = int(o.get("batch_size", max(ms)))
    mcfg = replace(ctx.cfg.model, n_layer=int(o.get("n_layer", 8)))
    cfg = replace(ctx.cfg, model=mcfg, batch_size=batch, grad_accum_steps=1)
    torch.manual_seed(cfg.seed)
    full = GPT(mcfg).to(ctx.device)
    d, s, v = mcfg.n_embd, cfg.context, mcfg.padded_vocab_size
    ranges = split_points(mcfg.n_layer, ctx.world, block_cost=12 * d * d + 2 * s * d, head_cost=d * v)
    lo, hi = ranges[ctx.rank]
    _splits, at = _common.global_batches(cfg, 1, seed=cfg.seed)

    payload = {"strategy": "pipeline", "stages": ctx.world, "ranges": ranges, "batch_size": batch, "context": cfg.context,
               "n_layer": mcfg.n_layer, "runs": {}}
    tied = tie_group(ctx.world)
    for sched_name in schedules:
        for m in ms:
            if batch % m or m < ctx.world:  # torch's schedules need at least one micro-batch per stage
                continue
            stage_mod = StageModule(copy.deepcopy(full), lo, hi, ctx.is_first, ctx.is_last).to(ctx.device)  # same start each run
            stage = PipelineStage(stage_mod, ctx.rank, ctx.world, ctx.device)
            events: list = []
            _record(stage, events)
            Sched = ScheduleGPipe if sched_name == "gpipe" else Schedule1F1B
            schedule = Sched(stage, n_microbatches=m, loss_fn=mean_loss)
            opt = torch.optim.AdamW(stage_mod.parameters(), lr=cfg.lr)
            timer = measure.StepTimer(ctx.device)
            timelines, losses_out = [], []
            check = {}
            for step in range(steps + 1):  # the extra last step is measured for memory, not timed
                x, y = (t.to(ctx.device) for t in at(step)[0])
                opt.zero_grad(set_to_none=False)
                events.clear()
                ledger = measure.MemoryLedger(keep_timeline=False) if (step == steps and ctx.device.type == "cpu") else None
                if step == steps and ctx.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(ctx.device)
                dist.barrier()
                losses: list = []
                with timer.step(), (ledger if ledger is not None else contextlib.nullcontext()):
                    if ctx.is_first and ctx.is_last:
                        schedule.step(x, target=y, losses=losses)
                    elif ctx.is_first:
                        schedule.step(x)
                    elif ctx.is_last:
                        schedule.step(target=y, losses=losses)
                    else:
                        schedule.step()
                    all_reduce_tied_grad(stage_mod, tied)
                if step < steps:
                    timelines.append([list(e) for e in events])
                if ctx.is_last and losses:
                    losses_out.append(float(torch.stack([l.detach() for l in losses]).mean()))
                if step == 0 and sched_name == schedules[0] and m == max(ms):
                    check = _compare_with_unsplit(full, stage_mod, x, y, losses, ctx)
                if step == steps:
                    peak = ledger.peak if ledger is not None else torch.cuda.max_memory_allocated(ctx.device)
                opt.step()
            payload["runs"][f"{sched_name}/m={m}"] = {
                "schedule": sched_name, "microbatches": m, "step_times": timer.times[:steps], "timelines": timelines,
                "losses": losses_out, "step_peak_bytes": peak,
                "peak_method": "CPU ledger: storages allocated during the step" if ctx.device.type == "cpu"
                else "CUDA max_memory_allocated (includes parameters and optimizer state)",
                "parameter_bytes": measure.tensor_bytes(stage_mod.parameters()), **({"check": check} if check else {})}
    payload["full_model_parameter_bytes"] = measure.tensor_bytes(full.parameters())
    _common.write(ctx, payload)
    _common.finish()


def _compare_with_unsplit(full: GPT, stage_mod: StageModule, x, y, losses, ctx) -> dict:
    """The unsplit model on the same batch: its loss against the pipeline's (last stage), its block gradients
    against this stage's, and (first and last stage, after the all-reduce) its tied-embedding gradient."""
    ref = copy.deepcopy(full)
    ref.zero_grad()
    loss = mean_loss(ref(x), y)
    loss.backward()
    out = {}
    if ctx.is_last and losses:
        out["pipeline_loss"] = float(torch.stack([l.detach() for l in losses]).mean())
        out["unsplit_loss"] = loss.item()
    diffs = []
    for i, block in enumerate(stage_mod.blocks):
        for (name, p), (_, q) in zip(block.named_parameters(), ref.blocks[stage_mod.lo + i].named_parameters()):
            diffs.append((p.grad - q.grad).abs().max().item())
    out["max_abs_block_grad_diff"] = max(diffs)
    out["max_abs_block_grad"] = max(q.grad.abs().max().item() for b in ref.blocks[stage_mod.lo:stage_mod.hi] for q in b.parameters())
    tied = stage_mod.tied_weight()
    if tied is not None:
        out["max_abs_tied_grad_diff"] = (tied.grad - ref.wte.weight.grad).abs().max().item()
        out["max_abs_tied_grad"] = ref.wte.weight.grad.abs().max().item()
    return out


if __name__ == "__main__":
    main()
