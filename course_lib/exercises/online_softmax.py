"""Notebook 04: merging two partial attention results by their log-sum-exp (the online softmax's step, and ring
attention's merge)."""

from __future__ import annotations

import torch

from .. import flash_attention
from .core import Case, Exercise, Mistake


def merge_tiles(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference. o_i (rows, d): softmax-weighted values over key set i alone; lse_i (rows,): the log of that
    softmax's denominator. Over both key sets the denominator is e^lse1 + e^lse2, so each part is weighted by its share
    e^(lse_i - lse), computed without ever forming e^lse_i (it overflows). Ring attention merges its blocks with it."""
    return flash_attention.merge(o1, lse1, o2, lse2)


def _tile(rows, d, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, d, generator=gen), torch.randn(rows, generator=gen) * scale


def _cases() -> list[Case]:
    o1, l1 = _tile(4, 8, 1.0, 0)
    o2, l2 = _tile(4, 8, 1.0, 1)
    big1, big2 = l1 + 100.0, l2 + 95.0  # large scores: e^lse overflows fp32
    masked = torch.full((4,), float("-inf"))  # a tile every query is masked from (causal): no weight at all
    return [
        Case("two tiles of similar weight", (o1, l1, o2, l2)),
        Case("large scores (e^lse would overflow)", (o1, big1, o2, big2)),
        Case("one tile dominates", (o1, l1 + 20.0, o2, l2)),
        Case("a fully masked second tile (lse = -inf)", (o1, l1, torch.zeros_like(o2), masked)),
    ]


def _average(o1, lse1, o2, lse2):
    return (o1 + o2) / 2, torch.logaddexp(lse1, lse2)


def _unshifted(o1, lse1, o2, lse2):
    e1, e2 = torch.exp(lse1), torch.exp(lse2)
    return (e1[:, None] * o1 + e2[:, None] * o2) / (e1 + e2)[:, None], torch.log(e1 + e2)


def _max_lse(o1, lse1, o2, lse2):
    out, _ = merge_tiles(o1, lse1, o2, lse2)
    return out, torch.maximum(lse1, lse2)


EXERCISE = Exercise(
    name="merge_tiles",
    notebook="04",
    title="Merging two tiles by their log-sum-exp",
    reference=merge_tiles,
    cases=_cases,
    mistakes=(
        Mistake(
            "a plain average",
            _average,
            "Each part must count by its share of the softmax's mass, e^(lse_i - lse) with lse = log(e^lse1 + "
            "e^lse2), not one half each.",
        ),
        Mistake(
            "e^lse without the shift",
            _unshifted,
            "e^lse overflows for large scores (e^89 is already infinite in fp32): subtract the larger lse before "
            "exponentiating, as torch.logaddexp does.",
        ),
        Mistake(
            "the new lse as a max",
            _max_lse,
            "The merged lse is log(e^lse1 + e^lse2) (torch.logaddexp), not max(lse1, lse2): the smaller part adds "
            "to the denominator too.",
        ),
    ),
    rtol=1e-5,
    atol=1e-5,
)


def online_softmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """The reference: softmax over the last dimension of x (rows, n). The exercise computes it reading the row in
    blocks of `block` columns, keeping a running maximum m and a running sum l of exp(x - m), rescaling l by
    exp(m_old - m_new) when the maximum grows, then normalising; torch's softmax gives the same numbers."""
    return torch.softmax(x, dim=-1)


def _softmax_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(0)
    rising = torch.arange(10.0).repeat(3, 1) + torch.randn(3, 10, generator=gen)
    masked = torch.randn(2, 12, generator=gen)
    masked[:, 7:] = float("-inf")  # keys after the query (causal): no weight
    return [
        Case("scores in one block", (torch.randn(4, 8, generator=gen), 8)),
        Case("scores that grow along the row (the maximum moves at every block)", (rising, 3)),
        Case("a block size that does not divide the row", (torch.randn(3, 11, generator=gen) * 3, 4)),
        Case("masked keys (-inf) at the end of the row", (masked, 4)),
        Case("every score below -200 (e^x underflows fp32)", (torch.randn(2, 9, generator=gen) - 250.0, 4)),
    ]


def _blocks(x, block):
    return [x[:, j : j + block] for j in range(0, x.shape[-1], block)]


def _not_rescaled(x, block):
    m = torch.full(x.shape[:-1], float("-inf"))
    ell = torch.zeros(x.shape[:-1])
    for xb in _blocks(x, block):
        m = torch.maximum(m, xb.amax(-1))
        ell = ell + torch.exp(xb - m[:, None]).sum(-1)  # the old sum was taken under the old maximum
    return torch.exp(x - m[:, None]) / ell[:, None]


def _max_from_zero(x, block):
    m = torch.zeros(x.shape[:-1])
    ell = torch.zeros(x.shape[:-1])
    for xb in _blocks(x, block):
        m_new = torch.maximum(m, xb.amax(-1))
        ell = ell * torch.exp(m - m_new) + torch.exp(xb - m_new[:, None]).sum(-1)
        m = m_new
    return torch.exp(x - m[:, None]) / ell[:, None]


def _per_block(x, block):
    out = []
    for xb in _blocks(x, block):  # each block's exp over its own sum, written out as a learner would
        e = torch.exp(xb - xb.amax(-1, keepdim=True))
        out.append(e / e.sum(-1, keepdim=True))
    return torch.cat(out, dim=-1)


def _softmax_describe(case, expected, got) -> str:
    sums = got.sum(-1)
    if not torch.allclose(sums, torch.ones_like(sums), atol=1e-4):
        return f"your rows' weights add up to {float(sums.min()):.4g} to {float(sums.max()):.4g}, a softmax's to 1"
    ratio = got / expected
    return f"your weights are {float(ratio.min()):.3g}x to {float(ratio.max()):.3g}x the reference's"


_SOFTMAX_OPS = {"_softmax", "softmax", "_log_softmax", "log_softmax", "logsumexp", "_safe_softmax"}


def _softmax_shortcut(func, out) -> str | None:
    if func.overloadpacket.__name__ in _SOFTMAX_OPS:
        return (
            f"your function calls torch's {func.overloadpacket.__name__}, which reads the whole row at once: the "
            "exercise is to read it in blocks, with a running maximum and a running sum."
        )
    return None


SOFTMAX = Exercise(
    name="online_softmax",
    notebook="04",
    title="The online softmax",
    reference=online_softmax,
    cases=_softmax_cases,
    mistakes=(
        Mistake(
            "each block on its own",
            _per_block,
            "Each block normalised by its own sum: every block's weights then add up to 1. The denominator is the "
            "sum over the whole row, kept as a running l across the blocks.",
        ),
        Mistake(
            "the old sum not rescaled",
            _not_rescaled,
            "When a block raises the maximum from m to m', the sum so far was taken as exp(x - m): multiply it by "
            "exp(m - m') before adding the new block's terms.",
        ),
        Mistake(
            "the maximum started at 0",
            _max_from_zero,
            "Start the running maximum at -inf, not 0: with every score far below 0, exp(x - 0) underflows to 0 and "
            "0/0 gives NaN.",
        ),
    ),
    rtol=1e-5,
    atol=1e-7,
    describe=_softmax_describe,
    shortcut=_softmax_shortcut,
)
