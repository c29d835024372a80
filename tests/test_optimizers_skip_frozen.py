"""Every optimizer written by hand skips a parameter whose .grad is None as torch.optim does (no weight decay, no step,
no state change), and otherwise gives torch's bits: each is trained beside the matching torch.optim optimizer
(foreach=False, the for-loop whose order of operations the hand-written rules follow) on a small model with a frozen
weight (requires_grad=False, in the optimizer's groups all the same), a branch with no gradient every other step and an
output layer tied to the embedding, and compared with torch.equal after every step. Zero1AdamW is compared the same way
in tests/test_zero1_by_hand.py, in one process and under gloo with 2 and 4."""

from __future__ import annotations

import pytest
import torch

from course_lib.distributed.zero1_by_hand import compare_on_frozen_and_tied
from course_lib.exercises.adamw import adamw_step, optimizer_from
from course_lib.lessons import optimizers_by_hand as O
from course_lib.lessons.pure_bf16 import LowPrecisionAdamW

ADAMW = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}

PAIRS = {
    "AdamW (notebook 05)": (lambda g: O.HandAdamW(g, **ADAMW), lambda g: torch.optim.AdamW(g, **ADAMW, foreach=False)),
    "the exercise's reference AdamW": (
        lambda g: optimizer_from(adamw_step)(g, **ADAMW),
        lambda g: torch.optim.AdamW(g, **ADAMW, foreach=False),
    ),
    "AdaGrad, L2 decay and lr decay": (
        lambda g: O.HandAdagrad(g, lr=3e-2, eps=1e-6, lr_decay=0.05),
        lambda g: torch.optim.Adagrad(g, lr=3e-2, eps=1e-6, lr_decay=0.05, foreach=False),
    ),
    "RMSProp": (lambda g: O.HandRMSprop(g, lr=1e-2), lambda g: torch.optim.RMSprop(g, lr=1e-2, foreach=False)),
    "RMSProp, momentum and centered": (
        lambda g: O.HandRMSprop(g, lr=1e-2, alpha=0.9, momentum=0.9, centered=True),
        lambda g: torch.optim.RMSprop(g, lr=1e-2, alpha=0.9, momentum=0.9, centered=True, foreach=False),
    ),
}


@pytest.mark.parametrize("name", PAIRS)
def test_a_hand_written_optimizer_is_torchs_to_the_bit_with_frozen_unused_and_tied_parameters(name):
    mine, theirs = PAIRS[name]
    # the groups' weight decay (0.1 on the >=2-D tensors) is AdamW's decoupled decay, AdaGrad's and RMSProp's L2
    got, _opt, _model = compare_on_frozen_and_tied(mine, theirs, steps=6, weight_decay=0.1)
    assert got["bit_equal_every_step"], got
    assert got["frozen_unchanged"] and got["branch_unchanged_when_unused"], got


@pytest.mark.parametrize("name", PAIRS)
def test_no_state_for_a_parameter_that_never_had_a_gradient(name):
    mine, _theirs = PAIRS[name]
    _got, opt, model = compare_on_frozen_and_tied(mine, _theirs, steps=3)
    assert model.frozen.weight not in opt.state  # made at a parameter's first step, as torch makes it
    assert opt.state[model.sometimes.weight]["t"] == 2  # used at steps 0 and 2 of 3: its own count


def test_the_comparison_sees_a_missing_gradient_treated_as_zero():
    # An AdamW that feeds zeros where .grad is None still decays the frozen weight: the comparison must say so
    class ZerosForMissing(O.HandAdamW):
        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
            return super().step(closure)

    got, _opt, _model = compare_on_frozen_and_tied(
        lambda g: ZerosForMissing(g, **ADAMW), lambda g: torch.optim.AdamW(g, **ADAMW, foreach=False)
    )
    assert not got["bit_equal_every_step"] and not got["frozen_unchanged"] and got["max_abs_diff"] > 1e-4


def test_the_low_precision_adamw_skips_a_parameter_without_a_gradient():
    # notebook 03's LowPrecisionAdamW (HandAdamW's loop, AdamW's rule one format wider, stored back rounded): with
    # float32 weights it widens to float64 and rounds back, so its bits are not torch's float32 AdamW's; what the
    # loop promises is the skip, checked to the bit, and the rest within float32's rounding
    got, _opt, _model = compare_on_frozen_and_tied(
        lambda g: LowPrecisionAdamW(g, **ADAMW), lambda g: torch.optim.AdamW(g, **ADAMW, foreach=False)
    )
    assert got["frozen_unchanged"] and got["branch_unchanged_when_unused"], got
    assert got["max_abs_diff"] < 1e-5, got
