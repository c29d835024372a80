"""The ladder's decisions, tested on every class of device without owning one: the climb runs with a stand-in trainer
whose step times and peaks are made up (a CPU without bf16 instructions, a GPU with tensor cores), so what is kept,
what is not and why can be checked exactly. The real loop under the ladder is tested in test_ladder_leaving_out.py
and test_cli.py."""

import dataclasses
import inspect
import random
import re

import pytest
import torch

from course_lib import config as C, ladder as L, techniques as T
from course_lib.capabilities import Support, capabilities
from course_lib.results import RunResult, provenance

MiB = 2**20


def speed(cfg: C.TrainConfig, device: str) -> float:
    """Seconds per step of a made-up device, from what the config switches on."""
    s = 0.200
    if cfg.precision == "tf32" and device == "drifting laptop":  # made up: the machine slowed while TF32 was timed
        s *= 1.08
    if cfg.precision == "tf32" and device == "noisy vm":  # made up: a neighbour left while TF32 was timed
        s /= 1.15
    if cfg.precision == "bf16":
        if device == "avx2 laptop":
            s *= 15.0
        elif device == "small gpu":  # made up: bf16 loses while attention is naive and wins once SDPA is on
            s *= 1.15 if cfg.model.attention == "naive" else 0.6
        else:
            s *= 0.4
    if cfg.model.attention == "sdpa":
        s *= 0.8
    if cfg.compile:
        s *= 0.7
    if cfg.fused_adamw:
        s *= 0.9 if device == "gpu" else 0.94 if device == "noisy vm" else 1.0
    if cfg.model.vocab_multiple > 1:
        s *= 0.95 if device == "gpu" else 1.0
    if cfg.activation_checkpointing != "none":
        s *= 1.25
    if cfg.loss_chunks > 1:
        s *= 1.05
    return s


def peak(cfg: C.TrainConfig) -> int:
    logits, activations, static = 60 * MiB, 30 * MiB, 10 * MiB
    if cfg.precision == "bf16":
        activations *= 0.6
    if cfg.model.attention == "sdpa":
        activations *= 0.7
    if cfg.activation_checkpointing != "none":
        activations *= 0.2
    if cfg.loss_chunks > 1:
        logits /= cfg.loss_chunks
    return int(logits + activations + static)


class StandInTrainer:
    """The Trainer's interface as the ladder uses it (fit with its callback, step, is_timed), with made-up times: each
    step of a config takes speed(cfg) seconds, +-2 % noise, and a compiled loop's first step 40x (compiling)."""

    device = "avx2 laptop"
    made: list = []

    def __init__(self, cfg: C.TrainConfig):
        self.cfg, self.step_index, self.result = cfg, 0, None
        self.rng = random.Random(len(StandInTrainer.made))
        StandInTrainer.made.append(self)
        self.excluded = set(range(cfg.timing_warmup)) | {cfg.steps - 1}

    def is_timed(self, step: int) -> bool:
        return step not in self.excluded

    def step(self) -> float:
        s = (
            speed(self.cfg, self.device)
            * self.rng.uniform(0.98, 1.02)
            * (40 if self.cfg.compile and self.step_index == 0 else 1)
        )
        if self.device == "noisy vm" and self.cfg.model.vocab_multiple > 1 and self.step_index < self.cfg.steps:
            s *= 0.94  # made up: the padded vocabulary's own run met a quiet spell; the pairs after it did not
        self.step_index += 1
        if self.result is not None:
            self.result.step_times.append(s)
        return s

    def fit(self, label, callback):
        self.result = r = RunResult(
            label=label, status="ok", config=self.cfg.to_dict(), provenance=provenance("stand-in"), tokens_per_step=1000
        )
        try:
            for i in range(self.cfg.steps):
                self.step()
                callback(i, r)
        except L.StopRun as stop:
            r.stopped_early = str(stop)
        timed = [t for i, t in enumerate(r.step_times) if i not in self.excluded]
        r.excluded_steps = sorted(i for i in self.excluded if i < len(r.step_times))
        r.median_step_s = sorted(timed)[len(timed) // 2]
        r.tokens_per_s = 1000 / r.median_step_s
        if len(r.step_times) == self.cfg.steps:  # the memory is measured on the last step
            r.memory = {"peak_bytes": peak(self.cfg), "by_category": {}, "method": "made up"}
        self.result = None
        return r


@pytest.fixture
def climb(monkeypatch, tiny):
    """climb(device, native_bf16, **run_ladder options) -> results, on a stand-in device."""

    def go(device: str, native_16bit: bool, **kw):
        StandInTrainer.device, StandInTrainer.made = device, []
        real = capabilities("cpu")
        bf16 = (
            Support(True, "bf16 hardware", True)
            if native_16bit
            else Support(True, "no bf16 instructions in use: converted in software", False)
        )
        fp16 = Support(True, "fp16 hardware", True) if native_16bit else Support(True, "no fp16 instructions", False)
        caps = dataclasses.replace(real, precisions={**real.precisions, "bf16": bf16, "fp16": fp16})
        monkeypatch.setattr(L, "Trainer", StandInTrainer)
        monkeypatch.setattr(L, "capabilities", lambda device=None: caps)
        monkeypatch.setattr(L, "efficiency", lambda *a, **k: (None, ""))
        monkeypatch.setattr(L, "refresh_peaks", lambda caps: None)  # a stand-in device has no peak to measure
        return L.run_ladder(tiny(steps=8, timing_warmup=2), **kw)

    return go


def by_label(results):
    return {r.label: r for r in results}


def test_a_bf16_rung_15x_slower_is_not_kept_stopped_early_and_says_why(climb):
    results = climb("avx2 laptop", native_16bit=False)
    bf16 = by_label(results)["+ 16-bit autocast"]
    assert bf16.config["precision"] == "bf16" and not bf16.ladder["kept"]
    assert bf16.ladder["speed"] == L.SLOWER and bf16.ladder["factor"] == pytest.approx(1 / 15, rel=0.05)
    # stopped after three paired steps: its verdict was clear, and the rest of its steps would cost minutes on a laptop
    assert len(bf16.ladder["pairs"]) == L.GIVE_UP_AFTER and "stopped after 3 timed steps" in bf16.ladder["why"]
    assert re.search(r"1[45]\.\d\dx slower", bf16.ladder["why"]) and "no bf16 instructions" in bf16.ladder["why"]
    # every later rung climbs without it
    assert all(r.config.get("precision") == "fp32" for r in results[3:] if r.ok)


@pytest.mark.parametrize("device", ["avx2 laptop", "drifting laptop"])
def test_tf32_on_a_cpu_is_no_measurable_change_whatever_its_pairs_said(climb, device):
    """TF32 does nothing on a CPU: its rung times the same step against itself, so a factor inside the noise or
    outside it (the machine slowed while it ran) is the machine's noise, and the row says so, not "slower"."""
    tf32 = by_label(climb(device, native_16bit=False))["+ tf32"]
    assert tf32.ladder["speed"] == L.NO_CHANGE and not tf32.ladder["kept"]
    assert "does nothing on a CPU" in tf32.ladder["why"] and "the noise of this machine" in tf32.ladder["why"]
    assert "slower" not in tf32.ladder["why"] and "faster" not in tf32.ladder["why"]
    if device == "drifting laptop":
        assert tf32.ladder["factor"] < 0.95  # its pairs did say slower
    assert tf32.ladder["speedup"] == 1.0  # the loop's speed-up over naive stays naive's


def test_tf32_on_a_cpu_in_the_fixed_ladder_is_kept_and_still_called_noise(climb):
    tf32 = by_label(climb("drifting laptop", native_16bit=False, fixed=True))["+ tf32"]
    assert tf32.ladder["kept"] and tf32.ladder["why"].startswith("kept (fixed ladder): ")
    assert "the noise of this machine" in tf32.ladder["why"] and "slower" not in tf32.ladder["why"]
    assert tf32.ladder["speed"] == L.NO_CHANGE and tf32.ladder["speedup"] == 1.0


def test_a_compile_that_pays_only_after_its_warm_up_is_kept(climb):
    r = by_label(climb("avx2 laptop", native_16bit=False))["+ compile"]
    assert r.step_times[0] > 10 * r.median_step_s  # the first step compiled...
    assert r.ladder["kept"] and r.ladder["factor"] == pytest.approx(1 / 0.7, rel=0.05)  # ...and is not what was judged


def test_a_memory_rung_that_costs_time_is_kept_and_says_what_it_cost(climb):
    r = by_label(climb("avx2 laptop", native_16bit=False))["+ checkpointing"]
    assert r.ladder["kept"] and r.ladder["memory"] == L.LEANER and r.ladder["speed"] == L.SLOWER
    assert re.search(r"1\.2[3-7]x slower", r.ladder["why"]) and "x the memory" in r.ladder["why"]  # 1.25x, +-2 % noise


def test_the_optimised_loop_leaves_out_memory_techniques_that_cost_time_and_the_leanest_keeps_them(climb):
    """On the made-up laptop the chunked loss (1.05x) and checkpointing (1.25x) make the peak smaller and cost time: the
    leanest loop keeps them, the optimised loop (the fastest that fits) leaves them out; each is timed against naive."""
    results = climb("avx2 laptop", native_16bit=False)
    opt, lean = results[-2:]
    assert (opt.label, lean.label) == L.FINAL_ROWS and L.optimised(results) is opt and L.leanest(results) is lean
    kept = [r.label for r in L.rungs_of(results)[1:] if r.ladder["kept"]]
    assert kept == ["+ sdpa", "+ compile", "+ chunked loss", "+ checkpointing"]
    assert lean.ladder["kept_rungs"] == kept and opt.ladder["kept_rungs"] == ["+ sdpa", "+ compile"]
    assert set(opt.ladder["left_out"]) == {"+ chunked loss", "+ checkpointing"} and opt.ladder["put_back"] == []
    assert "checkpointing left out: 1.2" in opt.ladder["why"] and "x slower at its rung" in opt.ladder["why"]
    cfg, lean_cfg = L.optimised_config(results), L.final_config(results, "leanest")
    assert (cfg.precision, cfg.model.attention, cfg.compile, cfg.activation_checkpointing, cfg.loss_chunks) == (
        "fp32",
        "sdpa",
        True,
        "none",
        1,
    )
    assert (lean_cfg.activation_checkpointing, lean_cfg.loss_chunks) == ("full", 8)
    assert L.final_config(results) == cfg  # the optimised loop, unless asked for the leanest
    assert not cfg.fused_adamw and cfg.model.vocab_multiple == 1  # no change on this device: not kept
    for row, c in ((opt, cfg), (lean, lean_cfg)):  # each timed in pairs with naive: one figure per loop
        expected = speed(T.naive(c), "avx2 laptop") / speed(c, "avx2 laptop")
        assert row.ladder["factor"] == pytest.approx(expected, rel=0.04)
        # more pairs than a rung's, every one the row's own step time: the figure handed to the learner must hold
        rung_pairs = len(by_label(results)["+ compile"].ladder["pairs"])
        assert len(row.ladder["pairs"]) == L.FINAL_PAIRS * rung_pairs
        assert row.step_times == [t for _, t in row.ladder["pairs"]] and not row.excluded_steps
        assert L.speedup_basis(row) == L.PAIRED and row.ladder["speedup"] == row.ladder["factor"]
    assert peak(lean_cfg) < peak(cfg) and opt.memory["peak_bytes"] == peak(cfg)  # the optimised loop's own peak
    cost = opt.ladder["factor"] / lean.ladder["factor"]
    assert (
        cost == pytest.approx(1.05 * 1.25, rel=0.05) and f"{cost:.2f}x slower than {L.OPTIMISED}" in lean.ladder["why"]
    )
    text = L.verdict(results)
    assert "not kept: 16-bit autocast" in text and "the leanest loop is" in text and "timed in pairs with naive" in text
    assert text.count("x naive fp32's speed") == 2  # one figure per loop
    assert "left out of the optimised loop, kept in the leanest: checkpointing" in text


def test_a_memory_technique_that_costs_nothing_joins_the_optimised_loop(climb, monkeypatch):
    """The chunked loss made free on this device: it stays in the optimised loop, and the row says why."""
    real = speed

    def free_chunks(cfg, device):
        return real(cfg, device) / (1.05 if cfg.loss_chunks > 1 else 1)

    monkeypatch.setitem(globals(), "speed", free_chunks)
    results = climb("avx2 laptop", native_16bit=False)
    opt = L.optimised(results)
    assert by_label(results)["+ chunked loss"].ladder["speed"] == L.NO_CHANGE
    assert L.optimised_config(results).loss_chunks == 8 and "+ chunked loss" in opt.ladder["kept_rungs"]
    assert "chunked loss kept: no measurable cost in time" in opt.ladder["why"]
    assert L.optimised_config(results).activation_checkpointing == "none"


def test_a_memory_technique_the_loop_does_not_fit_without_is_put_back(climb, monkeypatch):
    """Made up: without checkpointing the optimised loop runs out of memory. The chunked loss is put back first (ladder
    order), still out of memory; then checkpointing too, where it fits: the leanest loop is also the optimised one."""
    real_fit = StandInTrainer.fit
    tried = []

    def fit(self, label, callback):
        if label == L.OPTIMISED:
            tried.append((self.cfg.loss_chunks, self.cfg.activation_checkpointing))
            if self.cfg.activation_checkpointing == "none":
                raise torch.OutOfMemoryError("CUDA out of memory (made up)")
        return real_fit(self, label, callback)

    monkeypatch.setattr(StandInTrainer, "fit", fit)
    results = climb("avx2 laptop", native_16bit=False)
    opt, lean = results[-2:]
    assert tried == [(1, "none"), (8, "none")]  # then the leanest loop itself: already timed, not run again
    assert opt.config == lean.config and "does not fit without chunked loss, checkpointing" in opt.ladder["why"]
    assert lean.ladder["vs_optimised"] == 1.0


def test_the_optimised_loop_fits_with_a_technique_put_back(climb, monkeypatch):
    real_fit = StandInTrainer.fit

    def fit(self, label, callback):
        if label == L.OPTIMISED and self.cfg.loss_chunks == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (made up)")
        return real_fit(self, label, callback)

    monkeypatch.setattr(StandInTrainer, "fit", fit)
    results = climb("avx2 laptop", native_16bit=False)
    opt = L.optimised(results)
    assert opt.ladder["put_back"] == ["+ chunked loss"] and list(opt.ladder["left_out"]) == ["+ checkpointing"]
    assert "chunked loss kept: the loop does not fit without it" in opt.ladder["why"]
    assert (
        L.optimised_config(results).loss_chunks == 8 and L.optimised_config(results).activation_checkpointing == "none"
    )


def _row(label, aims, speed_verdict, kept=True):
    return RunResult(label, "ok", {}, {}, ladder={"kept": kept, "aims": aims, "speed": speed_verdict})


def test_which_memory_rungs_cost_time_from_the_rows_alone(tiny):
    rows = [
        _row("+ sdpa", [T.SPEED, T.MEMORY], L.SLOWER),  # aims at speed too: never left out for its time
        _row("+ set_to_none", [T.MEMORY], L.NO_CHANGE),
        _row("+ chunked loss", [T.MEMORY], L.SLOWER),
        _row("+ checkpointing", [T.MEMORY], L.TOO_FEW),  # cannot say it is free
        _row("+ checkpointing", [T.MEMORY], L.SLOWER, kept=False),
        _row("+ set_to_none", [T.MEMORY], L.FASTER),
    ]
    assert [r.label for r in L.memory_rungs_that_cost_time(rows)] == ["+ chunked loss", "+ checkpointing"]
    lean = dataclasses.replace(tiny(), loss_chunks=4, activation_checkpointing="full", set_to_none=True)
    cands = L.optimised_candidates(lean, L.memory_rungs_that_cost_time(rows))
    assert [(c.loss_chunks, c.activation_checkpointing, c.set_to_none) for c, _ in cands] == [
        (1, "none", True),
        (4, "none", True),
        (4, "full", True),
    ]
    assert [[r.label for r in back] for _, back in cands] == [
        [],
        ["+ chunked loss"],
        ["+ chunked loss", "+ checkpointing"],
    ]


def test_one_loop_one_figure_a_final_row_and_the_rung_that_ran_its_loop_pool_their_pairs(climb):
    """The optimised loop is + compile's here, the leanest + checkpointing's: each pair of rows quotes one figure, from
    the pairs with naive of both windows, and a rung not kept, priced from a pooled rung's figure, follows it."""
    results = climb("avx2 laptop", native_16bit=False)
    rows, table = by_label(results), {row["rung"]: row for row in L.ladder_rows(results)}
    for final, rung in ((L.OPTIMISED, "+ compile"), (L.LEANEST, "+ checkpointing")):
        row, at = rows[final], rows[rung]
        assert row.config == at.config and (row.ladder["pooled_with"], at.ladder["pooled_with"]) == (rung, final)
        both = L.speed_change(row.ladder["pairs"] + at.ladder["pairs_vs_naive"])
        assert row.ladder["factor"] == row.ladder["speedup"] == at.ladder["speedup"] == both.factor
        assert row.ladder["pooled_pairs"] == both.pairs == len(row.ladder["pairs"]) + len(at.ladder["pairs_vs_naive"])
        assert (
            f"{both.text()} naive fp32, timed in pairs with it" in row.ladder["why"]
            and f"at {rung})" in row.ladder["why"]
        )
        assert table[final]["vs naive, paired"] == table[rung]["vs naive, paired"] != ""
    again = [r for r in results if r.ladder.get("vs") == "+ checkpointing" and L.speedup_basis(r) == L.PRODUCT]
    assert again
    for r in again:
        factor = 1.0 if r.ladder.get("same_step_factor") else r.ladder["factor"]
        assert r.ladder["speedup"] == pytest.approx(rows["+ checkpointing"].ladder["speedup"] * factor)
    assert "over %d steps timed in pairs with naive, here and at + compile" % rows[L.OPTIMISED].ladder[
        "pooled_pairs"
    ] in (L.verdict(results))


def test_rows_priced_from_a_pooled_rung_follow_it_down_the_chain(climb, monkeypatch):
    """A kept loop not timed with naive (made to fail here for the chunked loss) is priced by the product of pairs:
    every row priced from the pooled rung, directly or through another such row, follows the pooled figure."""
    timed = L._Climb.timed_with_naive
    fails_chunked = lambda self, trainer, n: {} if trainer.cfg.loss_chunks > 1 else timed(self, trainer, n)  # noqa: E731
    monkeypatch.setattr(L._Climb, "timed_with_naive", fails_chunked)
    rows = by_label(climb("avx2 laptop", native_16bit=False))
    assert rows[L.OPTIMISED].ladder["pooled_with"] == "+ compile" and "pooled_with" not in rows[L.LEANEST].ladder
    assert (
        rows["+ checkpointing"].ladder["vs"] == "+ chunked loss" and rows["+ chunked loss"].ladder["vs"] == "+ compile"
    )
    for label in ("+ chunked loss", "+ checkpointing"):
        r = rows[label]
        assert L.speedup_basis(r) == L.PRODUCT
        assert r.ladder["speedup"] == pytest.approx(rows[r.ladder["vs"]].ladder["speedup"] * r.ladder["factor"])


def test_a_leanest_loop_not_timed_with_naive_quotes_its_rungs_paired_figure(climb, monkeypatch):
    """Pairing the leanest loop with naive fails (out of memory with both held, on a GPU): the row quotes the figure
    its rung's loop got in pairs with naive, in the paired column and in the verdict, not an empty cell."""
    paired = L._paired
    fails_for_the_last_row = lambda first, second, n: (  # noqa: E731
        ([], "OutOfMemoryError") if inspect.stack()[1].function == "leanest_row" else paired(first, second, n)
    )
    monkeypatch.setattr(L, "_paired", fails_for_the_last_row)
    results = climb("avx2 laptop", native_16bit=False)
    rows, table = by_label(results), {row["rung"]: row for row in L.ladder_rows(results)}
    lean, top = rows[L.LEANEST], rows["+ checkpointing"]
    assert "not timed against naive fp32 (OutOfMemoryError when paired)" in lean.ladder["why"]
    assert L.speedup_basis(lean) == L.PAIRED and lean.ladder["factor"] == top.ladder["speedup"]
    assert table[L.LEANEST]["vs naive, paired"] == table["+ checkpointing"]["vs naive, paired"] != ""
    assert "the product of its rungs' factors" not in L.verdict(results)


def test_each_column_of_the_table_means_one_thing(climb):
    """Products of paired factors and direct pairs against naive never share a column."""
    results = climb("avx2 laptop", native_16bit=False)
    rows = L.ladder_rows(results)
    assert set(L.LADDER_COLUMNS) <= set(rows[0])
    for row, r in zip(rows, results):
        final, kept = r.label in L.FINAL_ROWS, r.ladder.get("kept")
        assert not (row["vs naive, paired"] and row["vs naive, product of pairs"]), r.label
        assert not (final and row["vs best so far, paired"])
        if r.ok and r.label != "naive fp32":  # a loop kept or final: its own pairs with naive; else the product
            assert bool(row["vs naive, paired"]) == (final or kept) != bool(row["vs naive, product of pairs"]), r.label
            assert final or row["vs best so far, paired"], r.label
    kept_rung = next(r for r in results[1:] if r.ladder.get("kept") and r.label not in L.FINAL_ROWS)
    assert L.speedup_basis(kept_rung) == L.PAIRED and len(kept_rung.ladder["pairs_vs_naive"]) >= L.MIN_PAIRS


def test_a_climb_saved_before_the_final_rows_said_their_basis_reads_the_same():
    old_top = RunResult(L.OPTIMISED, "ok", {}, {}, ladder={"factor": 2.0, "pairs": [[1, 0.5]] * 3, "speedup": 2.0})
    old_memory_rung = RunResult("+ checkpointing", "ok", {}, {}, ladder={"speedup": 0.9, "pairs_vs_naive": [[1, 1]]})
    assert L.speedup_basis(old_top) == L.speedup_basis(old_memory_rung) == L.PAIRED
    assert L.speedup_basis(RunResult("+ sdpa", "ok", {}, {}, ladder={"speedup": 1.2})) == L.PRODUCT
    with pytest.raises(C.ConfigError, match="saved before the ladder had that row"):
        L.final_config([RunResult("naive fp32", "ok", {}, {}), old_top], "leanest")
    with pytest.raises(C.ConfigError, match="choose 'optimised'"):
        L.final_config([old_top], "fastest")


def test_on_a_gpu_with_bf16_tensor_cores_every_speed_rung_helps_and_is_kept(climb):
    results = climb("gpu", native_16bit=True)
    speed_rungs = [
        r
        for r in L.rungs_of(results)[1:]
        if r.ladder.get("aims") and T.SPEED in r.ladder["aims"] and r.label != "+ tf32"
    ]
    assert speed_rungs and all(r.ladder["kept"] for r in speed_rungs), [(r.label, r.ladder["why"]) for r in speed_rungs]
    assert L.optimised_config(results).precision == "bf16"


def test_the_fixed_ladder_keeps_every_rung_whatever_it_measured(climb):
    results = climb("avx2 laptop", native_16bit=False, fixed=True)
    assert all(r.ladder["kept"] for r in results)
    bf16 = by_label(results)["+ 16-bit autocast"]
    assert "kept (fixed ladder)" in bf16.ladder["why"] and not bf16.stopped_early  # the fixed climb gives up on nothing
    assert L.optimised_config(results).precision == "bf16"


def test_a_factor_within_the_machines_own_noise_is_timed_again_and_stands_only_if_both_windows_agree(climb):
    """On a noisy VM the TF32 rung (the same step on a CPU) measured 1.15x against itself. Fused AdamW's real 1.06x and
    SDPA's 1.25x are within twice that: a second window of pairs agrees, and they are kept. The padded vocabulary's
    1.06x came from a quiet spell during its own run: the second window disagrees, and it is no measurable change.
    Compile's 1.43x is past twice the noise: one window decides."""
    rows = by_label(climb("noisy vm", native_16bit=False))
    assert rows["+ tf32"].ladder["same_step_factor"] == pytest.approx(1.15, rel=0.03)
    noise = L.same_step_noise(list(rows.values()))
    assert noise == pytest.approx(1.15, rel=0.03)
    for name in ("+ fused AdamW", "+ sdpa"):
        lad = rows[name].ladder
        assert lad["kept"] and lad["speed"] == L.FASTER and len(lad["pairs_again"]) == len(lad["pairs"]), name
        assert "in a second window of paired steps: they agree" in lad["why"] and "up to 1.15x apart" in lad["why"]
        both = [tuple(p) for p in lad["pairs"] + lad["pairs_again"]]
        assert lad["factor"] == pytest.approx(L.speed_change(both).factor)
    vocab = rows["+ vocab to x64"].ladder
    assert not vocab["kept"] and vocab["speed"] == L.NO_CHANGE and "they disagree" in vocab["why"], vocab["why"]
    assert L.speed_change([tuple(p) for p in vocab["pairs"]]).verdict == L.FASTER  # what one window alone said
    assert rows["+ compile"].ladder["kept"] and rows["+ compile"].ladder["pairs_again"] == []


def test_on_a_quiet_machine_only_a_factor_close_to_the_threshold_is_timed_twice(climb):
    results = climb("avx2 laptop", native_16bit=False)
    assert L.same_step_noise(results) == pytest.approx(1 + L.MIN_SPEED_CHANGE)  # TF32 against itself: within 3%
    assert all(not r.ladder.get("pairs_again") for r in results)  # SDPA 1.25x, compile 1.43x: far past it


def test_a_second_window_that_fails_leaves_no_verdict(climb, monkeypatch):
    """Out of memory in the second window (both loops held): one window could not tell, so no measurable change."""
    monkeypatch.setattr(L, "_paired", lambda first, second, n: ([], "OutOfMemoryError"))
    results = climb("noisy vm", native_16bit=False)
    fused = by_label(results)["+ fused AdamW"].ladder
    assert not fused["kept"] and fused["speed"] == L.NO_CHANGE
    assert "not confirmed: OutOfMemoryError in a second window" in fused["why"], fused["why"]
    # and the leanest loop, which could not be paired with naive either, says what its speed-up is instead
    last = results[-1]
    assert last.label == L.LEANEST and last.ok and last.ladder["speedup"] > 1 and L.speedup_basis(last) == L.PRODUCT
    assert last.ladder["why"].startswith("not timed against naive fp32 (OutOfMemoryError when paired)")
    assert L.ladder_rows(results)[-1]["vs naive, paired"] == ""  # a product stays in the product's column


def test_same_step_noise_within_noise_and_second_window():
    def row(factor, low, high):
        return RunResult("x", "ok", {}, {}, ladder={"same_step_factor": factor, "factor_iqr": [low, high]})

    assert L.same_step_noise([row(1.19, 1.09, 1.22)]) == pytest.approx(1.19)  # the median, as far from 1 as it went
    assert L.same_step_noise([row(0.91, 0.89, 0.99)]) == pytest.approx(1 / 0.91)  # slower or faster alike
    assert L.same_step_noise([row(1.0, 0.8, 1.25)]) == pytest.approx(1.25 / 1.0, rel=0.01)  # or half its spread
    assert L.same_step_noise([row(1.01, 1.0, 1.02)]) == pytest.approx(1 + L.MIN_SPEED_CHANGE)  # at least the threshold
    assert L.same_step_noise([RunResult("y", "ok", {}, {})]) is None and L.same_step_noise([]) is None  # unmeasured
    faster = L.speed_change([(0.2, 0.2 / 1.05)] * 5)
    assert L.within_noise(faster, 1.03) and not L.within_noise(faster, 1.02) and not L.within_noise(faster, None)
    assert not L.within_noise(L.speed_change([(0.2, 0.2)] * 5), 1.10)  # no change needs no second look
    assert L.within_noise(L.speed_change([(0.2, 0.2 * 1.05)] * 5), 1.03)  # slower, the same way round
    first = [(0.2, 0.2 / 1.05)] * 5
    assert L.second_window(faster, first, [(0.2, 0.2 / 1.06)] * 5).verdict == L.FASTER
    again = L.second_window(faster, first, [(0.2, 0.2 / 0.99)] * 5)
    assert again.verdict == L.NO_CHANGE and again.pairs == 10


def test_one_slow_step_does_not_decide():
    steady = [(0.200, 0.150)] * 5
    assert L.speed_change(steady).verdict == L.FASTER
    assert L.speed_change(steady[:4] + [(0.200, 0.900)]).verdict == L.FASTER  # a page fault in one step
    assert L.speed_change([(0.2, 0.2 * f) for f in (0.99, 1.01, 1.0, 1.02, 0.98)]).verdict == L.NO_CHANGE
    assert L.speed_change([(0.2, 0.15)] * 2).verdict == L.TOO_FEW  # fewer than MIN_PAIRS cannot tell
    assert L.speed_change([(0.2, 0.2 / 1.02)] * 6).verdict == L.NO_CHANGE  # consistent, but below MIN_SPEED_CHANGE


@pytest.mark.parametrize(
    "aims, speed_verdict, mem, kept",
    [
        ((T.SPEED,), L.FASTER, L.FATTER, True),  # a speed technique is kept for speed, its memory cost said
        ((T.SPEED,), L.NO_CHANGE, L.LEANER, False),
        ((T.SPEED, T.MEMORY), L.NO_CHANGE, L.LEANER, True),  # SDPA: leaner at no cost
        ((T.SPEED, T.MEMORY), L.SLOWER, L.NO_CHANGE, False),
        ((T.SPEED, T.MEMORY), L.FASTER, L.FATTER, False),  # both are its aims: it helped one and hurt the other
        ((T.SPEED, T.MEMORY), L.SLOWER, L.LEANER, False),
        ((T.MEMORY,), L.SLOWER, L.LEANER, True),
        ((T.MEMORY,), L.FASTER, L.NO_CHANGE, False),
    ],
)
def test_judge(aims, speed_verdict, mem, kept):
    factor = {L.FASTER: 1.5, L.SLOWER: 0.5, L.NO_CHANGE: 1.0}[speed_verdict]
    change = L.SpeedChange(factor, factor * 0.95, factor * 1.05, 5, speed_verdict)
    assert L.judge(aims, change, (0.5 if mem == L.LEANER else 1.5 if mem == L.FATTER else 1.0, mem))[0] is kept


def test_too_few_steps_per_rung_are_raised_to_what_a_verdict_needs(climb):
    """tiny's 4 steps leave 2 timed on a CPU (a warm-up step and the ledger's): the climb raises them, and says so."""
    said = []
    results = climb("avx2 laptop", native_16bit=False, steps=4, progress=said.append)
    assert any("steps per rung raised from 4 to" in s for s in said)
    assert all(len(r.ladder["pairs"]) >= L.MIN_PAIRS for r in results[1:-1] if r.ok and not r.stopped_early)


def test_a_misspelt_rung_is_an_error_not_a_rung_left_out(tiny):
    with pytest.raises(C.ConfigError, match="did you mean '\\+ tf32'"):
        L.run_ladder(tiny(), rungs=["naive fp32", "+ tf33"])


def test_an_option_sets_its_techniques_last_rung_only(tiny):
    """--set precision=fp16 is what the 16-bit rung takes; TF32's rung stays TF32."""
    from course_lib.capabilities import capabilities

    caps, cfg = capabilities("cpu"), T.naive(tiny())
    tf32, sixteen = (next(r for r in T.LADDER if r.name == n) for n in ("+ tf32", "+ 16-bit autocast"))
    assert T.rung_up(cfg, tf32, caps, {"precision": "fp16"}).precision == "tf32"
    assert T.rung_up(cfg, sixteen, caps, {"precision": "fp16"}).precision == "fp16"


def test_the_best_loop_failing_while_paired_is_not_the_rungs_fault(climb, monkeypatch):
    """An error in the best loop's paired step stops the rung with that said (too few pairs: not kept), and the best
    loop is rebuilt for the next rung."""
    state = {"failed": False}
    real_step = StandInTrainer.step

    def flaky(self):
        compile_rung_built = any(t.cfg.compile for t in StandInTrainer.made)
        if compile_rung_built and self.cfg.model.attention == "sdpa" and not self.cfg.compile and not state["failed"]:
            state["failed"] = True  # the best loop's (sdpa's) first step paired with the compile rung
            raise RuntimeError("out of memory in the best loop")
        return real_step(self)

    monkeypatch.setattr(StandInTrainer, "step", flaky)
    results = climb("avx2 laptop", native_16bit=False)
    compile_rung = by_label(results)["+ compile"]
    assert state["failed"] and compile_rung.stopped_early.startswith("the best loop so far failed while paired")
    assert not compile_rung.ladder["kept"] and compile_rung.ladder["speed"] == L.TOO_FEW
    later = by_label(results)["+ chunked loss"]
    assert later.ok and len(later.ladder["pairs"]) >= L.MIN_PAIRS  # paired again, with the rebuilt best loop


def test_a_rung_without_a_single_pair_is_judged_too_few_not_a_crash():
    kept, why = L.judge((T.SPEED,), L.speed_change([]), (None, L.NOT_MEASURED))
    assert not kept and why == f"not kept: {L.TOO_FEW}"


def test_a_speed_rung_that_lost_early_gets_a_second_look_on_top_of_the_loop_the_climb_reached(climb):
    results = climb("small gpu", native_16bit=True)
    rows = by_label(results)
    first, again = rows["+ 16-bit autocast"], rows[L.again_label("+ 16-bit autocast")]
    assert first.ladder["speed"] == L.SLOWER and not first.ladder["kept"]
    assert again.ladder["kept"] and again.ladder["speed"] == L.FASTER
    assert again.config["model"]["attention"] == "sdpa" and again.config["precision"] == "bf16"
    assert L.optimised_config(results).precision == "bf16"
    assert L.again_label("+ 16-bit autocast") in L.optimised(results).ladder["kept_rungs"]
    # a second look that does not help is not kept either, and the optimised row stays last
    assert (
        not rows[L.again_label("+ fused AdamW")].ladder["kept"] and tuple(r.label for r in results[-2:]) == L.FINAL_ROWS
    )


def test_no_second_look_for_missing_hardware_nor_on_the_fixed_ladder(climb):
    laptop = by_label(climb("avx2 laptop", native_16bit=False))
    assert L.again_label("+ 16-bit autocast") not in laptop  # converted in software: slow whatever comes after it
    assert L.again_label("+ tf32") not in laptop  # TF32 does nothing on a CPU
    fixed = climb("small gpu", native_16bit=True, fixed=True)
    assert not any(r.label.endswith(L.AGAIN) for r in fixed)


def test_the_progress_counts_only_the_rungs_measured(climb):
    """A climb with rungs left out (notebook 04 climbs up to fused AdamW) announces only what it measures: "rung i of
    n" ends at n of n, and no left-out rung is announced with a time left."""
    said = []
    left_out = {"+ set_to_none": "left out", "+ chunked loss": "left out", "+ checkpointing": "left out"}
    results = climb("avx2 laptop", native_16bit=False, leave_out=left_out, progress=said.append)
    counted = [
        (int(i), int(n), name)
        for i, n, name in (re.match(r"rung (\d+) of (\d+): ([^(]+)", t).groups() for t in said if t.startswith("rung "))
    ]
    assert [name.strip() for *_, name in counted if name.strip() in left_out] == []
    assert counted[0][:2] == (1, len(T.LADDER) - len(left_out) + 1)  # (a second look adds one when it is decided)
    assert counted[-1][1] == len(T.LADDER) - len(left_out) + 1 + sum(r.label.endswith(L.AGAIN) for r in results)
    assert counted[-1][0] == counted[-1][1] and counted[-1][2].strip() == f"{L.OPTIMISED} and {L.LEANEST}"
    assert [i for i, *_ in counted] == list(range(1, len(counted) + 1))


@pytest.mark.parametrize("native_16bit, precision", [(False, "fp32"), (True, "bf16")])
def test_everything_on_leaves_out_what_does_nothing_or_runs_in_software(monkeypatch, tiny, native_16bit, precision):
    """Notebook 01's first look: on a CPU, TF32 (a no-op there) is not switched on, nor a 16-bit format without
    hardware; with bf16 hardware, bf16."""
    real = capabilities("cpu")
    bf16 = Support(True, "bf16 hardware", True) if native_16bit else Support(True, "converted in software", False)
    caps = dataclasses.replace(real, precisions={**real.precisions, "bf16": bf16, "fp16": bf16})
    monkeypatch.setattr(L, "capabilities", lambda device=None: caps)
    top = L.everything_on(tiny())
    assert top.precision == precision and top.model.attention == "sdpa"


@pytest.mark.parametrize(
    "device, compiled, mode, idle, tried",
    [
        ("cuda", True, "default", 0.45, True),  # the GPU waits on launches: CUDA graphs are worth a rung
        ("cuda", True, "default", 0.2, True),
        ("cuda", True, "default", 0.05, False),  # arithmetic sets the pace: nothing to save
        ("cuda", True, "default", None, False),  # not measured: not tried on a guess
        ("cuda", False, "default", 0.6, False),  # reduce-overhead is a mode of compile: a loop not compiled has none
        ("cuda", True, "max-autotune", 0.6, False),
        ("cpu", True, "default", 0.6, False),  # no launches on a CPU
    ],
)
def test_cuda_graphs_are_tried_only_where_the_device_waits_on_launches(tiny, device, compiled, mode, idle, tried):
    cfg = tiny(compile=compiled, compile_mode=mode)
    cfg = dataclasses.replace(cfg, device=device) if device == "cuda" else cfg
    decided, why = L.tries_cuda_graphs(cfg, idle, "out of memory" if idle is None else "")
    assert decided is tried, why
    if idle is not None and device == "cuda" and compiled and mode == "default":
        assert f"{idle:.0%}" in why
    if idle is None and device == "cuda" and compiled:
        assert "out of memory" in why


def test_a_climb_on_a_cpu_has_no_cuda_graphs_row(climb):
    assert L.CUDA_GRAPHS not in by_label(climb("avx2 laptop", native_16bit=False))
