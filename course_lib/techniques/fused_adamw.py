"""Fused AdamW: one kernel updates every parameter tensor, in place of the naive loop's for-loop (foreach=False).
optimizer.optimizer_for makes it; here: whether a device runs torch's fused kernel, and that it is AdamW's."""

from __future__ import annotations

import torch

from ..config import TrainConfig
from .declaration import Support, Technique


def fused_adamw_support(dev: torch.device) -> Support:
    p = torch.zeros(4, device=dev, requires_grad=True)
    p.grad = torch.ones_like(p)
    try:
        torch.optim.AdamW([p], fused=True).step()
    except (RuntimeError, ValueError) as e:
        return Support(False, f"torch's fused AdamW does not run here: {str(e).splitlines()[0][:120]}")
    return Support(True, "one fused kernel for every tensor")


def check(cfg: TrainConfig) -> str:
    wrong = cfg.fused_adamw and cfg.optimizer != "adamw"
    return "fused_adamw applies to optimizer='adamw' only: turn it off or use AdamW" if wrong else ""


TECHNIQUE = Technique(
    "fused_adamw",
    "fused AdamW",
    False,
    help="one fused kernel updates every parameter tensor, instead of a Python loop over them",
    probe=fused_adamw_support,
    check=check,
    rungs=(("+ fused AdamW", True, "one fused optimizer kernel for every tensor"),),
    memory_note="not in the estimate: AdamW's temporaries are smaller than the terms of the peak",
)
