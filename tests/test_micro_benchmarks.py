"""course_lib.lessons.micro_benchmarks: timing, peak memory, ugly sizes, AdamW implementations, compile events."""

import time
import types

import pytest
import torch

from course_lib.lessons import micro_benchmarks as B
from course_lib.timing import time_fn


def test_time_fn_returns_the_median_of_the_timed_calls(monkeypatch):
    # A scripted clock: the two warm-up calls take 1 s each, the timed ones 10, 50 and 20 ms. The median (20 ms)
    # is neither the mean (27 ms) nor anything that counts a warm-up call.
    durations = iter([1.0, 1.0, 0.010, 0.050, 0.020])
    now = [0.0]
    from course_lib import timing

    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    calls = []

    def fn():
        calls.append(1)
        now[0] += next(durations)

    assert time_fn(fn, repeats=3, warmup=2) == pytest.approx(0.020)
    assert len(calls) == 5


def test_time_fn_measures_real_seconds():
    t = time_fn(lambda: time.sleep(0.02), repeats=3, warmup=1)
    assert 0.02 <= t < 1.0, t  # sleep waits at least as long as asked; the upper bound only catches a unit error


def test_peak_bytes_counts_the_largest_live_allocation():
    def f():
        a = torch.empty(1000, dtype=torch.float32)  # 4000 bytes
        b = torch.empty(2000, dtype=torch.float32)  # 8000 bytes, alive with a
        del a, b
        return torch.empty(10, dtype=torch.float32)

    peak, method = B.peak_bytes(f)
    assert 12000 <= peak < 13000, peak
    assert method


def test_matmul_sweep_reports_flops():
    m, k, repeats = 64, 32, 2
    t0 = time.perf_counter()
    pts = B.matmul_sweep([63, 64], m=m, k=k, repeats=repeats)
    wall = time.perf_counter() - t0
    assert [p.n for p in pts] == [63, 64]
    assert [p.multiple_of_64 for p in pts] == [False, True]
    for p in pts:
        assert p.gflops == pytest.approx(2 * m * k * p.n / (p.ms / 1e3) / 1e9, rel=1e-9)  # GFLOP/s of that very time
        assert p.ms / 1e3 >= 1e-7, p  # no matmul call finishes in under 0.1 us
    # both timed calls of each size ran inside the sweep: their median (the mean of two) fits in the wall time
    assert sum(repeats * p.ms / 1e3 for p in pts) <= wall


def test_lm_head_time_grows_with_the_vocabulary():
    small = B.lm_head_time(257, tokens=32, width=16, repeats=3)
    big = B.lm_head_time(65536, tokens=32, width=16, repeats=3)  # 255x the logits, matmul and softmax work
    assert big > small, (small, big)


def test_adamw_implementations_agree_and_are_timed():
    params = [torch.randn(33, 17), torch.randn(17), torch.randn(5, 5, 3)]
    assert B.adamw_results_agree(params) < 1e-5
    t0 = time.perf_counter()
    times = B.adamw_step_times(params, repeats=2)
    wall = time.perf_counter() - t0
    assert {"for-loop", "foreach"} <= set(times)
    # fused AdamW is timed exactly where it runs on this device (a capability: checked, not assumed)
    p = torch.zeros(4, requires_grad=True)
    p.grad = torch.ones(4)
    try:
        torch.optim.AdamW([p], fused=True).step()
        fused_runs = True
    except (RuntimeError, ValueError):
        fused_runs = False
    print(f"fused AdamW on this CPU: {'runs' if fused_runs else 'not available'}; step times (s): {times}")
    assert ("fused" in times) == fused_runs
    # every implementation's two timed steps ran inside the call
    assert sum(2 * t for t in times.values()) <= wall


def test_compile_counter_sees_recompiles():
    import torch._dynamo

    torch._dynamo.reset()
    counter = B.CompileCounter()
    f = torch.compile(lambda x: torch.nn.functional.gelu(x) * 2 + 1, backend=counter)
    f(torch.randn(4, 8))
    f(torch.randn(4, 8))  # same shape: no new graph
    assert counter.compiles == 1
    f(torch.randn(4, 9))  # a new shape: a recompile (with a dynamic dimension from now on)
    assert counter.compiles == 2
    f(torch.randn(4, 10))  # covered by the dynamic graph
    assert counter.compiles == 2
    assert counter.graphs[1]["dynamic"]
    torch._dynamo.reset()


def test_break_even():
    assert B.break_even_steps(10.0, 1.0, 0.5) == pytest.approx(20.0)
    assert B.break_even_steps(10.0, 0.5, 0.6) is None
