"""Gradient accumulation: the batch arithmetic, exact equality with the big batch (with and without padding),
the classic mistakes measured as wrong, the one loop's equivalence, and the memory sweep."""

from dataclasses import replace

import pytest

from course_lib import config, data
from course_lib.lessons import accumulated_gradients as acc
from course_lib.measure import CATEGORIES

CONTEXT = 32
TOL = 1e-5  # fp32: only the order of the sums differs


@pytest.fixture(scope="module")
def cfg():
    base = config.tiny_preset("cpu")
    return replace(base, context=CONTEXT, batch_size=4, steps=3, timing_warmup=1)


@pytest.fixture(scope="module")
def model(cfg):
    return acc.make_model(cfg)


def test_tokens_per_step_and_accumulation_steps():
    assert acc.tokens_per_optimizer_step(16, 1024, 32) == 2**19
    assert acc.tokens_per_optimizer_step(16, 1024, 4, processes=8) == 2**19
    k = acc.accumulation_steps_for(2**19, 16, 1024)
    assert k == 32 and isinstance(k, int)
    assert acc.accumulation_steps_for(2**19, 16, 1024, processes=8) == 4
    with pytest.raises(ValueError, match="whole multiple"):
        acc.accumulation_steps_for(500_000, 16, 1024)
    with pytest.raises(ValueError):
        acc.tokens_per_optimizer_step(16, 1024, 32.0)


def test_accumulated_gradient_equals_big_batch_without_padding(model, splits):
    micro = acc.full_micro_batches(splits.train, 4, 1, CONTEXT, seed=1)
    assert len(set(acc.target_counts(micro))) == 1
    res = acc.compare_normalisations(model, micro)
    assert res["global"]["relative_error"] < TOL
    # with equal counts the mean of means is the same thing
    assert res["mean_of_means"]["relative_error"] < TOL
    # forgetting the 1/K, or dividing after backward, gives K times the gradient
    for name in ("no_division", "divide_after_backward"):
        assert res[name]["norm_ratio"] == pytest.approx(4.0, rel=1e-4)
    assert res["zero_grad_inside"]["relative_error"] > 0.1


def test_padding_trap(model, splits):
    micro = acc.padded_micro_batches(splits.train, [CONTEXT, CONTEXT // 2, 4, 2], 1, CONTEXT, splits.pad_id, seed=2)
    counts = acc.target_counts(micro)
    assert counts == [CONTEXT, CONTEXT // 2, 4, 2]
    x, y = acc.concat(micro)
    assert x.shape == (4, CONTEXT) and (y == data.IGNORE_INDEX).sum() == 4 * CONTEXT - sum(counts)
    res = acc.compare_normalisations(model, micro, ("global", "mean_of_means"))
    assert res["global"]["relative_error"] < TOL
    assert res["mean_of_means"]["relative_error"] > 1e-2


def test_unknown_normalisation(model, splits):
    with pytest.raises(ValueError, match="normalisation"):
        acc.gradients(model, acc.full_micro_batches(splits.train, 1, 1, CONTEXT), "mean")


def test_the_loop_accumulates_exactly(cfg, splits):
    lengths = [CONTEXT, CONTEXT // 2, 8, 3]
    micro = lambda step: acc.padded_micro_batches(splits.train, lengths, 1, CONTEXT, splits.pad_id, seed=10 + step)  # noqa: E731
    big, accumulated = acc.loop_equivalence(replace(cfg, batch_size=1), micro)
    assert accumulated.config["grad_accum_steps"] == 4 and big.config["grad_accum_steps"] == 1
    assert acc.max_relative_difference(accumulated.losses, big.losses) < 1e-5
    assert acc.max_relative_difference(accumulated.grad_norms, big.grad_norms) < 1e-4


def test_memory_follows_the_micro_batch(cfg):
    results = acc.accumulation_sweep(replace(cfg, batch_size=4), [1, 4])
    one, four = results
    assert all(r.ok and r.tokens_per_s > 0 and r.tokens_per_step == 4 * CONTEXT for r in results)
    assert four.config["grad_accum_steps"] == 4 and four.label.startswith("K=4")
    assert set(one.memory["by_category"]) == set(CATEGORIES)
    # the CPU ledger: activations and logits of one micro-batch at a time, a quarter of the big batch's
    for cat in ("activations", "logits"):
        ratio = four.memory["by_category"][cat] / one.memory["by_category"][cat]
        assert 0.2 < ratio < 0.35, (cat, ratio)
    static = ("parameters", "gradients", "optimizer state")
    assert [four.memory["by_category"][c] for c in static] == [one.memory["by_category"][c] for c in static]
    assert four.memory["peak_bytes"] < one.memory["peak_bytes"]
