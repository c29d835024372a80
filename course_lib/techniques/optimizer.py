"""Every optimizer the course uses, made in one place (`optimizer_for`), weight decay on the matmul weights and
embeddings only (`param_groups`); fused or for-loop AdamW is the fused_adamw technique's choice."""

from __future__ import annotations

import torch
import torch.nn as nn

from ..config import TrainConfig

# What each optimizer keeps per parameter (its memory term): momentum one buffer, AdamW m and v, AdaGrad its sum of
# g^2, RMSProp its average; all but SGD also keep a 4-byte `step` counter per parameter tensor.
STATES_PER_PARAMETER = {"sgd": 0, "sgd_momentum": 1, "adamw": 2, "adagrad": 1, "rmsprop": 1}
STEP_COUNTER_BYTES = {"sgd": 0, "sgd_momentum": 0, "adamw": 4, "adagrad": 4, "rmsprop": 4}


def state_bytes(kind: str, n_params: int, n_param_tensors: int = 0, bytes_per_value: int = 4) -> int:
    """Bytes of the optimizer's state for n_params parameters in n_param_tensors tensors (for the step counters)."""
    if kind not in STATES_PER_PARAMETER:
        raise ValueError(f"optimizer={kind!r} is not one of {', '.join(STATES_PER_PARAMETER)}")
    return STATES_PER_PARAMETER[kind] * n_params * bytes_per_value + STEP_COUNTER_BYTES[kind] * n_param_tensors


def param_groups(model: nn.Module, weight_decay: float, decay_2d_only: bool = True) -> list[dict]:
    """The optimizer's groups: decay on >=2-D tensors (matmul weights, embeddings), none on biases and LayerNorm gains;
    each parameter once (the tied embedding too)."""
    params = list({id(p): p for p in model.parameters() if p.requires_grad}.values())
    if not decay_2d_only:
        return [{"params": params, "weight_decay": weight_decay}]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def optimizer_for(
    kind: str, params, lr: float, *, betas=(0.9, 0.999), eps: float = 1e-8, momentum: float = 0.9, fused: bool = False
) -> torch.optim.Optimizer:
    """Every optimizer the course uses; AdamW's baseline is the naive loop's for-loop (foreach=False)."""
    if kind == "adamw":
        return torch.optim.AdamW(
            params, lr=lr, betas=betas, eps=eps, **({"fused": True} if fused else {"foreach": False})
        )
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if kind == "sgd_momentum":
        return torch.optim.SGD(params, lr=lr, momentum=momentum)
    if kind == "adagrad":  # eps in the denominator, as AdamW's (torch's default for AdaGrad is 1e-10)
        return torch.optim.Adagrad(params, lr=lr, eps=eps, foreach=False)
    if kind == "rmsprop":  # torch's defaults otherwise: alpha 0.99, no momentum, not centered
        return torch.optim.RMSprop(params, lr=lr, eps=eps, foreach=False)
    if kind == "adafactor":
        return torch.optim.Adafactor(params, lr=lr, foreach=False)
    raise ValueError(f"unknown optimizer kind {kind!r}: adamw, sgd, sgd_momentum, adagrad, rmsprop or adafactor")


def make_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay, cfg.decay_2d_only)
    return optimizer_for(
        cfg.optimizer, groups, cfg.lr, betas=cfg.betas, eps=cfg.eps, momentum=cfg.momentum, fused=cfg.fused_adamw
    )
