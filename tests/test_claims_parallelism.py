"""Notebooks 07 and 08: the bookkeeping behind their claims, moved out of their "Check yourself" cells, and
the accounting their corrected traffic figures use. Unit tests calling course_lib directly: CPU, in this process (a gloo
group of one process where a collective must run), a second or two in all. What needs real ranks is checked in the
notebooks and in test_distributed.py / test_zero_stages.py / test_tensor_parallel.py / test_moe.py / test_resume.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from course_lib import config as C
from course_lib.distributed import strategy_panel as DP, zero_memory as Z
from course_lib.distributed._common import KINDS, CollectiveCounter, bytes_written

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="this torch build has no torch.distributed"
)
PSI = 158_624  # notebook 07's model (any size does)


# ---- what one rank sends: the ring algorithms' shares ---------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 4, 8, 64])
def test_a_ring_all_reduce_sends_twice_the_share_of_an_all_gather_or_a_reduce_scatter(n):
    # 07 cell 8fec6a8b used to say that each rank sends (N-1)/N of every collective's bytes: true of an all-gather and a
    # reduce-scatter, half the truth for an all-reduce (a reduce-scatter followed by an all-gather).
    assert Z.sent_share("all-gather", n) == Z.sent_share("reduce-scatter", n) == pytest.approx((n - 1) / n)
    assert (
        Z.sent_share("all-reduce", n) == pytest.approx(2 * (n - 1) / n) == pytest.approx(Z.ring_all_reduce_bytes(1, n))
    )
    # N-1 ranks each receive the whole: the mean over ranks
    assert Z.sent_share("broadcast", n) == pytest.approx((n - 1) / n)
    # DDP's counted all-reduce of the fp32 gradients, times its share, is the paper's stage 0 traffic
    stage0 = {"all-reduce": {"calls": 1, "bytes": 4 * PSI}}
    assert Z.bytes_sent(stage0, n) == pytest.approx(Z.data_parallel_traffic(PSI, n, 0, grad_bytes=4, param_bytes=4))
    with pytest.raises(ValueError, match="no sent share"):
        Z.sent_share("all_reduce", n)


@pytest.mark.parametrize("n", [2, 4, 64])
def test_the_papers_accounting_and_this_courses_stage_1(n):
    paper = [Z.data_parallel_traffic(PSI, n, s) for s in Z.STAGES]
    # the paper: stages 1 and 2 reduce-scatter the gradients and all-gather the parameters, one all-reduce's volume;
    # stage 3 gathers the parameters twice, 1.5x
    assert paper[0] == pytest.approx(paper[1]) == pytest.approx(paper[2]) and paper[3] == pytest.approx(1.5 * paper[0])
    # the course's stage 1 (ZeroRedundancyOptimizer on DDP): DDP's all-reduce of the whole gradient, then a broadcast of
    # every rank's updated share (the model once in all): 1.5x DDP's bytes
    ddp = {"all-reduce": {"calls": 1, "bytes": 4 * PSI}}
    zero1 = {**ddp, "broadcast": {"calls": n, "bytes": 4 * PSI}}
    assert Z.bytes_sent(zero1, n) == pytest.approx(1.5 * Z.bytes_sent(ddp, n))
    # measured shares replace the ring's where given (this torch's gloo: its reduce-scatter, measured in notebook 07 and
    # test_distributed, sends an all-reduce's)
    fsdp = {"all-gather": {"calls": 2, "bytes": 8 * PSI}, "reduce-scatter": {"calls": 1, "bytes": 4 * PSI}}
    assert Z.bytes_sent(fsdp, n) == pytest.approx(1.5 * Z.bytes_sent(ddp, n))
    assert Z.bytes_sent(fsdp, n, {"reduce-scatter": 2 * (n - 1) / n}) == pytest.approx(2 * Z.bytes_sent(ddp, n))


def test_the_papers_zero_example_and_the_stage_formulas():
    # (was notebook 07's check #1: the calculator against the figure it reproduces)
    assert [round(r["GB per device"], 1) for r in Z.zero_table(7.5e9, 64)] == [120.0, 31.4, 16.6, 1.9]
    fp32 = [Z.zero_parts(PSI, 2, s, **Z.FP32_ADAMW) for s in Z.STAGES]
    assert fp32[0] == {"parameters": 4 * PSI, "gradients": 4 * PSI, "optimizer state": 8 * PSI}
    assert fp32[3] == {k: v / 2 for k, v in fp32[0].items()}


# ---- the counter: every collective named, the full side of the exchange counted --------------------------------------


@pytest.fixture
def one_process_group(tmp_path):
    """A gloo process group of this process alone (world size 1): its collectives run, and send nothing."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def test_the_counter_names_every_collective_and_counts_its_whole_tensor(one_process_group):
    import torch.distributed._functional_collectives as funcol

    dist = one_process_group
    whole, part = torch.ones(256), torch.ones(256)  # world size 1: a shard is the whole
    with CollectiveCounter() as counter:
        dist.all_reduce(whole)
        dist.all_gather_into_tensor(whole, part)
        dist.reduce_scatter_tensor(part, whole)
        dist.broadcast(whole, 0)
        # DTensor's kind (tensor parallelism)
        funcol.wait_tensor(funcol.all_reduce(torch.ones(64), "sum", dist.group.WORLD))
        dist.barrier()  # synchronisation: no payload, not counted
    one = {"calls": 1, "bytes": 1024, "by_group_size": {"1": 1024}}  # every call on a group of 1 rank
    assert dict(counter.counts) == {
        "all-reduce": {"calls": 2, "bytes": 1024 + 256, "by_group_size": {"1": 1024 + 256}},
        "all-gather": one,
        "reduce-scatter": one,
        "broadcast": one,
    }
    assert set(dict(counter.counts)) <= set(KINDS.values())
    if bytes_written() is not None:  # Linux: what the process wrote while counting; one process sends nothing to itself
        assert counter.written is not None and counter.written < 1024


def test_a_collective_on_a_subgroup_is_shared_among_the_groups_ranks_not_the_worlds():
    # The pipeline's tied-embedding all-reduce runs on its 2 end stages (pipeline.tied_group) whatever the world's size:
    # each of them sends 2(2-1)/2 = 1.0 of its bytes, not 2(N-1)/N = 1.5 at N = 4; the gradient norm's all-reduce runs
    # on all 4. 08's panel used to apply the world's share to every call.
    tied, norm, act = 4096, 4, 1000
    coll = {
        "all-reduce": {"calls": 2, "bytes": tied + norm, "by_group_size": {"2": tied, "4": norm}},
        "send": {"calls": 2, "bytes": act, "by_group_size": {"4": act}},
        "receive": {"calls": 2, "bytes": act, "by_group_size": {"4": act}},
    }
    assert Z.sent_by_kind(coll, 4) == pytest.approx(
        {"all-reduce": 1.0 * tied + 1.5 * norm, "send": act, "receive": 0.0}
    )
    # a record without group sizes (an older rank JSON): every call on the whole world, as before
    assert Z.bytes_sent({"all-reduce": {"calls": 1, "bytes": tied}}, 4) == pytest.approx(1.5 * tied)
    # a measured share (notebook 07's gloo shares, measured at the world's size) replaces only the world-sized calls'
    # share
    assert Z.sent_by_kind(coll, 4, {"all-reduce": 2.0})["all-reduce"] == pytest.approx(1.0 * tied + 2.0 * norm)
    run = {
        "parameter_bytes": 10,
        "step_peak_bytes": 20,
        "step_times": [1.0, 0.5],
        "collectives_last_step": coll,
        "written_last_step": None,
    }
    rows = DP.rank_rows("gpipe", [{"rank": r, "runs": {"gpipe/m=4": run}} for r in range(4)], 4)
    # receives send nothing: not drawn
    assert rows[0]["sent"] == pytest.approx({"all-reduce": tied + 1.5 * norm, "send": act})


def test_the_counter_records_each_calls_group_size(one_process_group):
    dist = one_process_group
    sub = dist.new_group([0])
    with CollectiveCounter() as counter:
        dist.all_reduce(torch.ones(8), group=sub)
    assert counter.counts["all-reduce"]["by_group_size"] == {str(dist.get_world_size(sub)): 32}


def test_the_counter_sees_no_collective_in_plain_arithmetic():
    with CollectiveCounter() as counter:
        (torch.ones(3) * 2).sum()
    assert dict(counter.counts) == {}


# ---- the panels of 07 and 08 -----------------------------------------------------------------------------------------


def test_each_panel_reaches_its_notebooks_strategies():
    assert set(DP.DATA_PARALLEL) == {"ddp", "zero1", "zero2", "fsdp", "resume"}  # ZeRO 0-3 and checkpoint/resume
    assert set(DP.MODEL_PARALLEL) == {"gpipe", "1f1b", "tp", "tp_sp", "moe"}  # pipeline, tensor, sequence, expert
    assert DP.STRATEGIES == {**DP.DATA_PARALLEL, **DP.MODEL_PARALLEL}


def test_the_panel_refuses_what_a_strategy_cannot_run(tiny):
    cfg = tiny(steps=3, context=64).with_model(n_layer=4, n_head=4)
    assert all(DP.why_not(cfg, s, 2, 2) is None for s in DP.STRATEGIES)
    assert "steps >= 3" in DP.why_not(dataclasses.replace(cfg, steps=2), "resume", 2, 2)
    assert "steps >= 2" in DP.why_not(dataclasses.replace(cfg, steps=1), "zero2", 2, 2)
    assert "experts" in DP.why_not(cfg, "moe", 3, 2) and DP.why_not(cfg, "moe", 4, 2) is None
    assert "context=63" in DP.why_not(dataclasses.replace(cfg, context=63), "tp_sp", 2, 2)
    assert "unknown strategy" in DP.why_not(cfg, "zero4", 2, 2)


def test_only_ddp_and_fsdp_are_exported_as_training_scripts(tiny):
    cfg = tiny()
    assert DP.export_config(cfg, "ddp").data_parallel == "ddp" and DP.export_config(cfg, "fsdp").data_parallel == "fsdp"
    for strategy in ("zero1", "zero2", "resume", "gpipe", "tp_sp", "moe"):
        with pytest.raises(C.ConfigError, match="not the course's loop"):
            DP.export_config(cfg, strategy)


def _zero_rank(rank: int, stage: int) -> dict:
    """What zero_stages writes for one rank and one stage, cut to what the panel reads."""
    held = {"parameters between steps": 100, "parameters after forward": 300, "gradients": 100, "optimizer state": 200}
    coll = {"all-gather": {"calls": 3, "bytes": 400}, "reduce-scatter": {"calls": 3, "bytes": 400}}
    result = {"step_times": [1.0, 0.02, 0.03], "excluded_steps": [0]}
    return {
        "rank": rank,
        "runs": {
            str(stage): {"memory": held, "collectives_last_step": coll, "written_last_step": 610, "result": result}
        },
    }


def test_the_panel_reads_a_ranks_memory_and_bytes_and_draws_them():
    from course_lib import plots
    from course_lib.results import RunResult

    rows = DP.rank_rows("zero2", [_zero_rank(0, 2), _zero_rank(1, 2)], 2)
    assert rows[0]["memory"] == {
        "parameters": 100,
        "gradients": 100,
        "optimizer state": 200,
        "gathered for the step": 200,
    }
    assert rows[0]["sent"] == {"all-gather": 200, "reduce-scatter": 200}  # (N-1)/N of the counted bytes, N = 2
    assert rows[0]["written"] == 610 and rows[0]["step_ms"] == pytest.approx(25.0)
    moe = {
        "rank": 0,
        "parameter_bytes_expert_parallel": 900,
        "expert_bytes_local": 300,
        "written_fwd_bwd": None,
        "fwd_bwd_s": 0.5,
        "all_to_all": {
            "counts": {"bytes_to_other_ranks": 8},
            "forward": {"bytes_to_other_ranks": 96},
            "backward": {"bytes_to_other_ranks": 96},
        },
    }
    assert DP.rank_rows("moe", [moe], 2)[0] == {
        "rank": 0,
        "memory": {"parameters": 600, "expert parameters": 300},
        "sent": {"all-to-all": 200},
        "written": None,
        "step_ms": 500.0,
    }
    runs = [
        RunResult(
            label=f"run {s}",
            status="ok",
            config={},
            provenance={"device": "cpu"},
            details={"strategy": s, "ranks": rows},
        )
        for s in ("zero2", "fsdp")
    ]
    fig = plots.new_figure(figsize=(8, 3))
    ax_mem, ax_bytes = fig.subplots(1, 2)
    DP.plot_rank_memory(runs, ax_mem)
    DP.plot_rank_bytes(runs, ax_bytes)
    assert len(ax_mem.patches) == 4 * 4 and len(ax_bytes.patches) == 4 * 2  # a bar per rank and category / kind
    assert [line.get_label() for line in ax_bytes.lines] == ["written to sockets (measured)"]


def test_the_notebooks_find_a_shipped_panel_run_by_its_strategy(tmp_path):
    # 07 and 08 list the shipped multi-process runs of their strategies (they used to filter on a metadata key that
    # nothing writes, so a shipped run could never be shown)
    from course_lib.results import RunResult, save_results

    def run(label, **details):
        return RunResult(label=label, status="ok", config={}, provenance={"device": "NVIDIA H100"}, details=details)

    save_results(
        [run("zero2", strategy="zero2", processes=8), run("moe", strategy="moe", processes=8)],
        tmp_path / "panel.json",
        device="8x NVIDIA H100",
        torch="2.13.0",
        date="2026-11-25",
    )
    save_results([run("ladder rung")], tmp_path / "ladder.json", preset="reference")  # a shipped ladder: no strategy
    assert [r.label for _f, r, _m in DP.shipped_runs(DP.DATA_PARALLEL, tmp_path)] == ["zero2"]
    assert [(r.label, m["device"]) for _f, r, m in DP.shipped_runs(DP.MODEL_PARALLEL, tmp_path)] == [
        ("moe", "8x NVIDIA H100")
    ]
