"""torch.compile: the model and its loss traced together, their element-wise work fused into generated kernels.
Applied after checkpointing, data parallelism and the chunked loss (it traces through them). The first step compiles:
the loop leaves it out of the timing.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from ..config import TrainConfig
from .declaration import Support, Technique

# The modes that replay CUDA graphs on a GPU: the loop then calls begin_cuda_graph_step before each optimizer step.
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")

# On a CPU, Inductor's C++ code computes tanh with SLEEF's vectorised tanh: exact to 1 ULP, and slow. This setting
# writes it as 2 / (1 + exp(-2x)) - 1 instead. Its error is absolute, up to 1.8e-7 against 6e-8 (large relative to a
# tanh near 0, where the subtraction cancels); GPT-2's tanh GELU (the model's only tanh) adds 1 to it, and is then off
# by up to 5.2e-7 against 4.3e-7 over [-10, 10]. The course turns it on for the speed of the simpler kernels (notebook
# 04 times compile on the learner's machine). Inductor made the exact tanh its default for a model whose tanh near 0 fed
# atan2 (pytorch#148241), and kept this as a setting. Triton (a GPU's) ignores it.
TANH_THROUGH_EXP = "cpp.use_decompose_tanh"
CPU_INDUCTOR_OPTIONS = {TANH_THROUGH_EXP: True}


def compile_support(dev: torch.device) -> Support:
    if not hasattr(torch, "compile"):
        return Support(False, "this torch has no torch.compile")
    if dev.type == "cpu":
        cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
        return (
            Support(True, f"Inductor generates C++/OpenMP, built with {Path(cxx).name}")
            if cxx
            else Support(
                False, "torch.compile on a CPU needs a C++ compiler (install g++ or clang++), or turn compile off"
            )
        )
    if dev.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return Support(False, "torch.compile on CUDA needs Triton (pip install triton), or turn compile off")
        major, minor = torch.cuda.get_device_capability(dev)
        if major < 7:
            return Support(False, f"Triton needs compute capability 7.0+; this GPU is {major}.{minor}")
        return Support(True, "Inductor generates Triton kernels")
    return Support(False, f"the course does not offer torch.compile on {dev.type!r}")


def check(cfg: TrainConfig) -> str:
    if cfg.compile and cfg.data_parallel != "none":
        return (
            f"compile with data_parallel={cfg.data_parallel!r} is not offered: the course has not run it; "
            "turn compile off in notebook 07's strategies"
        )
    return ""


def uses_cuda_graphs(cfg: TrainConfig) -> bool:
    """Compiled in a mode that replays CUDA graphs, on a CUDA device (on a CPU these modes have no graphs)."""
    return cfg.compile and cfg.compile_mode in CUDA_GRAPH_MODES and torch.device(cfg.device).type == "cuda"


def compile_arguments(cfg: TrainConfig) -> dict:
    """What torch.compile is given: the mode, or on a CPU the mode's Inductor settings and CPU_INDUCTOR_OPTIONS
    (torch.compile takes a mode or options, not both)."""
    if torch.device(cfg.device).type != "cpu":
        return {"mode": None if cfg.compile_mode == "default" else cfg.compile_mode}
    from torch._inductor import list_mode_options

    return {"options": {**list_mode_options(cfg.compile_mode), **CPU_INDUCTOR_OPTIONS}}


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


def apply(cfg: TrainConfig, loss_module) -> Callable:
    """What the step calls for its forward and loss: `loss_module` itself, or compiled. (In a CUDA-graph mode the step
    also calls begin_cuda_graph_step first; on any device: harmless where no graph replays.)"""
    return torch.compile(loss_module, **compile_arguments(cfg)) if cfg.compile else loss_module


TECHNIQUE = Technique(
    "compile",
    "compile",
    False,
    help="torch.compile fuses the element-wise work of the model and its loss into generated kernels",
    probe=compile_support,
    check=check,
    rungs=(("+ compile", True, "torch.compile fuses the element-wise work into generated kernels"),),
    memory_note="not in the estimate: it counts the eager loop's tensors (the ledger measures what compile keeps)",
)
