"""Gradient clipping by each tensor's own norm (train.train_step clips by the global norm with torch's own)."""

from __future__ import annotations

import torch


def clip_by_tensor_norm(params: list[torch.Tensor], max_norm: float) -> list[torch.Tensor]:
    """Each gradient times min(1, max_norm / (||g_i|| + 1e-6)): the whole gradient's direction changes, unlike the
    global norm's. Returns each norm before clipping, as tensors (nothing read back to the host)."""
    grads = [p.grad for p in params if p.grad is not None]
    norms = torch._foreach_norm(grads)
    torch._foreach_mul_(grads, [(max_norm / (n + 1e-6)).clamp(max=1.0) for n in norms])
    return norms
