"""Turn a TrainConfig into the objects the training loop uses: `build(cfg, model, parts)`, the techniques applied in
one fixed order (as torchtitan's parallelize.py applies its own):
  1. activation checkpointing wraps each block (it must see the eager blocks),
  2. data parallelism wraps the model (DDP, or FSDP2 sharding each block and then the root; DDP by hand
     hooks its parameters and gives the step its last sync),
  3. the model and its loss become one module (LossModule), optionally with the loss in chunks,
  4. torch.compile wraps that module (it then traces through the checkpointed blocks and the loss),
  5. the optimizer (fused or not), its schedule, autocast and the GradScaler, and the clipping,
  6. on a CPU, the start of each step sets the process's allocator (keep freed memory or not).
The optimizer always holds the original parameters. A technique that is off becomes a no-op object (nullcontext, a
disabled GradScaler, a clipper that does nothing), so the loop in course_lib.train has one code path.

`optimizer_step` is the end of every step, written once; the forward and backward of a step are
grad_accumulation.accumulate_micro_batches.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from ..config import TrainConfig
from . import activation_checkpointing, data_parallel, keep_freed_memory, torch_compile
from .chunked_loss import LossModule
from .clipping import _no_clip, make_clipper
from .declaration import nothing_to_do
from .grad_accumulation import accumulate_micro_batches
from .lr_schedule import make_scheduler
from .mixed_precision import autocast_context, make_grad_scaler
from .model_parts import ModelParts
from .optimizer import make_optimizer


def optimizer_step(
    setup: "Setup",
    cfg: TrainConfig,
    params: list[torch.Tensor],
    on_grads: Callable[[list[torch.Tensor]], None] | None = None,
) -> tuple[torch.Tensor, float, float]:
    """The end of every training step, written once: unscale (fp16), clip (setup.clip), step, scaler update,
    zero_grad, schedule. Returns (gradient norm before clipping, learning rate used, loss scale used).
    `on_grads` sees the gradients before zero_grad may free them (the memory ledger names them)."""
    setup.scaler.unscale_(setup.optimizer)
    grads = [p.grad for p in params if p.grad is not None]
    if on_grads:
        on_grads(grads)
    norm = setup.grad_norm(grads)
    setup.clip(params, norm)
    lr = setup.optimizer.param_groups[0]["lr"]
    scale = setup.scaler.get_scale() if setup.scaler.is_enabled() else 1.0
    setup.scaler.step(setup.optimizer)
    setup.scaler.update()
    setup.optimizer.zero_grad(set_to_none=cfg.set_to_none)
    with warnings.catch_warnings():  # a step the fp16 scaler skipped still advances the schedule, on purpose
        warnings.filterwarnings(
            "ignore", message=r"Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`"
        )
        setup.scheduler.step()
    return norm, lr, scale


@dataclass
class Setup:
    """Everything the loop needs, built from one TrainConfig. The last three fields are the step's pieces that a
    parallelism may own: pipeline parallelism runs forward and backward through its schedule, and its gradient
    norm must be summed over the stages (course_lib.distributed.pipeline sets both); a hand-written data parallelism
    waits for its all-reduces after backward (data_parallel="bucketed"; ddp_by_hand times it there)."""

    model: nn.Module  # the module the optimizer updates (eager, maybe with checkpointed blocks)
    loss_module: LossModule  # eager: (x, y) -> summed loss
    loss_fn: nn.Module | Callable  # what the loop calls: loss_module, or its compiled version
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    autocast: Callable[[], contextlib.AbstractContextManager]
    scaler: torch.amp.GradScaler
    parts: ModelParts
    clip: Callable[[list[torch.Tensor], torch.Tensor], None] = _no_clip  # make_clipper(cfg): global, per tensor or off
    # (setup, micro-batches, n_targets, meter) -> the step's loss, gradients left in .grad
    forward_backward: Callable[..., torch.Tensor] = accumulate_micro_batches
    grad_norm: Callable[[list[torch.Tensor]], torch.Tensor] = torch.nn.utils.get_total_norm  # of all gradients together
    # after the last backward of a step: a hand-written data parallelism waits for its all-reduces (else a no-op)
    sync_gradients: Callable[[], None] = nothing_to_do
    # before a step's first micro-batch: where compile replays CUDA graphs, a new step is marked (else a no-op)
    begin_step: Callable[[], None] = nothing_to_do


def build(cfg: TrainConfig, model: nn.Module, parts: ModelParts | None = None) -> Setup:
    """Apply the config's techniques to `model` (already on cfg.device) in the one correct order (module docstring)."""
    parts = parts if parts is not None else ModelParts.of(model)
    activation_checkpointing.apply(cfg, parts)  # 1
    loss_model, sync_gradients = data_parallel.apply_data_parallel(cfg, model, parts)  # 2
    loss_module = LossModule(loss_model, cfg.loss_chunks, parts)  # 3
    loss_fn, begin_step = torch_compile.apply(cfg, loss_module)  # 4
    optimizer = make_optimizer(cfg, model)  # 5: the original parameters, whatever wraps the model
    begin_step = keep_freed_memory.apply(cfg, begin_step)  # 6: each step sets the process's allocator first
    return Setup(
        model=model,
        loss_module=loss_module,
        loss_fn=loss_fn,
        begin_step=begin_step,
        optimizer=optimizer,
        scheduler=make_scheduler(cfg, optimizer),
        autocast=autocast_context(cfg.precision, cfg.device),
        scaler=make_grad_scaler(cfg),
        parts=parts,
        clip=make_clipper(cfg),
        sync_gradients=sync_gradients,
    )
