"""torch.compile: the model and its loss traced together, their element-wise work fused into generated kernels.
Applied after checkpointing, data parallelism and the chunked loss (it traces through them). The first step compiles:
the loop leaves it out of the timing.
"""

from __future__ import annotations

import torch

from ..codegen import Code, source
from ..config import TrainConfig
from .declaration import Technique

# The modes that replay CUDA graphs on a GPU (OneMarkPerOptimizerStep says what they need from the loop).
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


class OneMarkPerOptimizerStep:
    """A compiled loss function in a mode that replays CUDA graphs. A replay writes into the memory of the graphs'
    last outputs, and torch.compiler.cudagraph_mark_step_begin() says when a training step begins: from then on the
    outputs of the step before may be overwritten. Two rules follow.
    - One mark per optimizer step, before its first micro-batch: a mark between micro-batches would let the next
      backward overwrite the gradients the last one left in .grad.
    - Gradients that live from one step to the next (zero_grad(set_to_none=False)) are made before the first step, so
      that backward adds into them in place. Otherwise backward installs a graph's output as .grad, and the next step
      overwrites it: "accessing tensor output of CUDAGraphs that has been overwritten" (an H200, torch 2.11).
    """

    def __init__(self, compiled, params, micro_batches: int, grads_kept: bool):
        self.compiled, self.params = compiled, [p for p in params if p.requires_grad]
        self.micro_batches, self.grads_kept = micro_batches, grads_kept
        self.calls = 0

    def __call__(self, *args):
        if self.calls % self.micro_batches == 0:  # the first micro-batch of an optimizer step
            torch.compiler.cudagraph_mark_step_begin()
            if self.grads_kept:
                for p in self.params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
        self.calls += 1
        return self.compiled(*args)


def apply(cfg: TrainConfig, loss_module):
    """What the loop calls: `loss_module` itself, or compiled (in a CUDA-graph mode, behind OneMarkPerOptimizerStep)."""
    if not cfg.compile:
        return loss_module
    compiled = torch.compile(loss_module, mode=None if cfg.compile_mode == "default" else cfg.compile_mode)
    if cfg.compile_mode not in CUDA_GRAPH_MODES:
        return compiled
    return OneMarkPerOptimizerStep(
        compiled, loss_module.parameters(), cfg.grad_accum_steps, grads_kept=not cfg.set_to_none
    )


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
    micro_batches = "GRAD_ACCUM_STEPS" if cfg.grad_accum_steps > 1 else "1"
    kept = not cfg.set_to_none
    return Code(
        defs=(source(OneMarkPerOptimizerStep),),
        setup=setup + "compiled_loss = OneMarkPerOptimizerStep(\n"
        f"    torch.compile(compute_loss{mode}), model.parameters(), {micro_batches}, grads_kept={kept}\n"
        ")",
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
