"""Flash attention in PyTorch: FlashAttention-2's forward and backward as an `autograd.Function`, to read, to check
against the real kernel, and as the model's attention="flash" (slower than SDPA's fused kernel on any device).

Forward (`tiled_attention`): one (query block x key block) tile at a time with an online softmax; it keeps for backward
only the output O and the log-sum-exp L of each query row, O(s d) numbers where naive attention keeps the s x s
probabilities. Backward (`flash_backward`) recomputes each tile's P = exp(Q K^T / sqrt(d) - L), and with
D = rowsum(dO * O):
      dV_j += P^T dO_i        dP = dO_i V_j^T        dS = P * (dP - D_i)
      dQ_i += dS K_j / sqrt(d)      dK_j += dS^T Q_i / sqrt(d)
7 products of (s x s x d) where naive attention does 6, to never write or read an s x s tensor. Tiles are computed in
fp32 whatever the inputs' format (as the kernels accumulate) and cast back.
"""

from __future__ import annotations

import math

import torch


def tiled_attention(q, k, v, block_q: int = 64, block_k: int = 64, causal: bool = True, return_lse: bool = False):
    """Exact (causal) softmax attention of q, k, v (..., s, head_dim), one (block_q x block_k) tile of scores at a time.

    Per query row it keeps the largest score so far `m`, the sum of exp(score - m) `ell` and the weighted sum of
    values `acc`; a tile that raises the maximum from m to m' rescales both by exp(m - m'), so acc / ell is exactly
    softmax(scores) @ v in the end. Returns the output (and each query's log-sum-exp when `return_lse`).
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


def _causal_tile_mask(i0: int, i1: int, j0: int, j1: int, device) -> torch.Tensor:
    """(i1 - i0, j1 - j0) bool: True where key j comes after query i (masked out)."""
    return torch.arange(j0, j1, device=device) > torch.arange(i0, i1, device=device)[:, None]


def flash_backward(q, k, v, out, lse, d_out, causal: bool = True, block_q: int = 64, block_k: int = 64):
    """dQ, dK, dV from what the forward kept (q, k, v, out: (..., s, d); lse: (..., s)) and the output's gradient, tile
    by tile, each tile's probabilities recomputed (module docstring)."""
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


def flash_attention(q, k, v, causal: bool = True, block_q: int = 64, block_k: int = 64) -> torch.Tensor:
    """Attention with the hand-written flash forward and backward; q, k, v: (batch, heads, s, head_dim)."""
    return FlashAttention.apply(q, k, v, causal, block_q, block_k)


def merge(out_a, lse_a, out_b, lse_b):
    """Two attentions of the same queries over disjoint sets of keys -> the attention over their union: L is
    log(exp(L_a) + exp(L_b)), each part reweighted by exp(L_part - L) (a part that saw no key: L = -inf, weight 0)."""
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a * torch.exp(lse_a - lse).unsqueeze(-1) + out_b * torch.exp(lse_b - lse).unsqueeze(-1)
    return out, lse
