"""Pipeline parallelism with torch.distributed.pipelining: the GPT cut by layers into one stage per rank,
the batch cut into micro-batches, run with the GPipe and 1F1B schedules.

Stage 0 holds the embeddings and the first blocks, the last stage the last blocks, the final LayerNorm and
the output layer; the cut points balance an estimate of each part's work (the output layer of a small model
costs as much as several blocks). The tied input/output embedding becomes two copies here (one per end of
the pipeline), equal at the start; a real system all-reduces their gradients between the first and last stage.

Rank results: for every schedule and micro-batch count, step times and a timeline of when this stage ran the
forward (F) and backward (B) of each micro-batch; the peak bytes allocated during a step (CPU ledger or CUDA
peak); parameter bytes of the stage; and (step 0) the pipeline's loss and gradients against the unsplit model.

Options: {"microbatches": [2, 4, 8] (at least one per stage), "schedules": ["gpipe", "1f1b"], "n_layer": 8, "batch_size": 8, "steps": 3}

Its steps are not course_lib.train: a PipelineSchedule owns forward and backward across the stages, so
this module runs its own short AdamW loop (no clipping, schedule or mixed precision) to time the stages.
"""
from __future__ import annotations

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
    """One stage of the GPT: (embeddings if first) + blocks[lo:hi] + (final LayerNorm and output layer if last)."""

    def __init__(self, gpt: GPT, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        gpt = copy.deepcopy(gpt)
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe = gpt.wte, gpt.wpe
        self.blocks = nn.ModuleList(gpt.blocks[lo:hi])
        if last:
            self.ln_f = gpt.ln_f
            self.lm_head = nn.Linear(gpt.config.n_embd, gpt.config.padded_vocab_size, bias=False)
            self.lm_head.weight = nn.Parameter(gpt.lm_head.weight.detach().clone())  # untied copy, equal values

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.size(1), device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x


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
    for sched_name in schedules:
        for m in ms:
            if batch % m or m < ctx.world:  # torch's schedules need at least one micro-batch per stage
                continue
            stage_mod = StageModule(full, lo, hi, ctx.is_first, ctx.is_last).to(ctx.device)
            stage = PipelineStage(stage_mod, ctx.rank, ctx.world, ctx.device)
            events: list = []
            _record(stage, events)
            Sched = ScheduleGPipe if sched_name == "gpipe" else Schedule1F1B
            schedule = Sched(stage, n_microbatches=m, loss_fn=mean_loss)
            opt = torch.optim.AdamW(stage_mod.parameters(), lr=cfg.lr)
            times, timelines, losses_out = [], [], []
            check = {}
            for step in range(steps + 1):  # the extra last step is measured for memory, not timed
                x, y = (t.to(ctx.device) for t in at(step)[0])
                opt.zero_grad(set_to_none=False)
                events.clear()
                ledger = measure.MemoryLedger(keep_timeline=False) if (step == steps and ctx.device.type == "cpu") else None
                if step == steps and ctx.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(ctx.device)
                dist.barrier()
                measure.synchronize(ctx.device)
                t0 = time.perf_counter()
                losses: list = []
                with (ledger if ledger is not None else _nullcontext()):
                    if ctx.is_first and ctx.is_last:
                        schedule.step(x, target=y, losses=losses)
                    elif ctx.is_first:
                        schedule.step(x)
                    elif ctx.is_last:
                        schedule.step(target=y, losses=losses)
                    else:
                        schedule.step()
                measure.synchronize(ctx.device)
                if step < steps:
                    times.append(time.perf_counter() - t0)
                    timelines.append([list(e) for e in events])
                if ctx.is_last and losses:
                    losses_out.append(float(torch.stack([l.detach() for l in losses]).mean()))
                if step == 0 and sched_name == schedules[0] and m == max(ms):
                    check = _compare_with_unsplit(full, stage_mod, x, y, losses, lo, hi, ctx)
                if step == steps:
                    peak = ledger.peak if ledger is not None else torch.cuda.max_memory_allocated(ctx.device)
                opt.step()
            payload["runs"][f"{sched_name}/m={m}"] = {
                "schedule": sched_name, "microbatches": m, "step_times": times, "timelines": timelines, "losses": losses_out,
                "step_peak_bytes": peak, "peak_method": "CPU ledger: storages allocated during the step" if ctx.device.type == "cpu"
                else "CUDA max_memory_allocated (includes parameters and optimizer state)",
                "parameter_bytes": _common.local_bytes(stage_mod.parameters()), **({"check": check} if check else {})}
    payload["full_model_parameter_bytes"] = measure.tensor_bytes(full.parameters())
    _common.write(ctx, payload)
    _common.finish()


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _compare_with_unsplit(full: GPT, stage_mod: StageModule, x, y, losses, lo, hi, ctx) -> dict:
    """The unsplit model on the same batch: its loss against the pipeline's (last stage), and its block
    gradients against this stage's."""
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
        for (name, p), (_, q) in zip(block.named_parameters(), ref.blocks[lo + i].named_parameters()):
            diffs.append((p.grad - q.grad).abs().max().item())
    out["max_abs_block_grad_diff"] = max(diffs)
    out["max_abs_block_grad"] = max(q.grad.abs().max().item() for b in ref.blocks[lo:hi] for q in b.parameters())
    return out


if __name__ == "__main__":
    main()
