"""Notebook 04: merging two partial attention results by their log-sum-exp (the online softmax's step, and ring
attention's merge)."""

from __future__ import annotations

import torch

from .core import Case, Exercise, Mistake


def merge_tiles(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference. o_i (rows, d): softmax-weighted values over key set i alone; lse_i (rows,): the log of that
    softmax's denominator. Over both key sets the denominator is e^lse1 + e^lse2, so each part is weighted by its share
    e^(lse_i - lse), computed without ever forming e^lse_i (it overflows)."""
    lse = torch.logaddexp(lse1, lse2)
    w1, w2 = torch.exp(lse1 - lse), torch.exp(lse2 - lse)
    return w1[:, None] * o1 + w2[:, None] * o2, lse


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
