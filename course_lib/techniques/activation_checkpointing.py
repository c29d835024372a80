"""Activation checkpointing: keep less of the forward pass for backward, and recompute the rest there.

- `none`: every block keeps what its backward needs (the naive loop).
- `full` (`CheckpointedBlock`): a block keeps only its input; backward runs its forward again first.
- `selective` (`SelectiveCheckpointedBlock`): a block also keeps its matmul and attention outputs, which are
  expensive to recompute, and recomputes only the element-wise work between them. That is not the selection
  Korthikanti et al. (2022) propose: they keep the rest and recompute the attention core (QK^T, softmax, its dropout,
  the product with V: the s x s part); notebook 02 measures both.

Applied first of all the techniques (course_lib.techniques.assemble): it wraps the eager blocks, before data
parallelism or compile wrap the model. Its memory term: what one block keeps through the forward (`kept_per_layer`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..config import ConfigError, TrainConfig
from .declaration import MEMORY, Technique
from .model_parts import ModelParts

# What selective checkpointing keeps: the outputs of the matmuls and of attention (torch's selective-checkpoint policy
# as torchtitan uses it; SelectiveCheckpointedBlock says how it differs from Korthikanti et al.'s selection).
_SAVED_BY_SELECTIVE = tuple(
    getattr(torch.ops.aten, name).default
    for name in (
        "mm",
        "addmm",
        "bmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(torch.ops.aten, name)
)


def _selective_policy(_ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_BY_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


class CheckpointedBlock(nn.Module):
    """Full activation checkpointing: forward keeps only the block's input, and backward runs the block's forward
    again to get what it needs (non-reentrant): one block's activations at a time, for about one more forward."""

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
    """Selective activation checkpointing as the course does it: forward also keeps what is expensive to recompute,
    the outputs of the matmuls and of attention, and backward recomputes only the cheap element-wise work in between
    (LayerNorm, GELU, softmax, dropout, residual adds). Korthikanti et al. (2022) propose another selection: keep the
    rest and recompute the attention core (QK^T, softmax, its dropout, the product with V), whose s x s tensors are
    large but cheap to recompute; this policy keeps naive attention's s x s scores (a matmul output) and recomputes
    only their softmax. Notebook 02 measures what each mode keeps."""

    def checkpoint_options(self) -> dict:
        return {"context_fn": functools.partial(create_selective_checkpoint_contexts, _selective_policy)}


CHECKPOINTED_BLOCKS = {"full": CheckpointedBlock, "selective": SelectiveCheckpointedBlock}


def apply_activation_checkpointing(blocks: nn.ModuleList, mode: str) -> None:
    """Wrap every block in place (the ModuleList is the model's own, so the model sees the wrapped blocks)."""
    for i, block in enumerate(blocks):
        if not isinstance(block, CheckpointedBlock):
            blocks[i] = CHECKPOINTED_BLOCKS[mode](block)


def apply(cfg: TrainConfig, parts: ModelParts) -> None:
    """Wrap the model's blocks as cfg.activation_checkpointing says (nothing for "none")."""
    if cfg.activation_checkpointing == "none":
        return
    if parts.blocks is None:
        raise ConfigError(
            "activation checkpointing needs the model's blocks: pass ModelParts(blocks=...) or turn it off"
        )
    apply_activation_checkpointing(parts.blocks, cfg.activation_checkpointing)


# ---- its memory term -----------------------------------------------------------------------------------------------


def selective_activation_terms(
    s: int, b: int, h: int, a: int, value_bytes: int = 4, attention: str = "naive", residual_bytes: int | None = None
) -> dict[str, int]:
    """Bytes one block keeps with selective activation checkpointing (_SAVED_BY_SELECTIVE): its input and
    the outputs of its matmuls and of attention, which are what is expensive to recompute. The element-wise work
    (LayerNorm, GELU, softmax, the causal mask, dropout, autocast's weight casts) is recomputed in backward, so none of
    its inputs or outputs are kept. residual_bytes: bytes of the block input (the fp32 residual stream under
    autocast)."""
    B, sbh = value_bytes, s * b * h
    terms = {
        "block input (sbh)": sbh * (B if residual_bytes is None else residual_bytes),
        "QKV matmul output (3 x sbh)": 3 * sbh * B,
    }
    if attention == "naive":
        terms["QK^T matmul output (a s^2 b)"] = a * s * s * b * B
        terms["softmax x V matmul output (sbh)"] = sbh * B
    elif attention == "sdpa":
        terms["attention output (sbh)"] = sbh * B
        terms["softmax logsumexp (b a s, fp32)"] = b * a * s * 4
    else:
        raise ValueError(f"attention={attention!r} is not 'naive' or 'sdpa'")
    terms["attention projection output (sbh)"] = sbh * B
    terms["MLP first matmul output (4 x sbh)"] = 4 * sbh * B
    terms["MLP second matmul output (sbh)"] = sbh * B
    return terms


def kept_per_layer(
    mode: str, saved: int, s: int, b: int, h: int, a: int, value_bytes: int, attention: str, residual_bytes: int
) -> tuple[int, int]:
    """(bytes one block keeps through the forward pass, bytes its backward recomputes) in checkpointing `mode`, for a
    block that saves `saved` bytes for backward without checkpointing: all of them ("none"), its input ("full", the
    residual stream: fp32 under autocast too), or its input and its matmul outputs ("selective")."""
    if mode == "full":
        kept = s * b * h * residual_bytes
    elif mode == "selective":
        kept = sum(selective_activation_terms(s, b, h, a, value_bytes, attention, residual_bytes).values())
    else:
        kept = saved
    return kept, 0 if mode == "none" else saved


TECHNIQUE = Technique(
    "activation_checkpointing",
    "activation checkpointing",
    "none",
    help="keep less of the forward pass (a block's input; with selective, its matmul outputs too), recompute the rest "
    "in backward",
    rungs=(("+ checkpointing", "full", "activation checkpointing per block: recompute in backward, less memory"),),
    aims=(MEMORY,),
)
