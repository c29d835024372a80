"""Pipeline schedules (course_lib.distributed.pipeline): GPipe, 1F1B, interleaved 1F1B, the two zero-bubble ones.

Without processes: the bubble's formulas, the bubble measured from timelines, a schedule's order replayed at equal
stage work, the stages' placement, the bytes saved for backward, a rank holding both ends of the tied embedding.
With processes (gloo, 2 and 4 ranks; the 4-rank model gets 8 blocks for its 8 stages): every schedule computes the
unsplit model's loss and gradients and trains as one process does; each stage does each piece of work once; the order
torch's schedules run gives the formulas' bubbles; 1F1B's first stage holds p micro-batches' activations, GPipe's all
m. No time is asserted: the machine is shared.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from course_lib import config as C, techniques, train
from course_lib.config import ConfigError, ModelConfig
from course_lib.distributed import _common, launch as L, pipeline as P
from course_lib.model import GPT

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="this torch build has no torch.distributed"
)


# ---- orders of work, written out: what GPipe and 1F1B run ------------------------------------------------------


def gpipe_order(p: int, m: int) -> list[list[tuple[str, int, int]]]:
    """Every rank: all forwards, then all backwards (rank r runs stage r)."""
    return [[("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)] for r in range(p)]


def one_f_one_b_order(p: int, m: int) -> list[list[tuple[str, int, int]]]:
    """Rank r: p-1-r forwards to fill the pipeline, then a forward and a backward in turn, then the backwards left."""
    orders = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        order = [("F", r, i) for i in range(warm)]
        f, b = warm, 0
        while f < m:
            order += [("F", r, f), ("B", r, b)]
            f, b = f + 1, b + 1
        order += [("B", r, i) for i in range(b, m)]
        orders.append(order)
    return orders


# ---- no processes ----------------------------------------------------------------------------------------------


def test_the_formulas():
    assert P.bubble_fraction(4, 1) == 0.75 and P.bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert P.interleaved_bubble_fraction(4, 8, 1) == P.bubble_fraction(4, 8)  # one stage per rank: GPipe's
    assert P.interleaved_bubble_fraction(4, 8, 2) == pytest.approx(3 / 19)  # (p-1)/(v m + p-1)
    assert P.interleaved_bubble_fraction(1, 8, 2) == 0  # one rank never waits
    assert P.formula_bubble("1f1b", 4, 8, 2) == P.bubble_fraction(4, 8)  # stages_per_rank is the interleaved ones'
    assert P.formula_bubble("interleaved_1f1b", 4, 8, 3) == P.interleaved_bubble_fraction(4, 8, 3)
    assert P.formula_bubble("zbv", 4, 8, 3) == P.interleaved_bubble_fraction(4, 8, 2)  # ZB-V: always 2 per rank


def test_the_bubble_measured_from_timelines():
    # Rank 0 works 0-1 and 3-5, rank 1 works 1-2 and 2-3: 5 of the 2 x 5 rank-units of the step are busy.
    timelines = [[("F", 0, 0.0, 1.0), ("B", 0, 3.0, 5.0)], [("F", 0, 1.0, 2.0), ("B", 0, 2.0, 3.0)]]
    assert P.timeline_bubble(timelines) == pytest.approx(0.5)
    assert P.timeline_bubble([[("F", 0, 10.0, 12.0)]]) == 0  # one rank, always busy
    # the span runs from the first start to the last end on any rank
    assert P.timeline_bubble([[("F", 0, 0.0, 1.0)], [("F", 0, 3.0, 4.0)]]) == pytest.approx(1 - 2 / 8)


def test_gpipe_by_hand_replayed():
    # p=2, m=2, F=1, B=2. Rank 1: F0 1-2, F1 2-3, B0 3-5, B1 5-7; rank 0 waits for rank 1's backwards: B0 5-7, B1 7-9.
    (r0, r1) = P.simulate(gpipe_order(2, 2))
    assert [(k, mb, a, b) for k, mb, a, b, _ in r0] == [("F", 0, 0, 1), ("F", 1, 1, 2), ("B", 0, 5, 7), ("B", 1, 7, 9)]
    assert [(k, mb, a, b) for k, mb, a, b, _ in r1] == [("F", 0, 1, 2), ("F", 1, 2, 3), ("B", 0, 3, 5), ("B", 1, 5, 7)]
    assert P.timeline_bubble([r0, r1]) == pytest.approx(1 / 3) == P.bubble_fraction(2, 2)


@pytest.mark.parametrize("costs", [None, {"F": 1.0, "B": 3.0}, {"F": 2.0, "B": 2.5}])
def test_gpipe_and_1f1b_orders_give_the_formula_whatever_the_durations(costs):
    for p in range(1, 5):
        for m in range(1, 9):
            for order in (gpipe_order(p, m), one_f_one_b_order(p, m)):
                assert P.schedule_bubble(order, costs) == pytest.approx(P.bubble_fraction(p, m)), (p, m)


def test_a_weight_gradient_waits_for_its_input_gradient_and_an_impossible_order_is_refused():
    # One stage split into I and W: W runs after I; on one rank, nothing is idle.
    (tl,) = P.simulate([[("F", 0, 0), ("I", 0, 0), ("W", 0, 0)]])
    assert [e[:4] for e in tl] == [("F", 0, 0, 1), ("I", 0, 1, 2), ("W", 0, 2, 3)]
    # Rank 0 defers its W's behind the next forward: the two ranks' I's chain, the W's fill the wait.
    deferred = P.schedule_bubble(
        [
            [("F", 0, 0), ("F", 0, 1), ("I", 0, 0), ("I", 0, 1), ("W", 0, 0), ("W", 0, 1)],
            [("F", 1, 0), ("I", 1, 0), ("F", 1, 1), ("I", 1, 1), ("W", 1, 0), ("W", 1, 1)],
        ]
    )
    assert deferred < P.bubble_fraction(2, 2)
    with pytest.raises(ValueError, match="never finishes"):
        P.simulate([[("B", 0, 0), ("F", 0, 0)]])  # a backward before its own forward, on the same rank
    with pytest.raises(ValueError, match="unknown kind"):
        P.simulate([[("X", 0, 0)]])


def test_where_the_stages_go_and_what_cannot_run():
    assert P.stage_ranks("gpipe", 4, 2) == [0, 1, 2, 3]
    assert P.stage_ranks("interleaved_1f1b", 2, 2) == [0, 1, 0, 1]  # loop: stage s on rank s mod p
    assert P.stage_ranks("interleaved_zb", 2, 3) == [0, 1, 0, 1, 0, 1]
    assert P.stage_ranks("zbv", 4, 3) == [0, 1, 2, 3, 3, 2, 1, 0]  # the V, whatever v says
    assert P.why_not("gpipe", 2, 4, 8, 4, 2) is None
    assert "equal micro-batches" in P.why_not("gpipe", 2, 3, 8, 4, 2)
    assert "one per rank" in P.why_not("1f1b", 4, 2, 8, 8, 2)
    assert "8 stages (2 per rank) need at least 8 blocks" in P.why_not("interleaved_1f1b", 4, 4, 8, 4, 2)
    assert "multiple of max(1, m // p) = 2" in P.why_not("interleaved_zb", 4, 9, 9, 8, 2)
    assert P.why_not("interleaved_zb", 4, 6, 6, 8, 2) is None  # one round of 6
    with pytest.raises(ConfigError, match="interleaved_1f1b"):
        P.stages_per_rank("interleaved_1fb1", 2)
    with pytest.raises(ConfigError, match="zbv"):  # before any process starts
        L.check_strategy_options("pipeline", {"schedules": ["gpipe", "zbb"]})
    with pytest.raises(ConfigError, match="at least 1"):
        L.check_strategy_options("pipeline", {"stages_per_rank": 0})


def test_saved_bytes_counts_what_autograd_keeps_until_backward_lets_go():
    lin = torch.nn.Linear(8, 8)
    saved = P.SavedBytes(lin.parameters())
    xs = [torch.randn(4, 8) for _ in range(2)]
    with saved.hooks(0):  # off: counts nothing
        torch.relu(lin(xs[0])).sum().backward()
    assert saved.rank_peak == 0
    saved.on = True
    losses = []
    for stage, x in enumerate(xs):
        with saved.hooks(stage):
            # addmm keeps its input x (for the weight's gradient) and the weight (a parameter: not counted); relu its
            # output; x * x keeps x twice, one storage: counted once
            losses.append((torch.relu(lin(x)) + x * x).sum())
    one = 2 * 4 * 8 * 4  # x and relu's output, fp32
    assert dict(saved.live) == {0: one, 1: one} and saved.rank_peak == 2 * one
    losses[0].backward()  # the first graph is freed: what it kept is released
    assert dict(saved.live) == {0: 0, 1: one}
    losses[1].backward()
    assert saved.rank_live == 0 and dict(saved.peak) == {0: one, 1: one} and saved.rank_peak == 2 * one


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zbv"])
def test_a_rank_holding_both_ends_shares_the_tied_weight(schedule):
    # Four stages on two "ranks", run in one process: with the V (ZB-V), rank 0 holds the first and the last stage and
    # one tied Parameter, whose gradient is the whole model's; with the loop, the two ends hold copies whose gradients
    # sum to it (the all-reduce between the end ranks).
    torch.manual_seed(0)
    gpt = GPT(ModelConfig(n_layer=4, n_head=2, n_embd=32, block_size=16, vocab_size=100))
    ranges, placement = [(0, 1), (1, 2), (2, 3), (3, 4)], P.stage_ranks(schedule, 2, 2)
    ranks = [P.build_rank_stages(gpt, ranges, placement, r) for r in range(2)]
    stages = sorted((s for r in ranks for s in r.stages), key=lambda s: s.index)
    assert [s.index for s in ranks[0].stages] == [i for i, r in enumerate(placement) if r == 0]
    idx, y = torch.randint(0, 100, (3, 16)), torch.randint(0, 100, (3, 16))
    out = idx
    for s in stages:
        out = s(out)
    techniques.loss_sum(out, y).backward()
    techniques.loss_sum(gpt(idx), y).backward()
    n_params = sum(p.numel() for r in ranks for p in r.parameters())
    if schedule == "zbv":
        assert ranks[0].last_stage.gpt.lm_head.weight is ranks[0].first_stage.gpt.wte.weight
        assert n_params == gpt.num_params()
        torch.testing.assert_close(ranks[0].tied_weight().grad, gpt.wte.weight.grad)
        assert ranks[1].tied_weight() is None
    else:
        assert n_params == gpt.num_params() + gpt.wte.weight.numel()
        torch.testing.assert_close(ranks[0].tied_weight().grad + ranks[1].tied_weight().grad, gpt.wte.weight.grad)
    for s in stages:
        for i, block in enumerate(s.blocks):
            for p, q in zip(block.parameters(), gpt.blocks[s.lo + i].parameters()):
                torch.testing.assert_close(p.grad, q.grad)
    with pytest.raises(RuntimeError, match="schedule"):
        ranks[0](idx)


# ---- real launches: 2 and 4 gloo processes -----------------------------------------------------------------------

# small enough that every step clips: the gradient norm must be the whole model's on every rank
CLIPPED = dataclasses.replace(C.tiny_preset("cpu"), clip_norm=0.05)


@pytest.fixture(scope="module")
def two():
    result = L.launch(
        "pipeline",
        2,
        cfg=CLIPPED,
        device="cpu",
        options={"schedules": list(P.ALL_SCHEDULES), "microbatches": [4], "steps": 2, "n_layer": 4, "batch_size": 4},
        timeout_s=300,
    )
    assert result.ok, result.why()
    return result.ranks


@pytest.fixture(scope="module")
def four():
    result = L.launch(
        "pipeline",
        4,
        cfg=CLIPPED,
        device="cpu",
        options={"schedules": list(P.ALL_SCHEDULES), "microbatches": [8], "steps": 2, "n_layer": 8, "batch_size": 8},
        timeout_s=400,
    )
    assert result.ok, result.why()
    return result.ranks


@pytest.fixture(scope="module", params=["two", "four"])
def ranks(request):
    return request.getfixturevalue(request.param)


@pytest.mark.distributed
def test_every_schedule_computes_the_unsplit_models_loss_and_gradients(ranks):
    keys = list(ranks[0]["runs"])
    assert {k.split("/")[0] for k in keys} == set(P.ALL_SCHEDULES) and not ranks[0]["skipped"]
    for key in keys:
        checks = [r["runs"][key]["check"] for r in ranks if "check" in r["runs"][key]]
        if not checks:
            continue  # the check runs at the largest micro-batch count
        (last,) = [c for c in checks if "pipeline_loss" in c]  # one rank holds the last stage
        assert last["pipeline_loss"] == pytest.approx(last["unsplit_loss"], rel=1e-5), key
        for c in checks:
            assert c["max_abs_block_grad_diff"] < 1e-5 * max(1.0, c["max_abs_block_grad"]), key
        tied = [c for c in checks if "max_abs_tied_grad_diff" in c]
        assert len(tied) == (1 if key.startswith("zbv") else 2), key  # the V puts both ends on rank 0
        for c in tied:  # both ends hold the whole model's gradient of the tied embedding
            assert c["max_abs_tied_grad_diff"] < 1e-5 * max(1.0, c["max_abs_tied_grad"]), key


@pytest.mark.distributed
def test_every_schedule_trains_as_one_process_does(two):
    cfg = C.TrainConfig.from_dict(two[0]["config"])
    _splits, at = _common.global_batches(cfg, 1, seed=cfg.seed)
    one = train.train(dataclasses.replace(cfg, measure_memory=False), batches=at)
    assert min(one.grad_norms) > cfg.clip_norm  # every step clipped
    for key in two[0]["runs"]:
        (losses,) = [r["runs"][key]["losses"] for r in two if r["runs"][key]["losses"]]
        assert losses == pytest.approx(one.losses[:2], rel=1e-5), key
        for r in two:  # every rank clipped with the whole model's gradient norm
            assert r["runs"][key]["grad_norms"] == pytest.approx(one.grad_norms[:2], rel=1e-5), key


@pytest.mark.distributed
def test_each_stage_does_each_piece_of_work_once(ranks):
    for key, run0 in ranks[0]["runs"].items():
        m, placement = run0["microbatches"], run0["stage_ranks"]
        assert len(placement) == len(ranks) * run0["stages_per_rank"]
        for r in ranks:
            run = r["runs"][key]
            assert run["rank_stages"] == [s for s, rank in enumerate(placement) if rank == r["rank"]]
            for step_tl in run["stage_timelines"]:
                for stage, events in step_tl.items():
                    kinds = {kind for kind, *_ in events}
                    assert kinds in ({"F", "B"}, {"F", "I", "W"}), (key, stage, kinds)
                    for kind in kinds:
                        assert sorted(mb for k, mb, *_ in events if k == kind) == list(range(m)), (key, stage, kind)
                    if kinds == {"F", "I", "W"}:
                        assert key.split("/")[0] in ("interleaved_zb", "zbv")  # only they split the backward
            # the rank's timeline is its stages' together, in the order it ran them
            assert len(run["timelines"][-1]) == sum(len(e) for e in run["stage_timelines"][-1].values())


@pytest.mark.distributed
def test_the_schedules_own_order_gives_the_formulas_bubble(ranks):
    p = len(ranks)
    for key, run in ranks[0]["runs"].items():
        m, name = run["microbatches"], run["schedule"]
        own = P.schedule_bubble(P.run_orders(ranks, key))
        if name in ("gpipe", "1f1b"):
            assert own == pytest.approx(P.bubble_fraction(p, m)), key
        elif name == "interleaved_1f1b":  # Narayanan et al.'s interleaved form, for torch's order (m a multiple of p)
            assert own == pytest.approx(P.interleaved_bubble_fraction(p, m, 2)), key
        else:  # the weight gradients fill part of what interleaving leaves
            assert own < P.interleaved_bubble_fraction(p, m, 2), key
        assert 0 <= P.measured_bubble(ranks, key) < 1


@pytest.mark.distributed
def test_1f1b_holds_p_micro_batches_activations_on_the_first_stage_and_gpipe_all_m(ranks):
    p = len(ranks)
    m = max(run["microbatches"] for run in ranks[0]["runs"].values())
    first = ranks[0]["runs"]
    gpipe = first[f"gpipe/m={m}"]["saved_peak_bytes_by_stage"]["0"]
    one_f_one_b = first[f"1f1b/m={m}"]["saved_peak_bytes_by_stage"]["0"]
    assert m > p and one_f_one_b == pytest.approx(gpipe * p / m, rel=0.02)
    for key, run in first.items():  # every stage saved something, counted by stage
        assert all(b > 0 for r in ranks for b in r["runs"][key]["saved_peak_bytes_by_stage"].values()), key
        assert run["saved_peak_bytes"] >= max(run["saved_peak_bytes_by_stage"].values())


@pytest.mark.distributed
def test_the_figure_draws_every_piece_of_work(two):
    keys = [k for k in two[0]["runs"] if k.endswith("m=4")]
    fig = P.plot_schedules(two, keys)
    axes = fig.axes
    assert len(axes) == len(keys) + 2
    for ax, key in zip(axes, keys):
        n_events = sum(len(r["runs"][key]["timelines"][-1]) for r in two)
        assert len(ax.collections) == n_events, key
        assert "bubble measured" in ax.get_title()
    assert len(axes[-2].patches) == 3 * len(keys)  # measured, at equal stage work, formula
    assert len(axes[-1].patches) == sum(len(two[0]["runs"][k]["stage_ranks"]) for k in keys)  # a bar per stage


def test_building_a_ranks_stages_leaves_the_whole_model_as_it_was():
    # build_rank_stages leaves the whole model untouched (each stage is cut from a copy)
    gpt = GPT(ModelConfig(n_layer=4, n_head=2, n_embd=32, block_size=16, vocab_size=100))
    before = copy.deepcopy(gpt.state_dict())
    P.build_rank_stages(gpt, [(0, 2), (2, 4)], [0, 1], 0)
    assert len(gpt.blocks) == 4 and all(torch.equal(before[k], v) for k, v in gpt.state_dict().items())


def test_slowdown_together_tells_ranks_with_cores_of_their_own_from_ranks_sharing_them():
    """GPipe, p=2, m=2, made-up timelines. Ranks with cores of their own: every forward 1 s, every backward 2 s, alone
    or not, and the measured bubble is the formula's. Ranks sharing cores: work running beside the other rank's takes
    twice as long, the fill and the drain shrink against the rest, and the bubble measured falls below the formula's;
    slowdown_together names the cause."""

    def runs(f, b, f_together, b_together):
        # rank 0: F0 alone, F1 beside rank 1's F0, then B1 beside rank 1's B0 ... laid out by hand
        t = [0.0, f, f + f_together]
        rank0 = [["F", 0, t[0], t[1]], ["F", 1, t[1], t[2]]]
        rank1 = [["F", 0, t[1], t[1] + f_together], ["F", 1, t[2], t[2] + f], ["B", 1, t[2] + f, t[2] + f + b]]
        s = rank1[-1][3]
        rank1.append(["B", 0, s, s + b_together])
        rank0 += [["B", 1, s, s + b_together], ["B", 0, s + b_together, s + b_together + b]]
        return [{"runs": {"gpipe/m=2": {"timelines": [tl]}}} for tl in (rank0, rank1)]

    own = runs(1.0, 2.0, 1.0, 2.0)
    shared = runs(1.0, 2.0, 2.0, 4.0)
    assert P.slowdown_together(own, "gpipe/m=2") == pytest.approx(1.0)
    assert P.slowdown_together(shared, "gpipe/m=2") == pytest.approx(2.0)
    assert P.measured_bubble(own, "gpipe/m=2") == pytest.approx(P.bubble_fraction(2, 2))
    assert P.measured_bubble(shared, "gpipe/m=2") < P.bubble_fraction(2, 2) - 0.05
    assert P.shared_cores(own, "gpipe/m=2") is None and "shared cores" in P.shared_cores(shared, "gpipe/m=2")


def test_slowdown_together_is_none_without_both_ways_and_skips_empty_events():
    """No kind of work that ran both alone and beside another rank's: None. An event of no length (nothing done) is
    left out, so it cannot make a median of 0 and an endless ratio."""
    side_by_side = [{"runs": {"k": {"timelines": [[["F", 0, 0.0, 1.0]]]}}} for _ in range(2)]
    assert P.slowdown_together(side_by_side, "k") is None
    rank0 = [["F", 0, 0.0, 1.0], ["F", 1, 1.0, 1.0], ["F", 2, 1.5, 1.5], ["F", 3, 2.0, 3.0]]
    with_empty = [{"runs": {"k": {"timelines": [tl]}}} for tl in (rank0, [["F", 0, 2.0, 3.0]])]
    assert P.slowdown_together(with_empty, "k") == pytest.approx(1.0)


def test_a_rank_leaves_out_only_the_warm_up_messages_to_itself():
    """torch 2.11's warm-up of ZB-V's stages sends a rank a message from itself, which gloo refuses: those are left
    out, the messages to the other ranks kept (torch 2.13 never calls this warm-up)."""
    from types import SimpleNamespace

    from course_lib.distributed.pipeline import _no_warm_up_with_itself

    ops = [SimpleNamespace(group_peer=p) for p in (0, 1, 1, 2)]
    stage = SimpleNamespace(group_rank=1, _get_init_p2p_neighbors_ops=lambda: ops)
    _no_warm_up_with_itself(stage)
    assert [op.group_peer for op in stage._get_init_p2p_neighbors_ops()] == [0, 2]
