"""Gradient accumulation: a step's batch in grad_accum_steps micro-batches, one forward and backward each, their
gradients summing in .grad; every micro-batch's summed loss is divided by the target tokens of the whole step
(course_lib.train.train_step's loop over the micro-batches).
"""

from __future__ import annotations

from ..codegen import Code
from ..config import TrainConfig
from .declaration import Setting


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
