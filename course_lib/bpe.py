"""A byte-level BPE trainer small enough to read, producing ranks that tiktoken can load.

The course ships the ranks it trained on the Shakespeare corpus (data/shakespeare_bpe.tiktoken), so
nothing is downloaded. `python -m course_lib bpe` trains them again.
"""

from __future__ import annotations

import base64
from collections import Counter, defaultdict
from pathlib import Path

import regex

from .cache import write_atomic

# Pre-tokenisation: split text into words (with their leading space), numbers, punctuation runs and
# whitespace, so that merges never cross a word boundary. Same idea as GPT-2's pattern.
SPLIT_PATTERN = r"""'(?:s|t|re|ve|m|ll|d)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def train_bpe(text: str, n_ranks: int) -> dict[bytes, int]:
    """Learn merges until there are `n_ranks` tokens (256 single bytes + merges).

    Rank order is merge order, which is what tiktoken assumes: it merges the pair whose result has the
    lowest rank first.
    """
    if n_ranks < 256:
        raise ValueError(f"n_ranks must be at least 256 (the single bytes), got {n_ranks}")
    words = Counter(regex.findall(SPLIT_PATTERN, text))
    # Each distinct word is a list of token ids; work is proportional to distinct words, not to text.
    seqs: list[list[bytes]] = [[bytes([b]) for b in w.encode("utf-8")] for w in words]
    freqs = list(words.values())
    pair_counts: Counter[tuple[bytes, bytes]] = Counter()
    where: defaultdict[tuple[bytes, bytes], set[int]] = defaultdict(set)
    for i, seq in enumerate(seqs):
        for pair in zip(seq, seq[1:]):
            pair_counts[pair] += freqs[i]
            where[pair].add(i)

    ranks = {bytes([b]): b for b in range(256)}
    while len(ranks) < n_ranks and pair_counts:
        # Ties broken by the bytes themselves so training is deterministic.
        best = max(pair_counts, key=lambda p: (pair_counts[p], p))
        if pair_counts[best] < 2:
            break
        merged = best[0] + best[1]
        ranks[merged] = len(ranks)
        for i in list(where[best]):
            seq, f = seqs[i], freqs[i]
            for pair in zip(seq, seq[1:]):  # remove this word's old pairs
                pair_counts[pair] -= f
                if pair_counts[pair] <= 0:
                    del pair_counts[pair]
                where[pair].discard(i)
            out, j = [], 0
            while j < len(seq):
                if j + 1 < len(seq) and seq[j] == best[0] and seq[j + 1] == best[1]:
                    out.append(merged)
                    j += 2
                else:
                    out.append(seq[j])
                    j += 1
            seqs[i] = out
            for pair in zip(out, out[1:]):
                pair_counts[pair] += f
                where[pair].add(i)
        where.pop(best, None)
    return ranks


def save_ranks(ranks: dict[bytes, int], path: Path) -> None:
    """Write ranks in tiktoken's own file format: base64(token) rank, one per line."""
    lines = [f"{base64.b64encode(tok).decode()} {rank}" for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])]
    # in one step: a full disk or a Ctrl-C leaves the old ranks whole, and the tokenizer working
    write_atomic(Path(path), lambda f: f.write_text("\n".join(lines) + "\n"), strict=True)


def load_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    for line in Path(path).read_text().splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    return ranks
