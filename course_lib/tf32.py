"""TF32, the switch for fp32 matmuls on NVIDIA tensor cores (Ampere and newer), as a context: at the bottom of the
package, so that both the loop (through course_lib.techniques) and capabilities' matmul timing use it."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def matmul_precision(precision: str):
    """While inside: TF32 for CUDA's fp32 matmuls and cuDNN convolutions when `precision` is "tf32", exact fp32
    otherwise; restored on exit. Through torch's `fp32_precision` API (mixing it with the legacy `allow_tf32` raises);
    oneDNN's CPU matmuls are left at full fp32 (TF32 is a GPU lesson)."""
    matmul, conv, field = torch.backends.cuda.matmul, getattr(torch.backends.cudnn, "conv", None), "fp32_precision"
    value = "tf32" if precision == "tf32" else "ieee"
    if not hasattr(matmul, field) or conv is None:  # torch before 2.9: the legacy flags
        conv, field, value = torch.backends.cudnn, "allow_tf32", precision == "tf32"
    before = (getattr(matmul, field), getattr(conv, field))
    setattr(matmul, field, value)
    setattr(conv, field, value)
    try:
        yield
    finally:
        setattr(matmul, field, before[0])
        setattr(conv, field, before[1])
