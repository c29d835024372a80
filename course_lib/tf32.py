"""TF32: the switch for fp32 matmuls on NVIDIA tensor cores (Ampere and newer), as a context.

At the bottom of the package: the training loop applies it (course_lib.techniques re-exports it), and the device's
capabilities time a matmul under it.
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def matmul_precision(precision: str):
    """While inside: TF32 for fp32 matmuls and cuDNN convolutions on CUDA when `precision` is "tf32", exact
    fp32 otherwise; the previous settings come back on exit. Set through torch's `fp32_precision` API (mixing it
    with the legacy `allow_tf32` flags raises). Only CUDA's backends are touched: TF32 is a GPU lesson, and
    oneDNN's CPU matmuls keep full fp32."""
    mode = "tf32" if precision == "tf32" else "ieee"
    matmul, conv = torch.backends.cuda.matmul, getattr(torch.backends.cudnn, "conv", None)
    if not hasattr(matmul, "fp32_precision") or conv is None:  # torch before 2.9: the legacy flags
        before = (matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = mode == "tf32"
        try:
            yield
        finally:
            matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
        return
    before = (matmul.fp32_precision, conv.fp32_precision)
    matmul.fp32_precision = conv.fp32_precision = mode
    try:
        yield
    finally:
        matmul.fp32_precision, conv.fp32_precision = before
