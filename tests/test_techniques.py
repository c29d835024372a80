import contextlib
import dataclasses

import pytest
import torch

from course_lib import config as C, techniques as T
from course_lib.techniques.lr_schedule import wsd_lr


def loss_and_grads(model, loss_module, x, y):
    model.zero_grad()
    loss = loss_module(x, y)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]  # same order with or without wrappers


def test_param_groups_decay_only_matrices_and_embeddings(tiny_model):
    m = tiny_model()
    groups = T.param_groups(m, weight_decay=0.1)
    assert isinstance(groups, list) and all(isinstance(g, dict) for g in groups)
    decay, no_decay = groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(m.parameters()))  # the tied weight once


def test_warmup_cosine_matches_torch_schedulers_at_every_step():
    cfg = C.TrainConfig(lr=1e-3, steps=50, lr_warmup_steps=5, schedule="cosine", min_lr_ratio=0.1)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=cfg.lr)
    ref = torch.optim.lr_scheduler.SequentialLR(
        opt,
        [
            torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / 5, end_factor=1.0, total_iters=4),
            torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.steps - 1 - 5, eta_min=1e-4),
        ],
        milestones=[5],
    )
    for step in range(cfg.steps):
        assert T.lr_at(step, cfg) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-9, abs=1e-12), step
        opt.step()
        ref.step()
    assert T.lr_at(cfg.steps - 1, cfg) == pytest.approx(1e-4)


def test_scaler_only_for_fp16_and_autocast_only_for_16_bits():
    assert T.make_grad_scaler(C.TrainConfig(precision="fp16")).is_enabled()
    assert not T.make_grad_scaler(C.TrainConfig(precision="bf16")).is_enabled()
    assert T.autocast_context("fp32", "cpu") is contextlib.nullcontext
    with T.autocast_context("bf16", "cpu")():
        assert (torch.randn(4, 4) @ torch.randn(4, 4)).dtype == torch.bfloat16


def test_fused_adamw_runs_one_fused_kernel_and_updates_like_the_for_loop(tiny_model):
    """What runs, not what the constructor was told: the ops one optimizer step dispatches, and the result."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    params, ops = {}, {}
    for fused in (False, True):
        m = tiny_model()
        opt = T.make_optimizer(C.TrainConfig(fused_adamw=fused, lr=1e-2), m)
        for p in m.parameters():
            p.grad = torch.full_like(p, 0.5)
        with Ops() as seen:
            opt.step()
        ops[fused], params[fused], groups = (
            seen.names,
            [p.detach().clone() for p in m.parameters()],
            len(opt.param_groups),
        )
    n_tensors = len(params[False])
    assert sum("_fused_adamw" in n for n in ops[True]) == groups  # one kernel call per group, for all its tensors
    # several ops per tensor
    assert not any("_fused_adamw" in n for n in ops[False]) and len(ops[False]) > 3 * n_tensors
    for a, b in zip(params[False], params[True]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "change", [dict(activation_checkpointing="full"), dict(activation_checkpointing="selective"), dict(loss_chunks=4)]
)
def test_memory_savers_change_nothing_in_the_math(change, tiny_model):
    """Checkpointing and the loss in slices compute the plain loop's loss and gradients, with padding among the
    targets: a padded tail, and a whole slice of the chunked loss's 4 (tokens 0-15) that is padding only."""
    from course_lib.data import IGNORE_INDEX

    x, y = torch.randint(0, 64, (2, 32)), torch.randint(0, 64, (2, 32))
    y[0, :16] = IGNORE_INDEX
    y[1, 28:] = IGNORE_INDEX
    m0 = tiny_model()
    base = T.build(C.TrainConfig(model=m0.config, context=32), m0)
    l0, g0 = loss_and_grads(m0, base.loss_module, x, y)
    m1 = tiny_model()
    setup = T.build(dataclasses.replace(C.TrainConfig(model=m1.config, context=32), **change), m1)
    l1, g1 = loss_and_grads(m1, setup.loss_module, x, y)
    torch.testing.assert_close(l0, l1)
    assert len(g1) == len(g0)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_the_chunked_loss_recomputes_nothing_counted_by_flop_counter_mode(tiny_model):
    """The loss in slices makes each slice's gradients in forward: the step's FLOPs are the plain loss's, to the FLOP
    (torch's FlopCounterMode, whose module tracker also follows the output layer called inside the slices), with the
    padding's targets (IGNORE_INDEX) and a last slice shorter than the others."""
    from torch.utils.flop_counter import FlopCounterMode

    x, y = torch.randint(0, 64, (3, 31)), torch.randint(0, 64, (3, 31))
    y[0, :5] = -100
    flops = {}
    for chunks in (1, 4):
        m = tiny_model()
        setup = T.build(C.TrainConfig(model=m.config, context=31, loss_chunks=chunks), m)
        counter = FlopCounterMode(display=False)
        with counter:
            setup.loss_module(x, y).backward()
        flops[chunks] = counter.get_total_flops()
    assert flops[4] == flops[1] > 0


@pytest.mark.parametrize("schedule, warmup", [("wsd", 2), ("inverse_sqrt", 3), ("constant", 0)])
def test_every_schedule_the_config_offers_runs_in_the_loop(schedule, warmup, splits, tiny):
    """The loop logs, step by step, the schedule's curve from its plain function (shapes checked in
    test_optimizers_by_hand)."""
    from course_lib.train import train

    cfg = C.TrainConfig(
        model=tiny().model,
        context=32,
        batch_size=2,
        steps=10,
        timing_warmup=1,
        measure_memory=False,
        schedule=schedule,
        lr_warmup_steps=warmup,
        min_lr_ratio=0.0,
    )
    r = train(cfg, schedule, splits=splits)
    expected = {
        "wsd": [wsd_lr(s, cfg.lr, warmup, 10, min_lr_ratio=0.0) for s in range(10)],
        "inverse_sqrt": [cfg.lr * min((s + 1) / 3, (3 / (s + 1)) ** 0.5) for s in range(10)],
        "constant": [cfg.lr] * 10,
    }[schedule]
    assert r.lrs == pytest.approx(expected, rel=1e-9)
    if schedule == "wsd":
        assert r.lrs[-1] == 0.0 and r.lrs[5] == cfg.lr  # flat, then cooled down to min_lr_ratio * lr


def test_inverse_sqrt_without_warmup_is_refused_with_the_fix():
    with pytest.raises(C.ConfigError, match="set lr_warmup_steps >= 1"):
        C.TrainConfig(schedule="inverse_sqrt", lr_warmup_steps=0)


def _grads_of(model, x, y):
    model.zero_grad()
    T.loss_sum(model(x), y).backward()
    return [p for p in model.parameters() if p.grad is not None]


def _sgd_step_of(m, x, y, clip_norm, clip_kind):
    """The step train_step takes with plain SGD at lr 1 (the loss summed, not divided): the gradient as clipped."""
    from course_lib.train import train_step

    cfg = C.TrainConfig(model=m.config, context=32, clip_norm=clip_norm, clip_kind=clip_kind, optimizer="sgd", lr=1)
    params = list(m.parameters())
    before = [p.detach().clone() for p in params]
    train_step(T.build(cfg, m), cfg, params, [(x, y)], n_targets=1)
    return [b - p.detach() for b, p in zip(before, params)]


@pytest.mark.parametrize("kind", C.CLIP_KINDS)
def test_the_loops_clipping_is_the_rule_of_its_kind(kind, tiny_model):
    """The step clips at clip_norm globally (one factor, as course_lib.lessons.optimizers_by_hand writes it) or per
    tensor (each its own, the rule written out here)."""
    from course_lib.lessons import optimizers_by_hand as O

    x, y = torch.randint(0, 64, (2, 32)), torch.randint(0, 64, (2, 32))
    m, ref = tiny_model(), tiny_model()
    ref_params = _grads_of(ref, x, y)
    steps = _sgd_step_of(m, x, y, 0.05, kind)
    assert len(steps) == len(ref_params)
    if kind == "global":
        O.clip_global_(ref_params, 0.05)
    else:  # each gradient times min(1, max_norm / (||g_i|| + 1e-6)), tensor by tensor
        for p in ref_params:
            p.grad.mul_(min(1.0, 0.05 / (float(p.grad.norm()) + 1e-6)))
    for step, b in zip(steps, ref_params):
        torch.testing.assert_close(step, b.grad, rtol=1e-4, atol=1e-7)
    norms = [float(s.norm()) for s in steps]
    total = sum(n * n for n in norms) ** 0.5
    if kind == "per_tensor":
        assert max(norms) <= 0.05 + 1e-6 and total > 0.05 * 1.5  # each capped, not the whole
    else:
        assert total == pytest.approx(0.05, rel=1e-4)


def test_clipping_off_is_a_no_op_and_a_bad_kind_is_refused(tiny_model):
    x, y = torch.randint(0, 64, (2, 32)), torch.randint(0, 64, (2, 32))
    m, ref = tiny_model(), tiny_model()
    ref_params = _grads_of(ref, x, y)
    steps = _sgd_step_of(m, x, y, None, "per_tensor")  # clip_norm=None: off, whatever the kind
    for step, b in zip(steps, ref_params):
        torch.testing.assert_close(step, b.grad, rtol=1e-4, atol=1e-7)
    with pytest.raises(C.ConfigError, match="clip_kind='layerwise' is not one of 'global', 'per_tensor'"):
        C.TrainConfig(clip_kind="layerwise")


def test_per_tensor_clipping_in_the_loop_changes_the_run_not_the_logged_norm(splits, tiny):
    """The same run clipped globally and per tensor: the first step's logged norm (before clipping) is the same, the
    weights after it are not; without a threshold the kind changes nothing."""
    from course_lib.train import train

    cfg = C.TrainConfig(
        model=tiny().model,
        context=32,
        batch_size=2,
        steps=4,
        timing_warmup=1,
        measure_memory=False,
        clip_norm=0.1,
    )
    runs = {kind: train(dataclasses.replace(cfg, clip_kind=kind), kind, splits=splits) for kind in C.CLIP_KINDS}
    assert runs["global"].grad_norms[0] == pytest.approx(runs["per_tensor"].grad_norms[0], rel=1e-6)
    assert runs["global"].losses[1:] != pytest.approx(runs["per_tensor"].losses[1:], rel=1e-6)
    off = {
        kind: train(dataclasses.replace(cfg, clip_norm=None, clip_kind=kind), kind, splits=splits)
        for kind in C.CLIP_KINDS
    }
    assert off["global"].losses == off["per_tensor"].losses
