"""One home per technique: every technique module of course_lib/techniques/ declares its technique once, and the
ladder, the panel, the device's capabilities, the config checks, the exported script and the memory estimate find it
through the registry (techniques.TECHNIQUES) alone."""

import dataclasses
import importlib
from pathlib import Path

import pytest

from course_lib import __main__ as cli, capabilities as K, config as C, export, memory_formula as M, techniques as T
from course_lib.widgets.controls import Controls, technique_controls

PACKAGE = Path(T.__file__).parent
INFRASTRUCTURE = {"__init__", "declaration", "model_parts", "assemble"}  # the registry and what every technique uses
# What every run has, used by the loop and the exported template alike: no switch to declare.
EVERY_RUN = {"optimizer", "lr_schedule", "clipping", "data_parallel"}
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in INFRASTRUCTURE | EVERY_RUN)


@pytest.mark.parametrize("name", MODULES)
def test_each_technique_module_declares_one_technique_and_the_registry_holds_it(name):
    module = importlib.import_module(f"course_lib.techniques.{name}")
    declared = [v for v in vars(module).values() if isinstance(v, T.Technique)]
    assert len(declared) == 1, f"techniques/{name}.py must declare one TECHNIQUE, found {declared}"
    (t,) = declared
    assert t in T.TECHNIQUES, f"{t.field} is not in techniques.TECHNIQUES: no ladder rung, no panel control"
    assert T.module_of(t) == module.__name__
    for fn in (t.probe, t.check, t.memory):  # what the registry calls is written in the technique's own module
        assert fn is None or fn.__module__ == module.__name__


def test_the_ladder_is_derived_from_the_registry():
    assert len({t.name for t in T.TECHNIQUES}) == len(T.TECHNIQUES) == len(MODULES)
    assert [r.technique for r in T.LADDER[1:]] == [t for t in T.TECHNIQUES for _ in t.rungs]
    assert T.RUNGS == {r.name: r for r in T.LADDER} and T.TECHNIQUE == {t.name: t for t in T.TECHNIQUES}


@pytest.mark.parametrize("t", T.TECHNIQUES, ids=lambda t: t.name)
def test_a_technique_moves_the_memory_estimate_or_says_why_not(t, tiny):
    """Switched on by its last rung, a technique changes the estimate, or its memory_note says why it does not (the
    README's table of what the estimate models is this)."""
    assert t.help and t.label and (t.rungs or t.no_rung), f"{t.name}: no rung and no no_rung saying why"
    if t.memory_note:
        return
    base = T.naive(tiny(batch_size=4, context=64))
    value = t.rungs[-1][1]
    on = t.set(base, "bf16" if value == T.FAST_16BIT else value)
    assert M.estimate(on).peak_bytes != M.estimate(base).peak_bytes, f"{t.name} changes nothing in the estimate"


def test_the_memory_aimed_techniques_all_move_the_estimate():
    assert all(not t.memory_note for t in T.TECHNIQUES if T.MEMORY in t.aims)


def test_config_prints_every_section_and_names_the_module_of_each_technique_that_is_on(capsys):
    assert cli.main(["config", "--preset", "tiny", "--set", "activation_checkpointing=selective"]) == 0
    out = capsys.readouterr().out
    assert [line[:-1] for line in out.splitlines() if not line.startswith(" ")] == list(C.SECTIONS)
    assert "course_lib.techniques.activation_checkpointing" in out
    assert out.count("<- on") == 1  # the tiny preset is the naive loop but for this one
    assert cli.main(["config", "--preset", "tiny", "--set", "batchsize=4"]) == 2
    assert "did you mean" in capsys.readouterr().err


def test_the_sections_hold_every_field_once_in_the_class_order(tiny):
    names = [f.name for f in dataclasses.fields(C.TrainConfig)]
    assert [n for section in C.SECTIONS.values() for n in section] == names
    cfg = tiny()
    flat = {k: v for section in cfg.by_section().values() for k, v in section.items()}
    assert flat["batch_size"] == cfg.batch_size and flat["model.n_embd"] == cfg.model.n_embd


# A technique declared here and nowhere else. It stands on an existing field (eval_every: a new technique's own field
# is one line of config.TrainConfig, which a test cannot add), and declares a probe that this device fails, a check,
# and bytes it holds through the step.
TOY = T.Technique(
    "eval_every",
    "toy technique",
    0,
    help="a technique declared in a test",
    rungs=(("+ toy", 5, "the toy switched on"),),
    choices=(0, 5),
    probe=lambda device: K.Support(False, "no toy on this device"),
    check=lambda cfg: "the toy needs 6 steps or more: raise steps" if cfg.eval_every and cfg.steps < 6 else "",
    memory=lambda cfg: {"the toy's buffer": ("other", 12345)},
)


@pytest.fixture
def with_toy(monkeypatch):
    """The registry with TOY added last; capabilities, cached per device, asked afresh before and after."""
    K.capabilities.cache_clear()
    export.script.cache_clear()
    monkeypatch.setattr(T, "TECHNIQUES", (*T.TECHNIQUES, TOY))
    yield
    monkeypatch.undo()
    K.capabilities.cache_clear()
    export.script.cache_clear()


def test_a_technique_declared_in_a_test_alone_is_found_everywhere(with_toy, tiny):
    """Adding a technique is its module, its config field and its test: no other file names it. The ladder climbs it,
    naive() turns it off, the panel offers it (without the value this device's probe refuses), the device check and
    the config check refuse what they should, the exported script says it is on, and the estimate counts its bytes."""
    base = T.naive(tiny(steps=6))
    # the ladder, naive() and --set
    assert T.LADDER[-1].name == "+ toy" and T.RUNGS["+ toy"].technique is TOY
    on = T.RUNGS["+ toy"].apply(base)
    assert on.eval_every == 5 and T.naive(on) == base and T.technique_named("eval_every") is TOY
    # the panel: a control labelled as declared, the value this device cannot run left out, with the probe's reason
    panel = Controls(base, technique_controls(T.TECHNIQUES), techniques=T.TECHNIQUES)
    assert panel.widgets["eval_every"].description == "toy technique"
    assert any("no toy on this device" in note for note in panel.notes)
    # the device (its probe) and the config (its check), through the registry
    assert K.capabilities(base.device).unavailable()["eval_every=5"] == "no toy on this device"
    with pytest.raises(C.ConfigError, match="eval_every=5 cannot run on cpu: no toy on this device"):
        K.require(on)
    with pytest.raises(C.ConfigError, match="the toy needs 6 steps or more"):
        T.check(dataclasses.replace(on, steps=5))
    # the exported script: its docstring names what is on, and the code the field switches is there
    text = export.script(on)
    assert "- eval_every=5: the toy switched on" in text and "def evaluate(" in text
    assert "eval_every" not in export.script(base)
    # the memory estimate: the bytes it declares, at every moment of the step
    assert M.estimate(on).peak_bytes == M.estimate(base).peak_bytes + 12345
    assert M.estimate(on).terms["the toy's buffer"] == 12345
