import pytest

from course_lib import config as C
from course_lib.ladder import run_ladder


@pytest.fixture
def one_block(tiny):
    return tiny(steps=3, timing_warmup=1).with_model(n_layer=1)


def test_left_out_rungs_are_skipped_with_the_reason_and_the_climb_goes_on_without_them(one_block):
    why = "left out under the test budget"
    results = run_ladder(one_block, leave_out={"+ compile": why, "+ checkpointing": why})
    assert [r.label for r in results] == [r.name for r in C.LADDER]
    by = {r.label: r for r in results}
    for name in ("+ compile", "+ checkpointing"):
        assert by[name].status == "skipped" and by[name].reason == why
    ok = [r for r in results if r.ok]
    assert len(ok) == len(C.LADDER) - 2
    # every later rung climbs without the left-out techniques, and says so
    for r in ok:
        assert r.config["compile"] is False and r.config["activation_checkpointing"] == "none"
    assert "climbing without: + compile" in by["+ fused AdamW"].reason
    assert "climbing without" not in by["+ sdpa (flash)"].reason
    # the rungs above still apply their own change, cumulatively
    last = by["+ chunked loss"].config
    assert last["precision"] == "bf16" and last["model"]["attention"] == "sdpa" and last["loss_chunks"] == 8 and last["fused_adamw"]


def test_a_name_that_is_not_a_rung_is_an_error(one_block):
    with pytest.raises(C.ConfigError, match="not rungs of the ladder"):
        run_ladder(one_block, leave_out={"+ compiel": "typo"})


def test_a_ladder_option_changes_what_a_rung_sets(one_block):
    rungs = dict((r.name, c) for r, c in C.ladder_configs(one_block, options={"activation_checkpointing": "selective"}))
    assert rungs["+ checkpointing"].activation_checkpointing == "selective"
    assert rungs["+ chunked loss"].activation_checkpointing == "selective" and rungs["+ set_to_none"].activation_checkpointing == "none"
    with pytest.raises(C.ConfigError, match="not techniques of the ladder"):
        C.ladder_configs(one_block, options={"checkpointing": "selective"})
