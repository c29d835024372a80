import dataclasses
import json

import pytest

from course_lib import config as C, techniques as T, widgets
from course_lib.results import RunResult


@pytest.fixture
def panel(tiny):
    return widgets.Panel(
        tiny(),
        controls=("preset", "precision", "attention", "compile", "batch_size", "grad_accum_steps", "context", "steps"),
        plots=("speed", "memory", "loss", "step_times"),
    )


def test_controls_mirror_the_config(panel, tiny):
    assert panel.config() == tiny()
    panel.set(precision="bf16", attention="sdpa", batch_size=8)
    cfg = panel.config()
    assert (cfg.precision, cfg.model.attention, cfg.batch_size) == ("bf16", "sdpa", 8)
    assert panel.label(cfg) == "#1 precision=bf16, attention=sdpa, batch_size=8"


def test_runs_accumulate_in_the_table_and_plots_redraw(panel):
    panel.run()
    first_figure = panel.last_figure
    panel.set(attention="sdpa")
    panel.run()
    assert [r.status for r in panel.results] == ["ok", "ok"]
    assert panel.table.value.count("<tr>") == 3  # header + two runs
    assert panel.last_figure is not first_figure
    panel.clear()
    assert panel.results == [] and "No runs yet" in panel.table.value


def test_an_invalid_choice_is_a_row_with_the_reason_not_a_crash(panel):
    panel.set(batch_size=3, grad_accum_steps=2)
    r = panel.run()
    assert r.status == "skipped" and "does not divide" in r.reason
    assert "SKIPPED" in panel.table.value


def test_a_control_this_device_cannot_run_is_disabled_and_says_why(monkeypatch, tiny):
    from course_lib import capabilities as K

    no_compiler = lambda dev: K.Support(False, "needs a C++ compiler")  # noqa: E731
    probed = tuple(dataclasses.replace(t, probe=no_compiler) if t.name == "compile" else t for t in T.TECHNIQUES)
    monkeypatch.setattr(T, "TECHNIQUES", probed)  # the compile technique's probe, as this device would answer it
    K.capabilities.cache_clear()
    p = widgets.Panel(tiny(), controls=("compile",))
    K.capabilities.cache_clear()
    assert p.controls["compile"].disabled and "C++ compiler" in p.widget.children[0].value
    with pytest.raises(C.ConfigError, match="unavailable"):
        p.set(compile=True)


def test_a_new_panel_has_its_own_handlers(tiny):
    a = widgets.Panel(tiny(), controls=("steps",))
    b = widgets.Panel(tiny(), controls=("steps",))
    assert a.run_button is not b.run_button and len(a.run_button._click_handlers.callbacks) == 1


def test_unknown_control_is_explained(tiny):
    with pytest.raises(KeyError, match="no 'nonsense' control"):
        widgets.Panel(tiny(), controls=("steps",)).set(nonsense=1)


def test_a_run_without_memory_measurement_is_still_recorded(tiny):

    p = widgets.Panel(tiny(measure_memory=False), controls=("steps",))
    r = p.run()
    assert r.ok and p.results == [r] and "memory not measured" in p.status.value


def test_the_panel_figure_holds_a_drawing_after_every_run(panel):
    """What the browser shows is plot_image.value: a PNG with a real drawing after each run, not only the first."""
    import io

    import matplotlib.image as mpimg

    sizes = []
    for attention in ("naive", "sdpa"):
        panel.set(attention=attention)
        panel.run()
        png = panel.plot_image.value
        drawn = (mpimg.imread(io.BytesIO(png))[..., :3] < 0.95).any(axis=-1).mean()
        assert drawn > 0.03, f"run {len(sizes) + 1}: only {drawn:.1%} drawn"
        sizes.append(len(png))
    assert sizes[1] >= 0.5 * sizes[0]


def test_save_to_keeps_every_run_in_a_file(tmp_path, tiny):
    """The panel writes its results as it records them: closing the notebook loses nothing."""
    from course_lib.results import load_results

    path = tmp_path / "runs" / "panel.json"
    p = widgets.Panel(tiny(), controls=("attention", "steps"), save_to=path)
    first = p.run()
    assert [r.label for r in load_results(path)[0]] == [first.label]
    p.set(attention="sdpa")
    p.run()
    import json

    saved, _ = load_results(path)
    as_json = lambda rs: json.loads(json.dumps([r.to_dict() for r in rs]))  # noqa: E731 - tuples become lists in JSON
    assert as_json(saved) == as_json(p.results)


def test_a_save_that_fails_keeps_the_runs_and_says_so(tmp_path, tiny):
    """The save_to folder gone (replaced by a file) while the notebook runs: the run is kept and the panel says where
    its runs are; once the file can be written again they are all saved."""
    from course_lib.results import load_results

    folder = tmp_path / "runs"
    p = widgets.Panel(tiny(), controls=("steps",), save_to=folder / "panel.json")
    p.run()
    (folder / "panel.json").unlink()
    folder.rmdir()
    folder.write_text("now a file")
    second = p.run()
    assert second.ok and len(p.results) == 2
    assert "Not saved to" in p.status.value and "kept in this panel's .results" in p.status.value
    earlier = tmp_path / "elsewhere.json"
    earlier.write_text("an earlier session's runs")
    saved = p.save_runs(earlier)  # at once, and beside a file already there, never over it
    assert saved == tmp_path / "elsewhere-2.json" and len(load_results(saved)[0]) == 2
    assert earlier.read_text() == "an earlier session's runs"
    p.run()
    assert len(load_results(saved)[0]) == 3 and "Not saved" not in p.status.value


def test_save_to_never_replaces_an_earlier_file_and_says_where_it_writes(tmp_path, tiny):
    """A second session's panel with the same save_to writes beside the first one's file, and the panel says so."""
    from course_lib.results import load_results

    path = tmp_path / "panel.json"
    first = widgets.Panel(tiny(), controls=("steps",), save_to=path)
    first.run()
    before = path.read_text()
    second = widgets.Panel(tiny(), controls=("steps",), save_to=path)
    assert second.save_to == tmp_path / "panel-2.json" and "holds earlier runs: kept as it is" in second.status.value
    second.run()
    assert path.read_text() == before and len(load_results(second.save_to)[0]) == 1
    with pytest.raises(IsADirectoryError, match="is a folder"):
        widgets.Panel(tiny(), controls=("steps",), save_to=tmp_path)


def _drawn(png: bytes) -> float:
    import io

    import matplotlib.image as mpimg

    return float((mpimg.imread(io.BytesIO(png))[..., :3] < 0.95).any(axis=-1).mean())


def test_a_notebooks_own_control_and_plot_redraw_on_every_run(tiny):
    """extras reach the runner as keywords and name the run; a callable in plots draws on the Axes it is given;
    what the runner measured beyond a RunResult stays in panel.results (RunResult.details)."""
    import ipywidgets as W

    from course_lib.train import run

    seen, drawn_with = [], []

    def runner(cfg, label, callback, factor):
        seen.append(factor)
        return run(cfg, label, callback=callback).with_details(squares=[factor * i * i for i in range(cfg.steps)])

    def plot_squares(results, ax):
        drawn_with.append(len(results))
        for r in results:
            ax.plot(r.details["squares"], "o-", lw=3, label=r.label)
        ax.legend()

    p = widgets.Panel(
        tiny(measure_memory=False),
        controls=("steps",),
        runner=runner,
        extras={"factor": W.IntSlider(value=1, min=1, max=5, description="factor")},
        plots=(plot_squares, "grad_norm", "lr"),
    )
    for factor in (1, 3):
        p.set(factor=factor)
        p.run()
        assert _drawn(p.plot_image.value) > 0.03, f"run with factor={factor}: the figure holds no drawing"
    assert seen == [1, 3] and drawn_with == [1, 2]
    assert [r.label for r in p.results] == ["#1 baseline", "#2 factor=3"]
    assert p.results[1].details["squares"] == [0, 3, 12, 27] and len(p.last_figure.axes) == 3
    again = RunResult.from_dict(json.loads(json.dumps(p.results[1].to_dict())))  # what save_to writes
    assert (again.label, again.losses, again.details) == (p.results[1].label, p.results[1].losses, p.results[1].details)


def test_extras_need_a_runner_that_takes_them_and_plots_must_exist(tiny):
    import ipywidgets as W

    extra = {"factor": W.IntSlider(value=1)}
    with pytest.raises(ValueError, match="need a runner"):
        widgets.Panel(tiny(), controls=("steps",), extras=extra)
    with pytest.raises(ValueError, match="no argument named factor"):
        widgets.Panel(tiny(), controls=("steps",), extras=extra, runner=lambda cfg, label, callback: None)
    p = widgets.Panel(
        tiny(measure_memory=False),
        controls=("steps",),
        plots=("speed", "nonsense"),
    )
    with pytest.raises(KeyError, match="no plot named 'nonsense'"):
        p.run()
    assert len(p.results) == 1  # recorded before the figure failed


def test_loss_scale_controls_read_as_powers_of_two(tiny):
    p = widgets.Panel(
        tiny(precision="fp16"),
        controls=("loss_scale_init", "loss_scale_growth_interval"),
    )
    assert p.controls["loss_scale_init"].label == "2^16"
    p.set(loss_scale_init=2.0**30, loss_scale_growth_interval=3)
    cfg = p.config()
    assert (cfg.loss_scale_init, cfg.loss_scale_growth_interval) == (2.0**30, 3)
    assert p.label(cfg) == "#1 loss_scale_init=2^30, loss_scale_growth_interval=3"


def test_the_padding_panel_measures_each_normalisation_against_the_big_batch(splits, tiny):
    """Notebook 06's runner (accumulated_gradients.normalisation_run): whole-batch normalisation matches the big batch
    under uneven padding, the mean of means does not; both runs drawn."""
    import ipywidgets as W

    from course_lib.lessons import accumulated_gradients as acc

    def runner(cfg, label, callback, imbalance, normalisation):
        r, d = acc.normalisation_run(cfg, splits.train, splits.pad_id, imbalance, normalisation, label, callback)
        return r.with_details(**d)

    p = widgets.Panel(
        tiny(context=32, batch_size=4, grad_accum_steps=4, steps=2, timing_warmup=1),
        controls=("grad_accum_steps",),
        runner=runner,
        plots=(acc.plot_gradient_errors, acc.plot_target_counts),
        extras={
            "imbalance": W.Dropdown(options=[1, 8], value=8),
            "normalisation": W.Dropdown(options=list(acc.NORMALISATIONS)),
        },
    )
    for n in ("global", "mean_of_means"):
        p.set(normalisation=n).run()
        assert _drawn(p.plot_image.value) > 0.03
    good, bad = (r.details for r in p.results)
    assert good["target_counts"] == [32, 16, 8, 4] and good["relative_error"] < 1e-5 and bad["relative_error"] > 1e-2
    assert "relative error" in p.table.value


def test_the_strategy_panel_refuses_what_a_strategy_cannot_run(tiny):
    from course_lib.distributed import strategy_panel as DP

    cfg = tiny().with_model(n_layer=4, n_head=4)
    assert DP.why_not(cfg, "ddp", 3, 1) is None and DP.why_not(cfg, "gpipe", 2, 2) is None
    assert "at least 4 micro-batches" in DP.why_not(cfg, "1f1b", 4, 2)
    assert "not divisible by 3" in DP.why_not(cfg, "tp", 3, 1)


# ---- the code: the configuration as a training script (course_lib.export) ----------------------------------------


def test_the_code_view_follows_the_controls_while_open(panel):
    from course_lib import export

    assert panel.code.selected_index is None and panel.code_view.value == ""  # collapsed, nothing formatted yet
    panel.code.selected_index = 0
    naive_text = panel.code_view.value
    assert "the two scripts are the same" in naive_text  # the tiny preset is naive fp32
    panel.set(precision="bf16")
    assert panel.code_view.value != naive_text and "torch.autocast" in panel.code_view.value
    assert panel.code_view.value == export.diff_html(
        T.naive(panel.base), panel.config(), "naive fp32 -> this configuration"
    )
    panel.set(attention="sdpa")
    assert "scaled_dot_product_attention" in panel.code_view.value and "torch.autocast" in panel.code_view.value
    panel.set(batch_size=3, grad_accum_steps=2)  # no config: the reason, not a crash
    assert "No script for this configuration" in panel.code_view.value and "does not divide" in panel.code_view.value


def test_the_export_button_writes_the_current_configurations_script(panel, tmp_path, monkeypatch, pyflakes):
    from course_lib import export

    monkeypatch.chdir(tmp_path)  # the notebook's folder
    panel.set(precision="bf16", attention="sdpa", grad_accum_steps=2)
    panel.export_button.click()
    written = list(tmp_path.glob("train_*.py"))
    assert (
        len(written) == 1
        and written[0].name in panel.export_status.value
        and str(tmp_path) in panel.export_status.value
    )
    assert written[0].read_text() == export.script(panel.config())
    panel.set(batch_size=3)  # 3 sequences do not split into 2 micro-batches
    assert (
        panel.export_script() is None
        and "Not exported" in panel.export_status.value
        and len(list(tmp_path.glob("*.py"))) == 1
    )
    assert pyflakes(written[0]) == ""  # last: it skips where pyflakes is missing


def test_the_strategy_panel_exports_ddp_and_fsdp_as_torchrun_scripts(tmp_path, tiny):
    import ipywidgets as W

    from course_lib import export
    from course_lib.distributed import strategy_panel as DP

    p = widgets.Panel(
        tiny(measure_memory=False),
        controls=("steps",),
        runner=DP.strategy_runner(),
        extras={
            "strategy": W.Dropdown(options=list(DP.STRATEGIES), value="ddp"),
            "processes": W.IntSlider(value=2),
            "microbatches": W.IntSlider(value=2),
        },
    )
    p.code.selected_index = 0
    assert "DistributedDataParallel(model)" in p.code_view.value
    path = p.export_script(tmp_path)
    assert (
        path.read_text() == export.script(dataclasses.replace(p.config(), data_parallel="ddp"))
        and "torchrun" in p.export_status.value
    )
    p.set(strategy="fsdp")
    assert "fully_shard(model, mesh=mesh)" in p.code_view.value
    assert "fully_shard" in p.export_script(tmp_path).read_text()
    p.set(strategy="1f1b")
    assert "not the course's loop" in p.code_view.value and p.export_script(tmp_path) is None


def test_start_from_sets_every_control_and_names_runs_against_that_config(panel, tiny):
    """Notebooks 04 and 09 start their panels at the loop the ladder kept on this device."""
    kept = tiny(precision="bf16", batch_size=8).with_model(attention="sdpa")
    panel.start_from(kept)
    assert panel.config() == kept and panel.base == kept
    assert panel.label(panel.config()) == "#1 baseline"
    panel.set(attention="naive")
    assert panel.label(panel.config()) == "#1 attention=naive"
