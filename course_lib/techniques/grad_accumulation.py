"""Gradient accumulation: a step's batch in grad_accum_steps micro-batches, one forward and backward each, their
gradients summing in .grad; every micro-batch's summed loss is divided by the target tokens of the whole step
(`accumulate_micro_batches`, the forward and backward of every step the loop takes).
"""

from __future__ import annotations

import torch

from ..codegen import Code
from ..config import TrainConfig
from .declaration import Setting


def accumulate_micro_batches(
    setup, micro: list[tuple[torch.Tensor, torch.Tensor]], n_targets: int, meter
) -> torch.Tensor:
    """Forward and backward of a step's micro-batches (one when accumulation is off), their gradients summing in
    .grad; returns the step's loss per target token. `setup` is an assemble.Setup; `meter` names the phases (a no-op
    unless it measures)."""
    loss_fn = meter.loss_fn(setup)
    step_loss = torch.zeros((), device=micro[0][1].device)
    for x, y in micro:
        with setup.autocast(), meter.phase("forward"):
            loss = loss_fn(x, y) / n_targets
        with meter.phase("backward"):
            setup.scaler.scale(loss).backward()
        step_loss += loss.detach()
        del loss  # the graph and its activations go now, not when the next micro-batch reassigns it
    return step_loss


def export(cfg: TrainConfig) -> Code:
    if cfg.grad_accum_steps == 1:
        return Code()
    return Code(
        constants=(
            f"GRAD_ACCUM_STEPS = {cfg.grad_accum_steps}  # micro-batches per optimizer step, their gradients summed",
            f"MICRO_BATCH_SIZE = {cfg.micro_batch_size}  "
            "# BATCH_SIZE / GRAD_ACCUM_STEPS sequences, one forward and backward each",
        )
    )


SETTING = Setting("grad_accum_steps", export)
