"""Context parallelism: ring attention over processes (notebook 08), forward and backward written by hand.

The sequence is cut into 2n equal chunks for n ranks, and each rank keeps the queries, keys and values of two of them:
- `naive`: chunks 2r and 2r+1, a contiguous slice. Under a causal mask the last rank's queries see every key and the
  first rank's almost none: the last rank does most of the work while the others wait for it.
- `zigzag`: chunks r and 2n-1-r, one from each end. Every rank gets one early and one late chunk, so the same number of
  tiles to compute (the load balancing of Megatron-LM's context parallelism and of Llama 3's training).

Forward (`ring_forward`): n steps. At each step a rank attends its queries to the key/value block it holds (its own
first), one chunk pair at a time with `flash_attention.tiled_attention`, which also returns each query row's
log-sum-exp L; partial results over disjoint sets of keys merge exactly by their L (`merge`, the online softmax's
rescaling one block at a time). Meanwhile the block travels on to the next rank and the previous rank's arrives:
n-1 hops, the sending overlapped with the computing. A chunk pair whose keys all come after its queries is skipped;
on the diagonal the causal mask applies; below it no mask.

Backward (`ring_backward`): the same ring again, with `flash_attention.flash_backward` per chunk pair,
recomputing each tile's probabilities from the final L and O (so the shares are those of the full attention). dQ
stays at home; a dK/dV accumulator travels with each key/value block, every rank adds its share, and after n hops
it is back with the block's owner.

Memory per rank: its own q, k, v, O and their gradients, the key/value block in use and the one arriving, and in
backward a dK/dV accumulator and the one arriving: all of them (s/n) rows, never an (s x s) or a whole-sequence
tensor. The price: 2(n-1) hops of a key/value block (forward and backward) and n of a dK/dV block per rank and
forward-backward pass.

`main` (under torchrun) checks the outputs and gradients against SDPA on the whole sequence, counts the tiles each
rank computes under both layouts, times them, and measures memory per rank against the sequence length.

Options: {"length": int, "batch": int, "heads": int, "head_dim": int, "block": int, "causal": bool,
          "layouts": ["naive", "zigzag"], "memory_lengths": [int, ...], "repeats": int}
"""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..config import ConfigError, did_you_mean
from ..flash_attention import flash_attention, flash_backward, merge, tiled_attention
from ..lessons.micro_benchmarks import peak_bytes
from ..timing import synchronize
from . import _common

LAYOUTS = ("naive", "zigzag")


def chunks_of(rank: int, world: int, layout: str) -> tuple[int, int]:
    """The two chunks, of the 2 * world equal chunks of the sequence, that `rank` holds."""
    if layout == "naive":
        return 2 * rank, 2 * rank + 1
    if layout == "zigzag":
        return rank, 2 * world - 1 - rank
    raise ValueError(f"layout {layout!r}: choose one of {', '.join(LAYOUTS)}")


def take(x: torch.Tensor, rank: int, world: int, layout: str) -> torch.Tensor:
    """This rank's part of a whole-sequence tensor (..., s, d): its two chunks, in order."""
    parts = x.chunk(2 * world, dim=-2)
    return torch.cat([parts[c] for c in chunks_of(rank, world, layout)], dim=-2)


def relation(q_chunk: int, k_chunk: int, causal: bool) -> str | None:
    """How a chunk of queries attends a chunk of keys: "full", "diagonal" (causal mask) or None (all masked)."""
    if not causal or k_chunk < q_chunk:
        return "full"
    return "diagonal" if k_chunk == q_chunk else None


def tiles(q_len: int, k_len: int, block: int, causal: bool) -> int:
    """(block x block) tiles `tiled_attention` computes for these lengths (its loops, counted); `flash_backward`
    walks the same tiles when its two block sizes are equal."""
    return sum(math.ceil((min(i0 + block, q_len) if causal else k_len) / block) for i0 in range(0, q_len, block))


def work_per_rank(world: int, layout: str, s: int, block: int, causal: bool = True) -> list[int]:
    """Tiles each rank computes in one forward (as many again in backward) at sequence length s: what a run counts,
    counted here without running it."""
    c, counts = s // (2 * world), []
    for r in range(world):
        pairs = [
            p
            for owner in range(world)
            for p in _pairs(chunks_of(r, world, layout), chunks_of(owner, world, layout), causal)
        ]
        counts.append(sum(tiles(c, c, block, diagonal) for _a, _b, diagonal in pairs))
    return counts


def _pairs(q_chunks, k_chunks, causal):
    """(local query chunk index, local key chunk index, causal?) for each chunk pair that has something to compute."""
    for a, qc in enumerate(q_chunks):
        for b, kc in enumerate(k_chunks):
            rel = relation(qc, kc, causal)
            if rel is not None:
                yield a, b, rel == "diagonal"


def _send_to_next(tensors: list[torch.Tensor]):
    """Start sending `tensors` to the next rank and receiving the previous rank's; (requests, the tensors being
    received). Bytes: each a message of its own (no copy into one buffer)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    incoming = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, (rank + 1) % world) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, (rank - 1) % world) for t in incoming]
    return dist.batch_isend_irecv(ops), incoming


def _count_sent(stats: dict, tensors: list[torch.Tensor]) -> None:
    stats["bytes_sent"] += sum(t.numel() * t.element_size() for t in tensors)
    stats["messages"] += len(tensors)


def _new_stats() -> dict:
    return {"forward_tiles": 0, "backward_tiles": 0, "bytes_sent": 0, "messages": 0, "compute_s": 0.0}


def _around_the_ring(blocks: list[torch.Tensor], stats: dict):
    """Yields (owner, blocks) `world` times: this rank's own key/value blocks, then the previous rank's, and so on.
    Each hop is started before the caller computes with the blocks it holds and waited for after: the sending and
    the computing overlap. Two blocks live at a time (the one in use, the one arriving) if the caller lets go of
    each before asking for the next."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(world):
        last = step == world - 1  # n - 1 hops: nobody needs the blocks after the last step
        if not last:
            _count_sent(stats, blocks)
            reqs, incoming = _send_to_next(blocks)
        yield (rank - step) % world, blocks
        if not last:
            for r in reqs:
                r.wait()
            blocks, reqs, incoming = incoming, None, None


def attend_block(q, kv, pairs, c, block, out, lse, stats) -> None:
    """This rank's queries against one key/value block, chunk pair by chunk pair, merged into (out, lse)."""
    synchronize(q.device)
    t0 = time.perf_counter()
    for a, b, diagonal in pairs:
        rows, keys = slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c)
        o, l_ = tiled_attention(q[..., rows, :], kv[0][..., keys, :], kv[1][..., keys, :], block, block, diagonal,
                                return_lse=True)  # fmt: skip
        out[..., rows, :], lse[..., rows] = merge(out[..., rows, :], lse[..., rows], o, l_)
        stats["forward_tiles"] += tiles(c, c, block, diagonal)
    synchronize(q.device)  # on a GPU: the kernels done, not just queued
    stats["compute_s"] += time.perf_counter() - t0


def attend_block_backward(q, kv, out, lse, d_out, pairs, c, block, dq, dkv, stats) -> None:
    """The shares of one key/value block's chunk pairs: dQ's added to dq, dK's and dV's to the travelling dkv."""
    synchronize(q.device)
    t0 = time.perf_counter()
    for a, b, diagonal in pairs:
        rows, keys = slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c)
        shares = flash_backward(q[..., rows, :], kv[0][..., keys, :], kv[1][..., keys, :], out[..., rows, :],
                                lse[..., rows], d_out[..., rows, :], diagonal, block, block)  # fmt: skip
        dq[..., rows, :] += shares[0]
        dkv[0][..., keys, :] += shares[1]
        dkv[1][..., keys, :] += shares[2]
        stats["backward_tiles"] += tiles(c, c, block, diagonal)
    synchronize(q.device)
    stats["compute_s"] += time.perf_counter() - t0


def ring_forward(q, k, v, layout: str = "zigzag", causal: bool = True, block: int = 64, stats: dict | None = None):
    """This rank's attention output and log-sum-exp, its q, k, v being its two chunks (..., 2c, d) of the sequence."""
    world, stats = dist.get_world_size(), _new_stats() if stats is None else stats
    mine, c = chunks_of(dist.get_rank(), world, layout), q.size(-2) // 2
    out, lse = torch.zeros_like(q), q.new_full(q.shape[:-1], float("-inf"))  # no key seen yet: L = -inf
    for owner, kv in _around_the_ring([k, v], stats):
        attend_block(q, kv, _pairs(mine, chunks_of(owner, world, layout), causal), c, block, out, lse, stats)
        del kv  # let it go before the next block is sent on
    return out, lse


def ring_backward(q, k, v, out, lse, d_out, layout="zigzag", causal=True, block=64, stats: dict | None = None):
    """dQ, dK, dV of this rank's chunks. dQ gathers here; a dK/dV accumulator travels with each key/value block,
    each rank adds its share, and after `world` hops (one more than the block makes) it is back with its owner."""
    world, stats = dist.get_world_size(), _new_stats() if stats is None else stats
    mine, c = chunks_of(dist.get_rank(), world, layout), q.size(-2) // 2
    dq, dkv = torch.zeros_like(q), [torch.zeros_like(k), torch.zeros_like(v)]
    for owner, kv in _around_the_ring([k, v], stats):
        pairs = _pairs(mine, chunks_of(owner, world, layout), causal)
        attend_block_backward(q, kv, out, lse, d_out, pairs, c, block, dq, dkv, stats)
        del kv
        if world == 1:
            break
        _count_sent(stats, dkv)
        reqs, dkv = _send_to_next(dkv)  # the accumulator follows its block (the last hop takes it home)
        for r in reqs:
            r.wait()
        del reqs
    return dq, dkv[0], dkv[1]


class RingAttention(torch.autograd.Function):
    """softmax(Q K^T / sqrt(d)) V over the whole sequence, each rank holding two chunks of it (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, layout: str, causal: bool, block: int, stats: dict | None):
        out, lse = ring_forward(q, k, v, layout, causal, block, stats)
        ctx.save_for_backward(q, k, v, out, lse)  # this rank's chunks only
        ctx.options = (layout, causal, block, stats)
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(q, k, v, out, lse, d_out.contiguous(), *ctx.options)
        return dq, dk, dv, None, None, None, None


def ring_attention(q, k, v, layout: str = "zigzag", causal: bool = True, block: int = 64, stats: dict | None = None):
    """Attention over the whole sequence from this rank's chunks of it: q, k, v (batch, heads, 2c, head_dim), fp32,
    in `layout`; every rank calls it. `stats`, a dict, gets the tiles computed, bytes sent and compute seconds added."""
    if q.size(-2) % 2:
        raise ValueError(f"a rank holds two equal chunks: {q.size(-2)} rows do not halve")
    return RingAttention.apply(q, k, v, layout, causal, block, stats)


# ---- under torchrun: equality, work per rank, memory per rank -----------------------------------------------------


def _whole(s: int, opts: dict, seed: int, device):
    """The whole sequence's q, k, v and an output gradient, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    shape = (opts["batch"], opts["heads"], s, opts["head_dim"])
    return [torch.randn(shape, generator=gen).to(device) for _ in range(4)]


def check_layout(ctx: _common.Ctx, layout: str, opts: dict) -> dict:
    """Ring attention on this rank's chunks against SDPA on the whole sequence (fp32): largest differences of the
    output and the three gradients (this rank's rows), tiles computed, bytes sent, and times."""
    q, k, v, d_out = _whole(opts["length"], opts, 0, ctx.device)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=opts["causal"])
    ref.backward(d_out)
    mine = [take(t, ctx.rank, ctx.world, layout).requires_grad_() for t in (q, k, v)]
    stats = _new_stats()
    out = ring_attention(*mine, layout, opts["causal"], opts["block"], stats)
    g = take(d_out, ctx.rank, ctx.world, layout)
    out.backward(g)
    diffs = {"out": (out.detach(), take(ref.detach(), ctx.rank, ctx.world, layout))}
    diffs |= {f"d{n}": (t.grad, take(f.grad, ctx.rank, ctx.world, layout)) for n, t, f in zip("qkv", mine, full)}
    max_abs_diff = {n: (a - b).abs().max().item() for n, (a, b) in diffs.items()}
    max_abs = {n: b.abs().max().item() for n, (_a, b) in diffs.items()}
    walls, computes = [], []
    for _ in range(opts["repeats"]):  # the timed passes
        timed, fresh = _new_stats(), [t.detach().requires_grad_() for t in mine]
        dist.barrier()
        t0 = time.perf_counter()
        ring_attention(*fresh, layout, opts["causal"], opts["block"], timed).backward(g)
        synchronize(ctx.device)
        walls.append(time.perf_counter() - t0)
        computes.append(timed["compute_s"])
    return {
        "layout": layout,
        "chunks": list(chunks_of(ctx.rank, ctx.world, layout)),
        "max_abs_diff": max_abs_diff,
        "max_abs": max_abs,
        "forward_tiles": stats["forward_tiles"],
        "backward_tiles": stats["backward_tiles"],
        "bytes_sent": stats["bytes_sent"],
        "messages": stats["messages"],
        "wall_s": statistics.median(walls) if walls else None,
        "compute_s": statistics.median(computes) if computes else None,
    }


def memory_at(ctx: _common.Ctx, s: int, opts: dict) -> dict:
    """Peak bytes one forward and backward of ring attention allocates on this rank (the CPU ledger, or CUDA's peak)
    at sequence length s; beside it, on rank 0, the hand-written flash attention on the whole sequence in one
    process."""
    q, k, v, d_out = _whole(s, opts, s, ctx.device)
    mine = [take(t, ctx.rank, ctx.world, "zigzag").requires_grad_() for t in (q, k, v)]
    g = take(d_out, ctx.rank, ctx.world, "zigzag")
    dist.barrier()
    peak, method = peak_bytes(
        lambda: ring_attention(*mine, "zigzag", opts["causal"], opts["block"]).backward(g), device=ctx.device
    )
    row = {"s": s, "peak_bytes": peak, "method": method, "local_qkv_bytes": sum(t.nbytes for t in mine)}
    if ctx.is_first:
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        row["one_process_peak_bytes"], _ = peak_bytes(
            lambda: flash_attention(*whole, opts["causal"], opts["block"], opts["block"]).backward(d_out), ctx.device
        )
    return row


# What --options may set, with the defaults (_common.check_options checks a launch's options against it).
OPTIONS = {
    "length": 256,
    "batch": 1,
    "heads": 2,
    "head_dim": 32,
    "block": 32,
    "causal": True,
    "layouts": list(LAYOUTS),
    "memory_lengths": [256, 512, 1024],
    "repeats": 2,
}


def check(options: dict, world: int | None = None) -> None:
    """A ConfigError for options of the right kind that make no run (launch asks before any process starts; each rank
    asks again with its world size, which the lengths must divide into 2 * world chunks)."""
    o = {**OPTIONS, **options}
    bad = [x for x in o["layouts"] if x not in LAYOUTS]
    if bad or not o["layouts"]:
        hint = did_you_mean(str(bad[0]), LAYOUTS) if bad else ""
        raise ConfigError(f"ring_attention: layouts are some of {', '.join(LAYOUTS)}; got {o['layouts']}{hint}")
    sizes = {n: o[n] for n in ("length", "batch", "heads", "head_dim", "block", "repeats")}
    if any(v < 1 for v in sizes.values()) or any(s < 1 for s in o["memory_lengths"]):
        raise ConfigError(f"ring_attention: lengths, sizes and repeats are >= 1; got {sizes}, {o['memory_lengths']}")
    for s in [o["length"], *o["memory_lengths"]] if world else []:
        if s % (2 * world):
            raise ConfigError(f"ring_attention: length {s} does not cut into {2 * world} equal chunks ({world} ranks)")


def main(argv=None) -> None:
    ctx = _common.start(argv, OPTIONS, "ring_attention")
    opts = ctx.options
    try:
        check(opts, ctx.world)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    runs = [check_layout(ctx, layout, opts) for layout in opts["layouts"]]
    memory = [memory_at(ctx, s, opts) for s in opts["memory_lengths"]]
    shape = {n: opts[n] for n in ("length", "batch", "heads", "head_dim", "block", "causal")}
    _common.finish(ctx, {"strategy": "ring_attention", **shape, "runs": runs, "memory": memory})


if __name__ == "__main__":
    main()
