"""Turn a TrainConfig into the objects the training loop uses: `build(cfg, model, parts)`, the techniques applied in
one fixed order (as torchtitan's parallelize.py applies its own):
  1. activation checkpointing wraps each block (it must see the eager blocks),
  2. data parallelism wraps the model (DDP, or FSDP2 sharding each block and then the root; DDP by hand
     hooks its parameters and gives the step its last sync),
  3. the model and its loss become one module (LossModule), optionally with the loss in chunks,
  4. torch.compile wraps that module (it then traces through the checkpointed blocks and the loss),
  5. the optimizer (fused or not), its schedule, autocast and the GradScaler.
The optimizer always holds the original parameters. Autocast and the GradScaler are no-op objects where they are off
(nullcontext, a disabled GradScaler); the step that uses all this is course_lib.train.train_step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from ..config import TrainConfig
from . import activation_checkpointing, data_parallel, torch_compile
from .chunked_loss import LossModule
from .lr_schedule import make_scheduler
from .mixed_precision import autocast_context, make_grad_scaler
from .model_parts import ModelParts
from .optimizer import make_optimizer


@dataclass
class Setup:
    """Everything the training step needs, built from one TrainConfig. The last two fields are parallelisms that
    change the step itself (train_step's `if`s): a pipeline runs forward and backward through its schedule and sums the
    gradient norm over its stages (course_lib.distributed.pipeline.PipelineStep sets it); a hand-written data
    parallelism waits for its all-reduces after backward (data_parallel="bucketed": data_parallel.BucketedDDP)."""

    model: nn.Module  # the module the optimizer updates (eager, maybe with checkpointed blocks)
    loss_module: LossModule  # eager: (x, y) -> summed loss
    loss_fn: nn.Module | Callable  # what the loop calls: loss_module, or its compiled version
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    autocast: Callable[[], contextlib.AbstractContextManager]
    scaler: torch.amp.GradScaler
    parts: ModelParts
    pipeline: Any = None  # a PipelineStep: .forward_backward(setup, micro, n_targets, meter), .grad_norm(grads)
    hand_ddp: Any = None  # a hand-written DDP: .finish() after the step's last backward


def build(cfg: TrainConfig, model: nn.Module, parts: ModelParts | None = None) -> Setup:
    """Apply the config's techniques to `model` (already on cfg.device) in the one correct order (module docstring)."""
    parts = parts if parts is not None else ModelParts.of(model)
    activation_checkpointing.apply(cfg, parts)  # 1
    loss_model, hand_ddp = data_parallel.apply_data_parallel(cfg, model, parts)  # 2
    loss_module = LossModule(loss_model, cfg.loss_chunks, parts)  # 3
    loss_fn = torch_compile.apply(cfg, loss_module)  # 4
    optimizer = make_optimizer(cfg, model)  # 5: the original parameters, whatever wraps the model
    return Setup(
        model=model,
        loss_module=loss_module,
        loss_fn=loss_fn,
        optimizer=optimizer,
        scheduler=make_scheduler(cfg, optimizer),
        autocast=autocast_context(cfg.precision, cfg.device),
        scaler=make_grad_scaler(cfg),
        parts=parts,
        hand_ddp=hand_ddp,
    )
