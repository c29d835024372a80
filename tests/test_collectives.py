"""The collectives benchmark (course_lib.distributed.collectives): nccl-tests' bus-bandwidth factors, a launch at 2
and at 4 gloo processes that returns every op and size with consistent times and bandwidths, the alpha-beta model and
its fit, and options refused before any process starts. No speed is asserted: the machine may be shared."""

import subprocess

import pytest

from course_lib.config import ConfigError
from course_lib.distributed import collectives as C
from course_lib.distributed.launch import launch

TINY = {"min_bytes": 1024, "max_bytes": 16 * 1024, "factor": 4, "warmup": 1, "repeats": 3}


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 64])
def test_bus_factors_are_nccl_tests(n):
    # nccl-tests, doc/PERFORMANCE.md: busbw = algbw * 2(n-1)/n for AllReduce, * (n-1)/n for ReduceScatter, AllGather
    # (and its alltoall.cu: (n-1)/n)
    assert C.bus_factor("all-reduce", n) == pytest.approx(2 * (n - 1) / n)
    for op in ("all-gather", "reduce-scatter", "all-to-all"):
        assert C.bus_factor(op, n) == pytest.approx((n - 1) / n)


def test_an_unknown_collective_names_the_closest():
    with pytest.raises(ValueError, match="all-reduce"):
        C.bus_factor("all_reduce", 2)


def test_sizes_go_up_by_the_factor_to_the_maximum():
    assert C.sizes(1024, 4 * 2**20, 4) == [2**10, 2**12, 2**14, 2**16, 2**18, 2**20, 2**22]
    assert C.sizes(1024, 3000, 2) == [1024, 2048]
    assert C.sizes(1024, 1024, 4) == [1024]


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request):
    result = launch("collectives", request.param, options=TINY, device="cpu", timeout_s=240)
    assert result.ok, result.why()
    return result.ranks


@pytest.mark.distributed
def test_every_op_and_size_is_measured_with_consistent_bandwidths(ranks):
    n = len(ranks)
    sizes = C.sizes(TINY["min_bytes"], TINY["max_bytes"], TINY["factor"])
    for rank in ranks:
        assert rank["world_size"] == n and rank["backend"] == "gloo"
        assert {"device", "torch", "date"} <= set(rank["provenance"])
        assert [(r["op"], r["bytes"]) for r in rank["rows"]] == [
            (op, s // 4 // n * n * 4) for op in C.OPS for s in sizes
        ]  # every op, every size, rounded down to whole float32 elements per rank
        for row in rank["rows"]:
            assert len(row["times_s"]) == TINY["repeats"] and min(row["times_s"]) > 0
            assert row["q1_s"] <= row["median_s"] <= row["q3_s"]
            assert row["algbw_Bps"] == pytest.approx(row["bytes"] / row["median_s"])
            assert row["busbw_Bps"] == pytest.approx(row["algbw_Bps"] * C.bus_factor(row["op"], n))
    # each repetition counts as long as its slowest rank took: every rank writes the same times
    assert all(rank["rows"] == ranks[0]["rows"] for rank in ranks)


def test_the_model_is_latency_plus_bus_bytes_over_bandwidth():
    # 1 MiB on 4 ranks: 2 * 3/4 MiB over each link at 1 GB/s, after 50 µs
    assert C.predict_allreduce_s(2**20, 4, 50e-6, 1e9) == pytest.approx(50e-6 + 1.5 * 2**20 / 1e9)
    assert C.predict_allreduce_s(0, 4, 50e-6, 1e9) == pytest.approx(50e-6)


@pytest.mark.parametrize("world", [2, 4])
def test_the_fit_recovers_made_up_latency_and_bandwidth(world):
    latency, bw = 80e-6, 2.5e9
    sizes = [4**k * 1024 for k in range(7)]
    exact = [C.predict_allreduce_s(b, world, latency, bw) for b in sizes]
    assert C.fit_allreduce(sizes, exact, world) == pytest.approx((latency, bw), rel=1e-9)
    noisy = [t * (1 + 0.05 * (-1) ** i) for i, t in enumerate(exact)]  # +-5 %, alternating
    got_latency, got_bw = C.fit_allreduce(sizes, noisy, world)
    assert got_latency == pytest.approx(latency, rel=0.15) and got_bw == pytest.approx(bw, rel=0.15)


def test_the_fit_keeps_latency_non_negative_and_refuses_what_it_cannot_fit():
    sizes = [1024, 4096, 16384]
    latency, bw = C.fit_allreduce(sizes, [b / 1e9 for b in sizes], 2)  # pure bandwidth: no latency at all
    assert latency == pytest.approx(0, abs=1e-12) and bw == pytest.approx(1e9)
    with pytest.raises(ValueError, match="one process"):
        C.fit_allreduce(sizes, [1e-4] * 3, 1)
    with pytest.raises(ValueError, match="do not grow"):
        C.fit_allreduce(sizes, [3e-4, 2e-4, 1e-4], 2)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"max_bytes": 512}, "min_bytes <= max_bytes"),
        ({"factor": 1}, "factor >= 2"),
        ({"repeats": 0}, "repeats >= 1"),
        ({"ops": ["all_reduce"]}, "all-reduce"),
        ({"ops": []}, "ops are some of"),
        ({"max_bytse": 2**20}, "max_bytes"),  # an unknown option names the closest
        ({"max_bytes": "4MiB"}, "an integer"),
    ],
)
def test_a_bad_option_is_refused_before_any_process_starts(monkeypatch, options, message):
    def no_process(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    with pytest.raises(ConfigError, match=message):
        launch("collectives", 2, options=options)
