"""torch.compile: the model and its loss traced together, their element-wise work fused into generated kernels.
Applied after checkpointing, data parallelism and the chunked loss (it traces through them). The first step compiles:
the loop leaves it out of the timing.
"""

from __future__ import annotations

import torch

from ..codegen import Code
from ..config import TrainConfig
from .declaration import Technique


def apply(cfg: TrainConfig, loss_module):
    """What the loop calls: `loss_module` itself, or compiled."""
    if not cfg.compile:
        return loss_module
    return torch.compile(loss_module, mode=None if cfg.compile_mode == "default" else cfg.compile_mode)


def export(cfg: TrainConfig) -> Code:
    if not cfg.compile:
        return Code()
    mode = "" if cfg.compile_mode == "default" else f', mode="{cfg.compile_mode}"'
    return Code(
        setup=(
            "# torch.compile traces model and loss together and fuses their element-wise work into generated kernels;\n"
            "# the first step compiles (it is left out of the timing).\n"
            f"compiled_loss = torch.compile(compute_loss{mode})"
        ),
        loss_fn="compiled_loss",
    )


TECHNIQUE = Technique(
    "compile",
    "compile",
    False,
    help="torch.compile fuses the element-wise work of the model and its loss into generated kernels",
    export=export,
    reads=("compile_mode",),
    rungs=(("+ compile", True, "torch.compile fuses the element-wise work into generated kernels"),),
    memory_note="not in the estimate: it counts the eager loop's tensors (the ledger measures what compile keeps)",
)
