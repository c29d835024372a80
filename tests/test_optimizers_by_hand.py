"""course_lib.lessons.optimizers_by_hand: hand-written AdamW, schedules, clipping, state bytes, weight-decay groups
(tiny, CPU)."""

import math
from dataclasses import replace

import pytest
import torch

from course_lib import techniques
from course_lib.config import tiny_preset
from course_lib.data import load_splits, random_windows
from course_lib.lessons import optimizers_by_hand as O
from course_lib.model import GPT
from course_lib.train import train


def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return GPT(tiny_preset("cpu").model).to(dtype)


def _batch(cfg, seed=0):
    return random_windows(load_splits().train, cfg.batch_size, cfg.context, torch.Generator().manual_seed(seed))


# ---- AdamW ----


@pytest.mark.parametrize(
    "betas,eps,wd", [((0.9, 0.95), 1e-8, 0.1), ((0.9, 0.999), 1e-8, 0.0), ((0.8, 0.99), 1e-4, 0.01)]
)
def test_hand_adamw_equals_torch(betas, eps, wd, tiny):
    # float64, so that rounding cannot hide a real difference: the key bias's true gradient is exactly zero
    # (softmax ignores a constant shift), and in float32 its rounding noise is amplified by Adam's 1/sqrt(v)
    cfg = tiny()
    a, b = _model(dtype=torch.float64), _model(dtype=torch.float64)
    groups_a = techniques.param_groups(a, wd)
    groups_b = techniques.param_groups(b, wd)
    opt_a = O.HandAdamW(groups_a, lr=3e-3, betas=betas, eps=eps)
    opt_b = torch.optim.AdamW(groups_b, lr=3e-3, betas=betas, eps=eps, foreach=False)
    for step in range(3):
        x, y = _batch(replace(cfg, batch_size=2, context=32), step)
        for m, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            (techniques.loss_sum(m(x), y) / y.numel()).backward()
            opt.step()
    moved = 0.0
    for (name, pa), pb, p0 in zip(a.named_parameters(), b.parameters(), _model(dtype=torch.float64).parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-9, atol=1e-12, msg=name)
        moved = max(moved, float((pa - p0).detach().abs().max()))
    assert moved > 1e-3  # the parameters really moved


def test_adamw_update_is_decoupled_weight_decay():
    # zero gradient: only the decay acts, theta <- theta (1 - lr wd), whatever the moments
    p = torch.ones(3)
    m, v = torch.zeros(3), torch.zeros(3)
    O.adamw_update(p, torch.zeros(3), m, v, t=1, lr=0.1, weight_decay=0.5)
    torch.testing.assert_close(p, torch.full((3,), 0.95))


def test_first_adam_step_is_lr_sized_for_any_gradient_scale():
    # bias correction makes the first update lr * g / (|g| + eps): about lr per coordinate
    for scale in (1e-4, 1.0, 1e4):
        p = torch.zeros(4)
        O.adamw_update(p, torch.tensor([1.0, -2.0, 3.0, -4.0]) * scale, torch.zeros(4), torch.zeros(4), t=1, lr=0.01)
        torch.testing.assert_close(p.abs(), torch.full((4,), 0.01), rtol=1e-3, atol=0)


def test_bias_correction_ratio_closed_form_equals_the_update_rule():
    # constant gradient: without correction the step is (1 - b1^t)/sqrt(1 - b2^t) times the corrected one, which
    # is lr; with betas (0.9, 0.999) 3.16x at the first step (not sqrt(1000) = 31.6x), at most 6.57x, at step 12
    betas, lr, steps = (0.9, 0.999), 1e-3, 3000
    on = O.adam_step_sizes([1.0] * steps, lr, betas)  # |g| = 1: eps = 1e-8 moves the ratio by < 1e-6
    off = O.adam_step_sizes([1.0] * steps, lr, betas, bias_correction=False)
    closed = [O.bias_correction_ratio(t, betas) for t in range(1, steps + 1)]
    assert all(math.isclose(a / b, c, rel_tol=1e-6) for a, b, c in zip(off, on, closed))
    assert all(math.isclose(a, lr, rel_tol=1e-6) for a in on)
    assert math.isclose(closed[0], 0.1 / math.sqrt(0.001)) and 3.1 < closed[0] < 3.2
    peak = max(range(steps), key=closed.__getitem__)
    assert peak + 1 == 12 and 6.5 < closed[peak] < 6.6
    # the corrected rule is torch's AdamW, step by step
    g = [torch.full((1,), 1.0, dtype=torch.float64)] * 50
    ref = O.step_updates(lambda ps: torch.optim.AdamW(ps, lr=lr, betas=betas, eps=1e-8, weight_decay=0.0), g)
    assert all(math.isclose(abs(float(u)), a, rel_tol=1e-9) for u, a in zip(ref, on))


def test_huge_eps_makes_adam_momentum_sgd():
    # eps >> sqrt(v_hat): AdamW's update is -(lr/eps) m_hat, SGD with momentum on the bias-corrected average of the
    # gradients. torch's SGD(momentum=b1) keeps buf = m / (1 - b1), so with lr (1 - b1) lr/eps it steps -(lr/eps) m:
    # Adam's update times (1 - b1^t)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(64, generator=gen, dtype=torch.float64) * 1e-2 for _ in range(30)]
    lr, eps, (b1, b2) = 1e-3, 1e4, (0.9, 0.95)
    adam = O.step_updates(lambda ps: torch.optim.AdamW(ps, lr=lr, betas=(b1, b2), eps=eps, weight_decay=0.0), grads)
    sgd = O.step_updates(lambda ps: torch.optim.SGD(ps, lr=lr * (1 - b1) / eps, momentum=b1), grads)
    m = torch.zeros(64, dtype=torch.float64)
    for t, (g, a, s) in enumerate(zip(grads, adam, sgd), start=1):
        m = b1 * m + (1 - b1) * g
        torch.testing.assert_close(a, -(lr / eps) * m / (1 - b1**t), rtol=1e-5, atol=0)
        torch.testing.assert_close(a * (1 - b1**t), s, rtol=1e-5, atol=0)


# ---- schedules ----


@pytest.mark.parametrize("warmup,total", [(0, 40), (1, 40), (10, 100), (5, 6), (30, 300)])
def test_cosine_equals_torch_reference_and_the_loop(warmup, total, tiny):
    lr = 6e-4
    mine = O.curve(lambda s: O.warmup_cosine_lr(s, lr, warmup, total, 0.1), total)
    ref = O.torch_scheduler_curve(lambda opt: O.torch_warmup_cosine(opt, warmup, total, 0.1), lr, total)
    cfg = tiny(lr=lr, schedule="cosine", lr_warmup_steps=warmup, steps=total, min_lr_ratio=0.1)
    loop = [techniques.lr_at(s, cfg) for s in range(total)]
    for s in range(total):
        assert mine[s] == pytest.approx(ref[s], rel=1e-9, abs=1e-15), s
        assert mine[s] == pytest.approx(loop[s], rel=1e-12), s
    if total - 1 > warmup:
        assert mine[-1] == pytest.approx(0.1 * lr)  # ends at 10% of the maximum
    assert max(mine) == pytest.approx(lr)
    if warmup:
        assert mine[0] == pytest.approx(lr / warmup)  # never exactly zero


def test_loop_records_the_schedule(tiny):
    cfg = tiny(steps=6, schedule="cosine", lr_warmup_steps=2, lr=1e-3, measure_memory=False)
    r = train(cfg)
    # against torch's own schedulers (LinearLR then CosineAnnealingLR), not against the formula the loop uses
    ref = O.torch_scheduler_curve(lambda opt: O.torch_warmup_cosine(opt, 2, 6, cfg.min_lr_ratio), 1e-3, 6)
    assert r.lrs == pytest.approx(ref, rel=1e-9)


def test_step_decay_equals_torch_steplr():
    ref = O.torch_scheduler_curve(lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5), 1e-3, 30)
    mine = O.curve(lambda s: O.step_decay_lr(s, 1e-3, 7, 0.5), 30)
    assert mine == pytest.approx(ref, rel=1e-12)


def test_inverse_sqrt_and_wsd_shapes():
    w, lr = 10, 1e-3
    inv = O.curve(lambda s: O.inverse_sqrt_lr(s, lr, w), 100)
    assert inv[w - 1] == pytest.approx(lr) and max(inv) == pytest.approx(lr)
    assert inv[99] == pytest.approx(lr * math.sqrt(w / 100))  # 1/sqrt(t) after the peak
    assert inv[39] == pytest.approx(inv[9] / 2)  # 4x the steps, half the rate
    wsd = O.curve(lambda s: O.wsd_lr(s, lr, w, 100, decay_fraction=0.2), 100)
    assert wsd[w - 1] == lr and wsd[79] == lr and wsd[80] < lr
    assert wsd[-1] == pytest.approx(0.0, abs=1e-15)
    assert all(a >= b for a, b in zip(wsd[80:], wsd[81:]))
    with pytest.raises(ValueError):
        O.inverse_sqrt_lr(0, lr, 0)


# ---- clipping ----


def _with_grads(seed=0):
    cfg = tiny_preset("cpu")
    m = _model(seed)
    x, y = _batch(cfg, seed)
    (techniques.loss_sum(m(x), y) / y.numel()).backward()
    return m


def test_global_norm_and_clipping_equal_torch():
    a, b = _with_grads(), _with_grads()
    expected = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in a.parameters()))
    assert O.global_grad_norm(a.parameters()) == pytest.approx(expected, rel=1e-9)
    max_norm = expected / 4  # make sure clipping bites
    mine = O.clip_global_(list(a.parameters()), max_norm)
    ref = torch.nn.utils.clip_grad_norm_(list(b.parameters()), max_norm)
    assert mine == pytest.approx(float(ref), rel=1e-5)  # both return the norm before clipping
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad)
    assert O.global_grad_norm(a.parameters()) == pytest.approx(max_norm, rel=1e-4)


def test_per_tensor_clipping_changes_the_direction_global_does_not():
    a, b = _with_grads(), _with_grads()
    g0 = [p.grad.clone() for p in a.parameters()]
    norm = O.global_grad_norm(a.parameters())
    O.clip_global_(list(a.parameters()), norm / 10)
    per = O.clip_per_tensor_(list(b.parameters()), norm / 10)
    assert O.cosine_similarity(g0, [p.grad for p in a.parameters()]) == pytest.approx(1.0, abs=1e-9)
    assert O.cosine_similarity(g0, [p.grad for p in b.parameters()]) < 0.999
    assert len(per) == len(g0)


def test_per_tensor_clipping_brings_each_gradient_to_at_most_the_limit_on_its_own():
    """The rule written out: each gradient g_i becomes g_i * min(1, max_norm / (||g_i|| + 1e-6)), whatever the
    others are."""
    b = _with_grads()
    before = [p.grad.clone() for p in b.parameters()]
    limit = sorted(float(g.norm()) for g in before)[len(before) // 2]  # half the tensors above it, half below
    norms = O.clip_per_tensor_(list(b.parameters()), limit)
    for g0, p, n in zip(before, b.parameters(), norms):
        assert n == pytest.approx(float(g0.norm()), rel=1e-5)
        expected = g0 * min(1.0, limit / (float(g0.norm()) + 1e-6))  # (the 1e-6 guards a zero gradient)
        torch.testing.assert_close(p.grad, expected, rtol=1e-5, atol=1e-7)


def test_loop_logs_the_global_norm_before_clipping(tiny):
    cfg = tiny(steps=2, timing_warmup=1, clip_norm=1e-3, measure_memory=False)
    x, y = _batch(cfg, 7)
    r = train(cfg, batches=lambda step: [(x, y)])
    torch.manual_seed(cfg.seed)  # the loop builds its model right after seeding
    m = GPT(cfg.model)
    (techniques.loss_sum(m(x), y) / y.numel()).backward()
    expected = O.global_grad_norm(m.parameters())
    assert r.grad_norms[0] == pytest.approx(expected, rel=1e-4)
    assert r.grad_norms[0] > 10 * cfg.clip_norm  # logged before clipping, so above the threshold


def test_adam_update_size_ignores_gradient_scale_sgd_does_not():
    m = _with_grads()
    grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad(set_to_none=True)
    adam = [
        O.update_norm(m, grads, s, lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.0)) for s in (0.01, 1, 100)
    ]
    sgd = [O.update_norm(m, grads, s, lambda ps: torch.optim.SGD(ps, lr=1e-3)) for s in (0.01, 1, 100)]
    assert max(adam) / min(adam) < 1.1
    assert sgd[2] / sgd[0] == pytest.approx(1e4, rel=1e-3)
    clipped = [O.update_norm(m, grads, s, lambda ps: torch.optim.SGD(ps, lr=1e-3), clip=1e-6) for s in (1, 100)]
    assert clipped[0] == pytest.approx(clipped[1], rel=1e-3)


# ---- optimizer state ----


@pytest.mark.parametrize("kind", ["adamw", "sgd", "sgd_momentum", "adafactor"])
def test_state_bytes_match_formula(kind, tiny):
    cfg = tiny()
    m = _model()
    x, y = _batch(cfg)
    assert O.measured_state_bytes(kind, m, x, y) == O.expected_state_bytes(kind, list(m.parameters()))


def test_state_bytes_order():
    params = list(_model().parameters())
    n = sum(p.numel() for p in params)
    b = {k: O.expected_state_bytes(k, params) for k in ("adamw", "sgd", "sgd_momentum", "adafactor")}
    assert b["sgd"] == 0 and b["sgd_momentum"] == 4 * n and b["adamw"] > 8 * n
    assert b["adafactor"] < b["sgd_momentum"]


# ---- weight-decay groups ----


def test_groups_decay_only_matrices_and_embeddings():
    m = _model()
    rows = O.describe_param_groups(m, 0.1)
    assert [r["weight_decay"] for r in rows] == [0.1, 0.0]
    decay, no_decay = rows
    assert all(".weight" in n and ("ln" not in n) for n in decay["names"])
    assert any(n.startswith("wte.weight") for n in decay["names"]) and any(
        n.startswith("wpe.weight") for n in decay["names"]
    )
    assert all(n.split()[0].endswith(".bias") or ".ln" in "." + n or n.startswith("ln_f") for n in no_decay["names"])
    assert decay["parameters"] + no_decay["parameters"] == m.num_params()  # the tied weight counted once
    assert isinstance(techniques.param_groups(m, 0.1), list)
    one = O.describe_param_groups(m, 0.1, decay_2d_only=False)
    assert len(one) == 1 and one[0]["parameters"] == m.num_params()


# ---- batch sources ----


def test_bad_batch_changes_only_its_step(tiny):
    cfg = tiny()
    splits = load_splits()
    for kind in ("repeated", "random"):
        good = O.default_batches(splits, cfg)
        bad = O.with_bad_batch(splits, cfg, bad_steps=[2], kind=kind)
        for step in range(4):
            ((xg, yg),) = good(step)
            ((xb, yb),) = bad(step)
            assert torch.equal(xg, xb)
            assert torch.equal(yg, yb) == (step != 2)
    assert int((splits.train == 0).sum()) == 0  # the repeated token (byte 0) never occurs in the text
    with pytest.raises(ValueError):
        O.with_bad_batch(splits, cfg, [1], kind="nonsense")


def test_default_batches_are_the_loops(tiny):
    cfg = tiny(steps=3, measure_memory=False)
    a = train(cfg)
    b = train(cfg, batches=O.default_batches(load_splits(), cfg))
    assert a.losses == b.losses


def test_batch_ramp(tiny):
    assert [O.ramp_batch_size(s, 2, 10, 4) for s in range(6)] == [2, 4, 6, 8, 10, 10]
    cfg = tiny(steps=3, measure_memory=False)
    src = O.ramped_batches(load_splits(), cfg, start=1, ramp_steps=3)
    assert [src(s)[0][0].shape[0] for s in range(4)] == [1, 2, 3, 4]


# ---- AdaGrad and RMSProp, from their update rules ----


@pytest.mark.parametrize(
    "hand, ref",
    [
        (
            lambda g: O.HandAdagrad(g, lr=3e-2, eps=1e-6, weight_decay=0.1, lr_decay=0.05),
            lambda g: torch.optim.Adagrad(g, lr=3e-2, eps=1e-6, weight_decay=0.1, lr_decay=0.05, foreach=False),
        ),
        (
            lambda g: O.HandRMSprop(g, lr=3e-3, alpha=0.9, eps=1e-6, weight_decay=0.1, momentum=0.9),
            lambda g: torch.optim.RMSprop(
                g, lr=3e-3, alpha=0.9, eps=1e-6, weight_decay=0.1, momentum=0.9, foreach=False
            ),
        ),
        (
            lambda g: O.HandRMSprop(g, lr=1e-3, alpha=0.95, momentum=0.5, centered=True),
            lambda g: torch.optim.RMSprop(g, lr=1e-3, alpha=0.95, momentum=0.5, centered=True, foreach=False),
        ),
    ],
    ids=["adagrad wd lr_decay", "rmsprop wd momentum", "rmsprop centered"],
)
def test_hand_adagrad_and_rmsprop_equal_torch(hand, ref, tiny):
    # float64, a few steps of the tiny GPT with weight decay on the 2-D group: every parameter equal to torch's
    # (torch's defaults are checked in notebook 05)
    diff = O.max_difference_after_steps(hand, ref, tiny().model, steps=3, weight_decay=0.05)
    assert diff < 1e-10


def test_the_comparison_sees_one_hyperparameter():
    # the check above can fail: one parameter fed the same gradients, alpha 0.99 against 0.9, differs at once
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(8, generator=gen, dtype=torch.float64) for _ in range(3)]
    a = O.step_updates(lambda ps: O.HandRMSprop(ps, lr=1e-3, alpha=0.99), grads)
    b = O.step_updates(lambda ps: torch.optim.RMSprop(ps, lr=1e-3, alpha=0.9), grads)
    assert float((a[0] - b[0]).abs().max()) > 1e-4


def test_rmsprop_is_adam_without_first_moment_and_bias_correction():
    # RMSprop(alpha) steps -lr g / (sqrt(v) + eps); Adam with beta1 = 0 divides v by (1 - alpha^t) first, so its step is
    # sqrt(1 - alpha^t) times RMSProp's (eps negligible): 10x smaller at the first step for alpha = 0.99
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(16, generator=gen, dtype=torch.float64) for _ in range(20)]
    rms = O.step_updates(lambda ps: O.HandRMSprop(ps, lr=1e-3, alpha=0.99, eps=0.0), grads)
    adam = O.step_updates(lambda ps: O.HandAdamW(ps, lr=1e-3, betas=(0.0, 0.99), eps=0.0, weight_decay=0.0), grads)
    for t, (r, a) in enumerate(zip(rms, adam), start=1):
        torch.testing.assert_close(a, r * math.sqrt(1 - 0.99**t), rtol=1e-9, atol=0)


def test_adagrad_steps_shrink_like_one_over_sqrt_t():
    # a constant gradient: s_t = t g^2, so the t-th step is lr / sqrt(t), whatever the gradient's size
    for g in (1e-3, 1.0, 1e3):
        sizes = [
            abs(float(u))
            for u in O.step_updates(
                lambda ps: O.HandAdagrad(ps, lr=0.1, eps=0.0), [torch.full((1,), g, dtype=torch.float64)] * 16
            )
        ]
        assert sizes == pytest.approx([0.1 / math.sqrt(t) for t in range(1, 17)], rel=1e-12)


@pytest.mark.parametrize("kind", ["adagrad", "rmsprop"])
def test_new_kinds_state_bytes_and_memory_model(kind, tiny):
    from course_lib import memory_formula as M

    m = _model()
    params = list(m.parameters())
    x, y = _batch(tiny())
    assert (
        O.measured_state_bytes(kind, m, x, y)
        == O.expected_state_bytes(kind, params)
        == 4 * m.num_params() + 4 * len(params)
    )
    assert M.static_bytes(m.num_params(), kind, 4, len(params))["optimizer state"] == O.expected_state_bytes(
        kind, params
    )


def test_exponential_schedule_equals_torch_exponentiallr_and_the_loop(tiny):
    lr, warmup, total = 1e-3, 5, 60
    gamma = 0.1 ** (1 / (total - 1 - warmup))  # 10% of the rate at the last step
    mine = O.curve(lambda s: O.exponential_lr(s, lr, warmup, total, 0.1), total)
    cfg = tiny(lr=lr, schedule="exponential", lr_warmup_steps=warmup, steps=total, min_lr_ratio=0.1)
    loop = [techniques.lr_at(s, cfg) for s in range(total)]
    # torch's own: LinearLR over the warmup, then ExponentialLR(gamma), chained at the end of the warmup
    ref = O.torch_scheduler_curve(
        lambda opt: torch.optim.lr_scheduler.SequentialLR(
            opt,
            [
                torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / warmup, end_factor=1.0, total_iters=warmup - 1),
                torch.optim.lr_scheduler.ExponentialLR(opt, gamma=gamma),
            ],
            milestones=[warmup],
        ),
        lr,
        total,
    )
    assert mine == pytest.approx(ref, rel=1e-9) and mine == pytest.approx(loop, rel=1e-12)
    assert mine[warmup] == pytest.approx(lr) and mine[-1] == pytest.approx(0.1 * lr)
    assert all(b / a == pytest.approx(gamma) for a, b in zip(mine[warmup:], mine[warmup + 1 :]))  # one factor per step
    # without warmup it is ExponentialLR itself
    plain = O.torch_scheduler_curve(lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9), lr, 30)
    assert O.curve(lambda s: O.exponential_lr(s, lr, 0, 30, 0.9**29), 30) == pytest.approx(plain, rel=1e-9)
