"""course_lib.profiling and `python -m course_lib profile`: torch.profiler records only the steps after the warm-up,
around the course's one loop."""

import dataclasses
import json
import re
import sys

import pytest
import torch

from course_lib import cpu_allocator, profiling
from course_lib.__main__ import main as cli
from course_lib.lessons import kernel_floor as KF
from course_lib.lessons.device_timeline import timeline_figure


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
    # the page faults of each recorded step, where the system counts them, and what to do about them
    if p.page_faults is not None:  # (not on Windows)
        assert len(p.page_faults) == 2 and "Page faults: " in profiling.summary(p)
        # the way to keep them, where the switch exists (glibc)
        assert ("keep_freed_memory=true" in profiling.summary(p)) == (not cpu_allocator.unavailable())


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


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_the_kernel_floor_times_every_matmul_and_attention_call_of_a_step(tiny, checkpointing):
    """The floor finds a step's matmuls (the same FLOPs torch's FLOP counter counts in one training step) and its
    fused attention (a causal forward per block, two with full checkpointing, and a backward), and no validation pass
    (the run asks for one after every step), and times each kind alone."""
    from torch.utils.flop_counter import FlopCounterMode

    from course_lib.capabilities import capabilities
    from course_lib.train import Trainer

    cfg = tiny(timing_warmup=1, eval_every=1, activation_checkpointing=checkpointing).with_model(attention="sdpa")
    p = profiling.profile_run(cfg, active=2)
    floor = KF.kernel_floor(p, min_time_s=0.0)
    counter = FlopCounterMode(display=False)
    trainer = Trainer(dataclasses.replace(cfg, eval_every=0))
    with counter:
        trainer.step()
    matmul_ops = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm}
    counted = sum(n for op, n in counter.get_flop_counts()["Global"].items() if op in matmul_ops)
    if checkpointing == "none":
        assert floor.matmul_flops == pytest.approx(counted, rel=1e-9)
    else:  # under the FLOP counter checkpointing's recompute stops early, before a block's last matmul; not so here
        assert counted <= floor.matmul_flops <= 1.1 * counted
    (attention,) = [c for c in floor.calls if c.kind == "attention"]  # one shape, is_causal read from the call
    forwards = cfg.model.n_layer * (2 if checkpointing == "full" else 1)
    assert attention.causal and attention.calls == forwards and attention.backward_calls == cfg.model.n_layer
    assert all(c.seconds > 0 for c in floor.calls) and attention.backward_seconds > 0
    # the efficiency at the floor: the model's FLOPs of a step over the floor's time and the same peak
    peak, _ = capabilities("cpu").peak_tflops(cfg.precision)
    expected = p.result.flops_per_token * cfg.tokens_per_step / floor.total_s / (peak * 1e12)
    assert floor.mfu_at_floor == pytest.approx(expected, rel=1e-6)
    assert "The kernel floor" in floor.text()


def test_the_kernel_floor_says_when_it_has_nothing_to_read():
    """No matmul seen (CUDA graphs replay kernels without operators), or kernels that took longer alone than the whole
    step: the text says there is no floor, and claims no efficiency."""
    assert "no kernel floor" in KF.KernelFloor([], 0.2, 0.5, 0.2).text()
    slow = KF.KernelCall("matmul", "aten::mm", ((64, 64), (64, 64)), (), torch.float32, calls=4, seconds=0.1)
    text = KF.KernelFloor([slow], 0.2, 0.5, 0.2).text()
    assert "no floor to read" in text and "would reach" not in text and "records no layout" in text


def test_on_a_gpu_the_floor_is_the_kernels_as_they_ran_in_the_step_where_that_is_lower():
    """A GPU whose torch records no layout times a step's matmuls again in another one: an H200 with torch 2.11 read
    23.4 ms alone against 20.8 ms of the same kernels in the step. The floor, and the efficiency at it, take the lower
    reading, and the text gives both."""
    mm = KF.KernelCall("matmul", "aten::mm", ((64, 64), (64, 64)), (), torch.float32, calls=4, seconds=0.01)
    alone = KF.KernelFloor([mm], 0.1, 0.5, 0.1)
    assert alone.total_s == pytest.approx(0.04) and "in the recorded steps" not in alone.text()
    faster = KF.KernelFloor([mm], 0.1, 0.5, 0.1, in_step_s=0.03)
    assert faster.total_s == pytest.approx(0.03) and faster.mfu_at_floor == pytest.approx(0.5 * 0.1 / 0.03)
    assert "40.0 ms timed alone" in faster.text() and "took 30.0 ms a step" in faster.text()
    slower = KF.KernelFloor([mm], 0.1, 0.5, 0.1, in_step_s=0.05)
    assert slower.total_s == pytest.approx(0.04) and "more than alone by over a tenth" in slower.text()
    assert "by over a tenth" not in KF.KernelFloor([mm], 0.1, 0.5, 0.1, in_step_s=0.042).text()


def test_the_in_step_reading_counts_each_matmul_and_fused_attention_kernel_once_on_a_gpu_only():
    """Real profiler events, as torch builds them: a matmul counts its own kernels; a fused-attention operator of
    SDPA_OPS (forward or backward, any backend) counts the kernels beneath it, launched by an inner operator, once; the
    math backend's own element-wise kernel is not a call the floor times (its bmm is), nor is an element-wise
    operator's. On a CPU an operator's time is its overhead too: no in-step reading there."""
    from types import SimpleNamespace

    from torch.autograd.profiler_util import FunctionEvent

    ids = iter(range(100))

    def event(name, us=0, children=()):
        e = FunctionEvent(next(ids), name, 0, 0, 100, use_device="cuda")
        if us:
            e.append_kernel("kernel of " + name, 0, us)
        for child in children:
            e.append_cpu_child(child)
            child.set_cpu_parent(e)
        return e

    inner_fwd, inner_bwd = event("aten::_cudnn_attention_forward", 400), event("aten::_cudnn_attention_backward", 900)
    flash_bwd = event("aten::_flash_attention_backward", 700)
    bmm = event("aten::bmm", 300)
    events = [
        event("aten::mm", 3000),
        event("aten::addmm", 1000),
        inner_fwd,
        event("aten::_scaled_dot_product_cudnn_attention", 0, [inner_fwd]),
        inner_bwd,
        event("aten::_scaled_dot_product_cudnn_attention_backward", 0, [inner_bwd]),
        flash_bwd,
        event("aten::_scaled_dot_product_flash_attention_backward", 0, [flash_bwd]),
        bmm,
        event("aten::_scaled_dot_product_attention_math", 50, [bmm]),
        event("aten::add", 500),
    ]
    prof = SimpleNamespace(events=lambda: events)
    gpu = profiling.Profile(result=None, prof=prof, active=[0, 1], device="cuda")
    assert KF.in_step_kernel_s(gpu) == pytest.approx((3000 + 1000 + 400 + 900 + 700 + 300) / 1e6 / 2)
    assert KF.in_step_kernel_s(profiling.Profile(result=None, prof=prof, active=[0], device="cpu")) is None


def test_every_sdpa_op_the_floor_reads_has_is_causal_and_a_backward_with_a_query():
    """The floor reads is_causal, and a backward's query, at the positions the ops' schemas give: an op renamed or
    re-signed in another torch fails here, not in a learner's profile."""
    for op in KF.SDPA_OPS:
        KF._input_position("aten::" + op, "is_causal")
        KF._input_position("aten::" + op + "_backward", "query")


def recorded(fn) -> list:
    """The matmul and attention calls the floor finds in one run of fn under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return KF._kernel_calls(profiling.Profile(result=None, prof=prof, active=[0], device="cpu"))


def test_the_kernel_floor_times_an_operand_in_its_recorded_layout(monkeypatch):
    """A transposed operand can take another kernel than a contiguous one (a bf16 matmul on a CPU without bf16
    instructions is several times slower one way): the floor builds each operand with the strides the step used."""
    a, b = torch.randn(64, 32), torch.randn(64, 16)
    (call,) = recorded(lambda: torch.mm(a.t(), b))
    assert call.shapes == ((32, 64), (64, 16))
    if not call.strides:
        pytest.skip(f"torch {torch.__version__}'s profiler records no strides (the floor's operands are contiguous)")
    assert call.strides == ((1, 32), (16, 1))
    made, real_mm = [], torch.mm
    monkeypatch.setattr(torch, "mm", lambda x, y: made.append(x.stride()) or real_mm(x, y))
    seconds, _ = KF._time_alone(call, "cpu", "fp32", min_time_s=0.0)
    assert made and set(made) == {(1, 32)} and seconds > 0


def test_the_kernel_floor_times_an_expanded_operand():
    """The gradient of a sum is one number expanded (strides 0): the floor times such an operand as it was laid out."""
    x, w = torch.randn(8, 4), torch.randn(4, 3, requires_grad=True)
    calls = recorded(lambda: (x @ w).sum().backward())
    expanded = [c for c in calls if c.strides and any(0 in st for st in c.strides)]
    if not any(c.strides for c in calls):
        pytest.skip(f"torch {torch.__version__}'s profiler records no strides")
    assert expanded, [(c.shapes, c.strides) for c in calls]
    assert KF._time_alone(expanded[0], "cpu", "fp32", min_time_s=0.0)[0] > 0


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
    floor = KF.kernel_floor(p, min_time_s=0.0)  # the floor on a GPU: the same calls, timed on the GPU
    assert floor.matmul_flops > 0 and floor.total_s > 0 and "The kernel floor" in floor.text()
    # and as they ran in the step: some device time, no more than the GPU's busy time
    assert floor.in_step_s is not None and 0 < floor.in_step_s <= busy / len(p.active)


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 20976640000 bytes."),
    ],
    ids=["gpu-allocator", "cpu-allocator"],
)
def test_out_of_memory_in_the_profile_or_its_floor_is_a_message_not_a_traceback(capsys, monkeypatch, error):
    """Out of memory in the profiled steps: a message saying what to change, exit 1. Out of memory while the floor
    times a call alone: the profile still printed, a line saying so."""

    def oom(*args, **kwargs):
        raise error

    monkeypatch.setattr(KF, "kernel_floor", oom)
    assert cli(["profile", "--preset", "tiny", "--steps", "1", "--rows", "3"]) == 0
    captured = capsys.readouterr()
    assert "Where a step's time goes" in captured.out and "kernel floor: out of memory" in captured.err
    monkeypatch.setattr(profiling, "profile_run", oom)
    assert cli(["profile", "--preset", "tiny", "--steps", "1"]) == 1
    assert "out of memory in the profiled steps" in capsys.readouterr().err


def test_the_profilers_own_start_and_stop_lines_are_not_shown_and_anything_else_is(capfd, tiny):
    """Kineto writes 'USDT:... profiler_start' lines beneath Python when recording starts and stops (torch 2.13): the
    profile leaves them out of the learner's terminal. Anything else written there meanwhile is passed on."""
    import os

    profiling.profile_run(tiny(steps=3), active=1)
    assert not any(line.startswith(profiling.PROFILER_CHATTER) for line in capfd.readouterr().err.splitlines())
    with profiling._without_profiler_chatter():
        os.write(2, b"USDT:2026-11-26 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a warning to keep\n")
    assert capfd.readouterr().err == "a warning to keep\n"


def test_the_idle_share_counts_the_gaps_between_kernels_once():
    assert profiling.idle_share([(0, 10)], (0, 10)) == 0
    assert profiling.idle_share([], (0, 10)) == 1
    assert profiling.idle_share([(0, 2), (5, 7)], (0, 10)) == pytest.approx(0.6)
    # overlapping kernels (two streams) count once, in any order
    assert profiling.idle_share([(5, 8), (0, 4), (2, 6)], (0, 10)) == pytest.approx(0.2)
    # a kernel nested in another adds nothing; what lies outside the span is left out
    assert profiling.idle_share([(1, 9), (2, 3), (-5, 1), (9, 20)], (0, 10)) == pytest.approx(0.0)
    assert profiling.idle_share([(12, 14)], (0, 10)) == 1
    with pytest.raises(ValueError, match="must come after its start"):
        profiling.idle_share([], (5, 5))


@pytest.mark.parametrize("idle, waits", [(None, False), (0.0, False), (0.19, False), (0.2, True), (0.7, True)])
def test_a_step_is_launch_bound_where_the_device_sat_idle_long_enough(idle, waits):
    assert profiling.launch_bound(idle) is waits


def test_a_cpu_profile_has_no_device_idle_share(tiny):
    p = profiling.profile_run(tiny(), active=1)
    assert profiling.device_idle_share(p) is None
    start, end = profiling.recorded_span(p)
    assert end > start and profiling.kernel_intervals(p) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the device idle share of a real step")
def test_on_a_gpu_the_idle_share_of_a_real_step_is_a_share(tiny):
    p = profiling.profile_run(tiny(device="cuda"), active=2)
    idle = profiling.device_idle_share(p)
    assert idle is not None and 0 <= idle < 1 and profiling.kernel_intervals(p)


def test_the_timeline_draws_each_kernel_and_says_the_idle_share():
    fig = timeline_figure([(1000, 3000), (5000, 6000), (20000, 30000)], (0, 10000), "made up")
    (ax,) = fig.axes
    (bars,) = ax.collections  # one broken_barh: the kernels inside the span, the last one outside it left out
    assert len(bars.get_paths()) == 2 and "idle 70% of the time" in ax.get_title()
    assert ax.get_xlim() == (0, 10)
