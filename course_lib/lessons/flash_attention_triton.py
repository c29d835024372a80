"""Flash attention as Triton kernels, forward and backward: the algorithm of `attention_by_hand.flash_attention`
(FlashAttention-2), written as GPU programs. The only module of the course that imports triton (the optional extra:
`pip install -e ".[kernels]"`); nothing else imports this one.

- Forward (`_forward_kernel`): one program per (query block, batch*head). It walks the key blocks with the online
  softmax (running max `m`, running sum `ell`, unnormalised output `acc`, all fp32) and writes the output O and the
  log-sum-exp `lse` of every query row, nothing else.
- Backward, FlashAttention-2's split into three kernels, no atomic adds:
  `_backward_preprocess` computes D = rowsum(dO * O) per query row;
  `_backward_dk_dv` has one program per (key block, batch*head): it walks the query blocks that see its keys,
  recomputes P = exp(Q K^T * scale - lse) and accumulates dK and dV, which each finish in one program;
  `_backward_dq` has one program per (query block, batch*head): it walks the key blocks and accumulates dQ. Each of dK,
  dV and dQ is written by exactly one program, so the result is deterministic and needs no atomics. The price: the dQ
  kernel recomputes S = Q K^T and dP = dO V^T that the dK/dV kernel already computed, so this backward does 7 products
  of (s x s x d) where the PyTorch version (one loop, dQ accumulated in place) does 5 (`PRODUCTS`): 9 with the forward's
  2, against the PyTorch version's 7 and naive attention's 6 (notebook 04). The atomic-add variant would save those two
  but adds to dQ from many programs at once.

On a CPU, Triton's interpreter runs these kernels (numpy underneath, slow, small sizes only): set TRITON_INTERPRET=1
before this module is imported and keep it set while they run (triton 3.x reads it when `@triton.jit` decorates a
kernel, and again inside its interpreter); `interpreted()` says which way the kernels were made. On an NVIDIA GPU they
compile. `benchmark` times them against SDPA's flash kernel
(`python -m course_lib.lessons.flash_attention_triton --json runs/flash-triton.json`, in `.ci/gpu`'s `flash` stage).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from torch.torch_version import TorchVersion

__all__ = [
    "flash_attention_triton",
    "TritonFlashAttention",
    "interpreted",
    "forward",
    "backward",
    "benchmark",
    "plot_benchmark",
    "PRODUCTS",
]

# The (s x s x d) matrix products of this implementation, tile by tile (a causal mask halves each alike).
PRODUCTS = {
    "forward": 2,  # S = Q K^T, O = P V
    "backward, dK/dV kernel": 4,  # S again, dP = dO V^T, dV = P^T dO, dK = dS^T Q
    "backward, dQ kernel": 3,  # S and dP a third and second time, dQ = dS K
}


@triton.jit
def _forward_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr,  # q, k, v, out: (batch*heads, s, HEAD_DIM), contiguous; lse: fp32
    seq_q, seq_k, scale,
    HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    q_block, bh = tl.program_id(0), tl.program_id(1)
    rows = q_block * BLOCK_Q + tl.arange(0, BLOCK_Q)  # this program's query rows
    dims = tl.arange(0, HEAD_DIM)
    row_ok = rows < seq_q  # the last block may run past s: those rows are loaded as 0 and never stored
    q_offs = bh * seq_q * HEAD_DIM + rows[:, None] * HEAD_DIM + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None], other=0.0)
    k_base, v_base = k_ptr + bh * seq_k * HEAD_DIM, v_ptr + bh * seq_k * HEAD_DIM

    m = tl.full([BLOCK_Q], float("-inf"), tl.float32)  # running max per query row
    ell = tl.zeros([BLOCK_Q], tl.float32)  # running sum of exp(score - m)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM], tl.float32)  # running sum of exp(score - m) * v
    k_end = tl.minimum((q_block + 1) * BLOCK_Q, seq_k) if CAUSAL else seq_k  # later keys are masked for every row
    for j0 in range(0, k_end, BLOCK_K):
        cols = j0 + tl.arange(0, BLOCK_K)
        col_ok = cols < seq_k
        k = tl.load(k_base + cols[:, None] * HEAD_DIM + dims[None, :], mask=col_ok[:, None], other=0.0)
        v = tl.load(v_base + cols[:, None] * HEAD_DIM + dims[None, :], mask=col_ok[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT) * scale  # one (BLOCK_Q x BLOCK_K) tile, fp32
        keep = col_ok[None, :]
        if CAUSAL:
            keep = keep & (cols[None, :] <= rows[:, None])
        scores = tl.where(keep, scores, float("-inf"))
        # Every row sees key 0 in the first tile, so m is finite from then on: exp(-inf - m) is 0, never nan.
        m_new = tl.maximum(m, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        correction = tl.exp(m - m_new)  # rescales what was summed under the old maximum
        ell = ell * correction + tl.sum(p, 1)
        acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT)
        m = m_new

    out = acc / ell[:, None]
    tl.store(out_ptr + q_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(lse_ptr + bh * seq_q + rows, m + tl.log(ell), mask=row_ok)  # all backward needs besides q, k, v, out


@triton.jit
def _backward_preprocess(
    out_ptr, d_out_ptr, D_ptr, seq_q, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr
):  # fmt: skip
    q_block, bh = tl.program_id(0), tl.program_id(1)
    rows = q_block * BLOCK_Q + tl.arange(0, BLOCK_Q)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = rows < seq_q
    offs = bh * seq_q * HEAD_DIM + rows[:, None] * HEAD_DIM + dims[None, :]
    o = tl.load(out_ptr + offs, mask=row_ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(d_out_ptr + offs, mask=row_ok[:, None], other=0.0).to(tl.float32)
    # D = rowsum(dO * O) = rowsum(P * dP): softmax's backward needs it per row; from O it costs O(s d), not a pass over
    # every tile of P.
    tl.store(D_ptr + bh * seq_q + rows, tl.sum(do * o, 1), mask=row_ok)


@triton.jit
def _backward_dk_dv(
    q_ptr, k_ptr, v_ptr, d_out_ptr, lse_ptr, D_ptr, dk_ptr, dv_ptr,
    seq_q, seq_k, scale,
    HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    k_block, bh = tl.program_id(0), tl.program_id(1)
    cols = k_block * BLOCK_K + tl.arange(0, BLOCK_K)  # this program's keys: dK and dV of these rows finish here
    dims = tl.arange(0, HEAD_DIM)
    col_ok = cols < seq_k
    kv_offs = bh * seq_k * HEAD_DIM + cols[:, None] * HEAD_DIM + dims[None, :]
    k = tl.load(k_ptr + kv_offs, mask=col_ok[:, None], other=0.0)
    v = tl.load(v_ptr + kv_offs, mask=col_ok[:, None], other=0.0)
    q_base, do_base = q_ptr + bh * seq_q * HEAD_DIM, d_out_ptr + bh * seq_q * HEAD_DIM

    dk = tl.zeros([BLOCK_K, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_K, HEAD_DIM], tl.float32)
    first = k_block * BLOCK_K if CAUSAL else 0  # under a causal mask, queries before the first key see none of them
    for i0 in range(first, seq_q, BLOCK_Q):
        rows = i0 + tl.arange(0, BLOCK_Q)
        row_ok = rows < seq_q
        q = tl.load(q_base + rows[:, None] * HEAD_DIM + dims[None, :], mask=row_ok[:, None], other=0.0)
        do = tl.load(do_base + rows[:, None] * HEAD_DIM + dims[None, :], mask=row_ok[:, None], other=0.0)
        lse = tl.load(lse_ptr + bh * seq_q + rows, mask=row_ok, other=0.0)
        D = tl.load(D_ptr + bh * seq_q + rows, mask=row_ok, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT) * scale  # the tile again
        keep = row_ok[:, None] & col_ok[None, :]
        if CAUSAL:
            keep = keep & (cols[None, :] <= rows[:, None])
        p = tl.where(keep, tl.exp(scores - lse[:, None]), 0.0)  # the probabilities, recomputed from lse
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=DOT)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT)
        ds = p * (dp - D[:, None])  # softmax's backward, row by row
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=DOT)

    tl.store(dk_ptr + kv_offs, (dk * scale).to(dk_ptr.dtype.element_ty), mask=col_ok[:, None])
    tl.store(dv_ptr + kv_offs, dv.to(dv_ptr.dtype.element_ty), mask=col_ok[:, None])


@triton.jit
def _backward_dq(
    q_ptr, k_ptr, v_ptr, d_out_ptr, lse_ptr, D_ptr, dq_ptr,
    seq_q, seq_k, scale,
    HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    q_block, bh = tl.program_id(0), tl.program_id(1)
    rows = q_block * BLOCK_Q + tl.arange(0, BLOCK_Q)  # this program's queries: dQ of these rows finishes here
    dims = tl.arange(0, HEAD_DIM)
    row_ok = rows < seq_q
    q_offs = bh * seq_q * HEAD_DIM + rows[:, None] * HEAD_DIM + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None], other=0.0)
    do = tl.load(d_out_ptr + q_offs, mask=row_ok[:, None], other=0.0)
    lse = tl.load(lse_ptr + bh * seq_q + rows, mask=row_ok, other=0.0)
    D = tl.load(D_ptr + bh * seq_q + rows, mask=row_ok, other=0.0)
    k_base, v_base = k_ptr + bh * seq_k * HEAD_DIM, v_ptr + bh * seq_k * HEAD_DIM

    dq = tl.zeros([BLOCK_Q, HEAD_DIM], tl.float32)
    k_end = tl.minimum((q_block + 1) * BLOCK_Q, seq_k) if CAUSAL else seq_k
    for j0 in range(0, k_end, BLOCK_K):
        cols = j0 + tl.arange(0, BLOCK_K)
        col_ok = cols < seq_k
        k = tl.load(k_base + cols[:, None] * HEAD_DIM + dims[None, :], mask=col_ok[:, None], other=0.0)
        v = tl.load(v_base + cols[:, None] * HEAD_DIM + dims[None, :], mask=col_ok[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT) * scale  # recomputed once more: the split's price
        keep = row_ok[:, None] & col_ok[None, :]
        if CAUSAL:
            keep = keep & (cols[None, :] <= rows[:, None])
        p = tl.where(keep, tl.exp(scores - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT)
        ds = p * (dp - D[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT)

    tl.store(dq_ptr + q_offs, (dq * scale).to(dq_ptr.dtype.element_ty), mask=row_ok[:, None])


def interpreted() -> bool:
    """Whether the kernels were made for Triton's interpreter (TRITON_INTERPRET=1 when this module was imported)."""
    return type(_forward_kernel).__name__ == "InterpretedFunction"


def interpreter_too_old() -> str | None:
    """Why this Triton's interpreter cannot run the kernels here, or None: before 3.7.1 (pyproject's `kernels` pin) it
    converts a loop bound to int the way numpy 2.4 refuses."""
    numpy_version = importlib.metadata.version("numpy")
    if TorchVersion(triton.__version__) < (3, 7, 1) and TorchVersion(numpy_version) >= (2, 4):
        return (
            f"Triton {triton.__version__}'s interpreter cannot run beside numpy {numpy_version}: "
            "pip install 'triton>=3.7.1' (or 'numpy<2.4')"
        )
    return None


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, block_q: int, block_k: int) -> None:
    if q.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.size(-1) != k.size(-1):
        raise ValueError(f"q, k, v must be (batch, heads, s, head_dim) alike; got {q.shape}, {k.shape}, {v.shape}")
    if not q.dtype == k.dtype == v.dtype or q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"q, k, v must share one of fp32, fp16, bf16; got {q.dtype}, {k.dtype}, {v.dtype}")
    if causal and q.size(-2) != k.size(-2):
        raise ValueError("causal flash_attention_triton needs as many queries as keys")
    for name, n in (("head_dim", q.size(-1)), ("block_q", block_q), ("block_k", block_k)):
        if n < 16 or n & (n - 1):  # tl.arange needs a power of two; tl.dot a side of at least 16
            raise ValueError(f"{name} must be a power of two of at least 16, got {n}")
    if q.device.type != "cuda":
        if not interpreted():
            raise RuntimeError(
                "the Triton kernels need an NVIDIA GPU, or Triton's interpreter on a CPU: set TRITON_INTERPRET=1 "
                "before importing course_lib.lessons.flash_attention_triton"
            )
        if too_old := interpreter_too_old():
            raise RuntimeError(too_old)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 operands: full fp32 products ("ieee"), as SDPA's fp32 answer has; tl.dot's default would round them to TF32
    # (10-bit mantissa) on a GPU. 16-bit operands multiply exactly whatever this says.
    return "ieee" if dtype == torch.float32 else "tf32"


def _warps(head_dim: int) -> int:
    return 4 if head_dim <= 64 else 8  # the fp32 accumulators of a 128-wide tile need more registers: more threads


def forward(q, k, v, causal: bool = True, block_q: int = 64, block_k: int = 64):
    """O and the log-sum-exp per query row (fp32), from q, k, v: (batch, heads, s, head_dim)."""
    _check(q, k, v, causal, block_q, block_k)
    b, h, s_q, d = q.shape
    s_k = k.size(-2)
    q, k, v = (t.contiguous() for t in (q, k, v))
    out = torch.empty_like(q)
    lse = torch.empty(b, h, s_q, device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(s_q, block_q), b * h)
    _forward_kernel[grid](
        q, k, v, out, lse, s_q, s_k, 1.0 / math.sqrt(d),
        HEAD_DIM=d, BLOCK_Q=block_q, BLOCK_K=block_k, CAUSAL=causal, DOT=_dot_precision(q.dtype), num_warps=_warps(d),
    )  # fmt: skip
    return out, lse


def backward(q, k, v, out, lse, d_out, causal: bool = True, block_q: int = 64, block_k: int = 64):
    """dQ, dK, dV from what the forward kept and the output's gradient: three kernels (module docstring)."""
    _check(q, k, v, causal, block_q, block_k)
    b, h, s_q, d = q.shape
    s_k = k.size(-2)
    q, k, v, out, d_out = (t.contiguous() for t in (q, k, v, out, d_out))
    D = torch.empty_like(lse)  # rowsum(dO * O), one number per query row
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    scale, dot, warps = 1.0 / math.sqrt(d), _dot_precision(q.dtype), _warps(d)
    _backward_preprocess[(triton.cdiv(s_q, block_q), b * h)](out, d_out, D, s_q, HEAD_DIM=d, BLOCK_Q=block_q)
    _backward_dk_dv[(triton.cdiv(s_k, block_k), b * h)](
        q, k, v, d_out, lse, D, dk, dv, s_q, s_k, scale,
        HEAD_DIM=d, BLOCK_Q=block_q, BLOCK_K=block_k, CAUSAL=causal, DOT=dot, num_warps=warps,
    )  # fmt: skip
    _backward_dq[(triton.cdiv(s_q, block_q), b * h)](
        q, k, v, d_out, lse, D, dq, s_q, s_k, scale,
        HEAD_DIM=d, BLOCK_Q=block_q, BLOCK_K=block_k, CAUSAL=causal, DOT=dot, num_warps=warps,
    )  # fmt: skip
    return dq, dk, dv


class TritonFlashAttention(torch.autograd.Function):
    """softmax(Q K^T / sqrt(d)) V by the Triton kernels, keeping only O and the log-sum-exp for backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool = True, block_q: int = 64, block_k: int = 64):
        out, lse = forward(q, k, v, causal, block_q, block_k)
        ctx.save_for_backward(q, k, v, out, lse)  # O(s d): no (s x s) tensor is kept
        ctx.options = (causal, block_q, block_k)
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        return (*backward(q, k, v, out, lse, d_out, *ctx.options), None, None, None)


def flash_attention_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, block_q: int = 64, block_k: int = 64
) -> torch.Tensor:
    """Attention by the Triton kernels, forward and backward; q, k, v: (batch, heads, s, head_dim), head_dim and the
    blocks powers of two of at least 16, s anything (the last block is masked)."""
    return TritonFlashAttention.apply(q, k, v, causal, block_q, block_k)


# ---- the benchmark against SDPA's flash kernel (a GPU) ---------------------------------------------------------------


def _sdpa_flash(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # that kernel or an error, never a silent fallback
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def attention_flops(batch: int, heads: int, s: int, head_dim: int, causal: bool) -> float:
    """FLOPs of one forward and backward as model FLOPs count them (2 products forward, 4 backward, 2 s^2 d FLOPs each;
    a causal mask halves them), whatever an implementation recomputes: the basis of the TFLOP/s it is credited with."""
    return 6 * 2 * batch * heads * s * s * head_dim * (0.5 if causal else 1.0)


def benchmark(
    lengths=(512, 1024, 2048, 4096, 8192, 16384),
    head_dims=(64, 128),
    tokens: int = 16384,
    heads: int = 16,
    causal: bool = True,
    dtype=torch.bfloat16,
    block_q: int = 64,
    block_k: int = 64,
    device: str = "cuda",
    repeats: int = 10,
) -> dict:
    """Forward+backward time of the Triton kernels against SDPA's flash kernel, by sequence length and head size, at a
    fixed number of tokens per batch (batch = tokens // s, as FlashAttention-2's paper measures). Each point also
    records the largest difference from SDPA in the output and each gradient (over the largest value).
    Needs CUDA (SDPA's flash kernel)."""
    from ..capabilities import device_name
    from ..results import provenance

    if torch.device(device).type != "cuda":
        raise RuntimeError("the benchmark compares against SDPA's flash kernel, which needs a CUDA GPU")
    impls = {
        "triton (ours)": lambda q, k, v: flash_attention_triton(q, k, v, causal, block_q, block_k),
        "sdpa flash": lambda q, k, v: _sdpa_flash(q, k, v, causal),
    }
    points = []
    for d in head_dims:
        for s in lengths:
            points += _benchmark_shape(impls, max(1, tokens // s), heads, s, d, causal, dtype, device, repeats)
            torch.cuda.empty_cache()  # the shape's tensors are freed: hand their memory back before the next
    return {
        "what": "flash attention forward+backward: Triton kernels (course_lib.lessons.flash_attention_triton) "
        "against SDPA's flash kernel",
        "causal": causal,
        "dtype": str(dtype).removeprefix("torch."),
        "tokens_per_batch": tokens,
        "blocks": {"block_q": block_q, "block_k": block_k},
        "triton": triton.__version__,
        "flops_basis": "model FLOPs: 6 products of 2 s^2 d per head, halved when causal (attention_flops)",
        "provenance": provenance(device_name(device)),
        "points": points,
    }


def _benchmark_shape(impls: dict, batch, heads, s, d, causal, dtype, device, repeats) -> list[dict]:
    """One point per implementation at one shape; ours also records its largest difference from SDPA."""
    from ..timing import time_fn

    gen = torch.Generator(device=device).manual_seed(s + d)
    q, k, v = (
        torch.randn(batch, heads, s, d, device=device, dtype=dtype, generator=gen).requires_grad_() for _ in range(3)
    )
    grad = torch.randn(q.shape, device=device, dtype=dtype, generator=gen)
    answers, points = {}, []
    for name, fn in impls.items():

        def call(fn=fn):
            out = fn(q, k, v)
            return (out, *torch.autograd.grad(out, (q, k, v), grad))

        answers[name] = call()  # also the warm-up that compiles the kernels for this shape
        ms = time_fn(call, device=device, repeats=repeats, warmup=1) * 1e3
        flops = attention_flops(batch, heads, s, d, causal)
        points.append(
            {"impl": name, "s": s, "head_dim": d, "batch": batch, "heads": heads, "ms": ms,
             "tflops": flops / (ms * 1e-3) / 1e12}
        )  # fmt: skip
    # largest difference over the largest value, per tensor: bf16 keeps ~3 significant digits
    points[0]["max_rel_diff_from_sdpa"] = {
        n: float((a.float() - b.float()).abs().max() / b.float().abs().max())
        for n, a, b in zip(("out", "dq", "dk", "dv"), answers["triton (ours)"], answers["sdpa flash"])
    }
    return points


def plot_benchmark(result: dict):
    """Achieved TFLOP/s (model FLOPs) against sequence length, one panel per head size, each implementation a line."""
    from matplotlib.ticker import FormatStrFormatter

    from ..plots import new_figure

    dims = sorted({p["head_dim"] for p in result["points"]})
    fig = new_figure((4.2 * len(dims), 3.4))
    axes = fig.subplots(1, len(dims), squeeze=False)[0]
    for ax, d in zip(axes, dims):
        for impl in dict.fromkeys(p["impl"] for p in result["points"]):
            pts = [p for p in result["points"] if p["impl"] == impl and p["head_dim"] == d]
            ax.plot([p["s"] for p in pts], [p["tflops"] for p in pts], "o-", label=impl)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.set_xlabel("sequence length s")
        ax.set_ylabel("TFLOP/s, forward + backward")
        ax.set_title(f"head dim {d}", fontsize=9)
        ax.legend(fontsize=8)
    prov = result["provenance"]
    fig.suptitle(
        f"Flash attention, {result['dtype']}, {'causal' if result['causal'] else 'full'}, "
        f"{result['tokens_per_batch']} tokens per batch\n{prov['device']}, torch {prov['torch']}, "
        f"triton {result['triton']}, {prov['date'][:10]}",
        fontsize=9,
    )
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m course_lib.lessons.flash_attention_triton",
        description="Time the Triton flash attention against SDPA's flash kernel on a GPU; JSON and a PNG plot.",
    )
    parser.add_argument("--json", type=Path, required=True, help="where to write the results (the plot goes beside)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--full", action="store_true", help="no causal mask")
    args = parser.parse_args(argv)
    if torch.device(args.device).type != "cuda" or not torch.cuda.is_available():
        print(f"flash_attention_triton benchmark: needs a CUDA GPU (device {args.device!r} here)", file=sys.stderr)
        return 2
    result = benchmark(args.lengths, args.head_dims, causal=not args.full, device=args.device)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    png = args.json.with_suffix(".png")
    plot_benchmark(result).savefig(png, dpi=120)
    for p in result["points"]:
        print(f"{p['impl']:>14}  d={p['head_dim']:<4} s={p['s']:<6} {p['ms']:9.3f} ms  {p['tflops']:7.1f} TFLOP/s")
    print(f"wrote {args.json} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
