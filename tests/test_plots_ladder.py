import matplotlib.pyplot as plt
import pytest

from course_lib import plots
from course_lib.results import RunResult, provenance


def result(label, tps, peak_gib=3.0, status="ok", device="CPU (test)"):
    if status != "ok":
        return RunResult(
            label=label,
            status=status,
            config={},
            provenance=provenance(device),
            reason="left out under the test budget",
        )
    return RunResult(
        label=label,
        status="ok",
        config={},
        provenance=provenance(device),
        median_step_s=0.1,
        tokens_per_s=tps,
        memory={
            "peak_bytes": int(peak_gib * 2**30),
            "by_category": {"parameters": 2**30, "activations": int((peak_gib - 1) * 2**30)},
            "method": "CPU ledger: x",
        },
    )


def ladder():
    return [
        result("naive fp32", 100.0, 3.0),
        result("+ bf16", 150.0, 2.5),
        result("+ compile", 0, status="skipped"),
        result("+ chunked loss", 400.0, 1.5),
    ]


def test_speed_panel_shows_cumulative_speed_up_units_and_device():
    fig = plots.plot_ladder(ladder())
    ax_speed = fig.axes[0]
    texts = [t.get_text() for t in ax_speed.texts]
    assert texts[:3] == ["1.00x", "1.50x", "4.00x"]
    assert "SKIPPED" in texts
    assert "speed-up over naive fp32" in ax_speed.get_ylabel()
    line = ax_speed.lines[0]
    assert list(line.get_xdata()) == [0, 1, 3]  # the skipped rung keeps its place on the axis, without a point
    assert list(line.get_ydata()) == pytest.approx([1.0, 1.5, 4.0])
    assert "CPU (test)" in line.get_label()
    plt.close(fig)


def test_memory_panel_stacks_to_the_peak_and_states_the_factor():
    fig = plots.plot_ladder(ladder())
    ax_mem = fig.axes[1]
    assert "GiB" in ax_mem.get_ylabel() and "CPU (test)" in ax_mem.get_title()
    # stacked bars of the ok rungs add up to their peaks (3.0 + 2.5 + 1.5 GiB)
    assert sum(p.get_height() for p in ax_mem.patches) == pytest.approx(7.0)
    texts = [t.get_text() for t in ax_mem.texts]
    assert (
        "0.50x" in texts and "0.83x" in texts and "SKIPPED" in texts and "peak over naive fp32's" in ax_mem.get_title()
    )
    plt.close(fig)


def test_reference_line_is_matched_by_rung_and_labelled_with_its_device():
    ref = [
        result("naive fp32", 1000.0, device="NVIDIA H100 (ref)"),
        result("+ chunked loss", 9000.0, device="NVIDIA H100 (ref)"),
    ]
    fig = plots.plot_ladder(ladder(), reference=ref)
    ref_line = next(line for line in fig.axes[0].lines if "reference" in line.get_label())
    assert "NVIDIA H100 (ref)" in ref_line.get_label()
    assert list(ref_line.get_xdata()) == [0, 3] and list(ref_line.get_ydata()) == pytest.approx([1.0, 9.0])
    plt.close(fig)


def test_no_ok_rung_does_not_crash():
    fig = plots.plot_ladder([result("naive fp32", 0, status="oom")])
    assert "OOM" in [t.get_text() for t in fig.axes[0].texts]
    plt.close(fig)


def test_a_rung_not_kept_is_a_cross_off_the_line_at_its_paired_speed_up():
    """A climb's results carry the speed-up the ladder measured in pairs; the line joins the kept rungs only."""
    rs = ladder()
    for r, kept, speedup in zip(rs, (True, False, None, True), (1.0, 0.07, None, 2.5)):
        r.ladder = {"kept": kept, "speedup": speedup} if speedup else {"kept": False}
    fig = plots.plot_ladder(rs)
    ax = fig.axes[0]
    line = next(ln for ln in ax.lines if "kept" in ln.get_label() and "not" not in ln.get_label())
    assert list(line.get_xdata()) == [0, 3] and list(line.get_ydata()) == pytest.approx([1.0, 2.5])
    cross = next(ln for ln in ax.lines if ln.get_label() == "measured, not kept")
    assert list(cross.get_xdata()) == [1] and list(cross.get_ydata()) == pytest.approx([0.07])
    assert "0.07x" in [t.get_text() for t in ax.texts] and "SKIPPED" in [t.get_text() for t in ax.texts]
    plt.close(fig)
