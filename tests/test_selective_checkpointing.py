"""Activation checkpointing none / selective / full through the course's loop, on the tiny config: the memory the CPU
ledger measures is ordered none > selective > full and agrees with memory_formula.estimate, and the arithmetic is the
same (losses and gradients equal none's, bit for bit: the recompute repeats the same operations on the same values)."""

import dataclasses

import pytest
import torch

from course_lib import memory_formula as M
from course_lib.config import tiny_preset
from course_lib.measure import CATEGORIES
from course_lib.train import Trainer, run

MODES = ("none", "selective", "full")
TOL = 0.005  # of the measured peak, for the peak and each category (as tests/test_memory_estimate.py)


def config(mode):
    return dataclasses.replace(tiny_preset("cpu"), steps=3, timing_warmup=1, activation_checkpointing=mode)


@pytest.fixture(scope="module")
def results(splits):
    return {mode: run(config(mode), mode, splits=splits) for mode in MODES}


def test_ledger_orders_the_activations(results):
    act = {mode: r.memory["by_category"]["activations"] for mode, r in results.items()}
    assert act["none"] > act["selective"] > act["full"] > 0, act
    assert (
        results["none"].memory["peak_bytes"]
        > results["selective"].memory["peak_bytes"]
        > results["full"].memory["peak_bytes"]
    )


@pytest.mark.parametrize("mode", MODES)
def test_estimate_agrees_with_the_ledger(results, mode):
    led, est = results[mode].memory, M.estimate(config(mode))
    assert abs(est.peak_bytes - led["peak_bytes"]) <= TOL * led["peak_bytes"], (est.peak_bytes, led["peak_bytes"])
    for cat in CATEGORIES:
        assert abs(est.by_category[cat] - led["by_category"][cat]) <= TOL * led["peak_bytes"], (
            cat,
            est.by_category,
            led["by_category"],
        )
    # the forward keeps what activation_bytes says (the peak here is at the start of backward, after the whole forward)
    assert (
        est.when == "start of backward"
        and led["by_category"]["activations"] == M.activation_bytes(config(mode))["total"]
    )


def test_losses_equal_bit_for_bit(results):
    assert results["selective"].losses == results["none"].losses == results["full"].losses


def test_gradients_equal_none(splits):
    grads = {}
    for mode in MODES:
        trainer = Trainer(config(mode), splits=splits)  # same seed: the same initial weights and the same first batch
        setup = trainer.setup
        x, y = trainer.batches(0)[0]
        setup.loss_fn(x, y).backward()
        grads[mode] = [p.grad for p in setup.model.parameters()]
    for mode in ("selective", "full"):
        assert len(grads[mode]) == len(grads["none"])
        for a, b in zip(grads[mode], grads["none"]):
            assert torch.equal(a, b), (mode, (a - b).abs().max())
