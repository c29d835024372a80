"""Claims of notebooks 04 and 09 that are bookkeeping rather than a lesson, moved out of their "Check yourself"
cells."""

import torch

from course_lib import config as C
from course_lib.lessons import micro_benchmarks
from course_lib.model import GPT


def test_the_padded_gpt2_head_has_50304_rows_47_never_predicted():
    gpt2 = C.ModelConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50257, vocab_multiple=64)
    with torch.device("meta"):
        rows = GPT(gpt2).lm_head.weight.shape[0]
    assert rows == gpt2.padded_vocab_size == 50304 and rows - gpt2.vocab_size == 47


def test_foreach_and_fused_adamw_make_far_fewer_operator_calls_than_the_for_loop(tiny):
    params = [p.detach() for p in GPT(tiny().model).parameters()]
    calls = micro_benchmarks.adamw_operator_calls(params)
    assert calls["for-loop"] >= 4 * len(params)  # moments, decay and update: several calls per tensor
    assert len(params) > calls["foreach"] >= calls["fused"] >= 1, calls


def test_at_the_cpu_preset_none_and_selective_peak_at_different_moments_and_the_model_holds_at_each():
    """Notebook 09's checkpointing check at the learner's budget (the cpu preset's optimised loop, compile off): without
    checkpointing the step peaks in the forward's loss slices, with selective in the last block's backward, so the
    activations at the two peaks differ by more than what selective drops from the forward; the memory model matches
    the ledger at each mode's own peak, and so in the difference of the two, which is what the notebook checks."""
    import dataclasses

    from course_lib import ladder, memory_formula, reference
    from course_lib.lessons import training_compute

    # the loop an AVX2 laptop ends with: the optimised loop of the shipped AVX2 climb, as notebook 09 runs it
    climbs = [r for _, r, meta in reference.measured_cpus("cpu") if "ATEN_CPU_CAPABILITY=avx2" in meta["cpu"]]
    assert climbs, "data/measured/ holds a climb with every kernel held to AVX2"
    top = dataclasses.replace(
        ladder.optimised_config(climbs[0]), compile=False, activation_checkpointing="none", steps=3, timing_warmup=1
    )
    assert top.loss_chunks > 1 and top.model.attention == "sdpa", top  # the chunked loss is what moves none's peak
    act, est, when = {}, {}, {}
    for c in training_compute.checkpointing_costs(top, modes=("none", "selective"), repeats=1):  # notebook 09's
        measured, predicted = c.result.memory, c.estimate
        assert abs(predicted.peak_bytes - measured["peak_bytes"]) <= 0.005 * measured["peak_bytes"], c.mode
        act[c.mode], est[c.mode] = measured["by_category"]["activations"], predicted.by_category["activations"]
        when[c.mode] = predicted.when
    kept = {
        m: memory_formula.activation_bytes(dataclasses.replace(top, activation_checkpointing=m))["kept per layer"]
        for m in act
    }
    dropped = top.model.n_layer * (kept["none"] - kept["selective"])
    assert when["none"] != when["selective"], when
    assert act["none"] - act["selective"] > 1.01 * dropped, (act, dropped)
    # what the notebook checks instead: the drop at the peaks, the ledger's against the memory model's
    drop_model = est["none"] - est["selective"]
    assert abs(act["none"] - act["selective"] - drop_model) <= 0.01 * drop_model, (act, est)
