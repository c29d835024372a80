import pytest

from course_lib import config as C
from course_lib import widgets


@pytest.fixture
def panel():
    return widgets.Panel(C.tiny_preset("cpu"), controls=("preset", "precision", "attention", "compile", "batch_size", "grad_accum_steps", "context", "steps"),
                         plots=("speed", "memory", "loss", "step_times"))


def test_controls_mirror_the_config(panel):
    assert panel.config() == C.tiny_preset("cpu")
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


def test_a_control_this_device_cannot_run_is_disabled_and_says_why(monkeypatch):
    from course_lib import capabilities as K

    monkeypatch.setattr(K, "_compile_support", lambda dev: K.Support(False, "needs a C++ compiler"))
    K.capabilities.cache_clear()
    p = widgets.Panel(C.tiny_preset("cpu"), controls=("compile",))
    K.capabilities.cache_clear()
    assert p.controls["compile"].disabled and "C++ compiler" in p.widget.children[0].value
    with pytest.raises(C.ConfigError, match="unavailable"):
        p.set(compile=True)


def test_a_new_panel_has_its_own_handlers():
    a = widgets.Panel(C.tiny_preset("cpu"), controls=("steps",))
    b = widgets.Panel(C.tiny_preset("cpu"), controls=("steps",))
    assert a.run_button is not b.run_button and len(a.run_button._click_handlers.callbacks) == 1


def test_unknown_control_is_explained():
    with pytest.raises(KeyError, match="no 'nonsense' control"):
        widgets.Panel(C.tiny_preset("cpu"), controls=("steps",)).set(nonsense=1)


def test_a_run_without_memory_measurement_is_still_recorded():
    import dataclasses

    p = widgets.Panel(dataclasses.replace(C.tiny_preset("cpu"), measure_memory=False), controls=("steps",))
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


def test_save_to_keeps_every_run_in_a_file(tmp_path):
    """The panel writes its results as it records them: closing the notebook loses nothing."""
    from course_lib.results import load_results

    path = tmp_path / "runs" / "panel.json"
    p = widgets.Panel(C.tiny_preset("cpu"), controls=("attention", "steps"), save_to=path)
    first = p.run()
    assert [r.label for r in load_results(path)[0]] == [first.label]
    p.set(attention="sdpa")
    p.run()
    import json

    saved, _ = load_results(path)
    as_json = lambda rs: json.loads(json.dumps([r.to_dict() for r in rs]))  # noqa: E731 - tuples become lists in JSON
    assert as_json(saved) == as_json(p.results)
