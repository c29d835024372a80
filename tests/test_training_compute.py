"""course_lib.lessons.training_compute: C = 6ND, PF-days, time to train, on known values; and the work a step's
recompute adds, counted from the shapes (exact on any machine)."""

import dataclasses
import math

import pytest

from course_lib.capabilities import DATASHEET_TFLOPS
from course_lib.lessons import training_compute as CB


def test_gpt3_is_3640_pf_days():
    # Brown et al. (2020), table D.1: GPT-3 175B on 300B tokens, 3.14e23 FLOPs, 3,640 PF-days
    c = CB.training_flops(175e9, 300e9)
    assert math.isclose(c, 3.14e23, rel_tol=0.005)
    assert math.isclose(CB.pf_days(c), 3640, rel_tol=0.005)


def test_a_pf_day_is_an_amount_of_work():
    assert CB.PF_DAY_FLOPS == 8.64e19 and CB.pf_days(8.64e19) == 1.0
    # the source's arithmetic: one PF-day on an A100 at its fp32 (no tensor core) data-sheet peak, 19.5 TFLOP/s
    seconds = CB.time_to_train(CB.PF_DAY_FLOPS, DATASHEET_TFLOPS["A100"]["fp32"] * 1e12)
    assert round(seconds) == 4_430_769 and CB.human_duration(seconds) == "51.3 days"
    # and at its bf16 tensor-core peak, 16x less
    assert CB.human_duration(CB.time_to_train(CB.PF_DAY_FLOPS, DATASHEET_TFLOPS["A100"]["bf16"] * 1e12)) == "3.21 days"


def test_chinchilla_and_the_budget_table():
    n = 1e9
    assert CB.chinchilla_tokens(n) == 20e9
    c = CB.training_flops(n, CB.chinchilla_tokens(n))
    assert c == 1.2e20 and math.isclose(CB.pf_days(c), 1.389, rel_tol=1e-3)
    rows = CB.budget_rows({"1B": (n, 20e9)}, {"1 PF/s": 1e15, "1 TF/s": 1e12})
    assert rows == [
        {
            "run": "1B",
            "parameters": "1e+09",
            "tokens": "2e+10",
            "FLOPs (6ND)": "1.2e+20",
            "PF-days": "1.39",
            "1 PF/s": "1.39 days",
            "1 TF/s": "3.8 years",
        }
    ]


@pytest.mark.parametrize(
    "seconds, text",
    [
        (0.5, "0.5 s"),
        (90, "1.5 minutes"),
        (7200, "2 hours"),
        (86_400 * 150, "150 days"),
        (365.25 * 86_400 * 1234, "1,234 years"),
    ],
)
def test_human_duration(seconds, text):
    assert CB.human_duration(seconds) == text


def test_time_to_train_needs_a_speed():
    with pytest.raises(ValueError, match="positive"):
        CB.time_to_train(1e18, 0)


def test_recompute_counted_from_the_shapes(tiny):
    # Full checkpointing runs each block's forward again in backward, up to the last tensor backward needs: its QKV,
    # attention projection and MLP up-projection matmuls (3h^2 + h^2 + 4h^2 weights, 2 FLOPs each per token) and naive
    # attention's two s x s products (2 b s^2 h FLOPs each), but not the MLP's down-projection (4h^2 weights), whose
    # output backward never reads: non-reentrant checkpointing stops recomputing early. Selective keeps every matmul's
    # output, so no matmul is recomputed, only element-wise work (the same element-wise ops as full).
    cfg = tiny(steps=1)
    m, b, s = cfg.model, cfg.batch_size, cfg.context
    work = {
        mode: CB.step_work(dataclasses.replace(cfg, activation_checkpointing=mode))
        for mode in ("none", "selective", "full")
    }
    recomputed = m.n_layer * (2 * 8 * m.n_embd**2 * b * s + 2 * 2 * b * s * s * m.n_embd)
    assert work["full"].matmul_flops - work["none"].matmul_flops == recomputed
    assert work["selective"].matmul_flops == work["none"].matmul_flops
    assert work["selective"].elementwise_values == work["full"].elementwise_values > work["none"].elementwise_values
    assert work["none"].ops < work["selective"].ops
