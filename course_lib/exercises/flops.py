"""Notebook 01: the training FLOPs of one token, from the model's shape (6N for the weights, 12 L h s for attention)."""

from __future__ import annotations

from ..measure import flops_per_token
from .core import Case, Exercise, Mistake


def training_flops_per_token(n_params: int, n_layer: int, n_embd: int, context: int) -> int:
    """The reference: forward and backward FLOPs per token. n_params: the parameters the matmuls use (no position
    table). Each weight meets each token in one multiply-add forward (2 FLOPs) and two backward (4: the input's and the
    weight's gradients); attention's Q K^T and P V are 2 s h FLOPs each per token and layer forward, 3x with
    backward."""
    return flops_per_token(n_params, n_layer, n_embd, context)


def _cases() -> list[Case]:
    return [
        Case("a small model (2 blocks, width 64, context 64)", (1_000_000, 2, 64, 64)),
        Case("a long context: attention's term grows with s", (3_000_000, 4, 256, 4096)),
        Case("GPT-2 small (124.4M parameters less its position table)", (124_439_808 - 1024 * 768, 12, 768, 1024)),
    ]


def _forward_only(n_params, n_layer, n_embd, context):
    return 2 * n_params + 4 * n_layer * n_embd * context


def _no_attention(n_params, n_layer, n_embd, context):
    return 6 * n_params


def _attention_once(n_params, n_layer, n_embd, context):
    return 6 * n_params + 6 * n_layer * n_embd * context


def _ratio(case, expected, got) -> str:
    return f"your count is {got / expected:.3g}x the reference's ({got:,} against {expected:,} FLOPs per token)"


EXERCISE = Exercise(
    name="flops_per_token",
    notebook="01",
    title="Training FLOPs per token",
    reference=training_flops_per_token,
    cases=_cases,
    mistakes=(
        Mistake(
            "the forward pass only",
            _forward_only,
            "That is the forward pass alone. Backward makes two matmuls for each forward one (the gradient of the "
            "input and of the weight), so training costs 3x the forward: 6N, not 2N.",
        ),
        Mistake(
            "attention left out",
            _no_attention,
            "6N counts the weight matmuls only. Attention's Q K^T and P V have no weights: 2 s h FLOPs each per "
            "token and layer forward, 12 L h s with backward.",
        ),
        Mistake(
            "attention counted once",
            _attention_once,
            "Attention has two products per layer (Q K^T and P V), each 2 s h per token forward and 3x that with "
            "backward: 12 L h s, not 6 L h s.",
        ),
    ),
    rtol=0.0,
    atol=0.5,
    describe=_ratio,
)
