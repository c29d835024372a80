"""One home per technique: every module of course_lib/techniques/ declares its technique once, and the ladder, the
exporter, the memory estimate and `python -m course_lib config` find it through the registry."""

import dataclasses
import importlib
from pathlib import Path

import pytest

from course_lib import __main__ as cli, config as C, export, memory_estimate as M, techniques as T
from course_lib.codegen import Code

PACKAGE = Path(T.__file__).parent
INFRASTRUCTURE = {"__init__", "declaration", "model_parts", "assemble"}  # the registry and what every technique uses
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in INFRASTRUCTURE)


@pytest.mark.parametrize("name", MODULES)
def test_each_module_declares_one_technique_or_setting_and_the_registry_holds_it(name):
    module = importlib.import_module(f"course_lib.techniques.{name}")
    declared = [v for v in vars(module).values() if isinstance(v, (T.Technique, T.Setting))]
    assert len(declared) == 1, f"techniques/{name}.py must declare one TECHNIQUE or SETTING, found {declared}"
    (d,) = declared
    assert d in T.BUILD_ORDER, f"{d.field} is not in techniques.BUILD_ORDER: the exporter would leave it out"
    if isinstance(d, T.Technique):
        assert d in T.TECHNIQUES, f"{d.field} is not in techniques.TECHNIQUES: no ladder rung, no panel control"
    # its piece of the script is written in its own module, and so is its memory term
    assert d.export.__module__ == module.__name__
    if isinstance(d, T.Technique) and d.memory_term is not None:
        assert d.memory_term.__module__ == module.__name__


def test_the_registry_lists_every_declaration_once_and_the_exporter_takes_them_in_build_order():
    assert len({d.field for d in T.BUILD_ORDER}) == len(T.BUILD_ORDER) == len(MODULES)
    assert list(export.SNIPPETS)[: len(T.BUILD_ORDER)] == [d.field for d in T.BUILD_ORDER]
    assert [r.technique for r in T.LADDER[1:]] == [t for t in T.TECHNIQUES for _ in t.rungs]


@pytest.mark.parametrize("t", T.TECHNIQUES, ids=lambda t: t.name)
def test_a_techniques_memory_term_moves_the_estimate_or_it_says_why_it_has_none(t, tiny):
    """A technique with a memory term changes the estimate when its last rung switches it on (the term is used); one
    without says why (the README's table of what the estimate models is this)."""
    assert t.help and t.label and (t.rungs or t.no_rung), f"{t.name}: no rung and no no_rung saying why"
    if t.memory_term is None:
        assert t.memory_note, f"{t.name}: no memory term and no memory_note saying why"
        return
    assert not t.memory_note and t.rungs, f"{t.name}: a memory term is switched on by a rung"
    base = T.naive(tiny(batch_size=4, context=64))
    value = t.rungs[-1][1]
    on = t.set(base, "bf16" if value == T.FAST_16BIT else value)
    assert M.estimate(on).peak_bytes != M.estimate(base).peak_bytes, f"{t.name}'s memory term changes nothing"


def test_the_memory_aimed_techniques_all_have_a_memory_term():
    assert all(t.memory_term is not None for t in T.TECHNIQUES if T.MEMORY in t.aims)


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


def test_adding_a_technique_is_one_declaration_the_ladder_and_naive_follow(monkeypatch, tiny):
    """A made-up technique on an existing field, registered: the ladder gets its rung (through the same ladder_of the
    registry uses) and naive() turns it off."""
    extra = T.Technique(
        "eval_every", "eval", 0, help="validation loss", export=lambda cfg: Code(), rungs=(("+ eval", 5, "e"),)
    )
    techniques = (*T.TECHNIQUES, extra)
    ladder = T.ladder_of(techniques)
    assert ladder[: len(T.LADDER)] == T.LADDER and ladder[-1].name == "+ eval"
    assert ladder[-1].apply(tiny()).eval_every == 5
    monkeypatch.setattr(T, "TECHNIQUES", techniques)
    assert T.naive(tiny(eval_every=3)).eval_every == 0
