"""The panel's parts, each on its own (course_lib/widgets/): the controls are made from the technique registry, the run
queue goes on after an OOM and keeps every result, and the table and the figure are made from results alone."""

import weakref

import pytest
import torch

from course_lib import techniques as T
from course_lib.config import ConfigError
from course_lib.results import RunResult, provenance
from course_lib.widgets import controls as CT, figure, table
from course_lib.widgets.controls import Controls
from course_lib.widgets.run_queue import RunQueue


def _fake_technique(field, label, off, help, **kw):
    return T.Technique(field, label, off, help=help, **kw)


# ---- the controls: made from the registry ----------------------------------------------------------------------------


def test_a_technique_in_the_registry_gets_a_control_with_its_label_choices_and_tooltip(tiny):
    """A registry that is not the course's: its techniques, and only they, become controls, each labelled and explained
    by its own declaration (nothing about them is written in the widgets)."""
    fake = (
        _fake_technique("set_to_none", "free the gradients", False, "gradients go between steps"),
        _fake_technique("loss_chunks", "logit slices", 1, "the loss one slice at a time", choices=(3, 1)),
        _fake_technique("model.attention", "attention kind", "naive", "how attention is computed"),
    )
    names = CT.technique_controls(fake)
    assert names == ("set_to_none", "loss_chunks", "attention")
    c = Controls(tiny(), names, techniques=fake)
    box, slices, attention = (c.widgets[n] for n in names)
    assert (box.description, box.tooltip) == ("free the gradients", "gradients go between steps")
    assert (slices.description, slices.tooltip, slices.options) == (
        "logit slices",
        "the loss one slice at a time",
        (("1", 1), ("3", 3)),
    )
    assert (attention.description, [v for _, v in attention.options]) == ("attention kind", ["naive", "sdpa", "flash"])
    c.set(set_to_none=True, loss_chunks=3, attention="sdpa")
    cfg = c.config()
    assert (cfg.set_to_none, cfg.loss_chunks, cfg.model.attention) == (True, 3, "sdpa")
    assert c.describe(cfg) == "set_to_none, loss_chunks=3, attention=sdpa"


def test_the_course_registry_labels_every_default_control(tiny):
    c = Controls(tiny(), CT.ALL_CONTROLS)
    for t in T.TECHNIQUES:
        w = c.widgets[t.name]
        assert w.description.startswith(t.label) and (w.disabled or w.tooltip == t.help), t.name


def test_what_the_device_cannot_run_is_left_out_or_disabled_with_its_reason(monkeypatch, tiny):
    from course_lib import capabilities as K

    reasons = {"precision=bf16": "no bf16 on this made-up chip", "fused_adamw=True": "no fused kernel here"}
    monkeypatch.setattr(K.Capabilities, "unavailable", lambda self: reasons)
    c = Controls(tiny(precision="bf16"), ("precision", "fused_adamw"))
    precision, fused = c.widgets["precision"], c.widgets["fused_adamw"]
    assert "bf16" not in [v for _, v in precision.options] and precision.value == "fp32"  # the technique's off value
    assert fused.disabled and not fused.value and fused.tooltip == "no fused kernel here"
    assert any("no bf16 on this made-up chip" in n for n in c.notes) and any("no fused kernel" in n for n in c.notes)
    with pytest.raises(ConfigError, match="unavailable on this device: no fused kernel here"):
        c.set(fused_adamw=True)


def test_a_field_the_panel_does_not_know_is_refused_by_name(tiny):
    with pytest.raises(ValueError, match="No control for 'nonsense'"):
        Controls(tiny(), ("nonsense",))


# ---- the run queue: one after another, every result kept, an OOM a row ------------------------------------------


def _result(cfg, label, tokens_per_s=1000.0):
    return RunResult(
        label=label,
        status="ok",
        config=cfg.to_dict(),
        provenance=provenance("made up"),
        step_times=[0.01] * cfg.steps,
        losses=[4.0 - 0.1 * i for i in range(cfg.steps)],
        median_step_s=0.01,
        tokens_per_step=cfg.batch_size * cfg.context,
        tokens_per_s=tokens_per_s,
    )


def test_the_queue_goes_on_after_an_oom_frees_its_memory_and_keeps_every_result(tiny):
    """The second of four runs runs out of memory: its row says OOM, what it held is freed before the next run starts,
    and the runs after it run; a runner's ConfigError is a skipped row, any other exception an error row."""
    held, seen_by_next, events = [], [], []

    def runner(cfg, label, callback):
        for step in range(cfg.steps):
            callback(step, None)
        if cfg.batch_size == 64:
            activations = torch.zeros(1024)  # what a real OOM leaves behind in its frames
            held.append(weakref.ref(activations))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        if cfg.batch_size == 3:
            raise ConfigError("3 sequences do not split into 2 micro-batches")
        if cfg.batch_size == 5:
            raise RuntimeError("the runner fell over\nsecond line")
        seen_by_next.append(bool(held) and held[0]() is None)
        return _result(cfg, label)

    queue = RunQueue(
        runner,
        on_start=lambda cfg, label: events.append(("start", label)),
        on_step=lambda done, steps: events.append(("step", done, steps)),
        on_result=lambda r: events.append(("kept", r.label, r.status)),
    )
    sizes = (4, 64, 3, 5, 8)
    results = queue.run_all((tiny(batch_size=b, steps=2), f"batch {b}") for b in sizes)
    assert [r.status for r in results] == ["ok", "oom", "skipped", "error", "ok"]
    assert queue.results == results and [r.label for r in results] == [f"batch {b}" for b in sizes]
    assert results[1].reason.startswith("out of memory: CUDA out of memory") and results[1].config["batch_size"] == 64
    assert "3 sequences" in results[2].reason and results[3].reason == "RuntimeError: the runner fell over"
    assert seen_by_next == [False, True]  # the run after the OOM found its memory freed
    assert events[:4] == [("start", "batch 4"), ("step", 1, 2), ("step", 2, 2), ("kept", "batch 4", "ok")]
    assert [e[2] for e in events if e[0] == "kept"] == ["ok", "oom", "skipped", "error", "ok"]
    assert queue.next_number() == 6
    queue.clear()
    assert queue.results == [] and queue.next_number() == 1


def test_a_result_is_kept_before_anything_is_drawn_from_it(tiny):
    def fails_to_draw(_result):
        raise KeyError("no plot named 'nonsense'")

    queue = RunQueue(lambda cfg, label, callback: _result(cfg, label), on_result=fails_to_draw)
    with pytest.raises(KeyError):
        queue.run(tiny(steps=2), "a")
    assert [r.label for r in queue.results] == ["a"]


def test_the_default_runner_is_the_course_loop(tiny):
    r = RunQueue().run(tiny(steps=2, timing_warmup=1, measure_memory=False), "real")
    assert r.ok and len(r.losses) == 2 and r.tokens_per_s > 0


# ---- the table and the figure: made from results alone --------------------------------------------------------------


def _some_results(tiny):
    cfg = tiny(steps=3)
    oom = RunResult(
        label="#2 batch_size=64", status="oom", config=cfg.to_dict(), provenance={}, reason="out of memory: made up"
    )
    return [_result(cfg, "#1 baseline", 1000.0), oom, _result(cfg, "#3 sdpa", 1500.0)]


def test_the_table_is_made_from_results_alone(tiny):
    text = table.html(_some_results(tiny))
    assert text.count("<tr>") == 4  # header + three runs
    assert "OOM" in text and "out of memory: made up" in text and "1.50x" in text
    assert "No runs yet" in table.html([])


def test_the_figure_is_made_from_results_alone(tiny):
    from matplotlib.figure import Figure

    fig = figure.draw(_some_results(tiny), ("speed", "loss"))
    assert isinstance(fig, Figure) and len(fig.axes) == 2
    speed_notes = [t.get_text() for t in fig.axes[0].texts]
    assert speed_notes == ["1.00x", "OOM", "1.50x"]
    assert len(fig.axes[1].lines) == 2  # the OOM has no loss curve
    assert figure.draw([], ("speed",)) is None
