"""Gradient clipping: off, by the global norm of all gradients together (GPT-3's; the direction is kept), or each
tensor by its own norm (the direction changes). course_lib.train.train_step clips: torch's clip_grads_with_norm_ for
the global norm, clip_by_tensor_norm below for each tensor's own.
"""

from __future__ import annotations

import torch

from ..codegen import Code, source
from ..config import TrainConfig
from .declaration import Setting


def clip_by_tensor_norm(params: list[torch.Tensor], max_norm: float) -> list[torch.Tensor]:
    """Each gradient times its own factor, min(1, max_norm / (||g_i|| + 1e-6)): a tensor is clipped on its own norm,
    so the direction of the whole gradient changes. Returns each gradient's norm before clipping, as tensors: no
    value is read back to the host."""
    grads = [p.grad for p in params if p.grad is not None]
    norms = torch._foreach_norm(grads)
    torch._foreach_mul_(grads, [(max_norm / (n + 1e-6)).clamp(max=1.0) for n in norms])
    return norms


def export(cfg: TrainConfig) -> Code:
    if cfg.clip_norm is None:
        return Code()
    constant = (f"CLIP_NORM = {cfg.clip_norm!r}",)
    if cfg.clip_kind == "global":
        return Code(
            constants=constant,
            clip=(
                "# Every gradient times min(1, CLIP_NORM / ||g||), ||g|| the norm of all of them together (GPT-3):\n"
                "# the direction of the whole gradient is kept.\n"
                "torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)"
            ),
        )
    return Code(
        constants=constant,
        defs=(source(clip_by_tensor_norm),),
        clip="clip_by_tensor_norm(list(model.parameters()), CLIP_NORM)  # each gradient clipped on its own norm",
    )


SETTING = Setting("clip_norm", export, reads=("clip_kind",))
