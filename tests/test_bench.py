"""course_lib.bench: timing, peak memory, ugly sizes, AdamW implementations, compile events."""
import pytest
import torch

from course_lib import bench as B


def test_time_fn_is_positive_and_median():
    calls = []
    t = B.time_fn(lambda: calls.append(1), repeats=3, warmup=2)
    assert t >= 0 and len(calls) == 5


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
    pts = B.matmul_sweep([63, 64], m=64, k=32, repeats=2)
    assert [p.n for p in pts] == [63, 64]
    assert [p.multiple_of_64 for p in pts] == [False, True]
    assert all(p.ms > 0 and p.gflops > 0 for p in pts)


def test_lm_head_time_positive():
    assert B.lm_head_time(257, tokens=32, width=16, repeats=2) > 0


def test_adamw_implementations_agree_and_are_timed():
    params = [torch.randn(33, 17), torch.randn(17), torch.randn(5, 5, 3)]
    assert B.adamw_results_agree(params) < 1e-5
    times = B.adamw_step_times(params, repeats=2)
    assert {"for-loop", "foreach"} <= set(times) and all(t > 0 for t in times.values())


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
