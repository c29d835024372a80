"""Notebook 02: the bytes of training, from the shapes: the static memory (parameters, gradients, optimizer state) and
what one transformer block keeps for backward."""

from __future__ import annotations

from .. import memory_formula as M
from .core import Case, Exercise, Mistake


def static_memory(n_params: int, n_tensors: int, optimizer: str = "adamw") -> tuple[int, int, int]:
    """The reference, fp32: bytes of (parameters, gradients, optimizer state). The state is one buffer per parameter
    for SGD with momentum, two for AdamW (m and v), none for SGD; AdamW also keeps a 4-byte step counter per tensor."""
    b = M.static_bytes(n_params, optimizer, 4, n_tensors)
    return b["parameters"], b["gradients"], b["optimizer state"]


def _static_cases() -> list[Case]:
    return [
        Case("SGD: no state", (1_000, 4, "sgd")),
        Case("SGD with momentum: one buffer", (1_000, 4, "sgd_momentum")),
        Case("AdamW on a small model", (1_000, 4, "adamw")),
        Case("AdamW on GPT-2 small (124,439,808 parameters in 148 tensors)", (124_439_808, 148, "adamw")),
    ]


def _one_state(n_params, n_tensors, optimizer="adamw"):
    p, g, s = static_memory(n_params, n_tensors, optimizer)
    return (p, g, 4 * n_params) if optimizer == "adamw" else (p, g, s)


def _no_counters(n_params, n_tensors, optimizer="adamw"):
    return static_memory(n_params, 0, optimizer)


def _counter_per_parameter(n_params, n_tensors, optimizer="adamw"):
    return static_memory(n_params, n_params, optimizer)


def _static_describe(case, expected, got) -> str:
    names = ("parameters", "gradients", "optimizer state")
    wrong = [f"{n}: yours {g:,} B, the reference's {e:,} B" for n, e, g in zip(names, expected, got) if e != g]
    return "; ".join(wrong) + f" (in all {sum(got) / sum(expected):.3g}x)"


STATIC = Exercise(
    name="static_memory",
    notebook="02",
    title="Static memory: parameters, gradients, optimizer state",
    reference=static_memory,
    cases=_static_cases,
    mistakes=(
        Mistake(
            "one state for AdamW",
            _one_state,
            "AdamW keeps two moments per parameter, m and v: 8 bytes in fp32, so 16 bytes per parameter in all (the "
            "quoted 1.4 GB for GPT-2 small counts three copies, which is SGD with momentum).",
        ),
        Mistake(
            "step counters left out",
            _no_counters,
            "torch's AdamW also keeps a `step` per parameter tensor: a 4-byte fp32 scalar tensor, 4 x n_tensors bytes.",
        ),
        Mistake(
            "a step counter per parameter",
            _counter_per_parameter,
            "The step counter is one per parameter *tensor* (all its values take the same step), not one per value.",
        ),
    ),
    rtol=0.0,
    atol=0.5,
    describe=_static_describe,
)


def block_activation_bytes(s: int, b: int, h: int, a: int, value_bytes: int = 4, attention: str = "naive") -> int:
    """The reference: bytes one block of the course's GPT keeps for backward (no dropout), context s, batch b, width
    h, a heads, values of `value_bytes` bytes: sixteen s b h values (two LayerNorm inputs, the QKV input, Q, K, V, the
    attention output, the MLP input, GELU's 4h-wide input and the second matmul's 4h-wide input), LayerNorm's mean and
    1/std per token (fp32, two LayerNorms); naive attention also keeps its softmax output (a s^2 b values) and the
    s x s causal mask (1 byte each); SDPA instead keeps one fp32 log-sum-exp per query and head (b a s)."""
    return sum(M.layer_activation_terms(s, b, h, a, value_bytes, attention).values())


def _block_cases() -> list[Case]:
    return [
        Case("naive attention, fp32, 2 heads", (128, 4, 64, 2, 4, "naive")),
        Case("naive attention, 16-bit values, 8 heads", (256, 2, 128, 8, 2, "naive")),
        Case("SDPA: no s x s matrix", (512, 2, 256, 4, 4, "sdpa")),
        Case("the reference model's block (s 512, b 32, h 256, a 4)", (512, 32, 256, 4, 4, "naive")),
    ]


def _without_heads(s, b, h, a, value_bytes=4, attention="naive"):
    return (
        block_activation_bytes(s, b, h, 1, value_bytes, attention)
        if attention == "naive"
        else (block_activation_bytes(s, b, h, a, value_bytes, attention))
    )


def _mlp_h_wide(s, b, h, a, value_bytes=4, attention="naive"):
    return block_activation_bytes(s, b, h, a, value_bytes, attention) - 6 * s * b * h * value_bytes


def _no_norm_stats(s, b, h, a, value_bytes=4, attention="naive"):
    return block_activation_bytes(s, b, h, a, value_bytes, attention) - 2 * 2 * b * s * 4


def _block_describe(case, expected, got) -> str:
    return f"your count is {got / expected:.4g}x the reference's ({(got - expected) / 2**20:+,.3f} MiB)"


BLOCK = Exercise(
    name="block_activation_bytes",
    notebook="02",
    title="The activation bytes of one block",
    reference=block_activation_bytes,
    cases=_block_cases,
    mistakes=(
        Mistake(
            "the softmax output without the heads",
            _without_heads,
            "Each head has its own s x s softmax output: a s^2 b values per block, not s^2 b (the causal mask is "
            "shared by the heads: s^2 bytes once).",
        ),
        Mistake(
            "the MLP's values counted h wide",
            _mlp_h_wide,
            "The MLP's hidden layer is 4h wide: GELU's input and the second matmul's input are 4 s b h values each.",
        ),
        Mistake(
            "LayerNorm's statistics left out",
            _no_norm_stats,
            "Each LayerNorm also keeps its mean and 1/std per token for backward: 2 fp32 values x b s tokens x 2 "
            "LayerNorms = 16 b s bytes.",
        ),
    ),
    rtol=0.0,
    atol=0.5,
    describe=_block_describe,
)
