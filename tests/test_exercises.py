"""The exercises' checkers are honest: each reference passes, each recorded mistake is caught with its own hint, a
stub says "not solved yet", and a learner's exception is explained, not thrown."""

import pytest
import torch

from course_lib import __main__ as cli, exercises as X
from course_lib.exercises import core


@pytest.mark.parametrize("row", X.verify(), ids=lambda r: f"{r['exercise']}-{r['answer']}")
def test_the_reference_passes_and_every_recorded_mistake_is_caught_with_its_hint(row):
    assert row["ok"], row["said"]


def test_every_exercise_records_at_least_two_typical_mistakes_with_different_hints():
    for ex in X.EXERCISES.values():
        assert len(ex.mistakes) >= 2 and len({m.hint for m in ex.mistakes}) == len(ex.mistakes), ex.name


def test_a_stub_is_not_solved_and_the_notebook_goes_on_with_the_reference(monkeypatch):
    monkeypatch.setenv(core.FILL_ENV, "0")

    def merge_tiles(o1, lse1, o2, lse2):
        """Your code."""
        raise NotImplementedError

    verdict = X.check("merge_tiles", merge_tiles)
    assert not verdict.solved and "not solved yet" in verdict.message
    assert X.attempt("merge_tiles", merge_tiles) is X.EXERCISES["merge_tiles"].reference
    monkeypatch.setenv(core.FILL_ENV, "1")  # the tests' switch: the stub gets the reference, every check runs
    assert X.check("merge_tiles", merge_tiles).solved


def test_a_learners_error_is_explained_in_a_sentence_not_a_traceback(monkeypatch):
    monkeypatch.setenv(core.FILL_ENV, "0")

    def step_time(times, warmup):
        return sorted(times)[warmup:][len(times)]  # an index out of range

    verdict = X.check("step_time", step_time)
    assert not verdict.solved and "raised IndexError" in verdict.message and "Traceback" not in verdict.message


def test_a_wrong_shape_is_named_and_the_reference_shown_only_when_asked(monkeypatch):
    monkeypatch.setenv(core.FILL_ENV, "0")

    def merge_tiles(o1, lse1, o2, lse2):
        return o1  # forgot the lse

    verdict = X.check("merge_tiles", merge_tiles)
    assert "should be tuple of 2" in verdict.message and "def merge_tiles" not in verdict.message
    assert "def merge_tiles" in X.check("merge_tiles", merge_tiles, show_reference=True).message


def test_a_correct_answer_written_differently_is_accepted(monkeypatch):
    monkeypatch.setenv(core.FILL_ENV, "0")

    def merge_tiles(o1, lse1, o2, lse2):
        m = torch.maximum(lse1, lse2)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        e1, e2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
        return (e1[:, None] * o1 + e2[:, None] * o2) / (e1 + e2)[:, None], m + torch.log(e1 + e2)

    assert X.check("merge_tiles", merge_tiles).solved


def test_the_cli_verifies_every_checker(capsys):
    assert cli.main(["exercises", "--verify"]) == 0
    out = capsys.readouterr().out
    assert f"{len(X.verify())} of {len(X.verify())} as they must be" in out
    assert cli.main(["exercises"]) == 0 and "merge_tiles" in capsys.readouterr().out
