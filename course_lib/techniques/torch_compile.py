"""torch.compile: the model and its loss traced together, their element-wise work fused into generated kernels.
Applied after checkpointing, data parallelism and the chunked loss (it traces through them). The first step compiles:
the loop leaves it out of the timing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ..codegen import Code, source
from ..config import TrainConfig
from .declaration import Technique, nothing_to_do

# The modes that replay CUDA graphs on a GPU: the loop then calls begin_cuda_graph_step before each optimizer step.
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def begin_cuda_graph_step(params, grads_kept: bool) -> None:
    """Before an optimizer step's first micro-batch, where compiled code replays CUDA graphs. A replay writes into the
    memory of the graphs' last outputs, and torch.compiler.cudagraph_mark_step_begin() says when a step begins: from
    then on the outputs of the step before may be overwritten. A gradient can be such an output: a backward that finds
    .grad empty installs the graph's output there. So:
    - one mark per optimizer step, not per micro-batch: a mark between micro-batches would let the next backward
      overwrite the gradients the first left in .grad (zero_grad(set_to_none=True) empties .grad before the next mark);
    - gradients kept from step to step (set_to_none=False) are made before the first step, zeros, so that backward adds
      into them in place; else the next step's replay overwrites them ("accessing tensor output of CUDAGraphs that
      has been overwritten": an H200, torch 2.11).
    """
    torch.compiler.cudagraph_mark_step_begin()
    if grads_kept:
        for p in params:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)


def apply(cfg: TrainConfig, loss_module) -> tuple[Callable, Callable[[], None]]:
    """(what the loop calls: `loss_module` itself or compiled, what it calls before each optimizer step)."""
    if not cfg.compile:
        return loss_module, nothing_to_do
    compiled = torch.compile(loss_module, mode=None if cfg.compile_mode == "default" else cfg.compile_mode)
    if cfg.compile_mode not in CUDA_GRAPH_MODES:
        return compiled, nothing_to_do
    params = list(loss_module.parameters())
    return compiled, functools.partial(begin_cuda_graph_step, params, grads_kept=not cfg.set_to_none)


def export(cfg: TrainConfig) -> Code:
    if not cfg.compile:
        return Code()
    mode = "" if cfg.compile_mode == "default" else f', mode="{cfg.compile_mode}"'
    setup = (
        "# torch.compile traces model and loss together and fuses their element-wise work into generated kernels;\n"
        "# the first step compiles (it is left out of the timing).\n"
        f"compiled_loss = torch.compile(compute_loss{mode})"
    )
    if cfg.compile_mode not in CUDA_GRAPH_MODES:
        return Code(setup=setup, loss_fn="compiled_loss")
    return Code(
        defs=(source(begin_cuda_graph_step),),
        setup=setup,
        loss_fn="compiled_loss",
        step_start=f"begin_cuda_graph_step(model.parameters(), grads_kept={not cfg.set_to_none})",
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
