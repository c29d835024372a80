"""Attention three ways, flash attention's backward by hand, and the measurements of notebook 04.

- `naive_attention` (from model.py): writes out the (batch, heads, s, s) scores and probabilities.
- `sdpa_attention` (from model.py): `F.scaled_dot_product_attention`, which picks a fused kernel.
- `tiled_attention`: exact attention computed one (query block x key block) tile at a time with an online
  softmax, in plain PyTorch, for understanding. Only a tile of scores exists at any moment.
- `windowed_attention`: a *local* attention (each query sees only the last `window` keys). It is here to
  show what flash attention is NOT: flash attention is exact, a window changes the function.

And the measurements: which SDPA backend actually runs (`sdpa_backend`), and a context-length sweep that
times naive against SDPA attention and measures their peak memory (`context_sweep`).

Flash attention by hand, forward and backward: FlashAttention-2's algorithm as a PyTorch `autograd.Function`
(`flash_attention`), to read and to check against the real kernel.
- Forward (`tiled_attention`): it keeps for backward only its inputs, the output O and the log-sum-exp L of every
  query row: O(s d) numbers, where autograd through naive attention keeps the (s x s) probabilities of every head.
- Backward (`flash_backward`): walks the tiles again, key block by key block, and *recomputes* each tile's
  probabilities from Q, K and L, P = exp(Q K^T / sqrt(d) - L), instead of reading them from memory. With
  D = rowsum(dO * O) (= rowsum(P * dP), one number per query row):
      dV_j += P^T dO_i        dP = dO_i V_j^T        dS = P * (dP - D_i)
      dQ_i += dS K_j / sqrt(d)      dK_j += dS^T Q_i / sqrt(d)
  That is one more Q K^T per tile: 7 products of (s x s x d) where naive attention's forward and backward do 6
  (`recompute_share`), to never write or read an (s x s) tensor. On a GPU, memory traffic, not FLOPs, is what
  attention waits for. Inside, the tiles are computed in fp32 whatever the inputs' format (the kernels accumulate in
  fp32 too) and cast back. It is for understanding: slower than SDPA's fused kernel on any device.
"""

from __future__ import annotations

import gc
import math
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from ..model import naive_attention, sdpa_attention
from .micro_benchmarks import peak_bytes, time_fn

__all__ = [
    "naive_attention",
    "sdpa_attention",
    "tiled_attention",
    "flash_attention",
    "flash_backward",
    "windowed_attention",
    "max_abs_diff",
    "sdpa_backend",
    "AttentionPoint",
    "context_sweep",
    "IMPLS",
    "scores_bytes",
]


def tiled_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_q: int = 64,
    block_k: int = 64,
    causal: bool = True,
    return_lse: bool = False,
):
    """Exact (causal) softmax attention, one tile at a time, with an online softmax.

    For each block of queries we walk over the blocks of keys and keep, per query row, three running
    quantities: the largest score seen so far `m`, the sum of exp(score - m) `ell`, and the weighted sum of
    values `acc` (also relative to exp(-m)). When a new tile raises the maximum from m to m', the old `ell`
    and `acc` are rescaled by exp(m - m'), so at the end acc / ell is exactly softmax(scores) @ v.
    Only a (block_q x block_k) tile of scores exists at a time: the s x s matrix never does.

    q, k, v: (..., s, head_dim). Returns the output (and the log-sum-exp per query when `return_lse`).
    Under autograd this function saves its tiles for backward; `flash_attention` below has its own backward
    instead, which recomputes them.
    """
    if causal and q.size(-2) != k.size(-2):
        raise ValueError("causal tiled_attention needs as many queries as keys")
    s_q, s_k, d = q.size(-2), k.size(-2), q.size(-1)
    scale = 1.0 / math.sqrt(d)
    outs, lses = [], []
    for i0 in range(0, s_q, block_q):
        i1 = min(i0 + block_q, s_q)
        qi = q[..., i0:i1, :] * scale
        m = qi.new_full(qi.shape[:-1], float("-inf"))  # running max per query row
        ell = qi.new_zeros(qi.shape[:-1])  # running sum of exp(score - m)
        acc = qi.new_zeros(qi.shape)  # running sum of exp(score - m) * v
        k_end = i1 if causal else s_k  # keys after the block's last query are all masked
        for j0 in range(0, k_end, block_k):
            j1 = min(j0 + block_k, k_end)
            scores = qi @ k[..., j0:j1, :].transpose(-2, -1)  # one tile: (..., i1-i0, j1-j0)
            if causal and j1 - 1 > i0:  # the tile crosses the diagonal: mask keys after each query
                scores = scores.masked_fill(_causal_tile_mask(i0, i1, j0, j1, q.device), float("-inf"))
            m_new = torch.maximum(m, scores.amax(dim=-1))
            p = torch.exp(scores - m_new.unsqueeze(-1))
            correction = torch.exp(m - m_new)  # rescales what was summed under the old maximum
            ell = ell * correction + p.sum(dim=-1)
            acc = acc * correction.unsqueeze(-1) + p @ v[..., j0:j1, :]
            m = m_new
        outs.append(acc / ell.unsqueeze(-1))
        lses.append(m + torch.log(ell))
    out = torch.cat(outs, dim=-2)
    return (out, torch.cat(lses, dim=-1)) if return_lse else out


def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 64) -> torch.Tensor:
    """Causal *local* attention: query i sees keys i-window+1 .. i only. A different function from full
    attention whenever s > window (this is not what flash attention does)."""
    s = q.size(-2)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    i = torch.arange(s, device=q.device).unsqueeze(-1)
    j = torch.arange(s, device=q.device).unsqueeze(0)
    keep = (j <= i) & (j > i - window)
    return torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1) @ v


def _causal_tile_mask(i0: int, i1: int, j0: int, j1: int, device) -> torch.Tensor:
    """(i1 - i0, j1 - j0) bool: True where key j comes after query i (masked out)."""
    rows = torch.arange(i0, i1, device=device).unsqueeze(-1)
    cols = torch.arange(j0, j1, device=device).unsqueeze(0)
    return cols > rows


def flash_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    d_out: torch.Tensor,
    causal: bool = True,
    block_q: int = 64,
    block_k: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV of softmax attention from what the forward kept (q, k, v: (..., s, d); out: (..., s, d); lse:
    (..., s)) and the output's gradient, tile by tile, recomputing each tile's probabilities (module docstring)."""
    s_q, s_k, scale = q.size(-2), k.size(-2), 1.0 / math.sqrt(q.size(-1))
    D = (d_out * out).sum(dim=-1)  # (..., s_q): rowsum(dO * O) = rowsum(P * dP)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for j0 in range(0, s_k, block_k):  # outer loop over key blocks: dK_j and dV_j finish in one pass
        j1 = min(j0 + block_k, s_k)
        kj, vj = k[..., j0:j1, :], v[..., j0:j1, :]
        first = (j0 // block_q) * block_q if causal else 0  # query blocks before it see none of these keys
        for i0 in range(first, s_q, block_q):
            i1 = min(i0 + block_q, s_q)
            qi, doi = q[..., i0:i1, :], d_out[..., i0:i1, :]
            scores = (qi @ kj.transpose(-2, -1)) * scale  # the tile again: (..., i1-i0, j1-j0)
            if causal and j1 - 1 > i0:  # the tile crosses the diagonal
                scores = scores.masked_fill(_causal_tile_mask(i0, i1, j0, j1, q.device), float("-inf"))
            p = torch.exp(scores - lse[..., i0:i1, None])  # the probabilities, recomputed from L
            dv[..., j0:j1, :] += p.transpose(-2, -1) @ doi
            dp = doi @ vj.transpose(-2, -1)
            ds = p * (dp - D[..., i0:i1, None])  # softmax's backward, row by row
            dq[..., i0:i1, :] += (ds @ kj) * scale
            dk[..., j0:j1, :] += (ds.transpose(-2, -1) @ qi) * scale
    return dq, dk, dv


class FlashAttention(torch.autograd.Function):
    """softmax(Q K^T / sqrt(d)) V, causal or not, keeping only O and L for backward (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool = True, block_q: int = 64, block_k: int = 64):
        if causal and q.size(-2) != k.size(-2):
            raise ValueError("causal flash_attention needs as many queries as keys")
        qf, kf, vf = q.float(), k.float(), v.float()
        out, lse = tiled_attention(qf, kf, vf, block_q, block_k, causal, return_lse=True)
        ctx.save_for_backward(q, k, v, out, lse)  # O(s d): no (s x s) tensor is kept
        ctx.options = (causal, block_q, block_k)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = flash_backward(q.float(), k.float(), v.float(), out, lse, d_out.float(), *ctx.options)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, block_q: int = 64, block_k: int = 64
) -> torch.Tensor:
    """Attention with the hand-written flash forward and backward; q, k, v: (batch, heads, s, head_dim)."""
    return FlashAttention.apply(q, k, v, causal, block_q, block_k)


# The (s x s x d) matrix products of attention. Forward: S = Q K^T, O = P V. Backward: dV = P^T dO, dP = dO V^T,
# dQ = dS K, dK = dS^T Q. Flash's backward also recomputes S = Q K^T (a causal mask halves every product alike).
PRODUCTS = {"forward": 2, "backward": 4, "recomputed in backward": 1}


def recompute_share() -> float:
    """The share of flash attention's matmul FLOPs spent recomputing Q K^T in backward (1 of 7)."""
    return PRODUCTS["recomputed in backward"] / sum(PRODUCTS.values())


def peak_bytes_by_length(
    lengths: list[int], batch: int = 1, heads: int = 2, head_dim: int = 64, block: int = 64
) -> list[dict]:
    """Peak bytes of one forward and backward at each sequence length, by the CPU memory ledger: the hand-written
    flash attention against naive attention, fp32, causal. Flash's grows in proportion to s, naive's with s^2."""
    rows = []
    for s in lengths:
        gen = torch.Generator().manual_seed(s)
        q, k, v = (torch.randn(batch, heads, s, head_dim, generator=gen, requires_grad=True) for _ in range(3))
        fns = {"flash": lambda: flash_attention(q, k, v, True, block, block), "naive": lambda: naive_attention(q, k, v)}
        row = {"s": s}
        for name, fn in fns.items():
            row[name], row["method"] = peak_bytes(lambda: fn().sum().backward())
            q.grad = k.grad = v.grad = None
        rows.append(row)
    return rows


def _naive(q, k, v):
    return naive_attention(q, k, v)


def _sdpa(q, k, v):
    return sdpa_attention(q, k, v)


def _tiled(q, k, v):
    return tiled_attention(q, k, v, block_q=128, block_k=128)


def _flash(q, k, v):
    return flash_attention(q, k, v, block_q=128, block_k=128)


IMPLS: dict[str, Callable] = {"naive": _naive, "sdpa": _sdpa, "tiled": _tiled, "flash": _flash}


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def random_qkv(
    batch: int,
    heads: int,
    s: int,
    head_dim: int,
    device="cpu",
    dtype=torch.float32,
    seed: int = 0,
    requires_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = [torch.randn(batch, heads, s, head_dim, generator=gen).to(device=device, dtype=dtype) for _ in range(3)]
    for t in out:
        t.requires_grad_(requires_grad)
    return tuple(out)


# ---- which SDPA backend runs ---------------------------------------------------------------------

# aten op that scaled_dot_product_attention dispatches to -> backend name
SDPA_OPS = {
    "_scaled_dot_product_flash_attention_for_cpu": "flash (CPU kernel)",
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_efficient_attention": "memory-efficient",
    "_scaled_dot_product_cudnn_attention": "cuDNN",
    "_scaled_dot_product_fused_attention_overrideable": "fused (device plug-in)",
}


def sdpa_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = True) -> tuple[str, str]:
    """Which kernel F.scaled_dot_product_attention actually runs for these inputs: (backend, aten op).

    Found by watching the operators it dispatches to (a TorchDispatchMode sees them), not by asking what
    could run: SDPA silently falls back to the "math" path (plain matmul + softmax, s x s matrix and all)
    when no fused kernel accepts the inputs.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[str] = []

    class _Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), _Ops():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    for op in seen:
        if op in SDPA_OPS:
            return SDPA_OPS[op], "aten." + op
    return "math (unfused fallback)", "aten." + ", aten.".join(dict.fromkeys(seen))


# ---- the context-length sweep --------------------------------------------------------------------


def scores_bytes(batch: int, heads: int, s: int, dtype=torch.float32) -> int:
    """Bytes of one (batch, heads, s, s) matrix: what naive attention materialises (scores, then probs)."""
    return batch * heads * s * s * torch.tensor([], dtype=dtype).element_size()


@dataclass
class AttentionPoint:
    impl: str
    context: int
    ms: float  # median wall time, ms
    peak_bytes: int  # peak of the memory the call allocated (inputs not included)
    method: str  # how the peak was measured
    backward: bool  # forward + backward (training) or forward only
    batch: int
    heads: int
    head_dim: int
    device: str
    status: str = "ok"  # "oom" when the device ran out of memory at this size (ms and peak_bytes are then nan / 0)

    def to_dict(self) -> dict:
        return asdict(self)


def context_sweep(
    contexts,
    impls=("naive", "sdpa"),
    batch: int = 4,
    heads: int = 4,
    head_dim: int = 64,
    backward: bool = True,
    device="cpu",
    dtype=torch.float32,
    repeats: int = 3,
    progress: Callable[[str, int], None] | None = None,
) -> list[AttentionPoint]:
    """Time and peak memory of each attention implementation at each context length.

    Time: median of `repeats` calls after one warm-up, device synchronised. Memory: the peak of what the call
    allocates beyond its inputs (CPU: every storage followed by the course's ledger; CUDA: the allocator's peak),
    with `backward` the gradients of q, k, v and everything saved for backward included.
    """
    from ..measure import device_name

    name = device_name(device)
    points, out_of_memory = [], set()
    for s in contexts:
        for impl in impls:
            if impl in out_of_memory:  # a longer context will not fit either
                points.append(
                    AttentionPoint(impl, s, float("nan"), 0, "", backward, batch, heads, head_dim, name, status="oom")
                )
                continue
            fn = IMPLS[impl]
            q, k, v = random_qkv(batch, heads, s, head_dim, device=device, dtype=dtype, requires_grad=backward)

            def call(q=q, k=k, v=v):
                out = fn(q, k, v)
                if backward:
                    out.backward(torch.ones_like(out))
                    for t in (q, k, v):
                        t.grad = None
                return out

            ctx = torch.enable_grad() if backward else torch.no_grad()
            try:
                with ctx:
                    ms = time_fn(call, device=device, repeats=repeats, warmup=1) * 1e3
                    peak, method = peak_bytes(call, device=device)
                points.append(AttentionPoint(impl, s, ms, peak, method, backward, batch, heads, head_dim, name))
            except torch.OutOfMemoryError:
                out_of_memory.add(impl)
                points.append(
                    AttentionPoint(impl, s, float("nan"), 0, "", backward, batch, heads, head_dim, name, status="oom")
                )
            if progress:
                progress(impl, s)
            del q, k, v, call
            if impl in out_of_memory:  # free what the failed call left before the next size
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
    return points


def plot_sweep(points: list[AttentionPoint], title: str = ""):
    """Time (ms) and peak memory (MiB) against context length, log-log, with the s^2 matrix size for scale."""
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10.5, 3.6), layout="constrained")
    impls = list(dict.fromkeys(p.impl for p in points))
    for impl in impls:
        pts = [p for p in points if p.impl == impl and p.status == "ok"]
        for p in points:
            if p.impl == impl and p.status == "oom":
                ax_m.annotate(
                    f"{impl}: OOM",
                    (p.context, max((q.peak_bytes for q in pts), default=1) / 2**20),
                    fontsize=7,
                    color="#c44e52",
                )
        xs = [p.context for p in pts]
        ax_t.plot(xs, [p.ms for p in pts], "o-", label=impl)
        ax_m.plot(xs, [p.peak_bytes / 2**20 for p in pts], "o-", label=impl)
    if points:
        p0 = points[0]
        xs = sorted({p.context for p in points})
        ax_m.plot(
            xs, [scores_bytes(p0.batch, p0.heads, s) / 2**20 for s in xs], "k:", lw=1, label="one b·a·s·s fp32 matrix"
        )
    from matplotlib.ticker import FormatStrFormatter, NullFormatter

    for ax in (ax_t, ax_m):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("context length s (tokens)")
        ax.legend(fontsize=8)
    mode = "forward + backward" if points and points[0].backward else "forward only"
    ax_t.set_ylabel(f"time per call, {mode} (ms)")
    ax_m.set_ylabel("peak memory allocated by the call (MiB)")
    dev = points[0].device if points else ""
    shape = f"batch {points[0].batch}, heads {points[0].heads}, head dim {points[0].head_dim}" if points else ""
    fig.suptitle(f"{title or 'Attention vs context length'} ({shape})\n{dev}, torch {torch.__version__}", fontsize=9)
    return fig
