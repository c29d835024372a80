"""A byte-level BPE trainer small enough to read, producing ranks that tiktoken can load. The course ships the ranks
it trained on the Shakespeare corpus (data/shakespeare_bpe.tiktoken); `python -m course_lib bpe` trains them again."""

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
    """Learn merges until there are `n_ranks` tokens (256 single bytes + merges), ranked in merge order: tiktoken
    merges the pair whose result has the lowest rank first."""
    if n_ranks < 256:
        raise ValueError(f"n_ranks must be at least 256 (the single bytes), got {n_ranks}")
    words = Counter(regex.findall(SPLIT_PATTERN, text))
    # Each distinct word is a list of tokens, counted with its frequency: work follows distinct words, not the text.
    seqs = [[bytes([b]) for b in w.encode("utf-8")] for w in words]
    freqs = list(words.values())
    pair_counts: Counter[tuple[bytes, bytes]] = Counter()
    where = defaultdict(set)  # pair -> the words it occurs in

    def count(i: int, sign: int) -> None:
        """Add word i's pairs to the counts (sign -1: take them away)."""
        for pair in zip(seqs[i], seqs[i][1:]):
            pair_counts[pair] += sign * freqs[i]
            if sign > 0:
                where[pair].add(i)
            else:
                where[pair].discard(i)
                if pair_counts[pair] <= 0:  # in no word now
                    del pair_counts[pair]

    for i in range(len(seqs)):
        count(i, 1)
    ranks = {bytes([b]): b for b in range(256)}
    while len(ranks) < n_ranks and pair_counts:
        best = max(pair_counts, key=lambda p: (pair_counts[p], p))  # ties broken by the bytes: deterministic
        if pair_counts[best] < 2:
            break
        merged = best[0] + best[1]
        ranks[merged] = len(ranks)
        for i in where.pop(best):
            count(i, -1)
            out: list[bytes] = []  # the word with `best` merged, left to right
            for tok in seqs[i]:
                if out and out[-1] == best[0] and tok == best[1]:  # (a merged token is never best[0]: it is longer)
                    out[-1] = merged
                else:
                    out.append(tok)
            seqs[i] = out
            count(i, 1)
    return ranks


def save_ranks(ranks: dict[bytes, int], path: Path) -> None:
    """Write ranks in tiktoken's own file format: base64(token) rank, one per line."""
    lines = [f"{base64.b64encode(tok).decode()} {rank}" for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])]
    # in one step: a full disk or a Ctrl-C leaves the old ranks whole, and the tokenizer working
    write_atomic(Path(path), lambda f: f.write_text("\n".join(lines) + "\n"), strict=True)


def load_ranks(path: Path) -> dict[bytes, int]:
    pairs = (line.split() for line in Path(path).read_text().splitlines() if line)
    return {base64.b64decode(tok): int(rank) for tok, rank in pairs}
