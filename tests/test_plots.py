import matplotlib.pyplot as plt

from course_lib import plots
from course_lib.lessons.formula_beside_measured import plot_memory_vs_estimate
from course_lib.results import RunResult, provenance


def result(label, tps, status="ok"):
    return RunResult(
        label=label,
        status=status,
        config={},
        provenance=provenance("CPU (test)"),
        median_step_s=0.1,
        tokens_per_s=tps,
        step_times=[1.0, 0.1, 0.1],
        excluded_steps=[0],
        losses=[3.0, 2.5, 2.0],
        val_losses=[(2, 2.2)],
        memory={
            "peak_bytes": 3 * 2**30,
            "by_category": {"parameters": 2**30, "activations": 2 * 2**30},
            "method": "CPU ledger: x",
        },
    )


def test_each_plot_names_units_and_device():
    rs = [
        result("naive", 100.0),
        result("fast", 250.0),
        RunResult("huge", "oom", {}, {"device": "CPU (test)"}, reason="oom"),
    ]
    for fn, unit in [
        (plots.plot_speed, "tokens/s"),
        (plots.plot_memory, "GiB"),
        (plots.plot_losses, "nats/token"),
        (plots.plot_step_times, "ms"),
    ]:
        fig = fn(rs)
        ax = fig.axes[0]
        assert unit in ax.get_ylabel() and "CPU (test)" in ax.get_title()
        plt.close(fig)


def test_speed_bars_are_labelled_with_speed_up_and_failures():
    fig = plots.plot_speed(
        [result("naive", 100.0), result("fast", 250.0), RunResult("huge", "oom", {}, {"device": "x"})]
    )
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert texts == ["1.00x", "2.50x", "OOM"]
    plt.close(fig)


def test_memory_bars_stack_to_the_peak():
    fig = plots.plot_memory([result("naive", 100.0)])
    heights = [p.get_height() for p in fig.axes[0].patches]
    assert abs(sum(heights) - 3.0) < 1e-9
    plt.close(fig)


def test_course_figures_stay_out_of_pyplot_and_render_with_content():
    """A panel draws from a button's callback: its figures must not go through pyplot's global state, and the PNG
    it shows must hold a drawing (the blank-figure bug gave a PNG of the right size with nothing drawn)."""
    import io

    import matplotlib.image as mpimg

    before = plt.get_fignums()
    fig = plots.plot_results([result("naive", 100.0), result("fast", 250.0)], ("speed", "memory", "loss"))
    assert plt.get_fignums() == before  # not registered with pyplot
    png = plots.figure_png(fig)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = mpimg.imread(io.BytesIO(png))[..., :3]
    drawn = (pixels < 0.95).any(axis=-1).mean()
    assert drawn > 0.03, f"only {drawn:.1%} of the pixels are drawn"


def test_many_runs_stay_readable_short_ticks_and_a_legend_beside_the_curves():
    """A panel after many presses (notebook 05: 13 runs) and a run named by its whole config (notebook 09)."""
    runs = []
    for i in range(15):
        r = result(
            f"#{i + 1} precision=bf16, attention=sdpa, compile, vocab_multiple=64, fused_adamw, set_to_none", 100.0 + i
        )
        r.losses = [8.0 - 0.1 * k - 0.01 * i for k in range(5)]
        runs.append(r)
    fig = plots.plot_results(runs, ("speed", "loss"))
    ax_speed, ax_loss = fig.axes[0], fig.axes[1]
    ticks = [t.get_text() for t in ax_speed.get_xticklabels()]
    assert all(len(t) <= plots.MAX_TICK for t in ticks) and ticks[11].startswith("#12 ")
    legend = ax_loss.get_legend()
    texts = [t.get_text() for t in legend.get_texts()]
    assert len(texts) == plots.MAX_LEGEND and "the last" in texts[0] and texts[-1].startswith("#15")
    # placed beside the axes, not over the curves
    assert legend.get_bbox_to_anchor().x0 > ax_loss.get_window_extent().x0
    plt.close(fig)


def test_memory_vs_estimate_on_cuda_compares_only_what_the_allocator_measures_apart():
    """A CUDA run records the allocator's peak: parameters and optimizer state from the tensors, gradients None with
    set_to_none, activations and logits None, and the rest of the peak as "other" (train.Trainer.finish through
    measure.cuda_memory_report, called here as it writes it). The panel must not draw the formula's activations beside a
    measured "other" that holds them: both bars show parameters, optimizer state and one merged rest, equal to the peak
    less the measured parts, and the title says the allocator gives only the peak."""
    from course_lib import measure
    from course_lib.measure import CATEGORIES

    MiB = 2**20
    static = {"parameters": 10 * MiB, "gradients": None, "optimizer state": 20 * MiB}
    mem = measure.cuda_memory_report("cuda", static, peak=100 * MiB, reserved=128 * MiB).to_dict()
    assert mem["by_category"]["activations"] is None and mem["method"].startswith("CUDA:")
    formula = {
        "parameters": 10 * MiB,
        "gradients": 10 * MiB,
        "optimizer state": 20 * MiB,
        "activations": 40 * MiB,
        "logits": 15 * MiB,
        "other": 0,
    }
    r = RunResult(
        label="gpu",
        status="ok",
        config={},
        provenance=provenance("NVIDIA H100 (test)"),
        median_step_s=0.1,
        memory=mem,
        details={"estimate": {"by_category": formula, "peak_bytes": sum(formula.values())}},
    )
    ax = plot_memory_vs_estimate([r]).axes[0]
    # one bar per category shown, the formula's first (x = 0), then the measurement's (x = 1, the ones in the legend)
    names = [c.get_label() for c in ax.containers if not c.get_label().startswith("_")]
    assert len(ax.containers) == 2 * len(names)
    bars = {
        (x, name): c.patches[0].get_height() for x in (0, 1) for name, c in zip(names, ax.containers[x * len(names) :])
    }
    names = set(names)
    assert not names & {"activations", "logits", "gradients", "other"}, names  # none claims a split nobody measured
    rest = [n for n in names if n not in CATEGORIES]
    assert len(rest) == 1 and all(c in rest[0] for c in ("activations", "logits", "gradients", "other")), names
    # 100 - 10 - 20
    assert bars[(1, "parameters")] == 10 and bars[(1, "optimizer state")] == 20 and bars[(1, rest[0])] == 70
    assert bars[(0, rest[0])] == 10 + 40 + 15  # the formula's gradients, activations, logits and other, together
    title = ax.get_title()
    assert "CUDA" in title and "only the peak" in title and "activations" in title
    # a CPU ledger run (every category measured) keeps its categories apart
    cpu = RunResult(
        label="cpu",
        status="ok",
        config={},
        provenance=provenance("CPU (test)"),
        median_step_s=0.1,
        memory={"peak_bytes": 95 * MiB, "by_category": formula, "method": "CPU ledger: x"},
        details={"estimate": {"by_category": formula, "peak_bytes": 95 * MiB}},
    )
    ax = plot_memory_vs_estimate([cpu]).axes[0]
    assert {c.get_label() for c in ax.containers} >= {"activations", "logits"} and "only the peak" not in ax.get_title()
