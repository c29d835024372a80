"""`build(cfg, model, parts)`: the techniques applied in one fixed order (as torchtitan's parallelize.py does):
1. activation checkpointing wraps each block (it must see the eager blocks),
2. data parallelism wraps the model (DDP, or FSDP2 on each block then the root; DDP by hand hooks its parameters),
3. the model and its loss become one module (LossModule), optionally with the loss in chunks,
4. torch.compile wraps that module (it traces through the checkpointed blocks and the loss),
5. the optimizer (on the original parameters), its schedule, autocast and the GradScaler (no-ops where off).
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
    """Everything the training step (train.train_step) needs. The last two fields are parallelisms that change the
    step itself: a pipeline's schedule (distributed.pipeline.PipelineStep) and DDP by hand's wait after backward."""

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
    """Apply the config's techniques to `model` (already on cfg.device) in the order the module docstring gives."""
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
