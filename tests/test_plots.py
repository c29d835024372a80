import matplotlib.pyplot as plt

from course_lib import plots
from course_lib.results import RunResult, provenance


def result(label, tps, status="ok"):
    return RunResult(label=label, status=status, config={}, provenance=provenance("CPU (test)"), median_step_s=0.1, tokens_per_s=tps,
                     step_times=[1.0, 0.1, 0.1], excluded_steps=[0], losses=[3.0, 2.5, 2.0], val_losses=[(2, 2.2)],
                     memory={"peak_bytes": 3 * 2**30, "by_category": {"parameters": 2**30, "activations": 2 * 2**30}, "method": "CPU ledger: x"})


def test_each_plot_names_units_and_device():
    rs = [result("naive", 100.0), result("fast", 250.0), RunResult("huge", "oom", {}, {"device": "CPU (test)"}, reason="oom")]
    for fn, unit in [(plots.plot_speed, "tokens/s"), (plots.plot_memory, "GiB"), (plots.plot_losses, "nats/token"), (plots.plot_step_times, "ms")]:
        fig = fn(rs)
        ax = fig.axes[0]
        assert unit in ax.get_ylabel() and "CPU (test)" in ax.get_title()
        plt.close(fig)


def test_speed_bars_are_labelled_with_speed_up_and_failures():
    fig = plots.plot_speed([result("naive", 100.0), result("fast", 250.0), RunResult("huge", "oom", {}, {"device": "x"})])
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert texts == ["1.00x", "2.50x", "OOM"]
    plt.close(fig)


def test_memory_bars_stack_to_the_peak():
    fig = plots.plot_memory([result("naive", 100.0)])
    heights = [p.get_height() for p in fig.axes[0].patches]
    assert abs(sum(heights) - 3.0) < 1e-9
    plt.close(fig)
