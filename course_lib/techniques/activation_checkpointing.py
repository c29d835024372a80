"""Activation checkpointing: keep less of the forward pass for backward, and recompute the rest there. Applied first
(assemble.build), to the eager blocks. Its memory term: what a block keeps (`kept_per_layer`).
Selective keeps the matmul outputs and recomputes the element-wise work; Korthikanti et al. (2022) instead
recompute the attention core (QK^T, softmax).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..config import ConfigError, TrainConfig
from .declaration import MEMORY, Technique
from .model_parts import ModelParts

# What selective checkpointing keeps: the matmuls' and attention's outputs (torch's policy, as torchtitan uses it).
_SAVED_BY_SELECTIVE = tuple(
    getattr(torch.ops.aten, name).default
    for name in "mm addmm bmm _scaled_dot_product_flash_attention _scaled_dot_product_flash_attention_for_cpu "
    "_scaled_dot_product_efficient_attention _scaled_dot_product_cudnn_attention".split()
    if hasattr(torch.ops.aten, name)
)


def _selective_policy(_ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_BY_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


class CheckpointedBlock(nn.Module):
    """Full checkpointing: forward keeps only the block's input, backward runs its forward again (one more forward)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # evaluation: no backward, nothing to keep or recompute
            return self.block(x)
        return checkpoint(self.block, x, use_reentrant=False, **self.checkpoint_options())

    def checkpoint_options(self) -> dict:
        return {}


class SelectiveCheckpointedBlock(CheckpointedBlock):
    """Selective: forward also keeps the matmul and attention outputs, backward recomputes only the element-wise work.
    Korthikanti et al. (2022) instead recompute the attention core (QK^T, softmax: the s x s part); notebook 02 measures
    both."""

    def checkpoint_options(self) -> dict:
        return {"context_fn": functools.partial(create_selective_checkpoint_contexts, _selective_policy)}


CHECKPOINTED_BLOCKS = {"full": CheckpointedBlock, "selective": SelectiveCheckpointedBlock}


def apply(cfg: TrainConfig, parts: ModelParts) -> None:
    """Wrap each of the model's blocks in place as cfg.activation_checkpointing says (the ModuleList is the model's)."""
    if cfg.activation_checkpointing == "none":
        return
    if parts.blocks is None:
        raise ConfigError(
            "activation checkpointing needs the model's blocks: pass ModelParts(blocks=...) or turn it off"
        )
    for i, block in enumerate(parts.blocks):
        if not isinstance(block, CheckpointedBlock):  # a model built twice is wrapped once
            parts.blocks[i] = CHECKPOINTED_BLOCKS[cfg.activation_checkpointing](block)


def selective_activation_terms(
    s: int, b: int, h: int, a: int, value_bytes: int, attention: str, residual_bytes: int
) -> dict[str, int]:
    """Bytes one block keeps with selective checkpointing: its input (residual_bytes: fp32 under autocast) and the
    outputs of its matmuls and attention ("naive" or "sdpa"); the element-wise work is recomputed."""
    B, sbh = value_bytes, s * b * h
    kept_by_attention = {
        "naive": {"QK^T matmul output (a s^2 b)": a * s * s * b * B, "softmax x V matmul output (sbh)": sbh * B},
        "sdpa": {"attention output (sbh)": sbh * B, "softmax logsumexp (b a s, fp32)": b * a * s * 4},
    }
    return {
        "block input (sbh)": sbh * residual_bytes,
        "QKV matmul output (3 x sbh)": 3 * sbh * B,
        **kept_by_attention[attention],
        "attention projection output (sbh)": sbh * B,
        "MLP first matmul output (4 x sbh)": 4 * sbh * B,
        "MLP second matmul output (sbh)": sbh * B,
    }


def kept_per_layer(
    mode: str, saved: int, s: int, b: int, h: int, a: int, value_bytes: int, attention: str, residual_bytes: int
) -> int:
    """The bytes one block keeps through the forward, for a block that saves `saved` bytes uncheckpointed: all of them
    ("none"), its input ("full"), or its input and matmul outputs ("selective")."""
    if mode == "full":
        return s * b * h * residual_bytes
    if mode == "selective":
        return sum(selective_activation_terms(s, b, h, a, value_bytes, attention, residual_bytes).values())
    return saved


TECHNIQUE = Technique(
    "activation_checkpointing",
    "activation checkpointing",
    "none",
    help="keep less of the forward pass (a block's input; selective: its matmul outputs too), recompute the rest",
    rungs=(("+ checkpointing", "full", "activation checkpointing per block: recompute in backward, less memory"),),
    aims=(MEMORY,),
)
