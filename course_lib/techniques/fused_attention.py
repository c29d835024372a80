"""Fused attention: scaled_dot_product_attention (model.attention="sdpa") in place of naive attention, which writes
out the (batch, heads, s, s) scores; the model holds both (model.ATTENTION_IMPLS), notebook 04 builds the fused kernel
by hand. Its memory term (`what_attention_keeps`): whether a block keeps the s x s tensors."""

from __future__ import annotations

import torch

from ..config import TrainConfig
from .declaration import MEMORY, SPEED, Technique


def what_attention_keeps(cfg: TrainConfig) -> tuple[str, bool]:
    """(what attention keeps, "naive" or "sdpa"; whether it keeps a bool causal mask). SDPA with dropout on a CPU runs
    its math path, which keeps what naive attention keeps but the mask (it adds a float bias instead)."""
    m = cfg.model
    if m.attention == "sdpa" and m.dropout > 0 and torch.device(cfg.device).type == "cpu":
        return "naive", False
    if m.attention == "flash":  # the course's own flash attention keeps what SDPA's flash kernel keeps (O and lse)
        return "sdpa", False
    return m.attention, m.attention == "naive"


TECHNIQUE = Technique(
    "model.attention",
    "attention",
    "naive",
    help="naive attention writes out the s x s scores; scaled_dot_product_attention fuses them away; flash is the "
    "course's own flash attention, in PyTorch (slow, for measuring your own kernel)",
    rungs=(
        (
            "+ sdpa",
            "sdpa",
            # not "(flash)": torch picks the kernel, and on a CUDA GPU in fp32 its flash kernel cannot run
            "scaled_dot_product_attention: a fused kernel (flash or memory-efficient, as torch picks for this device "
            "and dtype), no s x s matrix in memory",
        ),
    ),
    aims=(SPEED, MEMORY),
)
