"""Notebooks 07 and 08: the bookkeeping behind their claims, moved out of their "Check yourself" cells (issue 31), and the
accounting their corrected traffic figures use. Unit tests calling course_lib directly: CPU, in this process (a gloo
group of one process where a collective must run), a second or two in all. What needs real ranks is checked in the
notebooks and in test_distributed.py / test_zero_stages.py / test_tensor_parallel.py / test_moe.py / test_resume.py."""
from __future__ import annotations

import pytest
import torch

from course_lib.distributed import zero as Z
from course_lib.distributed._common import KINDS, CollectiveCounter, bytes_written

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="this torch build has no torch.distributed")
PSI = 158_624  # notebook 07's model (any size does)


# ---- what one rank sends: the ring algorithms' shares ---------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 3, 4, 8, 64])
def test_a_ring_all_reduce_sends_twice_the_share_of_an_all_gather_or_a_reduce_scatter(n):
    # 07 cell 8fec6a8b used to say that each rank sends (N-1)/N of every collective's bytes: true of an all-gather and a
    # reduce-scatter, half the truth for an all-reduce (a reduce-scatter followed by an all-gather).
    assert Z.sent_share("all-gather", n) == Z.sent_share("reduce-scatter", n) == pytest.approx((n - 1) / n)
    assert Z.sent_share("all-reduce", n) == pytest.approx(2 * (n - 1) / n) == pytest.approx(Z.ring_all_reduce_bytes(1, n))
    assert Z.sent_share("broadcast", n) == pytest.approx((n - 1) / n)  # N-1 ranks each receive the whole: the mean over ranks
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
    # measured shares replace the ring's where given (gloo's reduce-scatter, measured in notebook 07, sends an all-reduce's)
    fsdp = {"all-gather": {"calls": 2, "bytes": 8 * PSI}, "reduce-scatter": {"calls": 1, "bytes": 4 * PSI}}
    assert Z.bytes_sent(fsdp, n) == pytest.approx(1.5 * Z.bytes_sent(ddp, n))
    assert Z.bytes_sent(fsdp, n, {"reduce-scatter": 2 * (n - 1) / n}) == pytest.approx(2 * Z.bytes_sent(ddp, n))


def test_the_papers_zero_example_and_the_stage_formulas():
    # (was notebook 07's check #1: the calculator against the figure it reproduces)
    assert [round(r["GB per device"], 1) for r in Z.zero_table(7.5e9, 64)] == [120.0, 31.4, 16.6, 1.9]
    fp32 = [Z.zero_parts(PSI, 2, s, **Z.FP32_ADAMW) for s in Z.STAGES]
    assert fp32[0] == {"parameters": 4 * PSI, "gradients": 4 * PSI, "optimizer state": 8 * PSI}
    assert fp32[3] == {k: v / 2 for k, v in fp32[0].items()}


# ---- the counter: every collective named, the full side of the exchange counted ------------------------------------------

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
        funcol.wait_tensor(funcol.all_reduce(torch.ones(64), "sum", dist.group.WORLD))  # DTensor's kind (tensor parallelism)
        dist.barrier()  # synchronisation: no payload, not counted
    assert dict(counter.counts) == {"all-reduce": {"calls": 2, "bytes": 1024 + 256}, "all-gather": {"calls": 1, "bytes": 1024},
                                    "reduce-scatter": {"calls": 1, "bytes": 1024}, "broadcast": {"calls": 1, "bytes": 1024}}
    assert set(dict(counter.counts)) <= set(KINDS.values())
    if bytes_written() is not None:  # Linux: what the process wrote while counting; one process sends nothing to itself
        assert counter.written is not None and counter.written < 1024


def test_the_counter_sees_no_collective_in_plain_arithmetic():
    with CollectiveCounter() as counter:
        (torch.ones(3) * 2).sum()
    assert dict(counter.counts) == {}
