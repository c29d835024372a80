"""Pipeline parallelism with torch.distributed.pipelining: the GPT cut by layers into stages, the batch cut into
micro-batches, run with the GPipe, 1F1B, interleaved 1F1B and zero-bubble schedules.

GPipe and 1F1B run one stage per rank. The interleaved schedules run several (`stages_per_rank`, v): the same blocks
cut into v x p smaller stages, rank r holding stages r, r+p, r+2p, ... ("loop" placement; Narayanan et al. 2021), or,
for ZB-V, stages r and 2p-1-r (the "V": rank 0 holds the first and the last stage; Qi et al. 2024, section 6). The
zero-bubble schedules split each backward into its input gradient (I, what the previous stage waits for) and its
weight gradient (W, which nobody waits for), and fill the bubble with the W's.

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
the same AdamW step, and stay equal. Where one rank holds both ends (one stage; ZB-V's rank 0) the two stages share
the one Parameter, and its gradient accumulates both parts with nothing sent.

Rank results: for every schedule and micro-batch count, step times and a timeline of when each of this rank's stages
ran the forward (F), backward (B; or its input part I and weight part W) of each micro-batch; the bytes autograd
saved for backward per stage, live, at their peak during the memory step (`SavedBytes`); the peak bytes allocated
during that step (CPU ledger or CUDA peak); parameter bytes of the rank's stages; the collectives of the last step
(sends and receives of activations and their gradients, the tied embedding's and the gradient norm's all-reduces:
_common.CollectiveCounter) and the bytes the rank wrote meanwhile (gloo); and (step 0, every schedule at the largest
micro-batch count) the pipeline's loss and gradients (blocks, and the tied embedding on the end stages) against the
unsplit model.

The bubble: `bubble_fraction` (p-1)/(m+p-1) and `interleaved_bubble_fraction` (p-1)/(v m+p-1) are the idle shares
of the formulas; `timeline_bubble` measures one from timelines (idle time / total); `simulate` replays the order a
schedule ran its work in with made-up durations and free communication, so `schedule_bubble` gives a schedule's own
idle share at equal stage work (the formula's assumptions) for any schedule, the zero-bubble ones included.

Options: {"microbatches": [2, 4, 8] (at least one per stage), "schedules": ["gpipe", "1f1b"] (or any of
ALL_SCHEDULES), "stages_per_rank": 2 (the interleaved schedules'; ZB-V needs 2), "n_layer": 8, "batch_size": 8,
"steps": 3}

Its steps are course_lib.train's one loop (Trainer): a PipelineSchedule owns forward and backward across the stages (it
calls each stage's forward per micro-batch, sends and receives activations and gradients, and runs the backward
itself), so the pipeline hands the loop that piece (`Setup.pipeline`: PipelineStep.forward_backward) and the
gradient norm over all stages (PipelineStep.grad_norm, for global-norm clipping); clipping, AdamW, the learning-rate
schedule, timing and the memory ledger are the loop's, as for every other run.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from collections import defaultdict
from dataclasses import replace
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import measure, techniques
from ..config import ConfigError, TrainConfig, did_you_mean
from ..model import GPT
from . import _common

# GPipe and 1F1B: one stage per rank (the default launch, and notebook 08's panel). The others: several stages per rank.
SCHEDULES = ("gpipe", "1f1b")
INTERLEAVED = ("interleaved_1f1b", "interleaved_zb", "zbv")
ALL_SCHEDULES = SCHEDULES + INTERLEAVED
SCHEDULE_NAMES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved_1f1b": "interleaved 1F1B",
    "interleaved_zb": "interleaved zero bubble",
    "zbv": "zero bubble V",
}
TORCH_CLASSES = {  # torch.distributed.pipelining's schedule for each
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "interleaved_zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}


# ---- the bubble: formulas, timelines, a schedule's own order replayed ---------------------------------------


def bubble_fraction(p: int, m: int) -> float:
    """Idle share of a GPipe or 1F1B step with p equal stages and m micro-batches: (p-1)/(m+p-1) (GPipe, Huang et al.
    2019: the pipeline fills and drains over p-1 slots of the m+p-1 a step lasts; 1F1B reorders the same work)."""
    return (p - 1) / (m + p - 1)


def interleaved_bubble_fraction(p: int, m: int, v: int) -> float:
    """Idle share of interleaved 1F1B with v stages per rank: (p-1)/(v m + p-1). Each stage is 1/v of a rank's layers,
    so filling and draining the pipeline costs (p-1) slots that are v times shorter (Narayanan et al. 2021, section
    2.2.2: bubble time over ideal time (p-1)/(v m), which as a share of the whole step is this). v=1 is GPipe's."""
    return (p - 1) / (v * m + p - 1)


def formula_bubble(schedule: str, p: int, m: int, v: int) -> float:
    """The formula a schedule is compared with: (p-1)/(m+p-1) with one stage per rank, (p-1)/(v m+p-1) with v. The
    zero-bubble schedules are held to the interleaved form too: their forwards and input gradients alone leave that
    much idle, and their weight gradients fill part of it (schedule_bubble says how much)."""
    return interleaved_bubble_fraction(p, m, stages_per_rank(schedule, v))


def timeline_bubble(timelines: list[list]) -> float:
    """Idle time over total time, from one timeline per rank (a device): 1 - (busy time summed over ranks) /
    (ranks x the step's span, from the first start to the last end on any rank). An event: (kind, micro-batch,
    start, end, ...)."""
    events = [e for tl in timelines for e in tl]
    start, end = min(e[2] for e in events), max(e[3] for e in events)
    busy = sum(e[3] - e[2] for e in events)
    return 1 - busy / (len(timelines) * (end - start))


def _timelines(ranks: list[dict], key: str, step: int) -> list[list]:
    """Every rank's timeline of run `key`'s timed step `step`."""
    return [r["runs"][key]["timelines"][step] for r in ranks]


def slowdown_together(ranks: list[dict], key: str, step: int = -1) -> float | None:
    """How much longer a rank's work took while another rank worked too than while it worked alone (the fill and the
    drain), largest over the ranks and kinds of work (median durations, one timed step), for one stage per rank (GPipe,
    1F1B: a rank's forwards are then all the same work); None when no kind ran both ways. About 1 when the ranks have
    cores of their own; well above 1 when they share cores (with each other or with other work), and then the fill and
    drain, where one rank runs alone and faster, shrink: the measured bubble falls below the formula's, which assumes
    a stage's work takes the same time whenever it runs. Events under a microsecond (nothing done) are left out."""
    timelines = _timelines(ranks, key, step)
    worst = None
    for r, tl in enumerate(timelines):
        others = [e for q, other in enumerate(timelines) if q != r for e in other]
        durations: dict[tuple[str, bool], list[float]] = defaultdict(list)
        for kind, _mb, t0, t1, *_ in tl:
            if t1 - t0 <= 1e-6:
                continue
            overlap = sum(max(0.0, min(t1, e[3]) - max(t0, e[2])) for e in others)
            durations[(kind, overlap > (t1 - t0) / 2)].append(t1 - t0)
        for kind in {k for k, _ in durations}:
            alone, together = durations.get((kind, False)), durations.get((kind, True))
            if alone and together:
                ratio = statistics.median(together) / statistics.median(alone)
                worst = ratio if worst is None else max(worst, ratio)
    return worst


SHARED_CORES = 1.5  # slowdown_together past this: the ranks shared cores, and the measured bubble shrank with it


def shared_cores(ranks: list[dict], key: str) -> str | None:
    """Why run `key`'s measured bubble cannot be held to the formula's here, or None: its ranks' work took more than
    SHARED_CORES times as long while both worked as while one worked alone (slowdown_together), so they shared
    cores, and the fill and drain, where a rank works alone and faster, shrank."""
    slow = slowdown_together(ranks, key)
    if slow is None or slow <= SHARED_CORES:
        return None
    return f"the ranks' work took {slow:.2f}x as long while both worked as while one worked alone: they shared cores"


def measured_bubble(ranks: list[dict], key: str, step: int = -1) -> float:
    """timeline_bubble of run `key` (e.g. "gpipe/m=4"), from every rank's timeline of one of its timed steps."""
    return timeline_bubble(_timelines(ranks, key, step))


# Equal stage work: a backward does two matmuls for each one of the forward (the input's gradient and the weight's),
# so B costs two F's, and its input and weight halves one each (where ZB-V's paper has no bubble at all).
EQUAL_COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def simulate(orders: list[list[tuple[str, int, int]]], costs: dict[str, float] | None = None) -> list[list[tuple]]:
    """Replay each rank's order of work with made-up durations and free communication. orders[r]: rank r's actions in
    the order it runs them, (kind, stage, micro-batch), kind F (forward), B (whole backward), I (its input gradient) or
    W (its weight gradient). An action starts when its rank is free and what it needs is done: F the previous stage's F
    of that micro-batch; B and I their own F and the next stage's B or I; W its own I. Returns each rank's timeline
    [(kind, micro-batch, start, end, stage)]. An order that waits for itself raises ValueError."""
    costs = {**EQUAL_COSTS, **(costs or {})}
    last = max(stage for order in orders for _, stage, _ in order)
    done: dict[tuple[str, int, int], float] = {}  # ("F" | "B" (an input gradient, B or I) | "W", stage, mb) -> end
    free, at = [0.0] * len(orders), [0] * len(orders)
    out: list[list[tuple]] = [[] for _ in orders]
    while any(at[r] < len(order) for r, order in enumerate(orders)):
        progressed = False
        for r, order in enumerate(orders):
            while at[r] < len(order):
                kind, stage, mb = order[at[r]]
                if kind == "F":
                    needs = [("F", stage - 1, mb)] if stage > 0 else []
                elif kind in ("B", "I"):
                    needs = [("F", stage, mb)] + ([("B", stage + 1, mb)] if stage < last else [])
                elif kind == "W":
                    needs = [("B", stage, mb)]
                else:
                    raise ValueError(f"unknown kind of work {kind!r}: F, B, I or W")
                if any(n not in done for n in needs):
                    break
                start = max([free[r]] + [done[n] for n in needs])
                free[r] = end = start + costs[kind]
                done[("B" if kind == "I" else kind, stage, mb)] = end
                out[r].append((kind, mb, start, end, stage))
                at[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: order[at[r]] for r, order in enumerate(orders) if at[r] < len(order)}
            raise ValueError(f"this order never finishes: each rank waits for work that comes later ({stuck})")
    return out


def schedule_bubble(orders: list[list[tuple[str, int, int]]], costs: dict[str, float] | None = None) -> float:
    """A schedule's own idle share: its order of work replayed (simulate) with equal stage work and free communication,
    the formulas' assumptions; with EQUAL_COSTS, GPipe's and 1F1B's orders give (p-1)/(m+p-1) exactly."""
    return timeline_bubble(simulate(orders, costs))


def run_orders(ranks: list[dict], key: str, step: int = -1) -> list[list[tuple[str, int, int]]]:
    """The order each rank ran its work in, in run `key`'s step `step`: [(kind, stage, micro-batch)] per rank."""
    orders = []
    for r in ranks:
        tl = r["runs"][key]["stage_timelines"][step]
        events = sorted((e[4], e[0], int(stage), e[1]) for stage, events in tl.items() for e in events)
        orders.append([(kind, stage, mb) for _, kind, stage, mb in events])
    return orders


def bubbles(ranks: list[dict], key: str) -> dict[str, float]:
    """Run `key`'s bubble three ways: "measured" (its last timed step's timelines), "schedule" (its order of work at
    equal stage work, schedule_bubble) and "formula" (formula_bubble)."""
    run = ranks[0]["runs"][key]
    return {
        "measured": measured_bubble(ranks, key),
        "schedule": schedule_bubble(run_orders(ranks, key)),
        "formula": formula_bubble(run["schedule"], len(ranks), run["microbatches"], run["stages_per_rank"]),
    }


# ---- where the stages go ------------------------------------------------------------------------------------------


def stages_per_rank(schedule: str, v: int) -> int:
    """How many stages each rank runs: 1 for GPipe and 1F1B, v for the interleaved schedules, 2 for ZB-V."""
    if schedule not in ALL_SCHEDULES:
        raise ConfigError(
            f"unknown schedule {schedule!r}{did_you_mean(schedule, ALL_SCHEDULES)}: one of {', '.join(ALL_SCHEDULES)}"
        )
    return 1 if schedule in SCHEDULES else 2 if schedule == "zbv" else v


def stage_ranks(schedule: str, world: int, v: int) -> list[int]:
    """The rank of every stage: loop placement (stage s on rank s mod p), or for ZB-V the V (rank r holds stages r and
    2p-1-r, so rank 0 holds the first and the last)."""
    n = world * stages_per_rank(schedule, v)
    if schedule == "zbv":
        return [s if s < world else n - 1 - s for s in range(n)]
    return [s % world for s in range(n)]


def why_not(schedule: str, world: int, m: int, batch: int, n_layer: int, v: int) -> str | None:
    """Why `schedule` cannot run with these numbers (None when it can)."""
    k = stages_per_rank(schedule, v)
    if batch % m:
        return f"batch_size={batch} does not split into {m} equal micro-batches"
    if m < world:
        return f"{world} ranks need at least {world} micro-batches (one per rank), got {m}"
    if n_layer < world * k:
        return f"{world * k} stages ({k} per rank) need at least {world * k} blocks, the model has {n_layer}"
    rounds = max(1, m // world)
    if schedule in ("interleaved_1f1b", "interleaved_zb") and m % rounds:
        return f"torch's {TORCH_CLASSES[schedule]} needs m to be a multiple of max(1, m // p) = {rounds}, got m={m}"
    return None


def check(options: dict) -> None:
    """A ConfigError for options of the right kind that name no schedule (launch asks before any process starts)."""
    o = {**OPTIONS, **options}
    for name in o["schedules"]:
        stages_per_rank(name, 1)
    if int(o["stages_per_rank"]) < 1:
        raise ConfigError(f"pipeline: stages_per_rank is at least 1, got {o['stages_per_rank']}")


def fewest_steps(cfg) -> int:
    """The smallest "steps" option a launch of `cfg` can time: its warm-up steps and one timed step. The run adds its
    memory step after them itself (main), so the loop's own rule (warm-up, memory step, one timed) holds with this."""
    return cfg.fewest_steps(ledger=False)


def check_steps(steps: int, cfg) -> None:
    """A ConfigError, in the launch's own terms, for a "steps" option that leaves no step to time."""
    if steps < fewest_steps(cfg):
        raise ConfigError(
            f'pipeline: "steps": {steps} leaves no step to time after {cfg.timing_warmup} warm-up step(s) (the memory '
            f'step is added after them): raise "steps" to at least {fewest_steps(cfg)} (pipeline.fewest_steps(cfg))'
        )


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
    model's pieces to run. `index`: its place in the pipeline (0 for the first stage).

    Takes `gpt` over (pass a copy to keep the whole model, as `main` does): like torchtitan's pipeline split, the
    parts this stage does not run are dropped from it, so that the stage's parameters, and the memory it keeps,
    are its own part only; `gpt.blocks` becomes the stage's slice (the same Block objects)."""

    def __init__(self, gpt: GPT, lo: int, hi: int, first: bool, last: bool, index: int | None = None):
        super().__init__()
        self.first, self.last, self.lo, self.hi = first, last, lo, hi
        self.index = index if index is not None else 0 if first else None
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


class RankStages(nn.Module):
    """The stages one rank runs (one for GPipe and 1F1B, several for the interleaved schedules), as the one module the
    loop trains: its parameters are what this rank's optimizer updates. Where the rank holds both ends of the pipeline,
    the last stage's output layer is tied again to the first stage's embedding: one Parameter, as in the GPT, whose
    gradient accumulates both ends' parts."""

    def __init__(self, stages: list[StageModule]):
        super().__init__()
        self.stages = nn.ModuleList(sorted(stages, key=lambda s: s.index))
        first, last = self.first_stage, self.last_stage
        if first is not None and last is not None and first is not last:
            last.gpt.lm_head.weight = first.gpt.wte.weight

    @property
    def first_stage(self) -> StageModule | None:
        return next((s for s in self.stages if s.first), None)

    @property
    def last_stage(self) -> StageModule | None:
        return next((s for s in self.stages if s.last), None)

    def blocks(self) -> list[nn.Module]:
        return [b for s in self.stages for b in s.blocks]

    def tied_weight(self) -> torch.Tensor | None:
        """This rank's copy of the tied embedding: the first stage's (on a rank holding both ends, the last's too), else
        the last stage's, else None."""
        first, last = self.first_stage, self.last_stage
        return first.gpt.wte.weight if first is not None else last.gpt.lm_head.weight if last is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a rank's stages run through the pipeline schedule (PipelineStep), not as one module")


def build_rank_stages(full: GPT, ranges: list[tuple[int, int]], placement: list[int], rank: int) -> RankStages:
    """This rank's stages of `full` (left whole: each stage is cut from a copy), ranges[s] the blocks of stage s and
    placement[s] its rank."""
    n = len(ranges)
    return RankStages(
        [
            StageModule(copy.deepcopy(full), lo, hi, s == 0, s == n - 1, index=s)
            for s, (lo, hi) in enumerate(ranges)
            if placement[s] == rank
        ]
    )


def tie_group(world: int, ranks: tuple[int, int] | None = None):
    """The process group of the ranks holding the first and the last stage (by default 0 and world-1), which share the
    tied embedding; None when one rank holds both. Every rank must call this (torch.distributed.new_group is
    collective)."""
    ends = ranks or (0, world - 1)
    return dist.new_group(sorted(set(ends))) if ends[0] != ends[1] else None


def all_reduce_tied_grad(stages: RankStages, group) -> None:
    """Sum the two ends' gradients of the tied embedding: each then holds the unsplit model's gradient."""
    w = stages.tied_weight()
    if group is not None and w is not None:
        dist.all_reduce(w.grad, group=group)


# ---- measuring a step: timelines and the bytes saved for backward --------------------------------------------------


class _Held:
    """What autograd keeps in place of a saved tensor while SavedBytes counts it: the tensor, and a release when
    autograd lets go of it."""

    __slots__ = ("tensor", "_release")

    def __init__(self, tensor: torch.Tensor, release: Callable[[], None]):
        self.tensor, self._release = tensor, release

    def __del__(self):
        self._release()


class SavedBytes:
    """The bytes autograd keeps for backward, per stage, while they live: every tensor a stage's forward (and the last
    stage's loss) saves, each storage once per stage, the parameters left out (a matmul saves its weight, which is no
    activation). A storage counts from when it is saved to when autograd lets go of it: after its micro-batch's
    backward, or, in a zero-bubble schedule, after its weight gradient (W), which still needs what the forward saved.
    `peak[stage]` is the most a stage held at once, `rank_peak` the most this rank's stages held together. Counts only
    while `on`."""

    def __init__(self, params=()):
        self._params = {p.untyped_storage().data_ptr() for p in params}
        self.live: dict[int, int] = defaultdict(int)
        self.peak: dict[int, int] = defaultdict(int)
        self.rank_live = self.rank_peak = 0
        self._held: dict[tuple[int, int], list[int]] = {}  # (stage, storage address) -> [references, bytes]
        self.on = False

    def _add(self, stage: int, n: int) -> None:
        self.live[stage] += n
        self.rank_live += n
        self.peak[stage] = max(self.peak[stage], self.live[stage])
        self.rank_peak = max(self.rank_peak, self.rank_live)

    def _release(self, key: tuple[int, int]) -> None:
        entry = self._held[key]
        entry[0] -= 1
        if entry[0] == 0:
            del self._held[key]
            self._add(key[0], -entry[1])

    def hooks(self, stage: int):
        """A context in which what autograd saves is counted for `stage` (a no-op while off)."""
        if not self.on:
            return contextlib.nullcontext()

        def pack(t: torch.Tensor):
            st = t.untyped_storage()
            if st.data_ptr() in self._params or st.nbytes() == 0:
                return t
            key = (stage, st.data_ptr())  # the storage lives at least as long as this count: _Held keeps it
            if key not in self._held:
                self._held[key] = [0, st.nbytes()]
                self._add(stage, st.nbytes())
            self._held[key][0] += 1
            return _Held(t, lambda: self._release(key))

        def unpack(held):
            return held.tensor if isinstance(held, _Held) else held

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _no_warm_up_with_itself(stage) -> None:
    """torch 2.11 warms up each stage's link to its neighbour stages with a send and a receive, also where the
    neighbour is on the same rank (ZB-V's two middle stages), and gloo refuses a rank's send to itself ("Pair is not
    connected"). A rank needs no link with itself: those warm-up messages are left out. (torch 2.13 warms up another
    way and never calls this.)"""
    warm_up = getattr(stage, "_get_init_p2p_neighbors_ops", None)
    if warm_up is None:
        return
    stage._get_init_p2p_neighbors_ops = lambda: [op for op in warm_up() if op.group_peer != stage.group_rank]


def _record(stage, events: list, saved: SavedBytes):
    """Wrap the stage's per-micro-batch work to log (kind, stage, micro-batch, start, end): F its forward (counted by
    `saved`), B its whole backward, I and W the input and weight halves of a zero-bubble schedule's backward (torch's
    first stage has no input gradient to send: its I is empty and its W runs the whole backward)."""
    fwd, bwd, wgt = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk
    index = stage.stage_index

    def forward_one_chunk(chunk_id, *args, **kwargs):
        t0 = time.time()
        with saved.hooks(index):
            out = fwd(chunk_id, *args, **kwargs)
        events.append(("F", index, chunk_id, t0, time.time()))
        return out

    def backward_one_chunk(chunk_id, loss=None, full_backward=True, last_backward=False):
        t0 = time.time()
        out = bwd(chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)
        events.append(("B" if full_backward else "I", index, chunk_id, t0, time.time()))
        return out

    def backward_weight_one_chunk(chunk_id, last_backward=False):
        t0 = time.time()
        out = wgt(chunk_id, last_backward=last_backward)
        events.append(("W", index, chunk_id, t0, time.time()))
        return out

    stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk
    stage.backward_weight_one_chunk = backward_weight_one_chunk


def split_timeline(events: list, stage_indices: list[int]) -> tuple[list, dict]:
    """A step's events (kind, stage, micro-batch, start, end), in the order the rank ran them, as the rank's timeline
    [[kind, micro-batch, start, end]] and one per stage, {"stage": [[kind, micro-batch, start, end, place in the
    rank's order]]} (JSON keys are strings)."""
    rank_tl = [[kind, mb, t0, t1] for kind, _stage, mb, t0, t1 in events]
    by_stage: dict[str, list] = {str(s): [] for s in stage_indices}
    for i, (kind, stage, mb, t0, t1) in enumerate(events):
        by_stage[str(stage)].append([kind, mb, t0, t1, i])
    return rank_tl, by_stage


class PipelineStep:
    """The step's forward and backward for the course's one loop (`Setup.pipeline`): the micro-batches of a
    step go, as one batch, to the pipeline schedule, which cuts it into its own micro-batches and runs their
    forwards and backwards across the stages; then the two ends sum their tied-embedding gradients. Everything else
    of the step (clipping, the optimizer, the schedule, timing, the memory ledger) is the loop's.

    Each micro-batch's loss is its summed cross-entropy over the count of target tokens of the whole step (as in the
    loop), so the schedule must not scale the gradients again (scale_grads=False): their sum is the step's gradient.
    `events` holds this step's work, (kind, stage, micro-batch, start, end); `saved` counts the bytes saved for
    backward per stage while it is on; `after_backward`, if set, sees the step's batch once backward is done (the
    check against the unsplit model)."""

    def __init__(
        self,
        stages: RankStages,
        ctx: _common.Ctx,
        schedule_name: str,
        n_microbatches: int,
        tied_group,
        n_stages: int | None = None,
    ):
        import torch.distributed.pipelining as pp

        self.stages, self.ctx, self.tied_group = stages, ctx, tied_group
        self.n_stages = n_stages or ctx.world
        self.events: list = []
        self.saved = SavedBytes(stages.parameters())
        pipe_stages = []
        for s in stages.stages:
            pipe_stage = pp.PipelineStage(s, s.index, self.n_stages, ctx.device)
            _no_warm_up_with_itself(pipe_stage)
            _record(pipe_stage, self.events, self.saved)
            pipe_stages.append(pipe_stage)
        schedule_cls = getattr(pp, TORCH_CLASSES[schedule_name])
        self.schedule = schedule_cls(
            pipe_stages[0] if schedule_name in SCHEDULES else pipe_stages,
            n_microbatches=n_microbatches,
            loss_fn=self._loss,
            scale_grads=False,
        )
        self.after_backward: Callable | None = None
        self._n_targets, self._scaler = 1, None
        self.timelines: list = []  # each timed step's: the rank's, and one per stage (split_timeline)
        self.stage_timelines: list = []

    def after_step(self, step: int, timed_steps: int) -> None:
        """A fit() callback: keep each timed step's timelines; from the step after them (the memory step), count the
        bytes saved for backward."""
        if step < timed_steps:
            rank_tl, by_stage = split_timeline(self.events, [st.index for st in self.stages.stages])
            self.timelines.append(rank_tl)
            self.stage_timelines.append(by_stage)
        if step == timed_steps - 1:
            self.saved.on = True

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self.saved.hooks(self.n_stages - 1):  # the loss is the last stage's: what it saves, that stage keeps
            return self._scaler.scale(techniques.loss_sum(logits, targets) / self._n_targets)

    def forward_backward(self, setup: techniques.Setup, micro, n_targets: int, meter) -> torch.Tensor:
        first, last = self.stages.first_stage is not None, self.stages.last_stage is not None
        x, y = torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro])
        self._n_targets, self._scaler = n_targets, setup.scaler
        self.events.clear()
        losses: list = []
        dist.barrier()  # every stage starts the step together, so the timelines line up
        # Forward and backward interleave inside the schedule: the ledger counts the step's storages as one phase.
        with setup.autocast(), meter.phase("pipeline"):
            if first and last:
                self.schedule.step(x, target=y, losses=losses)
            elif first:
                self.schedule.step(x)
            elif last:
                self.schedule.step(target=y, losses=losses)
            else:
                self.schedule.step()
        all_reduce_tied_grad(self.stages, self.tied_group)
        scale = setup.scaler.get_scale() if setup.scaler.is_enabled() else 1.0
        step_loss = (
            torch.stack([loss.detach() for loss in losses]).sum() / scale
            if losses
            else torch.zeros((), device=y.device)
        )
        if self.after_backward:
            self.after_backward(x, y, n_targets, step_loss)
        return step_loss

    def grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The gradient norm of the whole model from the stages' parts: each rank's sum of squares, summed over all
        ranks. The tied embedding's gradient is on both ends after their all-reduce: it counts once (the first
        stage's)."""
        last = self.stages.last_stage
        twin = last.gpt.lm_head.weight.grad if last is not None and self.stages.first_stage is None else None
        own = [g for g in grads if g is not twin]
        sq = (
            torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) ** 2 for g in own]).sum()
            if own
            else torch.zeros(())
        )
        dist.all_reduce(sq)
        return sq.sqrt()


def stage_flops_per_token(stages: RankStages, context: int) -> int:
    """This rank's share of the PaLM count (measure.flops_per_token): 6 x its weights that multiply (its blocks, and
    the output layer on the last stage) + 12 x its layers x width x context."""
    blocks = stages.blocks()
    last = stages.last_stage
    n_weights = sum(p.numel() for b in blocks for p in b.parameters()) + (
        last.gpt.lm_head.weight.numel() if last is not None else 0
    )
    return 6 * n_weights + 12 * len(blocks) * stages.stages[0].gpt.config.n_embd * context


# ---- plots ---------------------------------------------------------------------------------------------------------

HATCH = {"F": None, "B": "////", "I": "\\\\\\\\", "W": "xxx"}


def plot_timeline(ranks: list[dict], key: str, ax, step: int = -1) -> None:
    """A Gantt chart of run `key`'s step `step`: a row per rank, a bar per piece of work (F forward, hatched B backward,
    I its input half, W its weight half), coloured by micro-batch; with several stages per rank, a rank's later stages
    are lighter. The title gives the bubble measured, at equal stage work (the schedule's own order) and by formula."""
    run0 = ranks[0]["runs"][key]
    timelines = [r["runs"][key]["stage_timelines"][step] for r in ranks]
    t0 = min(e[2] for tl in timelines for events in tl.values() for e in events)
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    for r, tl in enumerate(timelines):
        local = sorted(int(s) for s in tl)
        for stage, events in tl.items():
            alpha = 1.0 if int(stage) == local[0] else 0.5
            for kind, mb, a, b, _order in events:
                ax.broken_barh(
                    [((a - t0) * 1e3, (b - a) * 1e3)],
                    (r - 0.4, 0.8),
                    facecolor=cmap(mb % 10),
                    alpha=alpha,
                    hatch=HATCH.get(kind),
                    edgecolor="k",
                    lw=0.4,
                )
                ax.text((a - t0) * 1e3 + (b - a) * 5e2, r, f"{kind}{mb}", ha="center", va="center", fontsize=5)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in range(len(ranks))])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step started")
    b = bubbles(ranks, key)
    stages = f", {run0['stages_per_rank']} stages per rank" if run0["stages_per_rank"] > 1 else ""
    ax.set_title(
        f"{SCHEDULE_NAMES[run0['schedule']]}, m={run0['microbatches']}{stages}: bubble measured {b['measured']:.2f}, "
        f"at equal stage work {b['schedule']:.2f}, formula {b['formula']:.2f}",
        fontsize=8,
    )


def plot_bubbles(ranks: list[dict], keys: list[str], ax) -> None:
    """The bubble of each run, three bars: measured (its timelines), its schedule's order at equal stage work and free
    communication (schedule_bubble), and the formula ((p-1)/(m+p-1), or (p-1)/(v m+p-1) with v stages per rank)."""
    import numpy as np

    x = np.arange(len(keys))
    values = [bubbles(ranks, k) for k in keys]
    for i, (what, label) in enumerate(
        (("measured", "measured"), ("schedule", "its order at equal stage work"), ("formula", "formula"))
    ):
        ax.bar(x + (i - 1) * 0.27, [b[what] for b in values], 0.27, label=label)
    ax.set_xticks(x, [k.replace("/", "\n") for k in keys], fontsize=7)
    ax.set_ylabel("idle share of the step")
    ax.set_title(f"Bubble per schedule, {len(ranks)} ranks", fontsize=9)
    ax.legend(fontsize=7)


def plot_saved_bytes(ranks: list[dict], keys: list[str], ax) -> None:
    """The most each stage held for backward at once during a step (SavedBytes), a group of bars per run, a bar per
    stage in pipeline order."""
    for i, key in enumerate(keys):
        by_stage = {int(s): b for r in ranks for s, b in r["runs"][key]["saved_peak_bytes_by_stage"].items()}
        n = len(by_stage)
        for s, nbytes in sorted(by_stage.items()):
            ax.bar(i + (s - (n - 1) / 2) * 0.8 / n, nbytes / 2**20, 0.8 / n, color=f"C{s % 10}")
    ax.set_xticks(range(len(keys)), [k.replace("/", "\n") for k in keys], fontsize=7)
    ax.set_ylabel("MiB saved for backward (peak)")
    ax.set_title("Activations held per stage (bar per stage, in order)", fontsize=9)


def plot_schedules(ranks: list[dict], keys: list[str] | None = None):
    """One figure: a Gantt chart per run (`keys`, by default every run of the launch), then the bubble per run and
    the activations each stage held. `ranks`: a pipeline launch's rank JSONs (LaunchResult.ranks)."""
    from ..plots import new_figure

    keys = keys or list(ranks[0]["runs"])
    fig = new_figure((11, 1.3 + 0.35 * len(ranks) * len(keys) + 2.8))
    grid = fig.add_gridspec(len(keys) + 1, 2, height_ratios=[0.35 * len(ranks) + 0.6] * len(keys) + [2.8])
    for i, key in enumerate(keys):
        plot_timeline(ranks, key, fig.add_subplot(grid[i, :]))
    plot_bubbles(ranks, keys, fig.add_subplot(grid[-1, 0]))
    plot_saved_bytes(ranks, keys, fig.add_subplot(grid[-1, 1]))
    fig.suptitle(
        f"Pipeline schedules on {len(ranks)} ranks - {ranks[0]['provenance']['device']} "
        f"(F forward, hatched: B backward, I its input half, W its weight half)",
        fontsize=9,
    )
    return fig


# What --options may set, with the defaults (_common.check_options checks a launch's options against it).
OPTIONS = {
    "microbatches": [2, 4, 8],
    "schedules": list(SCHEDULES),
    "steps": 3,
    "batch_size": None,
    "n_layer": 8,
    "stages_per_rank": 2,
}


def main(argv=None) -> None:
    ctx = _common.start(argv, OPTIONS, "pipeline")
    cfg, ms, schedules, v = _configure(ctx)
    torch.manual_seed(cfg.seed)
    full = GPT(cfg.model).to(ctx.device)
    _splits, at = _common.global_batches(cfg, 1, seed=cfg.seed)
    payload = {
        "strategy": "pipeline",
        "stages": ctx.world,
        "ranges": split_points(cfg.model.n_layer, ctx.world, *_work(cfg)),
        "batch_size": cfg.batch_size,
        "context": cfg.context,
        "n_layer": cfg.model.n_layer,
        "config": cfg.to_dict(),
        "runs": {},
        "skipped": {},
    }
    tied = tie_group(ctx.world)  # the loop placement's ends; ZB-V's are both on rank 0 (no group)
    for schedule in schedules:
        for m in ms:
            key = f"{schedule}/m={m}"
            if reason := why_not(schedule, ctx.world, m, cfg.batch_size, cfg.model.n_layer, v):
                payload["skipped"][key] = reason
            else:
                payload["runs"][key] = _run(ctx, cfg, full, at, key, schedule, m, v, tied, check=m == max(ms))
    payload["full_model_parameter_bytes"] = measure.tensor_bytes(full.parameters())
    _common.finish(ctx, payload)


def _configure(ctx: _common.Ctx) -> tuple[TrainConfig, list[int], list[str], int]:
    """The launch's config from its options, then its micro-batch counts, schedules and stages per rank. The timed
    steps are the first `steps`; one more at the end is the memory step (the CPU ledger watches it; on CUDA the run's
    peak is read; the bytes saved for backward are counted in it)."""
    o = ctx.options
    check(o)
    ms, schedules, steps, v = [int(m) for m in o["microbatches"]], o["schedules"], o["steps"], o["stages_per_rank"]
    check_steps(steps, ctx.cfg)
    if ctx.cfg.compile:
        raise ConfigError("the pipeline's stages run eager: set compile=False")
    if ctx.cfg.activation_checkpointing != "none" and any(stages_per_rank(s, v) > 1 for s in schedules):
        raise ConfigError("activation checkpointing wraps one stage's blocks: turn it off for several stages per rank")
    cfg = replace(
        ctx.cfg,
        model=replace(ctx.cfg.model, n_layer=o["n_layer"]),
        batch_size=o["batch_size"] or max(ms),
        grad_accum_steps=1,
        steps=steps + 1,
        eval_every=0,
        measure_memory=ctx.device.type == "cpu",
    )
    return cfg, ms, schedules, v


def _work(cfg: TrainConfig) -> tuple[int, int]:
    """The estimated work of a block and of the output layer, which the stage cut points balance."""
    d, vocab = cfg.model.n_embd, cfg.model.padded_vocab_size
    return 12 * d * d + 2 * cfg.context * d, d * vocab


def _run(ctx, cfg: TrainConfig, full: GPT, at, key: str, schedule: str, m: int, v: int, tied, check: bool) -> dict:
    """One schedule at m micro-batches through the course's one loop, with the pipeline's forward-backward and the norm
    over all stages plugged in; `check`: compare its first step with the unsplit model."""
    from ..train import Trainer

    k = stages_per_rank(schedule, v)
    placement = stage_ranks(schedule, ctx.world, v)
    ranges = split_points(cfg.model.n_layer, ctx.world * k, *_work(cfg))
    stages = build_rank_stages(full, ranges, placement, ctx.rank).to(ctx.device)  # same start each run
    last = stages.last_stage
    parts = techniques.ModelParts(
        blocks=stages.stages[0].blocks if k == 1 else None, head=last.gpt.lm_head if last is not None else None
    )
    trainer = Trainer(cfg, stages, parts=parts, batches=at, flops_per_token=stage_flops_per_token(stages, cfg.context))
    step_fn = PipelineStep(stages, ctx, schedule, m, tied if placement[0] != placement[-1] else None, len(placement))
    trainer.setup.pipeline = step_fn
    against_unsplit: dict = {}
    if check:

        def compare_once(x, y, n_targets, step_loss):
            if not against_unsplit:  # the first step, from the same weights as `full`
                against_unsplit.update(_compare_with_unsplit(full, stages, x, y, n_targets, step_loss))

        step_fn.after_backward = compare_once
    steps = cfg.steps - 1  # the timed ones; the memory step follows
    counter = _common.CollectiveCounter()  # the last step's sends, receives and all-reduces (the memory step)
    with counter.last_step_of(cfg.steps) as count:
        result = trainer.fit(key, callback=lambda step, r: (step_fn.after_step(step, steps), count(step, r)))
    held_before = sum(measure.static_bytes(stages, trainer.setup.optimizer).values())
    return {
        "schedule": schedule,
        "microbatches": m,
        "stages_per_rank": k,
        "stage_ranges": ranges,
        "stage_ranks": placement,
        "rank_stages": [st.index for st in stages.stages],
        "step_times": result.step_times[:steps],
        "timelines": step_fn.timelines,
        "stage_timelines": step_fn.stage_timelines,
        "losses": result.losses[:steps] if last is not None else [],
        "grad_norms": result.grad_norms[:steps],
        "step_peak_bytes": result.memory["peak_bytes"] - held_before,
        "peak_method": _peak_method(ctx.device, cfg.set_to_none),
        "saved_peak_bytes_by_stage": {str(i): step_fn.saved.peak[i] for i in sorted(step_fn.saved.peak)},
        "saved_peak_bytes": step_fn.saved.rank_peak,
        "saved_method": "saved_tensors_hooks over the memory step: bytes autograd held for backward at once, "
        "each storage once per stage, parameters excluded",
        "parameter_bytes": measure.tensor_bytes(stages.parameters()),
        "collectives_last_step": dict(counter.counts),
        "written_last_step": ctx.socket_bytes(counter),
        **({"check": against_unsplit} if against_unsplit else {}),
    }


def _peak_method(device: torch.device, set_to_none: bool) -> str:
    if device.type == "cpu":
        held = "parameters, optimizer state" + (")" if set_to_none else ", gradients)")
        return f"CPU ledger: the memory step's peak less what the stage held before it ({held}"
    return "CUDA max_memory_allocated over the run less the stage's parameters, gradients and optimizer state"


def _compare_with_unsplit(full: GPT, stages: RankStages, x, y, n_targets: int, step_loss: torch.Tensor) -> dict:
    """The unsplit model on the same batch: its loss against the pipeline's (the rank holding the last stage), its block
    gradients against this rank's stages', and (the ranks holding an end, after the all-reduce) its tied-embedding
    gradient."""
    ref = copy.deepcopy(full)
    ref.zero_grad()
    loss = techniques.loss_sum(ref(x), y) / n_targets
    loss.backward()
    out = {}
    if stages.last_stage is not None:
        out["pipeline_loss"] = step_loss.item()
        out["unsplit_loss"] = loss.item()
    grads = [
        (p.grad, q.grad)
        for stage in stages.stages
        for i, block in enumerate(stage.blocks)
        for p, q in zip(block.parameters(), ref.blocks[stage.lo + i].parameters())
    ]
    out["max_abs_block_grad_diff"] = max((g - r).abs().max().item() for g, r in grads)
    out["max_abs_block_grad"] = max(r.abs().max().item() for _, r in grads)
    tied = stages.tied_weight()
    if tied is not None:
        out["max_abs_tied_grad_diff"] = (tied.grad - ref.wte.weight.grad).abs().max().item()
        out["max_abs_tied_grad"] = ref.wte.weight.grad.abs().max().item()
    return out


if __name__ == "__main__":
    main()
