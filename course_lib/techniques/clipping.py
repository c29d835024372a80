"""Gradient clipping: off, by the global norm of all gradients together (GPT-3's; the direction is kept), or each
tensor by its own norm (the direction changes). `make_clipper` gives the loop one callable for any of them.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from ..codegen import Code, source
from ..config import TrainConfig
from .declaration import Setting


def _no_clip(params: list[torch.Tensor], total_norm: torch.Tensor) -> None:
    """Clipping off (clip_norm=None)."""


def clip_by_global_norm(params: list[torch.Tensor], total_norm: torch.Tensor, max_norm: float) -> None:
    """Every gradient times one factor, min(1, max_norm / ||g||) with ||g|| the norm of all of them together: the
    direction of the whole gradient is kept (GPT-3's clipping; torch's clip_grad_norm_)."""
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm)


def clip_by_tensor_norm(params: list[torch.Tensor], max_norm: float) -> list[torch.Tensor]:
    """Each gradient times its own factor, min(1, max_norm / (||g_i|| + 1e-6)): a tensor is clipped on its own norm,
    so the direction of the whole gradient changes. Returns each gradient's norm before clipping, as tensors: no
    value is read back to the host."""
    grads = [p.grad for p in params if p.grad is not None]
    norms = torch._foreach_norm(grads)
    torch._foreach_mul_(grads, [(max_norm / (n + 1e-6)).clamp(max=1.0) for n in norms])
    return norms


def make_clipper(cfg: TrainConfig) -> Callable[[list[torch.Tensor], torch.Tensor], None]:
    """clip(params, total_norm) for cfg.clip_kind at cfg.clip_norm, or a no-op when clip_norm is None."""
    if cfg.clip_norm is None:
        return _no_clip
    if cfg.clip_kind == "global":
        return functools.partial(clip_by_global_norm, max_norm=cfg.clip_norm)

    def clip_each(params: list[torch.Tensor], _total_norm: torch.Tensor) -> None:  # its own norms: the total unused
        clip_by_tensor_norm(params, cfg.clip_norm)

    return clip_each


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
