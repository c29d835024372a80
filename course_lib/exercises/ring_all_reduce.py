"""Notebook 07: a ring all-reduce simulated from point-to-point sends: reduce-scatter, then all-gather, over n ranks
that each hold n chunks of a gradient (what NCCL's ring does; no process group needed)."""

from __future__ import annotations

import torch

from .core import Case, Exercise, Mistake


def _send(chunks, step_chunk, combine):
    """One step of the ring: every rank r sends its chunk step_chunk(r) to rank r + 1 at the same time, which
    combines it into its own copy of that chunk (adds it in reduce-scatter, keeps it in all-gather)."""
    n = len(chunks)
    messages = [(r, step_chunk(r) % n, chunks[r][step_chunk(r) % n].clone()) for r in range(n)]  # all sent at once
    for r, c, data in messages:
        dst = (r + 1) % n
        chunks[dst][c] = combine(chunks[dst][c], data)


def ring_all_reduce(chunks: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """The reference. chunks[r][c]: rank r's chunk c of its gradient (n ranks, n chunks each). Returns every rank's
    chunks after the all-reduce: each chunk the sum over the ranks. Reduce-scatter: n - 1 steps; at step k rank r sends
    chunk (r - k) mod n to rank r + 1, which adds it to its own; after it rank r holds the whole sum of chunk
    (r + 1) mod n. All-gather: n - 1 more steps; at step k rank r sends chunk (r + 1 - k) mod n, which rank r + 1 keeps.
    Each rank sends 2 (n - 1) chunks of 1/n of the gradient: 2 (n - 1)/n of it, whatever n."""
    chunks = [[c.clone() for c in rank] for rank in chunks]
    n = len(chunks)
    for k in range(n - 1):
        _send(chunks, lambda r, k=k: r - k, lambda mine, received: mine + received)
    for k in range(n - 1):
        _send(chunks, lambda r, k=k: r + 1 - k, lambda mine, received: received)
    return chunks


def _ranks(n: int, shape, seed: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(shape, generator=gen) for _ in range(n)] for _ in range(n)]


def _cases() -> list[Case]:
    return [
        Case("2 ranks", (_ranks(2, (3,), 0),)),
        Case("4 ranks", (_ranks(4, (5,), 1),)),
        Case("3 ranks, chunks of 2 x 2", (_ranks(3, (2, 2), 2),)),
        Case("1 rank: nothing to send", (_ranks(1, (4,), 3),)),
    ]


def _reduce_scatter_only(chunks):
    chunks = [[c.clone() for c in rank] for rank in chunks]
    for k in range(len(chunks) - 1):
        _send(chunks, lambda r, k=k: r - k, lambda mine, received: mine + received)
    return chunks


def _n_steps(chunks):
    chunks = [[c.clone() for c in rank] for rank in chunks]
    n = len(chunks)
    for k in range(n):
        _send(chunks, lambda r, k=k: r - k, lambda mine, received: mine + received)
    for k in range(n - 1):
        _send(chunks, lambda r, k=k: r - k, lambda mine, received: received)
    return chunks


def _wrong_chunk(chunks):
    chunks = [[c.clone() for c in rank] for rank in chunks]
    n = len(chunks)
    for k in range(n - 1):
        _send(chunks, lambda r, k=k: r + k, lambda mine, received: mine + received)
    for k in range(n - 1):
        _send(chunks, lambda r, k=k: r + 1 - k, lambda mine, received: received)
    return chunks


def _describe(case, expected, got) -> str:
    n = len(expected)
    if len(got) != n or any(len(rank) != n for rank in got):
        return f"the answer should be {n} ranks of {n} chunks each"
    right = [[torch.allclose(g, e, rtol=1e-5, atol=1e-6) for g, e in zip(gr, er)] for gr, er in zip(got, expected)]
    r, c = next((r, c) for r in range(n) for c in range(n) if not right[r][c])
    return (
        f"{sum(map(sum, right))} of the {n * n} chunks (n ranks x n chunks) hold the sum over the ranks; the "
        f"first that does not: rank {r}'s chunk {c}"
    )


EXERCISE = Exercise(
    name="ring_all_reduce",
    notebook="07",
    title="A ring all-reduce from sends",
    reference=ring_all_reduce,
    cases=_cases,
    mistakes=(
        Mistake(
            "all-gather left out",
            _reduce_scatter_only,
            "After the reduce-scatter each rank holds the whole sum of only one chunk, (r + 1) mod n: n - 1 more "
            "steps pass the summed chunks around the ring (all-gather), each rank keeping what it receives.",
        ),
        Mistake(
            "n steps of reduce-scatter",
            _n_steps,
            "The reduce-scatter takes n - 1 steps: after them a chunk has passed every rank once. An n-th step adds a "
            "rank's contribution a second time.",
        ),
        Mistake(
            "the wrong chunk sent",
            _wrong_chunk,
            "At step k rank r passes on the chunk it received at step k - 1, (r - k) mod n, so the partial sum grows "
            "by one rank per hop; sending any other chunk mixes partial sums of different chunks.",
        ),
    ),
    rtol=1e-5,
    atol=1e-6,
    describe=_describe,
    describe_structure=True,
)
