"""Notebook 03: one step of fp16 loss scaling as torch.amp.GradScaler takes it: unscale, check for inf/NaN, back off
or grow the scale."""

from __future__ import annotations

import torch

from .core import Case, Exercise, Mistake


def scaler_step(
    grads: list[torch.Tensor], scale: float, tracker: int, growth_interval: int = 2000
) -> tuple[list[torch.Tensor], bool, float, int]:
    """The reference, with torch's own GradScaler kernels. grads: the gradients backward made from scale x loss.
    Returns (the gradients divided by the scale, whether any was inf or NaN, the next scale, the next count of clean
    steps in a row). A step with an inf or NaN is skipped and halves the scale (the count restarts at 0); after
    `growth_interval` clean steps in a row the scale doubles and the count restarts."""
    grads = [g.clone() for g in grads]
    found_inf = torch.zeros(1)
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, torch.full((1,), 1.0 / scale))
    s, t = torch.full((1,), float(scale)), torch.full((1,), tracker, dtype=torch.int32)
    torch._amp_update_scale_(s, t, found_inf, 2.0, 0.5, growth_interval)
    return grads, bool(found_inf.item()), float(s.item()), int(t.item())


def _grads(seed: int, scale: float, bad: float | None = None) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(4, 3, generator=gen) * 1e-3 * scale, torch.randn(5, generator=gen) * 1e-4 * scale]
    if bad is not None:
        grads[1][2] = bad
    return grads


def _cases() -> list[Case]:
    s = 2.0**16
    return [
        Case("a clean step", (_grads(0, s), s, 0, 2000)),
        Case("an overflow (inf in a gradient)", (_grads(1, s, float("inf")), s, 5, 2000)),
        Case("the last clean step of the growth interval", (_grads(2, s), s, 2, 3)),
        Case("a NaN (0 x inf in backward)", (_grads(3, s, float("nan")), s, 1, 2000)),
        Case("a clean step after a growth", (_grads(4, 2 * s), 2 * s, 0, 3)),
    ]


def _not_unscaled(grads, scale, tracker, growth_interval=2000):
    _, found, s, t = scaler_step(grads, scale, tracker, growth_interval)
    return [g.clone() for g in grads], found, s, t


def _no_back_off(grads, scale, tracker, growth_interval=2000):
    out, found, s, t = scaler_step(grads, scale, tracker, growth_interval)
    return out, found, (scale if found else s), (0 if found else t)


def _inf_only(grads, scale, tracker, growth_interval=2000):
    cleaned = [torch.nan_to_num(g, nan=0.0, posinf=float("inf"), neginf=float("-inf")) for g in grads]
    out, found, s, t = scaler_step(cleaned, scale, tracker, growth_interval)
    return [g / scale for g in grads], found, s, t


def _no_reset(grads, scale, tracker, growth_interval=2000):
    out, found, s, t = scaler_step(grads, scale, tracker, growth_interval)
    return out, found, s, (tracker + 1 if not found else t)


def _describe(case, expected, got) -> str:
    parts = []
    if not torch.allclose(
        torch.cat([g.flatten() for g in got[0]]),
        torch.cat([g.flatten() for g in expected[0]]),
        rtol=1e-6,
        atol=0,
        equal_nan=True,
    ):
        ratio = float(got[0][0].flatten()[0] / expected[0][0].flatten()[0])
        parts.append(f"your gradients are {ratio:.3g}x the reference's")
    if got[1] != expected[1]:
        parts.append(
            f"you found {'an' if got[1] else 'no'} inf/NaN where the reference found {'one' if expected[1] else 'none'}"
        )
    if got[2] != expected[2]:
        parts.append(f"your next scale is {got[2]:g} = {got[2] / expected[2]:g}x the reference's {expected[2]:g}")
    if got[3] != expected[3]:
        parts.append(f"your count of clean steps is {got[3]}, the reference's {expected[3]}")
    return "; ".join(parts) or "your answer differs from the reference's"


EXERCISE = Exercise(
    name="scaler_step",
    notebook="03",
    title="One GradScaler step",
    reference=scaler_step,
    cases=_cases,
    mistakes=(
        Mistake(
            "gradients not unscaled",
            _not_unscaled,
            "Backward ran on scale x loss, so every gradient is `scale` times too large: divide by the scale before "
            "clipping or stepping (scaler.unscale_).",
        ),
        Mistake(
            "no back-off",
            _no_back_off,
            "An overflow means the scale is too high: skip the step and halve the scale (backoff 0.5), or the next "
            "step overflows again.",
        ),
        Mistake(
            "inf checked, NaN not",
            _inf_only,
            "A NaN is as fatal as an inf (0 x inf in backward makes one): check for any non-finite value, "
            "torch.isfinite, not only for inf.",
        ),
        Mistake(
            "the count not restarted after growing",
            _no_reset,
            "After the scale doubles, the count of clean steps starts again at 0: the next growth waits another "
            "growth_interval steps.",
        ),
    ),
    rtol=1e-6,
    atol=0.0,
    describe=_describe,
)
