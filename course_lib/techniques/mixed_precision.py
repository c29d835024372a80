"""Mixed precision: the matmuls in 16 bits under autocast (bf16; fp16 with loss scaling), weights, gradients and
optimizer state in fp32; or TF32, fp32 matmuls on CUDA tensor cores with a 10-bit mantissa. Its memory term: the
bytes of an activation (`activation_format`)."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from ..config import PRECISION_DTYPES, TrainConfig
from ..tf32 import matmul_precision  # noqa: F401 - TF32's switch (in tf32.py, below capabilities, which use it too)
from .declaration import FAST_16BIT, Technique

AUTOCAST_DTYPES = {p: PRECISION_DTYPES[p] for p in ("bf16", "fp16")}  # the precisions autocast runs in
AUTOCAST_RUNG = "+ 16-bit autocast"  # the ladder's 16-bit rung (its format: the one this device runs fast)


def autocast_context(precision: str, device: str) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of the context to run forward and loss in: autocast for bf16/fp16, else nothing."""
    if precision in AUTOCAST_DTYPES:
        kind, dtype = torch.device(device).type, AUTOCAST_DTYPES[precision]
        return lambda: torch.autocast(device_type=kind, dtype=dtype)
    return contextlib.nullcontext


def make_grad_scaler(cfg: TrainConfig) -> torch.amp.GradScaler:
    """Loss scaling only for fp16 (its narrow exponent flushes small gradients to zero); bf16 needs none."""
    kind, on = torch.device(cfg.device).type, cfg.precision == "fp16"
    return torch.amp.GradScaler(
        kind, init_scale=cfg.loss_scale_init, growth_interval=cfg.loss_scale_growth_interval, enabled=on
    )


# ---- its memory term -----------------------------------------------------------------------------------------------


def activation_format(cfg: TrainConfig) -> tuple[bool, int]:
    """(autocast?, bytes of an activation): autocast makes the matmuls' outputs 16-bit; fp32 and tf32 keep 4 bytes."""
    return cfg.precision in AUTOCAST_DTYPES, PRECISION_DTYPES[cfg.precision].itemsize


TECHNIQUE = Technique(
    "precision",
    "precision",
    "fp32",
    help="the format the matmuls run in: fp32, TF32 (CUDA tensor cores), or bf16/fp16 under autocast with fp32 weights",
    rungs=(
        ("+ tf32", "tf32", "TF32 tensor-core matmuls for fp32 (CUDA Ampere+; does nothing on a CPU)"),
        (
            AUTOCAST_RUNG,
            FAST_16BIT,
            "matmuls in 16 bits under autocast (bf16; fp16 with loss scaling where only fp16 is fast), fp32 weights",
        ),
    ),
)
