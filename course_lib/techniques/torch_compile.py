"""torch.compile: the model and its loss traced together, their element-wise work fused into generated kernels.
Applied after checkpointing, data parallelism and the chunked loss (it traces through them). The first step compiles:
the loop leaves it out of the timing.
"""

from __future__ import annotations

import torch

from ..codegen import Code
from ..config import TrainConfig
from .declaration import Technique

# The modes that replay CUDA graphs on a GPU. A replay reuses the memory of the last one's outputs, so the loop says
# when a new forward begins (torch.compiler.cudagraph_mark_step_begin); without it, a backward that still reads a
# forward's output can find it overwritten (seen on an H200 with torch 2.11).
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def apply(cfg: TrainConfig, loss_module):
    """What the loop calls: `loss_module` itself, or compiled (in a CUDA-graph mode, behind a function that marks each
    forward a new step)."""
    if not cfg.compile:
        return loss_module
    compiled = torch.compile(loss_module, mode=None if cfg.compile_mode == "default" else cfg.compile_mode)
    if cfg.compile_mode not in CUDA_GRAPH_MODES:
        return compiled

    def each_forward_a_new_step(*args, **kwargs):
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(*args, **kwargs)

    return each_forward_a_new_step


def export(cfg: TrainConfig) -> Code:
    if not cfg.compile:
        return Code()
    mode = "" if cfg.compile_mode == "default" else f', mode="{cfg.compile_mode}"'
    setup = (
        "# torch.compile traces model and loss together and fuses their element-wise work into generated kernels;\n"
        "# the first step compiles (it is left out of the timing).\n"
    )
    if cfg.compile_mode not in CUDA_GRAPH_MODES:
        return Code(setup=setup + f"compiled_loss = torch.compile(compute_loss{mode})", loss_fn="compiled_loss")
    return Code(
        setup=setup + f"graphed_loss = torch.compile(compute_loss{mode})\n\n"
        "def compiled_loss(*args):\n"
        "    # CUDA graphs replay into the memory of their last outputs: say that a new forward begins\n"
        "    torch.compiler.cudagraph_mark_step_begin()\n"
        "    return graphed_loss(*args)",
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
