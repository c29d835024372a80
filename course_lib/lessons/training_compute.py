"""What training costs in compute (the name says it apart from course_lib.budget, the notebooks' run length): the
6ND FLOPs of training, and what activation checkpointing's recompute costs.

Training a dense transformer of N parameters on D tokens costs about C = 6·N·D FLOPs (Kaplan et al., 2020): per
token and per weight, one multiply-add (2 FLOPs) in the forward pass and two in the backward pass (the gradient of
the input and the gradient of the weight). Divided by the FLOP/s a device sustains, C is the time to train. Papers
quote C in PF-days: one petaFLOP/s sustained for a day, 10^15 FLOP/s x 86,400 s = 8.64·10^19 FLOPs, an amount of work
(not a speed). GPT-3 (175B parameters, 300B tokens) is 6 x 175e9 x 300e9 = 3.15e23 FLOPs, about 3,640 PF-days, as
its paper reports (Brown et al., 2020, table D.1). The course's per-token count, 6N + 12·L·h·s
(course_lib.measure.flops_per_token), adds attention's own work to the same rule.

Activation checkpointing buys memory with compute: `checkpointing_costs` runs none / selective / full through the
course's loop and puts beside each the memory the ledger measured, what memory_formula.estimate predicted, the work of
one step counted from the shapes (`step_work`), and the forward and backward times measured on the device.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .. import memory_formula, train
from ..config import TrainConfig
from ..data import Splits
from ..measure import _aliasing_returns
from ..results import RunResult
from ..techniques import matmul_precision
from ..timing import StepTimer, time_fn
from .formula_beside_measured import account_step

PF_DAY_FLOPS = 10**15 * 86_400  # 1 PF-day: 10^15 FLOP/s for 86,400 s = 8.64e19 FLOPs
CHINCHILLA_TOKENS_PER_PARAM = 20  # Hoffmann et al. (2022): about 20 training tokens per parameter is compute-optimal


# ---- the budget ----------------------------------------------------------------------------------


def training_flops(n_params: float, tokens: float) -> float:
    """C = 6·N·D: FLOPs to train N parameters on D tokens (2N per token forward, 4N backward)."""
    return 6.0 * n_params * tokens


def tokens_for(flops: float, n_params: float) -> float:
    """D = C / 6N: the training tokens that `flops` buys a model of N parameters (training_flops solved for D)."""
    return flops / (6.0 * n_params)


def pf_days(flops: float) -> float:
    """FLOPs in PF-days (1 PF-day = 10^15 FLOP/s x 86,400 s = 8.64e19 FLOPs)."""
    return flops / PF_DAY_FLOPS


def time_to_train(flops: float, flop_per_s: float) -> float:
    """Seconds to do `flops` of work at a sustained `flop_per_s` (a peak times the fraction of it reached, the MFU)."""
    if flop_per_s <= 0:
        raise ValueError(f"flop_per_s must be positive, got {flop_per_s}")
    return flops / flop_per_s


def chinchilla_tokens(n_params: float, tokens_per_param: float = CHINCHILLA_TOKENS_PER_PARAM) -> float:
    """Compute-optimal training tokens for N parameters, Chinchilla's rule of thumb: 20 per parameter."""
    return tokens_per_param * n_params


_UNITS = (("years", 365.25 * 86_400), ("days", 86_400), ("hours", 3_600), ("minutes", 60), ("s", 1))


def human_duration(seconds: float) -> str:
    """'3.2 days', '41 years': the largest unit that leaves a number of at least 1."""
    for name, size in _UNITS:
        if seconds >= size or size == 1:
            value = seconds / size
            return f"{value:,.0f} {name}" if value >= 100 else f"{value:.3g} {name}"
    raise AssertionError("unreachable")


def budget_rows(runs: dict[str, tuple[float, float]], devices: dict[str, float]) -> list[dict[str, str]]:
    """A table: one row per training run {name: (parameters, tokens)}: its FLOPs (6ND), its PF-days and the time it
    takes on each device {label: sustained FLOP/s}."""
    rows = []
    for name, (n, d) in runs.items():
        c = training_flops(n, d)
        row = {
            "run": name,
            "parameters": f"{n:.3g}",
            "tokens": f"{d:.3g}",
            "FLOPs (6ND)": f"{c:.3g}",
            "PF-days": f"{pf_days(c):.3g}",
        }
        row.update({label: human_duration(time_to_train(c, speed)) for label, speed in devices.items()})
        rows.append(row)
    return rows


# ---- what recompute costs: activation checkpointing -----------------------------------------------


@dataclass
class StepWork:
    """The work of one training step, counted from the shapes (the same on any machine)."""

    matmul_flops: int  # what torch.utils.flop_counter.FlopCounterMode counts: matmuls and attention
    elementwise_values: int  # values written by every other operation that allocates (views and in-place ops excluded)
    ops: int  # operations run, views included


class _WorkCounter(TorchDispatchMode):
    """Counts the operations of a step and the values written by those FlopCounterMode does not count."""

    def __init__(self):
        super().__init__()
        from torch.utils.flop_counter import flop_registry

        self.counted_by_flops = set(flop_registry)
        self.ops = self.values = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        if func.overloadpacket not in self.counted_by_flops:
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            self.values += sum(t.numel() for t, aliases in zip(outs, _aliasing_returns(func, out)) if not aliases)
        return out


def step_work(cfg: TrainConfig) -> StepWork:
    """The work of one training step of `cfg` (the first, so that nothing before it is counted): the loop's own step
    body (formula_beside_measured.account_step) under FakeTensorMode, so it takes no time and no memory and the counts
    are exact."""
    from torch.utils.flop_counter import FlopCounterMode

    flops, counter = FlopCounterMode(display=False), _WorkCounter()
    with flops, counter:
        account_step(cfg, fake=True, warm_steps=0)
    return StepWork(matmul_flops=flops.get_total_flops(), elementwise_values=counter.values, ops=counter.ops)


def forward_backward_seconds(cfg: TrainConfig, repeats: int = 5, splits: Splits | None = None) -> dict[str, float]:
    """Median seconds of one micro-batch's forward (with the loss, keeping what backward needs) and of its backward,
    on cfg.device, timed as every step is (a warm-up, the clock read with the device synchronised, the median). The
    model and its techniques are the loop's own (train.Trainer). Backward is timed on its own, after an untimed forward
    in each repeat (a difference of two medians, (forward + backward) less forward, went negative on a busy machine).
    With the loss in slices (loss_chunks > 1) the output layer's gradients are made in the forward pass: their time is
    in "forward"."""
    trainer = train.Trainer(cfg, splits=splits)
    setup, dev = trainer.setup, trainer.dev
    x, y = (t.to(dev) for t in trainer.batches(0)[0])

    def forward():
        with setup.autocast():
            return setup.loss_fn(x, y)

    timer = StepTimer(dev)
    with matmul_precision(cfg.precision):
        fwd = time_fn(forward, dev, repeats=repeats)
        for _ in range(1 + max(1, repeats)):  # the first is a warm-up
            setup.model.zero_grad(set_to_none=True)  # every repeat does the same work (no accumulating into .grad)
            loss = setup.scaler.scale(forward())
            with timer.step():
                loss.backward()
    return {"forward": fwd, "backward": statistics.median(timer.times[1:])}


@dataclass
class CheckpointingCost:
    """One checkpointing mode of a config: measured (the run, the phase times) beside predicted and counted."""

    mode: str
    result: RunResult  # train.run: losses, step time, memory (the CPU ledger's categories; on CUDA the peak)
    estimate: memory_formula.Estimate  # memory_formula.estimate's prediction of the same step
    work: StepWork  # counted from the shapes
    seconds: dict[str, float]  # forward_backward_seconds


def checkpointing_costs(
    base: TrainConfig, modes=("none", "selective", "full"), repeats: int = 5, splits: Splits | None = None
) -> list[CheckpointingCost]:
    """Each activation-checkpointing mode of `base`, run through the course's loop with the same seed and batches."""
    costs = []
    for mode in modes:
        cfg = dataclasses.replace(base, activation_checkpointing=mode)
        costs.append(
            CheckpointingCost(
                mode=mode,
                result=train.run(cfg, f"checkpointing {mode}", splits=splits),
                estimate=memory_formula.estimate(cfg),
                work=step_work(cfg),
                seconds=forward_backward_seconds(cfg, repeats, splits),
            )
        )
    return costs


def recompute_share(cost: CheckpointingCost, baseline: CheckpointingCost) -> dict[str, float]:
    """What `cost`'s recompute adds to `baseline`'s step (checkpointing "none"), as fractions of the baseline:
    counted matmul FLOPs, counted element-wise values, and measured backward time."""
    return {
        "matmul FLOPs": cost.work.matmul_flops / baseline.work.matmul_flops - 1,
        "element-wise values": cost.work.elementwise_values / baseline.work.elementwise_values - 1,
        "backward time": cost.seconds["backward"] / baseline.seconds["backward"] - 1,
    }


def checkpointing_rows(costs: list[CheckpointingCost]) -> list[dict[str, str]]:
    """A table of checkpointing_costs, relative to its first entry (checkpointing "none")."""
    MiB = 2**20
    rows = []
    for c in costs:
        mem = c.result.memory or {}
        act = (mem.get("by_category") or {}).get("activations")
        share = recompute_share(c, costs[0])
        rows.append(
            {
                "checkpointing": c.mode,
                "activations MiB (measured)": "not measured" if act is None else f"{act / MiB:.2f}",
                "activations MiB (estimate)": f"{c.estimate.by_category['activations'] / MiB:.2f}",
                "peak MiB (measured)": f"{mem['peak_bytes'] / MiB:.2f}" if mem else "",
                "peak MiB (estimate)": f"{c.estimate.peak_bytes / MiB:.2f}",
                "step ms": f"{c.result.median_step_s * 1e3:.1f}" if c.result.ok else c.result.status,
                "forward ms": f"{c.seconds['forward'] * 1e3:.1f}",
                "backward ms": f"{c.seconds['backward'] * 1e3:.1f}",
                "recomputed matmul FLOPs": f"{share['matmul FLOPs']:+.1%}",
                "recomputed element-wise values": f"{share['element-wise values']:+.1%}",
            }
        )
    return rows
