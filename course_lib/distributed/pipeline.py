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
peak); parameter bytes of the stage; the collectives of the last step (sends and receives of activations and their
gradients, the tied embedding's and the gradient norm's all-reduces: _common.CollectiveCounter) and the bytes the rank
wrote meanwhile (gloo); and (step 0) the pipeline's loss and gradients (blocks, and the tied embedding on the end
stages) against the unsplit model.

Options: {"microbatches": [2, 4, 8] (at least one per stage), "schedules": ["gpipe", "1f1b"], "n_layer": 8,
"batch_size": 8, "steps": 3}

Its steps are course_lib.train's one loop (Trainer): a PipelineSchedule owns forward and backward across the stages (it
calls each stage's forward per micro-batch, sends and receives activations and gradients, and runs the backward
itself), so the pipeline hands the loop that piece (`Setup.forward_backward`) and the gradient norm over all stages
(`Setup.grad_norm`, for global-norm clipping); clipping, AdamW, the learning-rate schedule, timing and the memory
ledger are the loop's, as for every other run.
"""

from __future__ import annotations

import copy
import time
from dataclasses import replace
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import measure, techniques
from ..config import ConfigError
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
            costs = [
                (end - start) * block_cost + (head_cost if i == p - 1 else 0) for i, (start, end) in enumerate(ranges)
            ]
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


class PipelineStep:
    """The step's forward and backward for the course's one loop (`Setup.forward_backward`): the micro-batches of a
    step go, as one batch, to the pipeline schedule, which cuts it into its own micro-batches and runs their
    forwards and backwards across the stages; then the two ends sum their tied-embedding gradients. Everything else
    of the step (clipping, the optimizer, the schedule, timing, the memory ledger) is the loop's.

    Each micro-batch's loss is its summed cross-entropy over the count of target tokens of the whole step (as in the
    loop), so the schedule must not scale the gradients again (scale_grads=False): their sum is the step's gradient.
    `events` holds this step's timeline, (kind, micro-batch, start, end); `after_backward`, if set, sees the step's
    batch once backward is done (the check against the unsplit model)."""

    def __init__(self, stage_mod: StageModule, ctx: _common.Ctx, schedule_name: str, n_microbatches: int, tied_group):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        self.stage_mod, self.ctx, self.tied_group = stage_mod, ctx, tied_group
        stage = PipelineStage(stage_mod, ctx.rank, ctx.world, ctx.device)
        self.events: list = []
        _record(stage, self.events)
        schedule_cls = ScheduleGPipe if schedule_name == "gpipe" else Schedule1F1B
        self.schedule = schedule_cls(stage, n_microbatches=n_microbatches, loss_fn=self._loss, scale_grads=False)
        self.after_backward: Callable | None = None
        self._n_targets, self._scaler = 1, None

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self._scaler.scale(techniques.loss_sum(logits, targets) / self._n_targets)

    def __call__(self, setup: techniques.Setup, micro, n_targets: int, meter) -> torch.Tensor:
        ctx = self.ctx
        x, y = torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro])
        self._n_targets, self._scaler = n_targets, setup.scaler
        self.events.clear()
        losses: list = []
        dist.barrier()  # every stage starts the step together, so the timelines line up
        # Forward and backward interleave inside the schedule: the ledger counts the step's storages as one phase.
        with setup.autocast(), meter.phase("pipeline"):
            if ctx.is_first and ctx.is_last:
                self.schedule.step(x, target=y, losses=losses)
            elif ctx.is_first:
                self.schedule.step(x)
            elif ctx.is_last:
                self.schedule.step(target=y, losses=losses)
            else:
                self.schedule.step()
        all_reduce_tied_grad(self.stage_mod, self.tied_group)
        scale = setup.scaler.get_scale() if setup.scaler.is_enabled() else 1.0
        step_loss = (
            torch.stack([loss.detach() for loss in losses]).sum() / scale
            if losses
            else torch.zeros((), device=y.device)
        )
        if self.after_backward:
            self.after_backward(x, y, n_targets, step_loss)
        return step_loss


def stage_grad_norm(stage_mod: StageModule) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    """The gradient norm of the whole model from the stages' parts: each stage's sum of squares, summed over all
    ranks. The tied embedding's gradient is on both ends after their all-reduce: it counts once (the first stage's)."""

    def grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
        tied = stage_mod.tied_weight()
        twin = tied.grad if tied is not None and not stage_mod.first else None
        own = [g for g in grads if g is not twin]
        sq = (
            torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) ** 2 for g in own]).sum()
            if own
            else torch.zeros(())
        )
        dist.all_reduce(sq)
        return sq.sqrt()

    return grad_norm


def stage_flops_per_token(stage_mod: StageModule, context: int) -> int:
    """This stage's share of the PaLM count (measure.flops_per_token): 6 x its weights that multiply (its blocks, and
    the output layer on the last stage) + 12 x its layers x width x context."""
    n_weights = sum(p.numel() for p in stage_mod.blocks.parameters()) + (
        stage_mod.gpt.lm_head.weight.numel() if stage_mod.last else 0
    )
    return 6 * n_weights + 12 * len(stage_mod.blocks) * stage_mod.gpt.config.n_embd * context


# What --options may set, with the defaults (_common.check_options checks a launch's options against it).
OPTIONS = {"microbatches": [2, 4, 8], "schedules": list(SCHEDULES), "steps": 3, "batch_size": None, "n_layer": 8}


def main(argv=None) -> None:
    from ..train import Trainer

    ctx = _common.start(argv, OPTIONS, "pipeline")
    o = ctx.options
    ms = [int(m) for m in o.get("microbatches", [2, 4, 8])]
    schedules = o.get("schedules", list(SCHEDULES))
    steps = int(o.get("steps", 3))
    batch = int(o["batch_size"] or max(ms))
    if ctx.cfg.compile:
        raise ConfigError("the pipeline's stages run eager: set compile=False")
    mcfg = replace(ctx.cfg.model, n_layer=int(o.get("n_layer", 8)))
    # One extra step at the end is the memory step (the CPU ledger watches it; on CUDA the run's peak is read): the
    # timed steps are the first `steps`.
    cfg = replace(
        ctx.cfg,
        model=mcfg,
        batch_size=batch,
        grad_accum_steps=1,
        steps=steps + 1,
        eval_every=0,
        measure_memory=ctx.device.type == "cpu",
    )
    torch.manual_seed(cfg.seed)
    full = GPT(mcfg).to(ctx.device)
    d, s, v = mcfg.n_embd, cfg.context, mcfg.padded_vocab_size
    ranges = split_points(mcfg.n_layer, ctx.world, block_cost=12 * d * d + 2 * s * d, head_cost=d * v)
    lo, hi = ranges[ctx.rank]
    _splits, at = _common.global_batches(cfg, 1, seed=cfg.seed)

    payload = {
        "strategy": "pipeline",
        "stages": ctx.world,
        "ranges": ranges,
        "batch_size": batch,
        "context": cfg.context,
        "n_layer": mcfg.n_layer,
        "config": cfg.to_dict(),
        "runs": {},
    }
    tied = tie_group(ctx.world)
    for sched_name in schedules:
        for m in ms:
            if batch % m or m < ctx.world:  # torch's schedules need at least one micro-batch per stage
                continue
            # same start each run
            stage_mod = StageModule(copy.deepcopy(full), lo, hi, ctx.is_first, ctx.is_last).to(ctx.device)
            # The course's one loop, with the pipeline's forward-backward and the norm over all stages plugged in.
            trainer = Trainer(
                cfg,
                stage_mod,
                parts=techniques.ModelParts(blocks=stage_mod.blocks, head=stage_mod.gpt.lm_head),
                batches=at,
                flops_per_token=stage_flops_per_token(stage_mod, cfg.context),
            )
            step_fn = PipelineStep(stage_mod, ctx, sched_name, m, tied)
            trainer.setup.forward_backward, trainer.setup.grad_norm = step_fn, stage_grad_norm(stage_mod)
            check: dict = {}
            if sched_name == schedules[0] and m == max(ms):

                def compare_once(x, y, n_targets, step_loss, check=check, stage_mod=stage_mod):
                    if not check:  # the first step, from the same weights as `full`
                        check.update(_compare_with_unsplit(full, stage_mod, x, y, n_targets, step_loss, ctx))

                step_fn.after_backward = compare_once
            timelines: list = []

            def keep_timeline(step, _result, timelines=timelines, step_fn=step_fn):
                if step < steps:
                    timelines.append([list(e) for e in step_fn.events])

            counter = _common.CollectiveCounter()  # the last step's sends, receives and all-reduces (the memory step)
            with counter.last_step_of(cfg.steps) as count:

                def callback(step, result, keep_timeline=keep_timeline, count=count):
                    keep_timeline(step, result)
                    count(step, result)

                result = trainer.fit(f"{sched_name}/m={m}", callback=callback)
            held_before = sum(measure.static_bytes(stage_mod, trainer.setup.optimizer).values())
            payload["runs"][f"{sched_name}/m={m}"] = {
                "schedule": sched_name,
                "microbatches": m,
                "step_times": result.step_times[:steps],
                "timelines": timelines,
                "losses": result.losses[:steps] if ctx.is_last else [],
                "grad_norms": result.grad_norms[:steps],
                "step_peak_bytes": result.memory["peak_bytes"] - held_before,
                "peak_method": (
                    "CPU ledger: the memory step's peak less what the stage held before it (parameters, optimizer state"
                    + (")" if cfg.set_to_none else ", gradients)")
                    if ctx.device.type == "cpu"
                    else (
                        "CUDA max_memory_allocated over the run less the stage's parameters, gradients "
                        "and optimizer state"
                    )
                ),
                "parameter_bytes": measure.tensor_bytes(stage_mod.parameters()),
                "collectives_last_step": dict(counter.counts),
                "written_last_step": counter.written if ctx.backend == "gloo" else None,
                **({"check": check} if check else {}),
            }
    payload["full_model_parameter_bytes"] = measure.tensor_bytes(full.parameters())
    _common.write(ctx, payload)
    _common.finish()


def _compare_with_unsplit(
    full: GPT, stage_mod: StageModule, x, y, n_targets: int, step_loss: torch.Tensor, ctx
) -> dict:
    """The unsplit model on the same batch: its loss against the pipeline's (last stage), its block gradients
    against this stage's, and (first and last stage, after the all-reduce) its tied-embedding gradient."""
    ref = copy.deepcopy(full)
    ref.zero_grad()
    loss = techniques.loss_sum(ref(x), y) / n_targets
    loss.backward()
    out = {}
    if ctx.is_last:
        out["pipeline_loss"] = step_loss.item()
        out["unsplit_loss"] = loss.item()
    diffs = []
    for i, block in enumerate(stage_mod.blocks):
        for (name, p), (_, q) in zip(block.named_parameters(), ref.blocks[stage_mod.lo + i].named_parameters()):
            diffs.append((p.grad - q.grad).abs().max().item())
    out["max_abs_block_grad_diff"] = max(diffs)
    out["max_abs_block_grad"] = max(
        q.grad.abs().max().item() for b in ref.blocks[stage_mod.lo : stage_mod.hi] for q in b.parameters()
    )
    tied = stage_mod.tied_weight()
    if tied is not None:
        out["max_abs_tied_grad_diff"] = (tied.grad - ref.wte.weight.grad).abs().max().item()
        out["max_abs_tied_grad"] = ref.wte.weight.grad.abs().max().item()
    return out


if __name__ == "__main__":
    main()
