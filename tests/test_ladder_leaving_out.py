"""The ladder on the course's real loop (tiny model): leaving rungs out, options, the fixed ladder. Its decisions on
made-up timings are in test_ladder.py."""

import pytest

from course_lib import config as C, techniques as T
from course_lib.ladder import (
    AGAIN,
    FINAL_ROWS,
    final_config,
    ladder_configs,
    optimised,
    optimised_config,
    run_ladder,
    rung_name,
    rungs_of,
)


@pytest.fixture
def one_block(tiny):
    return tiny(steps=5, timing_warmup=1).with_model(n_layer=1)


def test_left_out_rungs_are_skipped_with_the_reason_and_the_climb_goes_on_without_them(one_block):
    why = "left out under the test budget"
    results = run_ladder(one_block, leave_out={"+ compile": why, "+ checkpointing": why})
    # every rung in order, then any second looks ("<rung>, again"), then the optimised and the leanest loop
    labels = [r.label for r in results]
    assert labels[: len(T.LADDER)] == [r.name for r in T.LADDER] and tuple(labels[-2:]) == FINAL_ROWS
    assert all(label.endswith(AGAIN) for label in labels[len(T.LADDER) : -2])
    by = {r.label: r for r in results}
    for name in ("+ compile", "+ checkpointing"):
        assert by[name].status == "skipped" and by[name].reason == why and by[name].ladder["kept"] is False
        assert name + AGAIN not in by  # a rung that did not run gets no second look
    ok = [r for r in rungs_of(results) if r.ok]
    assert len([r for r in ok if not r.label.endswith(AGAIN)]) == len(T.LADDER) - 2
    for r in ok:  # no rung ran with a left-out technique
        assert r.config["compile"] is False and r.config["activation_checkpointing"] == "none"
    # each rung ran on the best loop so far: its config is the kept rungs' plus its own change
    kept = {}
    for r in ok[1:]:
        assert r.ladder["vs"] in [x.label for x in ok] and r.ladder["why"].startswith(("kept", "not kept"))
        for t in T.TECHNIQUES:
            value = t.value(C.TrainConfig.from_dict(r.config))
            if rung_name(r) in [name for name, _, _ in t.rungs]:
                continue
            assert value == kept.get(t.name, t.off), (r.label, t.name)
        if r.ladder["kept"]:
            for t in T.TECHNIQUES:
                if rung_name(r) in [name for name, _, _ in t.rungs]:
                    kept[t.name] = t.value(C.TrainConfig.from_dict(r.config))
    # the leanest loop is the kept rungs'; the optimised one leaves out the memory rungs that cost time, and only those
    lean = final_config(results, "leanest")
    assert {t.name: t.value(lean) for t in T.TECHNIQUES} == {t.name: kept.get(t.name, t.off) for t in T.TECHNIQUES}
    fastest, left_out = optimised_config(results), optimised(results).ladder.get("left_out", {})
    for t in T.TECHNIQUES:
        dropped = any(rung_name(by[label]) in [name for name, _, _ in t.rungs] for label in left_out)
        assert t.value(fastest) == (t.off if dropped else kept.get(t.name, t.off)), t.name


def test_a_name_that_is_not_a_rung_is_an_error_and_naive_cannot_be_left_out(one_block):
    with pytest.raises(C.ConfigError, match="not rungs of the ladder"):
        run_ladder(one_block, leave_out={"+ compiel": "typo"})
    with pytest.raises(C.ConfigError, match="baseline every rung is measured against"):
        run_ladder(one_block, leave_out={"naive fp32": "no baseline"})


def test_a_ladder_option_changes_what_a_rung_sets(one_block):
    rungs = dict((r.name, c) for r, c in ladder_configs(one_block, options={"activation_checkpointing": "selective"}))
    assert rungs["+ checkpointing"].activation_checkpointing == "selective"
    assert (
        rungs["+ chunked loss"].activation_checkpointing == "none"
        and rungs["+ set_to_none"].activation_checkpointing == "none"
    )
    with pytest.raises(C.ConfigError, match="not techniques of the ladder"):
        ladder_configs(one_block, options={"checkpointing": "selective"})


def test_the_fixed_ladder_keeps_every_rung_it_runs(one_block):
    results = run_ladder(one_block, rungs=["naive fp32", "+ sdpa", "+ set_to_none", "+ chunked loss"], fixed=True)
    ran = [r for r in rungs_of(results) if r.ok]
    assert [r.label for r in ran] == ["naive fp32", "+ sdpa", "+ set_to_none", "+ chunked loss"]
    assert all(r.ladder["kept"] for r in ran) and all("kept (fixed ladder)" in r.ladder["why"] for r in ran[1:])
    for final in (optimised_config(results), final_config(results, "leanest")):  # the fixed ladder's two loops are one
        assert (final.model.attention, final.set_to_none, final.loss_chunks) == ("sdpa", True, 8)


def test_each_rung_s_figures_follow_from_its_own_measurements(one_block):
    """What notebook 09 reports of each rung, recomputed from the rung's raw measurements (moved from its checks)."""
    import dataclasses
    import math
    import statistics
    import time

    from course_lib.ladder import FASTER, LEANER, NO_CHANGE, SLOWER, second_window, speed_change

    t0 = time.perf_counter()
    results = run_ladder(one_block, leave_out={"+ compile": "left out"})
    wall_s = time.perf_counter() - t0
    ran = [r for r in rungs_of(results) if r.ok]
    by = {r.label: r for r in rungs_of(results)}
    m = one_block.model
    pad_bytes = 4 * (dataclasses.replace(m, vocab_multiple=64).padded_vocab_size - m.padded_vocab_size) * m.n_embd
    assert sum(sum(r.step_times) for r in ran) <= wall_s
    for r in ran:
        c, skip = r.config, set(r.excluded_steps)
        assert skip >= set(range(c["timing_warmup"])), r.label
        median_s = statistics.median(t for i, t in enumerate(r.step_times) if i not in skip)
        assert math.isclose(r.tokens_per_s, c["batch_size"] * c["context"] / median_s, rel_tol=1e-9), r.label
        assert r.mfu is None or r.mfu > 0
        assert abs(r.losses[0] - math.log(m.vocab_size)) < 0.3, (r.label, r.losses[0])  # a fresh model: about uniform
        if r.memory:  # (a rung given up on after its paired steps has no memory measurement)
            assert r.memory["by_category"]["parameters"] == 4 * r.n_params, r.label
        if r is ran[0]:
            continue
        pairs, again = ([tuple(p) for p in r.ladder[k]] for k in ("pairs", "pairs_again"))
        change = speed_change(pairs)
        if again:  # the first window was within this machine's noise: the verdict of both windows
            change = second_window(change, pairs, again)
        # TF32 does nothing on a CPU: no measurable change, whatever its pairs said
        verdict = NO_CHANGE if r.label == "+ tf32" and c["device"] == "cpu" else change.verdict
        assert verdict == r.ladder["speed"] and math.isclose(change.factor, r.ladder["factor"]), r.label
        if r.ladder["kept"] and r.ladder["aims"] == [T.SPEED]:
            assert change.verdict == FASTER and change.low > 1, r.label
        if r.ladder["kept"] and r.ladder["aims"] == [T.MEMORY]:
            assert r.ladder["memory"] == LEANER, r.label
        if not r.ladder["kept"] and r.stopped_early.startswith("stopped after"):
            assert r.ladder["speed"] == SLOWER and r.memory is None, r.label
        below = by[r.ladder["vs"]]  # only the vocabulary rung changes the parameter bytes: by exactly its padding rows
        if r.memory and below.memory:
            grew = r.memory["by_category"]["parameters"] - below.memory["by_category"]["parameters"]
            assert grew == (pad_bytes if rung_name(r) == "+ vocab to x64" else 0), (r.label, grew)


def test_a_climb_measures_the_peak_again_and_a_stale_low_one_no_longer_flatters_its_efficiency(
    one_block, tmp_path, monkeypatch
):
    """A cached peak measured while the machine was busy is too low, and every efficiency over it too high: the climb
    measures the peak again first, the cache keeps the higher, and the rows' efficiency is over that."""
    import json

    from course_lib import capabilities as K

    monkeypatch.setenv("COURSE_CACHE_DIR", str(tmp_path))
    stale = 1e-6  # TFLOP/s: one megaFLOP/s, far below any CPU's matmuls
    K.measured_tflops("cpu", "fp32")  # makes the cache's entry for this machine, then spoiled:
    peaks = tmp_path / "matmul_peaks.json"
    (key,) = json.loads(peaks.read_text())
    peaks.write_text(json.dumps({key: stale}))
    (naive, *_) = run_ladder(one_block, rungs=["naive fp32"])
    peak = json.loads(peaks.read_text())[key]
    assert peak > 1000 * stale
    assert naive.mfu == pytest.approx(naive.tokens_per_s * naive.flops_per_token / (peak * 1e12))
