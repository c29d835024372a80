"""course_lib.distributed.resume: a sharded training state saved with torch.distributed.checkpoint, a run killed
mid-save, and resumes on the same and on another number of processes that continue the loss curve."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from course_lib.distributed import launch as L, resume as R

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="this torch build has no torch.distributed"
)


def test_latest_checkpoint_is_the_newest_complete_one(tmp_path):
    for name, metadata in (("step_000002", True), ("step_000004", False), ("step_000006.partial", True)):
        (tmp_path / name).mkdir()
        if metadata:
            (tmp_path / name / ".metadata").write_bytes(b"")
    assert R.latest_checkpoint(tmp_path) == tmp_path / "step_000002"
    assert R.latest_checkpoint(tmp_path / "step_000002") is None


def one_process_cfg(tiny, steps=4):
    return replace(tiny(steps=steps, batch_size=4, measure_memory=False), timing_warmup=1)


def test_a_resumed_run_continues_bit_for_bit_in_one_process(tiny, tmp_path):
    cfg = one_process_cfg(tiny)
    at = R.global_batches(cfg, 4)
    whole = R.train(cfg, at, 0, 1, tmp_path, save_at=[2])
    resumed = R.train(cfg, at, 0, 1, tmp_path, resume=True)  # a new model, optimizer and schedule, loaded from disk
    assert resumed["start_step"] == 2 and resumed["loaded"].endswith("step_000002")
    assert resumed["result"]["losses"] == whole["result"]["losses"][2:]  # bit for bit
    assert resumed["result"]["lrs"] == whole["result"]["lrs"][2:]
    for (n, p), q in zip(whole["setup"].model.named_parameters(), resumed["setup"].model.parameters()):
        assert torch.equal(p, q), n


@pytest.mark.distributed
def test_killed_mid_save_the_last_good_checkpoint_resumes_on_2_and_on_1_process(tiny, tmp_path):
    root = tmp_path / "ckpt"
    opts = {
        "steps": 4,
        "global_batch": 8,
        "save_at": [2],
        "ckpt": str(root),
        "resume_in_place": True,
        "die_in_final_save": True,
    }
    r = L.launch("resume", 2, options=opts, device="cpu", timeout_s=200, out_dir=tmp_path / "run", show_errors=False)
    # the final save killed rank 1: the launch failed, after both ranks had written their results
    assert not r.ok and r.returncode != 0 and not r.timed_out and len(r.ranks) == 2, r.why()
    torn = R.checkpoint_dir(root, 4, partial=True)
    assert torn.is_dir() and not (torn / ".metadata").exists()
    with pytest.raises(CheckpointException):
        dcp.load({"progress": {"step": 0}}, checkpoint_id=str(torn))  # DCP cannot read a save without its metadata
    assert R.latest_checkpoint(root) == R.checkpoint_dir(root, 2)
    for rank in r.ranks:  # resumed on 2 processes from the files alone: the same losses, bit for bit
        assert rank["resumed_in_place"]["start_step"] == 2
        assert rank["resumed_in_place"]["result"]["losses"] == rank["run"]["result"]["losses"][2:]
    # resumed on 1 process (this one, no process group): DCP reshards; the same losses up to float summation order
    cfg = one_process_cfg(tiny)
    one = R.train(replace(cfg, batch_size=8), R.global_batches(cfg, 8), 0, 1, root, resume=True)
    two = [sum(rank["run"]["result"]["losses"][i] for rank in r.ranks) / 2 for i in range(2, 4)]
    assert one["start_step"] == 2 and one["result"]["losses"] == pytest.approx(two, rel=1e-5)
