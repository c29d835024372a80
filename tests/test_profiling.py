"""course_lib.profiling and `python -m course_lib profile`: torch.profiler records only the steps after the warm-up,
around the course's one loop."""

import json
import re
import sys

import pytest
import torch

from course_lib import profiling
from course_lib.__main__ import main as cli


def test_only_the_steps_after_the_warm_up_are_recorded(tiny, tmp_path):
    trace = tmp_path / "trace.json"
    p = profiling.profile_run(tiny(timing_warmup=1), active=2, trace=trace)
    # 2 warm-up steps at least (the profiler warms up on one)
    assert len(p.result.step_times) == 4 and p.active == [2, 3]
    by_name = {e.key: e for e in p.prof.key_averages()}
    assert by_name["ProfilerStep*"].count == 2
    events = json.loads(trace.read_text())["traceEvents"]  # the trace names each step (key_averages folds them)
    steps = sorted({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")})
    assert steps == ["ProfilerStep#2", "ProfilerStep#3"]  # the two steps after the warm-up, not the warm-up ones
    # each recorded step did its forward's matmuls (4 per block + the head)
    n_mm = sum(by_name[k].count for k in ("aten::mm", "aten::addmm") if k in by_name)
    assert n_mm >= 2 * (4 * tiny().model.n_layer + 1), n_mm
    assert 0 < p.active_wall_s < sum(p.result.step_times)
    text = profiling.summary(p, rows=5)
    assert "2 recorded steps" in text and "own CPU time" in text
    # the operators' own time, without the named ranges' and the steps' (the gaps between operators)
    assert 0 < profiling.busy_s(p) < footer_seconds(text, "Self CPU time total")


def test_a_cpu_profile_says_where_a_steps_time_goes_by_kind(tiny):
    """A step of the tiny model with SDPA, by kind: its matmuls, its attention kernel and its optimizer each take
    time, and no generated kernel (nothing is compiled)."""
    p = profiling.profile_run(tiny(timing_warmup=1).with_model(attention="sdpa"), active=2)
    kinds = profiling.by_kind(p)
    for kind in ("matmuls", "attention (SDPA's fused kernel)", "optimizer (AdamW's update, zero_grad)"):
        assert kinds[kind] > 0, kinds
    assert "torch.compile's generated kernels" not in kinds  # nothing is compiled
    assert "Where a step's time goes" in profiling.summary(p)


@pytest.mark.skipif(
    sys.platform not in ("linux", "win32"),
    reason=f"Inductor names its CPU kernels in a profile only on Linux and Windows (this is {sys.platform})",
)
@pytest.mark.skipif(
    not torch._dynamo.is_dynamo_supported(), reason="torch.compile (dynamo) is not supported on this Python"
)
def test_under_compile_a_cpu_profile_names_the_generated_kernels(tiny):
    """Compiled, Inductor's C++ kernels each show as their own row, named after what they fuse, and count among the
    kinds; without the profile's setting they would be hidden in the compiled graph's call."""
    p = profiling.profile_run(tiny(timing_warmup=1, compile=True).with_model(n_layer=1), active=1)
    generated = [e.key for e in p.prof.key_averages() if "cpp_fused_" in e.key]
    assert generated, [e.key for e in p.prof.key_averages()]
    assert profiling.by_kind(p)["torch.compile's generated kernels"] > 0


def test_the_kernel_floor_times_every_matmul_and_attention_call_of_a_step(tiny):
    """The floor finds a step's matmuls (the same FLOPs torch's FLOP counter counts in one step) and its fused
    attention (a causal forward and a backward per block), times each kind alone, and says what share of the step
    they are."""
    from torch.utils.flop_counter import FlopCounterMode

    from course_lib.train import Trainer

    cfg = tiny(timing_warmup=1).with_model(attention="sdpa")
    p = profiling.profile_run(cfg, active=2)
    floor = profiling.kernel_floor(p, min_time_s=0.0)
    counter = FlopCounterMode(display=False)
    trainer = Trainer(cfg)
    with counter:
        trainer.step()
    matmul_ops = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm}
    counted = sum(n for op, n in counter.get_flop_counts()["Global"].items() if op in matmul_ops)
    assert floor.matmul_flops == pytest.approx(counted, rel=1e-9)
    attention = [c for c in floor.calls if c.what == "attention"]
    assert len(attention) == 1 and attention[0].causal  # one shape, is_causal read from the recorded call
    assert attention[0].calls == attention[0].backward_calls == cfg.model.n_layer
    assert all(c.seconds > 0 for c in floor.calls) and attention[0].backward_seconds > 0
    assert floor.total_s == pytest.approx(floor.matmul_s + floor.attention_s) and floor.step_s > 0
    text = floor.text()
    assert "The kernel floor" in text and f"{floor.total_s * 1e3:.1f} ms" in text
    assert f"{floor.total_s / floor.step_s:.0%} of it" in text


def test_every_fused_attention_op_the_floor_reads_is_one_of_this_torchs_with_an_is_causal_input():
    """The floor reads is_causal from the recorded inputs at the position the op's schema gives: an op renamed or
    re-signed in another torch fails here, not in a learner's profile."""
    for op in profiling.ATTENTION_OPS:
        assert 3 <= profiling._is_causal_position(op) <= 8, op
        assert hasattr(torch.ops.aten, op.removeprefix("aten::") + "_backward"), op


def test_the_kernel_floor_times_an_operand_in_its_recorded_layout():
    """A transposed operand can take another kernel than a contiguous one (a bf16 matmul on a CPU without bf16
    instructions is several times slower one way): the floor builds each operand with the strides the step used."""
    from torch.profiler import ProfilerActivity, profile

    a, b = torch.randn(64, 32), torch.randn(64, 16)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        torch.mm(a.t(), b)
    (call,) = profiling._kernel_calls(profiling.Profile(result=None, prof=prof, active=[0], device="cpu"))
    assert call.shapes == ((32, 64), (64, 16))
    if not call.strides:
        pytest.skip(f"torch {torch.__version__}'s profiler records no strides (the floor's operands are contiguous)")
    assert call.strides == ((1, 32), (16, 1))
    made = []
    real_mm = torch.mm
    try:
        torch.mm = lambda x, y: made.append(x.stride()) or real_mm(x, y)
        profiling._time_alone(call, "cpu", min_time_s=0.0)
    finally:
        torch.mm = real_mm
    assert made and set(made) == {(1, 32)} and call.seconds > 0


def footer_seconds(table: str, label: str) -> float:
    """A total from the foot of torch's profiler table, e.g. 'Self CUDA time total: 1.234ms', in seconds."""
    value = re.search(rf"{label}: ([0-9.]+)(us|ms|s)\b", table)
    assert value, table[-500:]
    return float(value[1]) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[value[2]]


def test_profile_command_and_its_errors(capsys, tmp_path):
    trace = tmp_path / "not yet" / "trace.json"  # a folder that does not exist yet is made
    assert (
        cli(["profile", "--preset", "tiny", "--rung", "3", "--steps", "1", "--rows", "3", "--trace", str(trace)]) == 0
    )
    out = capsys.readouterr().out
    assert "1 recorded after 2 warm-up" in out and "precision bf16" in out and "attention sdpa" in out
    assert json.loads(trace.read_text())["traceEvents"]
    assert cli(["profile", "--preset", "tiny", "--steps", "0"]) == 2
    assert "steps must be a positive int" in capsys.readouterr().err
    assert cli(["profile", "--preset", "tiny", "--set", "precision"]) == 2
    assert "--set takes FIELD=VALUE" in capsys.readouterr().err


@pytest.mark.cuda
def test_on_a_gpu_the_summary_counts_kernel_time(tiny):
    p = profiling.profile_run(tiny(device="cuda"), active=2)
    text = profiling.summary(p, rows=5)
    assert "the GPU's kernels and copies" in text and "% of it" in text
    # each kernel counted once: what torch's own table foot says, and on one stream no more than the steps' wall time
    busy = profiling.busy_s(p)
    assert busy == pytest.approx(footer_seconds(text, "Self CUDA time total"), rel=0.01, abs=2e-6)
    assert 0 < busy <= p.active_wall_s
    floor = profiling.kernel_floor(p, min_time_s=0.0)  # the floor on a GPU: the same calls, timed on the GPU
    assert floor.matmul_flops > 0 and floor.total_s > 0 and "The kernel floor" in floor.text()
