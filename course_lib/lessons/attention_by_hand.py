"""Attention three ways, flash attention's backward by hand, and the measurements of notebook 04.

- `naive_attention` (from model.py): writes out the (batch, heads, s, s) scores and probabilities.
- `sdpa_attention` (from model.py): `F.scaled_dot_product_attention`, which picks a fused kernel.
- `tiled_attention`: exact attention computed one (query block x key block) tile at a time with an online
  softmax, in plain PyTorch, for understanding. Only a tile of scores exists at any moment.
- `windowed_attention`: a *local* attention (each query sees only the last `window` keys). It is here to
  show what flash attention is NOT: flash attention is exact, a window changes the function.

And the measurements: which SDPA backend actually runs (`sdpa_backend`), and a context-length sweep that
times naive against SDPA attention and measures their peak memory (`context_sweep`).

Flash attention by hand, forward and backward (`flash_attention`, `flash_backward`, `tiled_attention` its forward):
FlashAttention-2's algorithm in PyTorch, written in course_lib.flash_attention (the model can use it:
ModelConfig.attention="flash") and measured here: its memory by sequence length (`peak_bytes_by_length`) and the
share of its FLOPs its backward spends recomputing (`recompute_share`).

Whether this device's SDPA kernel skips the masked half of a causal square (`causal_skipping`), and
`sdpa_in_query_blocks`, which hands the kernel only the keys each block of queries can see.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..capabilities import device_name

# notebook 04 reads the hand-written flash attention here, beside the other attentions of its lesson
from ..flash_attention import flash_attention, flash_backward, tiled_attention  # noqa: F401
from ..model import naive_attention, sdpa_attention
from ..timing import StepTimer, time_fn
from ..train import free_memory, unless_it_fails
from .kernel_floor import SDPA_OPS
from .micro_benchmarks import peak_bytes

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
    "sdpa_in_query_blocks",
    "query_blocks",
    "square_share",
    "causal_skipping",
]


def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 64) -> torch.Tensor:
    """Causal *local* attention: query i sees keys i-window+1 .. i only. A different function from full
    attention whenever s > window (this is not what flash attention does)."""
    s = q.size(-2)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    i = torch.arange(s, device=q.device).unsqueeze(-1)
    j = torch.arange(s, device=q.device).unsqueeze(0)
    keep = (j <= i) & (j > i - window)
    return torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1) @ v


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


def query_blocks(s: int, blocks: int) -> list[tuple[int, int]]:
    """The (first, past-the-last) query of each of `blocks` blocks of s queries, as even as whole queries allow (empty
    blocks left out)."""
    if blocks < 1:
        raise ValueError(f"blocks={blocks}: split the queries into 1 block or more")
    bounds = [s * i // blocks for i in range(blocks + 1)]
    return [(i0, i1) for i0, i1 in zip(bounds, bounds[1:]) if i1 > i0]


def sdpa_in_query_blocks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: int = 4, dropout_p: float = 0.0
) -> torch.Tensor:
    """Causal attention through SDPA one block of queries at a time, each block against the keys up to its own last
    query only: the same function as sdpa_attention, but a kernel that computes every pair of the square it is given
    is given square_share(s, blocks) of the square (5/8 at 4 blocks) instead of all of it.

    Block (i0, i1) is causal aligned to its lower right, query i0 + r seeing keys 0 .. i0 + r, given as a boolean
    mask (torch.nn.attention.bias.causal_lower_right is not a plain tensor, and the course's memory ledger and
    profiler watch every operator). On a GPU a mask makes SDPA leave its flash kernel for another: there this compares
    two kernels, not two shares of the square."""
    outs = []
    for i0, i1 in query_blocks(q.size(-2), blocks):
        keep = torch.ones(i1 - i0, i1, dtype=torch.bool, device=q.device).tril(diagonal=i0)  # (queries, keys)
        outs.append(
            F.scaled_dot_product_attention(
                q[..., i0:i1, :], k[..., :i1, :], v[..., :i1, :], attn_mask=keep, dropout_p=dropout_p
            )
        )
    return torch.cat(outs, dim=-2)  # (b, a, s, d)


def square_share(s: int, blocks: int) -> float:
    """The share of the s x s square of (query, key) pairs that sdpa_in_query_blocks hands its kernel: each block's
    queries times the keys up to its last one. (blocks + 1) / (2 blocks) where the blocks divide s; the causal pairs
    themselves, s (s + 1) / 2, are about half of the square."""
    return sum((i1 - i0) * i1 for i0, i1 in query_blocks(s, blocks)) / (s * s)


def use_query_blocks(blocks: int = 4) -> None:
    """Make this process's model attention="sdpa" run sdpa_in_query_blocks (course_lib.model.ATTENTION_IMPLS): for
    timing the training loop with it, in a process of its own (lessons.fresh_processes, `before`); nothing else in the
    course calls this."""
    from .. import model

    def attend(q, k, v, dropout_p: float = 0.0, training: bool = False):
        return sdpa_in_query_blocks(q, k, v, blocks, dropout_p if training else 0.0)

    model.ATTENTION_IMPLS["sdpa"] = attend


IMPLS: dict[str, Callable] = {
    "naive": _naive,
    "sdpa": _sdpa,
    "tiled": _tiled,
    "flash": _flash,
    "sdpa_blocks": sdpa_in_query_blocks,
}


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

# SDPA_OPS: aten op that scaled_dot_product_attention dispatches to -> backend name (the kernel floor's table)


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
    name = device_name(device)
    points, ran_out = [], set()
    for s in contexts:
        for impl in impls:
            oom_point = AttentionPoint(
                impl, s, float("nan"), 0, "", backward, batch, heads, head_dim, name, status="oom"
            )
            if impl in ran_out:  # a longer context will not fit either
                points.append(oom_point)
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

            def measured(call=call):
                with torch.enable_grad() if backward else torch.no_grad():
                    ms = time_fn(call, device=device, repeats=repeats, warmup=1) * 1e3
                    return (ms, *peak_bytes(call, device=device))

            got, oom = unless_it_fails(measured)  # out of memory is a point of the sweep
            if oom:
                ran_out.add(impl)
                points.append(oom_point)
            else:
                ms, peak, method = got
                points.append(AttentionPoint(impl, s, ms, peak, method, backward, batch, heads, head_dim, name))
            if progress:
                progress(impl, s)
            del q, k, v, call
            if impl in ran_out:  # free what the failed call left (its inputs, held here) before the next size
                free_memory()
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


# ---- does the kernel skip the masked half? ------------------------------------------------------


def causal_skipping(
    batch: int = 8,
    heads: int = 2,
    s: int = 512,
    head_dim: int = 64,
    blocks: int = 4,
    repeats: int = 5,
    device="cpu",
    dtype=torch.float32,
) -> dict:
    """Forward + backward of SDPA three ways, the three taking turns `repeats` times after a warm-up each (a machine
    that slows down slows all alike): the whole square (not causal), causal, and causal in `blocks` query blocks
    (sdpa_in_query_blocks). {"ms": {way: (min, median, max)}, the shape, the device}. Causal needs half the pairs; a
    kernel that skips the tiles above the diagonal takes about half the time of the whole square where a call is long
    enough to be timed (no launch overhead to hide it), one that computes the square and masks it takes as long."""
    q, k, v = random_qkv(batch, heads, s, head_dim, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(q)
    ways = {
        "whole square (not causal)": lambda: F.scaled_dot_product_attention(q, k, v),
        "causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        f"causal, in {blocks} query blocks": lambda: sdpa_in_query_blocks(q, k, v, blocks),
    }
    for attend in ways.values():  # one untimed call each
        torch.autograd.grad(attend(), (q, k, v), grad)
    timers = {name: StepTimer(device) for name in ways}
    for _ in range(repeats):
        for name, attend in ways.items():
            with timers[name].step():
                torch.autograd.grad(attend(), (q, k, v), grad)
    ms = {}
    for name, timer in timers.items():
        t = [x * 1e3 for x in timer.times]
        ms[name] = (min(t), statistics.median(t), max(t))
    dtype_name = str(dtype).removeprefix("torch.")
    shape = dict(batch=batch, heads=heads, s=s, head_dim=head_dim, blocks=blocks, dtype=dtype_name)
    return {"ms": ms, "shape": shape, "device": device_name(device), "torch": torch.__version__}
