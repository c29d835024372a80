"""Flash attention by hand, forward and backward (notebook 04): FlashAttention-2's algorithm as a PyTorch
`autograd.Function`, in plain tensor operations, to read and to check against the real kernel.

- Forward (`attention_by_hand.tiled_attention`): one (query block x key block) tile at a time with an online softmax
  (a running max per row, the sums rescaled when it rises). It keeps for backward only its inputs, the output O and
  the log-sum-exp L of every query row: O(s d) numbers, where autograd through naive attention keeps the (s x s)
  probabilities of every head.
- Backward (`flash_backward`): walks the tiles again, key block by key block, and *recomputes* each tile's
  probabilities from Q, K and L, P = exp(Q K^T / sqrt(d) - L), instead of reading them from memory. With
  D = rowsum(dO * O) (= rowsum(P * dP), one number per query row):
      dV_j += P^T dO_i        dP = dO_i V_j^T        dS = P * (dP - D_i)
      dQ_i += dS K_j / sqrt(d)      dK_j += dS^T Q_i / sqrt(d)
  That is one more Q K^T per tile: 7 products of (s x s x d) where naive attention's forward and backward do 6, a
  seventh of the work (`recompute_share`), to never write or read an (s x s) tensor. On a GPU, memory traffic, not
  FLOPs, is what attention waits for.

Inside, the tiles are computed in fp32 whatever the inputs' format (the kernels accumulate in fp32 too) and the
results are cast back. This is for understanding: it is slower than SDPA's fused kernel on any device.
"""

from __future__ import annotations

import math

import torch

from .attention_by_hand import tiled_attention


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


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """The textbook attention autograd differentiates: it writes, and keeps, the (s x s) probabilities."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    if causal:
        s = q.size(-2)
        scores = scores.masked_fill(_causal_tile_mask(0, s, 0, s, q.device), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


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
    from .micro_benchmarks import peak_bytes

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
