"""ZeRO-1 by hand (course_lib.distributed.zero1_by_hand): AdamW's state sharded over the ranks, equal to unsharded
torch.optim.AdamW. Without processes: the shards' bounds, and one rank's Zero1AdamW against torch's AdamW step for step.
With 2 and 4 gloo processes: the course's loop trains the same as with torch's AdamW on every rank, and each rank holds
1/N of AdamW's state plus the padding's share."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from course_lib import config as C, techniques
from course_lib.distributed import launch as L
from course_lib.distributed.zero1_by_hand import Zero1AdamW, shard_bounds
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
    assert state["exp_avg"].numel() == sum(p.numel() for p in b.parameters()) and state["step"].item() == 4


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
def ranks(request):
    result = L.launch("zero1_by_hand", request.param, cfg=CFG, options={"steps": 3}, device="cpu", timeout_s=300)
    assert result.ok, result.why()
    return result.ranks


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
        # measured from the tensors: AdamW's two fp32 moments for the shard only, and one step counter
        assert zero1["optimizer_state_bytes"] == 8 * size + 4 == rank["optimizer_state_bytes_formula"]["zero1"]
        assert replicated["optimizer_state_bytes"] == rank["optimizer_state_bytes_formula"]["replicated"] >= 8 * n
        assert zero1["optimizer_state_bytes"] <= replicated["optimizer_state_bytes"] / world + 8 * (world - 1) + 4
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
