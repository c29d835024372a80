"""Learning-rate schedules: the rate of optimizer step `step` (0-based) as plain functions (`lr_at` picks
cfg.schedule's; the exported script carries them too), and the LambdaLR the loop steps (`make_scheduler`)."""

from __future__ import annotations

import math

import torch

from ..config import TrainConfig


def _warmup(step: int, lr: float, warmup: int) -> float:
    return lr * (step + 1) / warmup


def constant_lr(step: int, lr: float, warmup: int = 0) -> float:
    return _warmup(step, lr, warmup) if step < warmup else lr


def warmup_cosine_lr(step: int, lr: float, warmup: int, total: int, min_lr_ratio: float = 0.1) -> float:
    """Linear warmup, then half a cosine down to min_lr_ratio * lr at the last step (GPT-3 decays to 10%)."""
    if step < warmup:
        return _warmup(step, lr, warmup)
    progress = min(1.0, (step - warmup) / max(1, total - 1 - warmup))
    floor = min_lr_ratio * lr
    return floor + 0.5 * (lr - floor) * (1 + math.cos(math.pi * progress))


def inverse_sqrt_lr(step: int, lr: float, warmup: int) -> float:
    """The original Transformer's, peaking at `lr`: with t = step + 1, lr * min(t / warmup, sqrt(warmup / t))."""
    if warmup < 1:
        raise ValueError("inverse_sqrt_lr needs warmup >= 1 (it peaks at t = warmup)")
    t = step + 1
    return lr * min(t / warmup, math.sqrt(warmup / t))


def wsd_lr(
    step: int, lr: float, warmup: int, total: int, decay_fraction: float = 0.2, min_lr_ratio: float = 0.0
) -> float:
    """Warmup-stable-decay: warmup, flat at `lr`, then a linear cool-down over the last `decay_fraction` of the steps to
    min_lr_ratio * lr at the last step."""
    if step < warmup:
        return _warmup(step, lr, warmup)
    decay_steps = max(1, math.ceil(decay_fraction * total))
    start = total - decay_steps  # first step of the cool-down
    if step < start:
        return lr
    progress = min(1.0, (step - start + 1) / decay_steps)
    floor = min_lr_ratio * lr
    return lr - (lr - floor) * progress


def exponential_lr(step: int, lr: float, warmup: int, total: int, min_lr_ratio: float = 0.1) -> float:
    """Warmup, then the rate times gamma at every step (ExponentialLR), reaching min_lr_ratio * lr at the last step."""
    if step < warmup:
        return _warmup(step, lr, warmup)
    gamma = min_lr_ratio ** (1 / max(1, total - 1 - warmup))  # the per-step factor
    return lr * gamma ** (step - warmup)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """The learning rate of optimizer step `step` (0-based) for cfg.schedule."""
    w = cfg.lr_warmup_steps
    if cfg.schedule == "constant":
        return constant_lr(step, cfg.lr, w)
    if cfg.schedule == "cosine":
        return warmup_cosine_lr(step, cfg.lr, w, cfg.steps, cfg.min_lr_ratio)
    if cfg.schedule == "wsd":
        return wsd_lr(step, cfg.lr, w, cfg.steps, min_lr_ratio=cfg.min_lr_ratio)
    if cfg.schedule == "exponential":
        return exponential_lr(step, cfg.lr, w, cfg.steps, cfg.min_lr_ratio)
    return inverse_sqrt_lr(step, cfg.lr, w)


def make_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, cfg) / cfg.lr)
