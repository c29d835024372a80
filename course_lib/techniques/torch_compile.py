"""torch.compile: the model and its loss traced together, their element-wise work fused into generated kernels.
Applied last (it traces through checkpointing and the chunked loss); the loop leaves the compiling step untimed."""

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

# On a CPU, Inductor's exact tanh is slow; this writes it as 2 / (1 + exp(-2x)) - 1, whose error near 0 (pytorch#148241)
# is harmless to GPT-2's tanh GELU, which adds 1 to it. Triton ignores it.
TANH_THROUGH_EXP = "cpp.use_decompose_tanh"
CPU_INDUCTOR_OPTIONS = {TANH_THROUGH_EXP: True}


def compile_support(dev: torch.device) -> Support:
    if dev.type == "cpu":
        if cxx := os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++"):
            return Support(True, f"Inductor generates C++/OpenMP, built with {Path(cxx).name}")
        return Support(
            False, "torch.compile on a CPU needs a C++ compiler (install g++ or clang++), or turn compile off"
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
    """The mode, or on a CPU its Inductor settings and CPU_INDUCTOR_OPTIONS (torch.compile takes one or the other)."""
    if torch.device(cfg.device).type != "cpu":
        return {"mode": None if cfg.compile_mode == "default" else cfg.compile_mode}
    from torch._inductor import list_mode_options

    return {"options": {**list_mode_options(cfg.compile_mode), **CPU_INDUCTOR_OPTIONS}}


def begin_cuda_graph_step(params, grads_kept: bool) -> None:
    """Before an optimizer step's first micro-batch under CUDA graphs: one mark per step (a replay may overwrite the
    outputs from before the mark), and kept gradients made as zeros first, so backward adds into them in place."""
    torch.compiler.cudagraph_mark_step_begin()
    if grads_kept:
        for p in params:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)


def apply(cfg: TrainConfig, loss_module) -> Callable:
    """What the step calls for its forward and loss: `loss_module` itself, or compiled."""
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
