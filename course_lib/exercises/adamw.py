"""Notebook 05: one AdamW step with bias correction, and linear warmup + cosine decay."""

from __future__ import annotations

import math

import torch

from ..lessons.optimizers_by_hand import HandAdamW, adamw_update
from ..techniques import warmup_cosine_lr
from .core import Case, Exercise, Mistake


def adamw_step(p, g, m, v, t: int, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
    """The reference: the new (p, m, v) after AdamW step `t` (from 1), the inputs left unchanged."""
    p, m, v = p.clone(), m.clone(), v.clone()
    adamw_update(p, g, m, v, t, lr, betas, eps, weight_decay)
    return p, m, v


def optimizer_from(step) -> type[torch.optim.Optimizer]:
    """An optimizer built on a step function with adamw_step's signature (the learner's, once it passes): the loop of
    optimizers_by_hand.HandAdamW calls it for every parameter that has a gradient (one whose .grad is None is skipped,
    as torch skips it), and its new (p, m, v) replace the old. So a learner's AdamW trains the course's model beside
    torch.optim.AdamW (notebook 05)."""

    class StepAdamW(HandAdamW):
        def update(self, p, g, state, group):
            args = (group["lr"], group["betas"], group["eps"], group["weight_decay"])
            new_p, new_m, new_v = step(p, g, state["m"], state["v"], state["t"], *args)
            p.copy_(new_p)
            state["m"].copy_(new_m)
            state["v"].copy_(new_v)

    return StepAdamW


def _state(shape, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(shape, generator=gen)
    g = torch.randn(shape, generator=gen) * scale
    return p, g, torch.zeros(shape), torch.zeros(shape)


def _cases() -> list[Case]:
    p, g, m, v = _state((5,), 0)
    later_m, later_v = g * 0.3, g.square() * 0.02  # moments part-way through training
    tp, tg, tm, tv = _state((3, 4), 1, scale=1e-9)
    return [
        Case("the first step (t = 1)", (p, g, m, v, 1, 1e-3)),
        Case("step 10, moments already filled", (p, g, later_m, later_v, 10, 1e-3, (0.9, 0.95))),
        Case("with weight decay", (p, g, later_m, later_v, 3, 1e-2, (0.9, 0.999), 1e-8, 0.1)),
        Case("tiny gradients (eps matters)", (tp, tg, tm, tv, 1, 1e-3, (0.9, 0.999), 1e-8)),
    ]


def _no_correction(p, g, m, v, t, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
    p, m, v = p.clone(), m.clone(), v.clone()
    adamw_update(p, g, m, v, t, lr, betas, eps, weight_decay, bias_correction=False)
    return p, m, v


def _l2_in_gradient(p, g, m, v, t, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
    return adamw_step(p, g + weight_decay * p, m, v, t, lr, betas, eps, 0.0)


def _eps_inside_sqrt(p, g, m, v, t, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
    b1, b2 = betas
    p = p * (1 - lr * weight_decay)
    m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    return p - lr * (m / (1 - b1**t)) / torch.sqrt(v / (1 - b2**t) + eps), m, v


def _update_ratio(case, expected, got) -> str:
    p0 = case.args[0]
    ours, ref = (got[0] - p0).norm(), (expected[0] - p0).norm()
    return f"your update is {float(ours / ref):.3g}x the reference's (its size, over the tensor)"


EXERCISE = Exercise(
    name="adamw_step",
    notebook="05",
    title="One AdamW step",
    reference=adamw_step,
    cases=_cases,
    mistakes=(
        Mistake(
            "no bias correction",
            _no_correction,
            "m and v start at zero, so early on they are too small: did you divide m by 1 - beta1^t and v by "
            "1 - beta2^t before using them?",
        ),
        Mistake(
            "L2 in the gradient",
            _l2_in_gradient,
            "That is Adam with L2 regularisation: AdamW decays the weights themselves, p <- p - lr * wd * p, outside "
            "the moments (decoupled weight decay).",
        ),
        Mistake(
            "eps inside the square root",
            _eps_inside_sqrt,
            "eps goes outside the square root: sqrt(v_hat) + eps. Inside it, it dominates tiny gradients' "
            "denominators.",
        ),
    ),
    rtol=1e-5,
    atol=1e-8,
    describe=_update_ratio,
)


def lr_at(step: int, lr: float, warmup: int, total: int, min_lr_ratio: float = 0.1) -> float:
    """The reference: linear warmup over `warmup` steps, then half a cosine to min_lr_ratio * lr at step total - 1."""
    return warmup_cosine_lr(step, lr, warmup, total, min_lr_ratio)


def _schedule_cases() -> list[Case]:
    return [
        Case("the first step of the warmup (step 0)", (0, 1e-3, 10, 100)),
        Case("the last warmup step", (9, 1e-3, 10, 100)),
        Case("half-way through the decay", (54, 1e-3, 10, 100)),
        Case("the last step reaches the floor", (99, 1e-3, 10, 100)),
        Case("no warmup", (0, 3e-4, 0, 50, 0.0)),
    ]


def _from_zero(step, lr, warmup, total, min_lr_ratio=0.1):
    return lr * step / warmup if step < warmup else warmup_cosine_lr(step, lr, warmup, total, min_lr_ratio)


def _to_zero(step, lr, warmup, total, min_lr_ratio=0.1):
    return warmup_cosine_lr(step, lr, warmup, total, 0.0)


def _one_late(step, lr, warmup, total, min_lr_ratio=0.1):
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return min_lr_ratio * lr + 0.5 * (lr - min_lr_ratio * lr) * (1 + math.cos(math.pi * progress))


SCHEDULE = Exercise(
    name="warmup_cosine",
    notebook="05",
    title="Warmup and cosine decay",
    reference=lr_at,
    cases=_schedule_cases,
    mistakes=(
        Mistake(
            "warmup from zero",
            _from_zero,
            "Step 0 would then train with a learning rate of 0, a wasted step: the warmup's first step takes "
            "lr / warmup, (step + 1) / warmup of the peak.",
        ),
        Mistake(
            "decay to zero",
            _to_zero,
            "The cosine ends at min_lr_ratio * lr (GPT-3 decays to 10%), not at 0.",
        ),
        Mistake(
            "the floor one step late",
            _one_late,
            "The last step is total - 1: the decay spans total - 1 - warmup steps, so that the last step reaches "
            "the floor exactly.",
        ),
    ),
    rtol=1e-9,
    atol=1e-15,
    describe=lambda case, expected, got: (
        f"your learning rate at step {case.args[0]} is {got:.4g}, the reference's {expected:.4g}"
    ),
)
