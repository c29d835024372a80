import socket
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import course_lib
from course_lib import bpe, data

ROOT = Path(__file__).resolve().parent.parent


def test_corpus_comes_from_the_installed_package():
    plays = data.load_plays()
    assert len(plays) >= 30 and "hamlet" in plays
    assert "To be, or not to be" in plays["hamlet"]
    assert "**" not in plays["hamlet"]  # markdown removed


def test_tokenizer_loads_offline_and_round_trips(monkeypatch):
    def no_network(*a, **k):
        raise AssertionError("the tokenizer must not touch the network")

    monkeypatch.setattr(socket, "create_connection", no_network)
    data.get_tokenizer.cache_clear()
    enc = data.get_tokenizer()
    assert enc.n_vocab == 4097
    text = "Now is the winter of our discontent\nMade glorious summer by this sun of York;"
    ids = enc.encode(text)
    assert enc.decode(ids) == text
    assert len(ids) < len(text) / 2.5  # BPE compresses English several characters per token
    assert data.pad_id(enc) == 4096 and enc.eot_token == 4095


def test_shipped_data_is_the_repository_data_folder_in_a_checkout():
    """Editable install (or the bare source tree): the package data `course_lib._data` is the top-level data/ itself,
    so `python -m course_lib bpe` rewrites the repository's file. Installed copies: tests/test_packaging.py."""
    if Path(course_lib.__file__).resolve().parent.parent != ROOT:
        pytest.skip("course_lib is not imported from this checkout")
    assert data.DATA_DIR.resolve() == ROOT / "data"
    assert data.RANKS_FILE.is_file() and data.MEASURED_DIR.is_dir()


def test_shipped_ranks_are_tiktoken_format_and_merge_ordered():
    ranks = bpe.load_ranks(data.RANKS_FILE)
    assert len(ranks) == data.N_RANKS
    assert sorted(ranks.values()) == list(range(data.N_RANKS))
    assert all(ranks[bytes([b])] == b for b in range(256))


def test_bpe_trainer_merges_the_most_frequent_pair_first():
    ranks = bpe.train_bpe("ab ab ab ab cd cd ab", 258)
    assert ranks[b"ab"] == 256  # "ab" is the most frequent pair
    assert ranks[b" ab"] == 257
    assert bpe.train_bpe("ab ab ab ab cd cd ab", 258) == ranks  # deterministic


def test_batches_are_shifted_by_one():
    stream = torch.arange(1000)
    x, y = data.random_windows(stream, 4, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y, x + 1)
    # one gather, the same windows as slicing each start (and no Python list of batch_size views)
    starts = torch.randint(0, 1000 - 16 - 1, (4,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(x, torch.stack([stream[s : s + 16] for s in starts.tolist()]))


def test_splits_are_disjoint_and_cover_the_stream():
    s = data.load_splits()
    assert len(s.train) + len(s.val) == len(data.token_stream())
    assert len(s.val) > 0.04 * len(data.token_stream())


def test_padding_adds_nothing_to_the_loss():
    seqs = [torch.arange(2, 12), torch.arange(3, 7)]
    x, y = data.pad_sequences(seqs, context=12, pad=99)
    assert (x[1, 3:] == 99).all() and (y[1, 3:] == data.IGNORE_INDEX).all()
    assert data.count_targets(y) == 9 + 3
    logits = torch.randn(2, 12, 100)
    loss = F.cross_entropy(logits.view(-1, 100), y.view(-1), ignore_index=data.IGNORE_INDEX, reduction="sum")
    logits2 = logits.clone()
    logits2[1, 3:] = torch.randn(9, 100) * 10  # whatever the model says at padded positions
    loss2 = F.cross_entropy(logits2.view(-1, 100), y.view(-1), ignore_index=data.IGNORE_INDEX, reduction="sum")
    torch.testing.assert_close(loss, loss2)


def test_too_short_sequence_is_refused():
    with pytest.raises(ValueError, match="at least 2 tokens"):
        data.pad_sequences([torch.tensor([1])], 4, 0)


@pytest.fixture
def fresh_stream(tmp_path, monkeypatch):
    """token_stream as a new process sees it, with its cache in tmp_path; the process's own copy is forgotten after."""
    monkeypatch.setenv("COURSE_CACHE_DIR", str(tmp_path / "cache"))
    data.token_stream.cache_clear()
    yield tmp_path / "cache"
    data.token_stream.cache_clear()


def test_the_token_stream_is_cached_on_disk_and_read_back_equal(fresh_stream, monkeypatch):
    encoded = data.token_stream()
    (cached,) = fresh_stream.glob("tokens-shakespeare-*.pt")
    data.token_stream.cache_clear()

    def not_again(text):
        raise AssertionError("encoded again although the cache holds the stream")

    monkeypatch.setattr(data.get_tokenizer(), "encode_ordinary", not_again)
    again = data.token_stream()
    assert again.dtype == torch.long and torch.equal(again, encoded)
    assert encoded.max() < data.get_tokenizer().n_vocab


def test_changed_plays_make_a_new_cache_entry_not_a_stale_read(fresh_stream, monkeypatch):
    data.token_stream()
    data.token_stream.cache_clear()
    monkeypatch.setattr(data, "load_plays", lambda: {"sonnet": "Shall I compare thee to a summer's day?"})
    short = data.token_stream()
    enc = data.get_tokenizer()
    assert short.tolist() == enc.encode_ordinary("Shall I compare thee to a summer's day?") + [enc.eot_token]
    assert len(list(fresh_stream.glob("tokens-shakespeare-*.pt"))) == 2


def test_a_damaged_or_unwritable_cache_is_encoded_again(fresh_stream, monkeypatch, tmp_path):
    encoded = data.token_stream()
    (cached,) = fresh_stream.glob("tokens-shakespeare-*.pt")
    cached.write_bytes(cached.read_bytes()[:1000])  # a file cut short
    data.token_stream.cache_clear()
    assert torch.equal(data.token_stream(), encoded)
    assert cached.stat().st_size > 1000  # written whole again
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv("COURSE_CACHE_DIR", str(blocker / "cache"))  # cannot be created: no cache, the same stream
    data.token_stream.cache_clear()
    assert torch.equal(data.token_stream(), encoded)


def test_a_cache_write_that_fails_any_way_leaves_the_run_and_no_partial_file(fresh_stream, monkeypatch):
    """torch.save reports a full or read-only disk as a RuntimeError, not an OSError: still no failed run."""

    def full_disk(obj, f):
        Path(f).write_bytes(b"half")
        raise RuntimeError("[enforce fail at inline_container.cc] . PytorchStreamWriter failed writing file")

    monkeypatch.setattr(data.torch, "save", full_disk)
    stream = data.token_stream()
    assert len(stream) > 1_000_000 and stream.dtype == torch.long
    assert list(fresh_stream.iterdir()) == []  # neither a cache file nor the partial one
