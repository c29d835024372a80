"""Notebook 08: tensor parallelism of the course's MLP by hand (Megatron-LM's split): the first weight by columns, the
second by rows, so that each rank computes a partial output and one all-reduce (a sum) gives the full one."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .core import Case, Exercise, Mistake


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")  # course_lib.model.MLP's GELU


def mlp_partials(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, n: int) -> list[torch.Tensor]:
    """The reference. x (tokens, h), w1 (h, 4h) and b1 (4h,), w2 (4h, h): the course's MLP, gelu(x @ w1 + b1) @ w2
    (GELU's tanh form; with nn.Linear, w1 = c_fc.weight.T, w2 = c_proj.weight.T) split over n ranks. Rank r holds the
    r-th of n equal column blocks of w1 and b1 (whole hidden units) and the same rows of w2, and computes
    gelu(x @ w1_r + b1_r) @ w2_r with no communication: GELU acts on each hidden unit alone. Returns the n partial
    outputs, each (tokens, h); their sum (what an all-reduce makes), plus c_proj's bias once, is the MLP's output."""
    return [_gelu(x @ a + c) @ b for a, c, b in zip(w1.chunk(n, dim=1), b1.chunk(n), w2.chunk(n, dim=0))]


def _weights(tokens: int, h: int, seed: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, h, generator=gen, dtype=dtype)
    w1 = torch.randn(h, 4 * h, generator=gen, dtype=dtype) / h**0.5
    b1 = torch.randn(4 * h, generator=gen, dtype=dtype) * 0.1
    return x, w1, b1, torch.randn(4 * h, h, generator=gen, dtype=dtype) / (2 * h**0.5)


def _cases() -> list[Case]:
    return [
        Case("2 ranks", (*_weights(6, 8, 0), 2)),
        Case("4 ranks", (*_weights(5, 16, 1), 4)),
        Case("float64, 8 ranks", (*_weights(3, 8, 2, torch.float64), 8)),
        Case("1 rank: the whole MLP", (*_weights(4, 8, 3), 1)),
    ]


def _gelu_after_sum(x, w1, b1, w2, n):
    return [(x @ a + c) @ b for a, c, b in zip(w1.chunk(n, dim=1), b1.chunk(n), w2.chunk(n, dim=0))]


def _rows_first(x, w1, b1, w2, n):
    return [_gelu(xr @ a + b1 / n) @ w2 / n for xr, a in zip(x.chunk(n, dim=1), w1.chunk(n, dim=0))]


def _strided_rows(x, w1, b1, w2, n):
    return [_gelu(x @ a + c) @ w2[r::n] for r, (a, c) in enumerate(zip(w1.chunk(n, dim=1), b1.chunk(n)))]


def _describe(case, expected, got) -> str:
    full, total = sum(expected), sum(got)
    error = float((total - full).norm() / full.norm())
    return f"the sum of your partial outputs is off from gelu(x @ w1 + b1) @ w2 by {error:.3g} of its norm"


EXERCISE = Exercise(
    name="mlp_partials",
    notebook="08",
    title="A tensor-parallel MLP: column, then row",
    reference=mlp_partials,
    cases=_cases,
    mistakes=(
        Mistake(
            "GELU left for after the all-reduce",
            _gelu_after_sum,
            "GELU belongs before the second matmul, on each rank: a column split keeps every hidden unit whole on one "
            "rank, so gelu(x @ w1_r + b1_r) needs nothing from the others, while GELU of the summed output is another "
            "function.",
        ),
        Mistake(
            "the first weight split by rows",
            _rows_first,
            "Split by rows (the input features), x @ w1_r is a partial sum of the hidden layer, and GELU of a partial "
            "sum is not a partial GELU: the first weight is split by columns (Megatron-LM's column-parallel layer).",
        ),
        Mistake(
            "the second weight's rows strided",
            _strided_rows,
            "Rank r's rows of w2 must be the same hidden units as its columns of w1: the r-th contiguous block "
            "(chunk), not every n-th row.",
        ),
    ),
    rtol=1e-5,
    atol=1e-6,
    describe=_describe,
)
