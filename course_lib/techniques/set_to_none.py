"""zero_grad(set_to_none=True): the gradients are freed between steps instead of zeroed in place (train.train_step).
Its memory term (`gradients_before_backward`): whether the gradients are there when a step's peak comes."""

from __future__ import annotations

from ..config import TrainConfig
from .declaration import MEMORY, Technique


def gradients_before_backward(cfg: TrainConfig) -> bool:
    """Whether .grad holds gradients before a step's last backward: not where set_to_none freed them and there is one
    micro-batch (with accumulation the earlier micro-batches made them)."""
    return not (cfg.set_to_none and cfg.grad_accum_steps == 1)


TECHNIQUE = Technique(
    "set_to_none",
    "zero_grad(set_to_none)",
    False,
    help="free the gradients between steps instead of zeroing them in place",
    rungs=(("+ set_to_none", True, "zero_grad(set_to_none=True): gradients freed between steps, not zeroed in place"),),
    aims=(MEMORY,),
)
