"""The hand-written DDPs (course_lib.distributed.ddp_by_hand), on 2 gloo processes: each ends a run with torch DDP's
parameters and losses, and the bucketed one sends fewer, larger messages."""

import pytest

from course_lib.distributed.launch import launch


@pytest.fixture(scope="module")
def ranks():
    result = launch("ddp_by_hand", 2, options={"steps": 3, "bucket_kb": [64, 4096]}, timeout_s=300)
    assert result.ok, result.why()
    return result.ranks


def test_every_hand_written_ddp_trains_exactly_as_torch_ddp(ranks):
    for rank in ranks:
        torch_run, *hand = rank["runs"]
        assert torch_run["variant"] == "torch" and [r["variant"] for r in hand][:2] == ["naive", "overlapped"]
        for r in hand:
            assert r["max_abs_param_diff_vs_torch_ddp"] <= 1e-6, r["variant"]
            assert r["losses"] == pytest.approx(torch_run["losses"], rel=1e-6), r["variant"]


def test_naive_and_overlapped_send_one_message_per_tensor_and_buckets_fewer(ranks):
    runs = {(r["variant"], r["bucket_bytes"]): r for r in ranks[0]["runs"]}
    per_tensor = runs[("naive", 0)]["allreduce_calls_per_step"]
    assert per_tensor == runs[("overlapped", 0)]["allreduce_calls_per_step"] > 2  # the tiny model's tensors
    small, large = runs[("bucketed", 64 * 1024)], runs[("bucketed", 4096 * 1024)]
    assert per_tensor > small["allreduce_calls_per_step"] > large["allreduce_calls_per_step"] == 1
    assert all(r["exposed_comm_s"] is not None and r["exposed_comm_s"] >= 0 for r in ranks[0]["runs"][1:])


def test_the_timeline_shows_overlap_where_the_hooks_send_during_backward(ranks):
    """Each rank's last step: the overlapped and bucketed DDPs launch all-reduces before backward has ended (their
    hooks fire inside it), the naive one only after; every wait ends after backward. An ordering, not a speed."""
    from course_lib.lessons import communication

    for rank in ranks:
        for r in rank["runs"][1:]:
            t = r["timeline_last_step"]
            assert t["launches"] and t["backward_done"] <= t["waited_until"], r["variant"]
            assert min(t["launches"]) >= 0, t  # measured from the step's forward: nothing leaves before it
            during = [x for x in t["launches"] if x < t["backward_done"]]
            if r["variant"] == "naive":
                assert during == [], t
            else:
                assert during, (r["variant"], t)
    fig = communication.plot_overlap_timeline(ranks)
    assert len(fig.axes[0].get_yticklabels()) == 2 * (len(ranks[0]["runs"]) - 1)
