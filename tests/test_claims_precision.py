"""Bookkeeping behind notebooks 03 (mixed precision) and 05 (algorithmic hyperparameters): the identities and constants
their "Check yourself" cells used to assert in front of the learner. Those cells keep only what this
machine's measurements could refute; what is arithmetic, a restated constant or the course's own bookkeeping is checked
here.

Already covered elsewhere, so not repeated: the cosine and exponential schedules against torch's schedulers and the loop
(test_optimizers_by_hand), Adam's update size against SGD's, the optimizer-state formulas and their order, AdaGrad's and
RMSProp's state (test_optimizers_by_hand), the bias-correction peak of 6.57x at step 12 (test_optimizers_by_hand), the
bytes per parameter of pure bf16 (test_pure_bf16), the GradScaler only for fp16 in techniques (test_techniques)."""

import math
from dataclasses import replace

import pytest
import torch

from course_lib import config as C, techniques
from course_lib.lessons import optimizers_by_hand as O
from course_lib.model import GPT
from course_lib.train import train

BF16 = torch.bfloat16


# ---- notebook 03 ---------------------------------------------------------------------------------------------------


def test_only_fp16_runs_a_loss_scaler(splits, tiny):
    """03's old check #4, tail: bf16 has fp32's range and needs no scaler, so the loop logs a scale for fp16 runs
    only."""
    cfg = tiny(steps=2, timing_warmup=1, measure_memory=False, batch_size=2, context=32)
    scales = {p: train(replace(cfg, precision=p), splits=splits).loss_scales for p in ("fp32", "bf16", "fp16")}
    assert (
        scales["fp32"] == scales["bf16"] == [] and len(scales["fp16"]) == 2 and scales["fp16"][0] == cfg.loss_scale_init
    )


def _gap_below(x: float, dtype) -> float:
    """The distance from the value `x` holds in `dtype` to the next one down."""
    t = torch.tensor(x, dtype=dtype)
    return float(t.float() - torch.nextafter(t, torch.tensor(-math.inf, dtype=dtype)).float())


def test_the_bf16_gaps_notebook_03_quotes():
    """03, "fp32 master weights": a gain of 1.0 has a gap of 2^-8 just below 1 (an update under 2^-9 is lost), a weight
    of about 0.02 one of 2^-13; AdamW's 1e-3 survives at 0.02, 6e-5 does not at its larger weights."""
    assert _gap_below(1.0, BF16) == 2.0**-8 and _gap_below(0.02, BF16) == 2.0**-13
    one = torch.tensor(1.0, dtype=BF16)
    assert (one - 0.99 * 2.0**-9).to(BF16) == one and (one - 1.01 * 2.0**-9).to(BF16) != one
    w = torch.tensor(0.03, dtype=BF16)  # a larger matrix weight, in [2^-6, 2^-5)
    assert (w + 1e-3).to(BF16) != w and (w.double() + 6e-5).to(BF16) == w


# ---- notebook 05 ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("steps, warmup", [(40, 8), (120, 12)])  # notebook 05's BASE, smoke and full
def test_notebook_05s_cosine_starts_above_zero_peaks_at_lr_and_ends_at_a_tenth(steps, warmup):
    """05's old check #2 (the schedule's shape, on the notebook's own settings; the run's logged rates against torch's
    schedulers stay in the notebook)."""
    peak = 3e-3
    cfg = replace(
        C.cpu_preset("cpu"), lr=peak, schedule="cosine", lr_warmup_steps=warmup, steps=steps, min_lr_ratio=0.1
    )
    loop = [techniques.lr_at(t, cfg) for t in range(steps)]
    ref = O.torch_scheduler_curve(lambda opt: O.torch_warmup_cosine(opt, warmup, steps, 0.1), peak, steps)
    assert loop == pytest.approx(ref, rel=1e-9)
    assert 0 < loop[0] < peak and max(loop) == pytest.approx(peak) and loop[-1] == pytest.approx(0.1 * peak)


def test_weight_decay_groups_of_notebook_05s_model():
    """05's old check #6: decay on >= 2-D tensors only, none on the 1-D ones, every parameter in exactly one group."""
    model = GPT(C.cpu_preset("cpu").model)
    decay, no_decay = techniques.param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    ids = [id(p) for g in (decay, no_decay) for p in g["params"]]
    assert (
        len(ids) == len(set(ids))
        and sum(p.numel() for g in (decay, no_decay) for p in g["params"]) == model.num_params()
    )


def _simulated_bias_ratios(betas, steps: int, g: float = 0.3) -> list[float]:
    """Measured, not derived: torch's AdamW (with bias correction) fed a constant gradient g, and Adam's two moment
    recursions run by hand without the correction, m <- b1 m + (1 - b1) g, v <- b2 v + (1 - b2) g^2; at each step the
    uncorrected step m / sqrt(v) over torch's step (its change in the weight / lr)."""
    b1, b2 = betas
    p = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.AdamW([p], lr=1e-3, betas=betas, eps=1e-30, weight_decay=0.0)
    m = v = 0.0
    ratios = []
    for _ in range(steps):
        before = p.detach().clone()
        p.grad = torch.full_like(p, g)
        opt.step()
        corrected = abs(float(p.detach() - before)) / 1e-3
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        ratios.append(abs(m) / math.sqrt(v) / corrected)
    return ratios


def test_gpt3s_betas_bias_correction_numbers_in_notebook_05():
    """05, "Bias correction": with betas (0.9, 0.999) the uncorrected first step is 3.16x (not 30x); with GPT-3's
    (0.9, 0.95) it is too SMALL, 0.45x, and within 10% of 1 after a few steps. Measured by running the moments and
    torch's AdamW (_simulated_bias_ratios), and O.bias_correction_ratio (the closed form the notebook plots)
    checked against that run."""
    default, gpt3 = _simulated_bias_ratios((0.9, 0.999), 200), _simulated_bias_ratios((0.9, 0.95), 200)
    for betas, ran in (((0.9, 0.999), default), ((0.9, 0.95), gpt3)):
        assert all(math.isclose(O.bias_correction_ratio(t, betas), r, rel_tol=1e-6) for t, r in enumerate(ran, start=1))
    assert round(default[0], 2) == 3.16 and round(gpt3[0], 2) == 0.45
    settled = next(t for t in range(len(gpt3)) if all(abs(r - 1) < 0.1 for r in gpt3[t:])) + 1
    assert settled <= 10, settled


def test_adams_state_is_4_bytes_per_parameter_each_8_together(tiny):
    """05's summary: two fp32 tensors per parameter, 4 bytes each, 8 together (plus a 4-byte step counter per tensor),
    measured from torch's own AdamW state: twice the fp32 weights, not 16 bytes per parameter."""
    model = GPT(tiny().model)
    cfg = tiny()
    x = torch.randint(0, cfg.model.vocab_size, (2, 16))
    measured = O.measured_state_bytes("adamw", model, x, x)
    n, tensors = model.num_params(), len(list(model.parameters()))
    assert measured == 8 * n + 4 * tensors
    opt = torch.optim.AdamW(model.parameters())
    model(x).sum().backward()
    opt.step()
    p = next(model.parameters())
    assert {k: v.element_size() for k, v in opt.state[p].items() if v.numel() == p.numel()} == {
        "exp_avg": 4,
        "exp_avg_sq": 4,
    }


@pytest.mark.parametrize(
    "hand, ref",
    [
        (lambda g: O.HandAdagrad(g), lambda g: torch.optim.Adagrad(g, foreach=False)),
        (lambda g: O.HandRMSprop(g), lambda g: torch.optim.RMSprop(g, foreach=False)),
    ],
    ids=["adagrad", "rmsprop"],
)
def test_hand_adagrad_and_rmsprop_at_torchs_defaults(hand, ref, tiny):
    """05's AdaGrad and RMSProp cell checked the non-default options in front of the learner; torch's defaults here."""
    assert O.max_difference_after_steps(hand, ref, tiny().model, steps=3, weight_decay=0.1) < 1e-10


def test_tensor_kind_finds_exactly_the_layernorm_gains(tiny):
    """number_formats.tensor_kind sorts 03's updates lost by kind and picks 05's LayerNorm gains (cell 0e8246e3): its
    "LayerNorm gains" are the weights of the model's nn.LayerNorm modules, found here by module type, not by name."""
    from course_lib.lessons.number_formats import tensor_kind

    model = GPT(tiny().model)
    by_type = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.LayerNorm)}
    by_kind = {id(p) for n, p in model.named_parameters() if tensor_kind(n, p) == "LayerNorm gains"}
    assert by_type and by_kind == by_type
    assert all(tensor_kind(n, p) == "matrices, embeddings" for n, p in model.named_parameters() if p.dim() >= 2)
