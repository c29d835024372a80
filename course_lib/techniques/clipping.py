"""Gradient clipping: off, by the global norm of all gradients together (GPT-3's; the direction is kept), or each
tensor by its own norm (the direction changes). course_lib.train.train_step clips: torch's clip_grads_with_norm_ for
the global norm, clip_by_tensor_norm below for each tensor's own.
"""

from __future__ import annotations

import torch


def clip_by_tensor_norm(params: list[torch.Tensor], max_norm: float) -> list[torch.Tensor]:
    """Each gradient times its own factor, min(1, max_norm / (||g_i|| + 1e-6)): a tensor is clipped on its own norm,
    so the direction of the whole gradient changes. Returns each gradient's norm before clipping, as tensors: no
    value is read back to the host."""
    grads = [p.grad for p in params if p.grad is not None]
    norms = torch._foreach_norm(grads)
    torch._foreach_mul_(grads, [(max_norm / (n + 1e-6)).clamp(max=1.0) for n in norms])
    return norms
