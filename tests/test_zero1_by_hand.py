"""ZeRO-1 by hand (course_lib.distributed.zero1_by_hand): AdamW's state sharded over the ranks, equal to unsharded
torch.optim.AdamW. Without processes: the shards' bounds, and one rank's Zero1AdamW against torch's AdamW step for step,
on the course's GPT and on a model with a frozen weight, a branch unused every other step and tied weights. With 2 and 4
gloo processes: the course's loop trains the same as with torch's AdamW on every rank, each rank holds 1/N of AdamW's
state plus the padding's share, the frozen and unused parameters are skipped as torch skips them, and no collective
warns of its deprecation."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from course_lib import config as C, techniques
from course_lib.distributed import launch as L
from course_lib.distributed.zero1_by_hand import Zero1AdamW, compare_with_torch_adamw, shard_bounds
from course_lib.model import GPT

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="this torch build has no torch.distributed"
)


def test_the_shards_cover_the_padded_buffer():
    assert [shard_bounds(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 12)]  # 2 elements of padding
    assert shard_bounds(12, 4, 3) == (9, 12) and shard_bounds(7, 1, 0) == (0, 7)


def test_one_ranks_zero1_adamw_is_torchs_adamw_to_the_bit():
    # World 1: the shard is the whole buffer, no collective. The course's parameter groups (weight decay on >=2-D
    # tensors only), the tied embedding, a learning rate that changes every step.
    cfg = C.tiny_preset("cpu")
    torch.manual_seed(0)
    a = GPT(cfg.model)
    b = GPT(cfg.model)
    b.load_state_dict(a.state_dict())
    groups = [techniques.param_groups(m, 0.1, True) for m in (a, b)]
    ref = torch.optim.AdamW(groups[0], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    mine = Zero1AdamW(groups[1], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, world=1, rank=0)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1 / (1 + step)) for o in (ref, mine)]
    assert all(p.untyped_storage().data_ptr() == mine.flat.untyped_storage().data_ptr() for p in b.parameters())
    assert b.lm_head.weight is b.wte.weight  # still tied: one Parameter, one piece of the buffer
    for step in range(4):
        x, y = torch.randint(0, 4097, (2, 16)), torch.randint(0, 4097, (2, 16))
        for model, opt, sched in zip((a, b), (ref, mine), schedulers):
            techniques.loss_sum(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(p, q), (step, name)
    state = mine.state[mine.flat]
    assert state["exp_avg"].numel() == sum(p.numel() for p in b.parameters())
    assert state["step"].tolist() == [4.0] * len(list(b.parameters()))  # one counter per tensor, as torch keeps


def test_a_parameter_without_a_gradient_is_skipped_as_torch_skips_it():
    # World 1: a frozen weight (requires_grad=False) in the groups, weight decay 0.1 on it, a branch with no gradient
    # every other step (its own step counter lags: the bias correction sees it), the output tied to the embedding
    got = compare_with_torch_adamw(steps=5, world=1, rank=0)
    assert got["bit_equal_every_step"] and got["max_abs_diff"] == 0.0
    assert got["frozen_unchanged"] and got["branch_unchanged_when_unused"]


def test_treating_a_missing_gradient_as_zero_would_be_seen():
    # What the comparison guards against: AdamW given a zero gradient still decays the weight (and moves it by its
    # moments), so a frozen weight that were fed zeros would drift
    w = torch.nn.Parameter(torch.full((3,), 2.0))
    opt = torch.optim.AdamW([w], lr=1e-2, weight_decay=0.1, foreach=False)
    for _ in range(10):
        w.grad = torch.zeros_like(w)
        opt.step()
    assert not torch.equal(w, torch.full((3,), 2.0))
    mine = Zero1AdamW(
        [torch.nn.Parameter(torch.full((3,), 2.0), requires_grad=False)], lr=1e-2, weight_decay=0.1, world=1, rank=0
    )
    for _ in range(10):
        mine.step()
    assert torch.equal(mine.flat[:3], torch.full((3,), 2.0)) and mine.state[mine.flat]["step"].tolist() == [0.0]


@pytest.mark.filterwarnings("ignore:optimizer contains a parameter group with duplicate parameters")
def test_a_parameter_listed_twice_is_refused():
    # torch's Optimizer only warns; a second piece of the buffer for one parameter would break the flat layout
    lin = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="twice"):
        Zero1AdamW([lin.weight, lin.weight, lin.bias], world=1, rank=0)


# ---- real launches ------------------------------------------------------------------------------------------------

# n_embd 30: 147,270 parameters, which 4 ranks cannot split evenly (2 elements of padding)
CFG = dataclasses.replace(C.tiny_preset("cpu"), lr=1e-2, weight_decay=0.1).with_model(n_embd=30)


@pytest.fixture(scope="module", params=[2, 4])
def launched(request):
    result = L.launch("zero1_by_hand", request.param, cfg=CFG, options={"steps": 3}, device="cpu", timeout_s=300)
    assert result.ok, result.why()
    return result


@pytest.fixture(scope="module")
def ranks(launched):
    return launched.ranks


@pytest.mark.distributed
def test_no_collective_warns_of_its_deprecation(launched):
    # torch 2.13 deprecates all_gather_into_tensor (a FutureWarning, shown once per process): the all-gather is the
    # current call on every torch the course supports
    assert "is deprecated" not in launched.stderr, launched.stderr[-2000:]


@pytest.mark.distributed
def test_frozen_unused_and_tied_parameters_match_torch_across_ranks(ranks):
    for rank in ranks:
        got = rank["frozen_and_tied"]
        assert got["bit_equal_every_step"] and got["max_abs_diff"] == 0.0, (rank["rank"], got)
        assert got["frozen_unchanged"] and got["branch_unchanged_when_unused"]
    # a shard's edge cuts a parameter somewhere: the skipping holds for a parameter split between two ranks
    assert any(rank["frozen_and_tied"]["split_by_this_shard"] for rank in ranks)
    if len(ranks) == 2:
        assert ranks[0]["frozen_and_tied"]["split_by_this_shard"] == ["frozen.weight"]


@pytest.mark.distributed
def test_zero1_trains_as_unsharded_adamw_does(ranks):
    for rank in ranks:
        zero1, replicated = rank["runs"]["zero1"], rank["runs"]["replicated"]
        assert rank["max_abs_param_diff"] <= 1e-6  # the same update, element for element (0.0 here)
        assert zero1["losses"] == pytest.approx(replicated["losses"], rel=1e-6)
        assert zero1["losses"][-1] < zero1["losses"][0]  # it trains


@pytest.mark.distributed
def test_each_rank_keeps_one_shard_of_adamws_state(ranks):
    world = len(ranks)
    for rank in ranks:
        n, size = rank["n_params"], rank["shard_elements"]
        assert size * world - n == rank["padding_elements"] == (-n) % world
        zero1, replicated = rank["runs"]["zero1"], rank["runs"]["replicated"]
        # measured from the tensors: AdamW's two fp32 moments for the shard only, and a step counter per tensor the
        # shard has a share of
        tensors = zero1["parameters_in_shard"]
        assert (
            zero1["optimizer_state_bytes"] == 8 * size + 4 * tensors == rank["optimizer_state_bytes_formula"]["zero1"]
        )
        assert replicated["optimizer_state_bytes"] == rank["optimizer_state_bytes_formula"]["replicated"] >= 8 * n
        assert zero1["optimizer_state_bytes"] <= 8 * n / world + 8 * (world - 1) + 4 * tensors
        # the parameters live in the padded flat buffer
        assert zero1["bytes_held"]["parameters"] == 4 * size * world
        assert replicated["bytes_held"]["parameters"] == 4 * n
        # per step: one all-reduce of the gradients, and (ZeRO-1 only) one all-gather of the updated shards
        assert {k: v["calls"] for k, v in zero1["collectives_last_step"].items()} == {"all-reduce": 1, "all-gather": 1}
        assert zero1["collectives_last_step"]["all-gather"]["bytes"] == 4 * size * world
        assert {k: v["calls"] for k, v in replicated["collectives_last_step"].items()} == {"all-reduce": 1}
    if world == 4:
        assert ranks[0]["padding_elements"] == 2


@pytest.mark.distributed
def test_the_figure_has_two_stacked_bars_per_rank(ranks):
    from course_lib.distributed.zero1_by_hand import plot_state_bytes

    ax = plot_state_bytes(ranks).axes[0]
    assert len(ax.patches) == 2 * 2 * len(ranks)  # (every rank's AdamW, ZeRO-1) x (parameters, state)
    heights = [p.get_height() for p in ax.patches]
    world = len(ranks)
    state_replicated, state_zero1 = heights[world : 2 * world], heights[3 * world :]
    assert all(z < r / world + 1e-3 for z, r in zip(state_zero1, state_replicated))  # MiB: 1/N, plus a few bytes
