"""Ring attention by hand (course_lib.distributed.ring_attention): its pieces on one process (the merge by log-sum-exp,
the tile count, the layouts), then the whole under gloo with 2 and 4 processes: outputs and gradients equal SDPA's on
the whole sequence under both layouts, the zig-zag layout balances the causal work and the contiguous one does not,
and the memory per rank falls as the ranks grow."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from course_lib.config import ConfigError
from course_lib.distributed import ring_attention as R
from course_lib.distributed.launch import check_strategy_options, launch
from course_lib.lessons.attention_by_hand import flash_backward, tiled_attention


def _qkv(s, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, s, d, generator=gen) for _ in range(4)]


def test_merging_by_log_sum_exp_gives_attention_over_all_the_keys():
    q, k, v, _ = _qkv(48)
    whole = F.scaled_dot_product_attention(q, k, v)
    a = tiled_attention(q, k[..., :20, :], v[..., :20, :], 16, 16, causal=False, return_lse=True)
    b = tiled_attention(q, k[..., 20:, :], v[..., 20:, :], 16, 16, causal=False, return_lse=True)
    out, lse = R.merge(*a, *b)
    torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, torch.logsumexp(q @ k.transpose(-2, -1) / math.sqrt(16), dim=-1))
    # the order does not matter, and a part that saw no key (L = -inf) changes nothing
    torch.testing.assert_close(R.merge(*b, *a)[0], out)
    nothing = (torch.zeros_like(out), torch.full_like(lse, float("-inf")))
    torch.testing.assert_close(R.merge(*nothing, out, lse)[0], out)
    # a plain average of the two parts is not the attention over the union: the weights are what the merge adds
    assert (0.5 * (a[0] + b[0]) - whole).abs().max() > 1e-2


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("s, block", [(64, 16), (96, 32)])
def test_the_tiles_counted_are_the_tiles_computed(s, block, causal):
    """Every tile costs 2 matmuls of (block x block x d) forward and 5 backward (the recomputed scores, dV, dP, dQ,
    dK): FlopCounterMode's count over the tile count gives exactly that."""
    q, k, v, g = _qkv(s)
    per_product = 2 * 2 * block * block * 16  # FLOPs of one (block x block x d) product, batch 1 x 2 heads
    with FlopCounterMode(display=False) as fwd:
        out, lse = tiled_attention(q, k, v, block, block, causal, return_lse=True)
    with FlopCounterMode(display=False) as bwd:
        flash_backward(q, k, v, out, lse, g, causal, block, block)
    n = R.tiles(s, s, block, causal)
    assert fwd.get_total_flops() == 2 * per_product * n
    assert bwd.get_total_flops() == 5 * per_product * n
    assert n == ((s // block) * (s // block + 1) // 2 if causal else (s // block) ** 2)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_each_layout_gives_every_chunk_to_exactly_one_rank(world):
    for layout in R.LAYOUTS:
        held = sorted(c for r in range(world) for c in R.chunks_of(r, world, layout))
        assert held == list(range(2 * world)), layout
    x = torch.arange(8 * world).view(1, 8 * world, 1)
    assert R.take(x, 0, world, "zigzag").flatten().tolist() == [0, 1, 2, 3] + list(range(8 * world - 4, 8 * world))


@pytest.mark.parametrize("world", [2, 4, 8])
def test_zigzag_balances_the_causal_work_and_the_contiguous_split_does_not(world):
    s, block = 64 * world, 16
    naive, zigzag = (R.work_per_rank(world, layout, s, block) for layout in R.LAYOUTS)
    assert sum(naive) == sum(zigzag) == R.tiles(s, s, block, True)  # the same work, shared out differently
    assert len(set(zigzag)) == 1
    assert naive == sorted(naive) and naive[-1] > zigzag[0] > naive[0]
    # without the mask every split is balanced
    assert len(set(R.work_per_rank(world, "naive", s, block, causal=False))) == 1


def test_options_that_make_no_run_are_refused_before_any_process_starts():
    with pytest.raises(ConfigError, match="zigzag"):
        check_strategy_options("ring_attention", {"layouts": ["zigzg"]})
    with pytest.raises(ConfigError, match=">= 1"):
        check_strategy_options("ring_attention", {"block": 0})
    with pytest.raises(ConfigError, match="8 equal chunks"):
        R.check({"length": 100}, world=4)


# ---- under gloo, 2 and 4 processes -------------------------------------------------------------------------------

OPTIONS = {"length": 128, "head_dim": 16, "block": 16, "memory_lengths": [256, 512], "repeats": 1}


@pytest.fixture(scope="module")
def runs():
    """{world size: its ranks' results}: one launch with 2 processes, one with 4."""
    out = {}
    for world in (2, 4):
        result = launch("ring_attention", world, options=OPTIONS, device="cpu", timeout_s=300)
        assert result.ok, result.why()
        out[world] = result.ranks
    return out


@pytest.mark.distributed
def test_outputs_and_gradients_equal_full_attention(runs):
    for world, ranks in runs.items():
        for rank in ranks:
            assert [r["layout"] for r in rank["runs"]] == list(R.LAYOUTS)
            for run in rank["runs"]:
                for name, diff in run["max_abs_diff"].items():  # fp32, whole-sequence SDPA against the ring
                    assert diff <= 1e-5 * max(1.0, run["max_abs"][name]), (world, rank["rank"], run["layout"], name)
    assert {"device", "torch", "date"} <= set(runs[2][0]["provenance"])


@pytest.mark.distributed
def test_the_work_per_rank_counted_in_the_run(runs):
    for world, ranks in runs.items():
        for i, layout in enumerate(R.LAYOUTS):
            counted = [rank["runs"][i]["forward_tiles"] for rank in ranks]
            assert counted == R.work_per_rank(world, layout, OPTIONS["length"], OPTIONS["block"])
            assert counted == [rank["runs"][i]["backward_tiles"] for rank in ranks]
        naive, zigzag = ([rank["runs"][i]["forward_tiles"] for rank in ranks] for i in range(2))
        assert len(set(zigzag)) == 1 and max(naive) > zigzag[0] > min(naive)
        # each rank sends n-1 key/value hops forward, n-1 backward and n dK/dV hops, each a (K, V) pair of its rows
        pair_bytes = 2 * 2 * (OPTIONS["length"] // world) * OPTIONS["head_dim"] * 4  # (k, v) x 2 heads x rows x d x 4
        assert all(run["bytes_sent"] == (3 * world - 2) * pair_bytes for rank in ranks for run in rank["runs"])


@pytest.mark.distributed
def test_memory_per_rank_falls_with_the_number_of_ranks(runs):
    """Peak bytes of one forward and backward per rank (CPU ledger). Everything a rank allocates has s/n rows, plus
    a few (block x block) tiles: the growth per token of s falls with n (at 2 ranks the block received last is never
    sent on, so 4 ranks do not quite halve it), and at 4 ranks a rank needs less than one process on the whole
    sequence."""
    two, four = ({m["s"]: m for m in runs[n][0]["memory"]} for n in (2, 4))
    lengths = sorted(two)
    for s in lengths:
        assert four[s]["peak_bytes"] < two[s]["peak_bytes"]
    slope = {n: (m[lengths[-1]]["peak_bytes"] - m[lengths[0]]["peak_bytes"]) / (lengths[-1] - lengths[0])
             for n, m in ((2, two), (4, four))}  # fmt: skip
    assert 0.4 < slope[4] / slope[2] < 0.7, slope
    assert four[lengths[-1]]["peak_bytes"] < four[lengths[-1]]["one_process_peak_bytes"]
