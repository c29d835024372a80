"""Notebook 02's memory calculator: the paper's activation count (Korthikanti et al. 2022) to set beside the course's
own (memory_formula.layer_activation_terms), and the calculator's config."""

from __future__ import annotations

import dataclasses

from ..config import TrainConfig, preset as make_preset


def korthikanti_terms(s: int, b: int, h: int, a: int) -> dict[str, int]:
    """Bytes per transformer layer, term by term, as the paper counts them: 16-bit values, 1-byte dropout masks, no
    sequence or tensor parallelism. They sum to sbh(34 + 5as/h)."""
    sbh, as2b = s * b * h, a * s * s * b
    return {
        "LayerNorm inputs (2 x 2sbh)": 4 * sbh,
        "QKV matmul input (2sbh)": 2 * sbh,
        "Q and K for QK^T (4sbh)": 4 * sbh,
        "softmax output (2as^2b)": 2 * as2b,
        "attention dropout mask (as^2b)": as2b,
        "attention dropout output (2as^2b)": 2 * as2b,
        "V (2sbh)": 2 * sbh,
        "output projection input (2sbh)": 2 * sbh,
        "attention residual dropout mask (sbh)": sbh,
        "MLP first matmul input (2sbh)": 2 * sbh,
        "GELU input (8sbh)": 8 * sbh,
        "MLP second matmul input (8sbh)": 8 * sbh,
        "MLP dropout mask (sbh)": sbh,
    }


def korthikanti_bytes(s: int, b: int, h: int, a: int, bits: int = 16, flash: bool = False) -> int:
    """sbh(34 + 5as/h) bytes per layer at 16 bits, twice that at 32; flash=True drops 5as/h (no s x s matrices)."""
    if bits not in (16, 32):
        raise ValueError("bits must be 16 or 32")
    return (34 * s * b * h + (0 if flash else 5 * a * s * s * b)) * (bits // 16)


def calculator_config(
    preset: str = "gpt2-small", batch_size: int = 32, context: int = 1024, attention: str = "naive", **changes
) -> TrainConfig:
    """A preset's network at any batch, context (its position table grown where needed) and attention, any other
    TrainConfig field changed; on the CPU, as the formula needs no GPU."""
    cfg = make_preset(preset, "cpu")
    cfg = cfg.with_model(attention=attention, block_size=max(cfg.model.block_size, context))
    return dataclasses.replace(cfg, batch_size=batch_size, context=context, **changes)
