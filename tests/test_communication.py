"""course_lib.lessons.communication (notebook 07): the collectives' table with its provenance, saved and plotted, the
fit read from it, the naive DDP's predicted communication, and the hand-written DDPs' rows and figure, on made-up ranks'
JSON (tests/test_collectives.py and tests/test_ddp_by_hand.py launch the real programs)."""

import json

import matplotlib.pyplot as plt
import pytest
import torch.nn as nn

from course_lib.distributed import collectives as C
from course_lib.lessons import communication as M

PROVENANCE = {"device": "CPU (made up, 1 thread)", "torch": "2.x", "cuda": None, "date": "2026-01-01T00:00:00+00:00"}
LATENCY, BW = 100e-6, 2e9


def collectives_ranks(world: int) -> list[dict]:
    """A collectives launch's ranks whose all-reduce times follow the model exactly (the others: twice as slow)."""
    rows = []
    for op in C.OPS:
        for b in C.sizes(1024, 2**20, 4):
            t = C.predict_allreduce_s(b, world, LATENCY, BW) * (1 if op == "all-reduce" else 2)
            rows.append(
                {
                    "op": op,
                    "bytes": b,
                    "times_s": [t] * 3,
                    "median_s": t,
                    "q1_s": 0.9 * t,
                    "q3_s": 1.2 * t,
                    "algbw_Bps": b / t,
                    "busbw_Bps": b / t * C.bus_factor(op, world),
                }
            )
    rank = {"strategy": "collectives", "world_size": world, "backend": "gloo", "provenance": PROVENANCE, "rows": rows}
    return [rank] * world


@pytest.fixture
def table():
    return M.collect(collectives_ranks(2), collectives_ranks(4))


def test_the_table_holds_every_world_op_and_size_with_its_provenance(table):
    assert table["worlds"] == [2, 4] and table["backend"] == "gloo"
    assert {"device", "cpu_model", "torch", "date"} <= set(table["provenance"])
    assert len(table["rows"]) == 2 * len(C.OPS) * len(C.sizes(1024, 2**20, 4))
    row = next(r for r in table["rows"] if r["world"] == 4 and r["op"] == "all-gather" and r["bytes"] == 2**20)
    assert row["algbw_GBps"] == pytest.approx(2**20 / row["median_s"] / 1e9)
    assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * 3 / 4)
    text = M.format_table(table)
    assert "busbw GB/s" in text and "all-to-all" in text and PROVENANCE["device"] in text


def test_collect_refuses_another_strategy():
    with pytest.raises(ValueError, match="not a collectives launch"):
        M.collect([{"strategy": "ddp", "provenance": PROVENANCE, "backend": "gloo"}])
    with pytest.raises(ValueError, match="at least one"):
        M.collect()


def test_the_table_saves_as_json(table, tmp_path):
    path = M.save(table, tmp_path / "sub" / "collectives.json")
    assert json.loads(path.read_text()) == table


def test_the_fit_reads_the_tables_all_reduce_points(table):
    for world in (2, 4):
        assert M.fit(table, world) == pytest.approx((LATENCY, BW), rel=1e-9)
    with pytest.raises(ValueError, match="no all-reduce measured at 8"):
        M.fit(table, 8)


def test_the_plot_draws_both_panels_outside_pyplot(table):
    before = plt.get_fignums()
    fig = M.plot(table)
    assert plt.get_fignums() == before  # not kept in pyplot's manager
    ax_t, ax_bw = fig.axes[:2]
    assert ax_t.get_xscale() == ax_t.get_yscale() == "log"
    model_lines = [line for line in ax_t.get_lines() if line.get_label().startswith("all-reduce model")]
    assert len(model_lines) == 2  # one per world size
    assert len(ax_bw.get_lines()) == 2 * len(C.OPS)


def test_the_naive_ddp_prediction_is_one_all_reduce_per_tensor():
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2, bias=False))
    model[0].bias.requires_grad_(False)  # a frozen tensor sends nothing
    sizes = [8 * 4 * 4, 2 * 8 * 4]
    want = sum(LATENCY + b * 2 * (2 - 1) / 2 / BW for b in sizes)
    assert M.predict_naive_ddp_s(model, 2, LATENCY, BW) == pytest.approx(want)


def ddp_ranks() -> list[dict]:
    def run(variant, kb, step, exposed, calls, diff):
        return {
            "variant": variant,
            "bucket_bytes": kb * 1024,
            "median_step_s": step,
            "exposed_comm_s": exposed,
            "allreduce_calls_per_step": calls,
            "max_abs_param_diff_vs_torch_ddp": diff,
        }

    def rank(r, slow):
        runs = [
            run("torch", 0, 0.02 * slow, None, 1, 0.0),
            run("naive", 0, 0.05 * slow, 0.03 * slow, 28, 0.0),
            run("overlapped", 0, 0.04, 0.01, 28, 0.0),
            run("bucketed", 4, 0.03, 0.01, 10, 1e-9 * r),
            run("bucketed", 1024, 0.025, 0.012, 1, 0.0),
        ]
        return {"rank": r, "backend": "gloo", "provenance": PROVENANCE, "runs": runs}

    return [rank(0, 1.0), rank(1, 2.0)]


def test_ddp_rows_take_the_slowest_rank_and_the_largest_difference():
    rows = M.ddp_rows(ddp_ranks())
    assert [r["name"] for r in rows] == ["torch DDP", "naive", "overlapped", "bucketed 4 KiB", "bucketed 1024 KiB"]
    assert rows[1]["step_ms"] == pytest.approx(100) and rows[1]["exposed_ms"] == pytest.approx(60)
    assert rows[0]["exposed_ms"] is None and rows[3]["max_param_diff"] == pytest.approx(1e-9)


def test_the_ddp_figure_draws_every_variant_and_the_sweep():
    fig = M.plot_ddp_by_hand(ddp_ranks())
    ax, ax_b = fig.axes[:2]
    assert len(ax.patches) == 2 * 5  # step time and exposed communication per run
    assert [line.get_xdata().tolist() for line in ax_b.get_lines()] == [[4, 1024], [4, 1024]]
