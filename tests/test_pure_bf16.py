"""course_lib.lessons.pure_bf16: lost bf16 updates, stochastic rounding, Kahan-compensated updates (tiny, CPU).

bf16 arithmetic is the same on every CPU (emulated where there are no bf16 instructions), so these hold anywhere."""

from dataclasses import replace

import pytest
import torch

from course_lib.lessons import optimizers_by_hand, pure_bf16 as L

BF16 = torch.bfloat16


def test_the_lost_update_counter_on_a_hand_made_case():
    # around 1.0 the bf16 gap is 2^-7 above (2^-8 below): an update under half of it rounds back to 1.0
    w = torch.ones(4, dtype=BF16)
    update = torch.tensor([1e-4, 1e-2, -1e-3, 0.0])  # lost, kept, lost (2^-9 ~ 2e-3 below 1), zero: not an update
    applied = L.apply_update_(w, update, "nearest")
    assert L.lost_updates(update, applied).tolist() == [True, False, True, False]
    assert w.tolist() == [1.0, 1.0078125, 1.0, 1.0]  # 1 + 1e-2 rounds to the next bf16 value, 1 + 2^-7
    # the same updates on fp32 weights are all applied
    w32 = torch.ones(4)
    assert not L.lost_updates(update.double(), L.apply_update_(w32, update.double(), "nearest")).any()


def _gap(value: float) -> float:
    """The distance between the two bf16 values around `value`."""
    x = torch.tensor(abs(value)).to(BF16)
    return float(torch.nextafter(x, torch.tensor(float("inf"), dtype=BF16)).float() - x.float())


def test_stochastic_rounding_is_unbiased():
    gen = torch.Generator().manual_seed(0)
    n = 200_000
    for value in (1.001, -1.001, 0.0203, 3.0e-5):
        x = torch.full((n,), value)
        sr = L.stochastic_round(x, gen).double()
        gap = _gap(value)
        assert sr.unique().numel() == 2 and float((sr - value).abs().max()) < gap  # one of the two neighbours
        # the mean of n roundings is within 5 standard errors (each is off by at most one gap) of the fp32 value
        assert abs(float(sr.mean()) - value) < 5 * gap / n**0.5, value
        assert abs(float(x[0].to(BF16)) - value) > 20 * gap / n**0.5  # while rounding to nearest is biased by far more
    exact = torch.tensor([1.0, -2.0, 0.5])  # a value bf16 holds exactly is never moved
    assert torch.equal(L.stochastic_round(exact, gen).float(), exact)


def test_kahan_recovers_the_sum_of_many_tiny_updates():
    # 1000 updates of about 1e-4 each (each under half of bf16's gap at 1.0, 2^-8): rounded to nearest, every one is
    # lost; with the compensation buffer their sum arrives, to within 1% (the buffer is bf16 too: 8 significant bits)
    updates = torch.empty(1000).uniform_(0.5e-4, 1.5e-4, generator=torch.Generator().manual_seed(0))
    plain, w, comp = torch.ones(1, dtype=BF16), torch.ones(1, dtype=BF16), torch.zeros(1, dtype=BF16)
    for u in updates:
        L.apply_update_(plain, u.reshape(1), "nearest")
        L.kahan_add_(w, u.reshape(1), comp)
    total = float(updates.double().sum())
    assert float(plain) == 1.0
    assert abs(float(w.double() + comp.double()) - (1 + total)) < 0.01 * total
    assert abs(float(w) - (1 + total)) <= _gap(1 + total)  # the weight itself is a bf16 value next to the sum


def test_low_precision_adamw_is_adamw(tiny):
    # on fp64 weights (computed and stored in fp64) it is exactly AdamW, the rule of optimizers_by_hand.adamw_update
    diff = optimizers_by_hand.max_difference_after_steps(
        lambda g: L.LowPrecisionAdamW(g, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1),
        lambda g: torch.optim.AdamW(g, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=False),
        tiny().model,
        steps=2,
        weight_decay=0.1,
    )
    assert diff < 1e-10
    with pytest.raises(ValueError):
        L.LowPrecisionAdamW([torch.nn.Parameter(torch.zeros(1))], rounding="up")


def test_pure_bf16_loses_updates_and_kahan_keeps_them(splits, tiny):
    # a short run of the tiny GPT under bf16 autocast: the weights stored in bf16 lose a share of their updates every
    # step (the LayerNorm gains at 1.0 all of theirs); with the compensation buffer almost none is lost
    cfg = tiny(precision="bf16", steps=6, timing_warmup=1, measure_memory=False, weight_decay=0.1)
    runs = {
        (w, r): L.train(cfg, r, w, splits=splits)
        for w, r in ((torch.float32, "nearest"), (BF16, "nearest"), (BF16, "stochastic"), (BF16, "kahan"))
    }
    master, pure, sr, kahan = (r.details for r in runs.values())
    assert max(master["lost"]) < 1e-4  # fp32 master weights lose only updates below ~2^-25 of the weight: rare
    assert min(pure["lost"][1:]) > 0.003  # pure bf16 loses a nonzero share every step (its LayerNorm gains are 0.1%)
    assert max(kahan["lost"]) < min(pure["lost"][1:]) / 10
    assert all(abs(k - 1) < 1e-3 for k in kahan["kept"])
    assert all(abs(k - 1) < 0.05 for k in sr["kept"])  # unbiased: the update lands on average
    # bytes per parameter, measured from the tensors: 4+4+8 with fp32 master weights, 2+2+4 pure, +2 for Kahan
    assert [round(d["bytes_per_parameter"]["total"], 6) for d in (master, pure, sr, kahan)] == [16, 8, 8, 10]
    # every run started from the same weights and batches (the bf16 ones rounded): the same first loss to bf16's
    # precision
    first = [r.losses[0] for r in runs.values()]
    assert max(first) - min(first) < 0.01 * first[0]


def _adamw_like_updates(n: int, steps: int, gen: torch.Generator, lr: float = 1e-4) -> list[torch.Tensor]:
    """AdamW-sized updates (|u| <= lr): a steady pull per weight plus noise, as late in a schedule."""
    pull = torch.rand(n, generator=gen) * 2 - 1
    return [-lr * (pull + 0.5 * torch.randn(n, generator=gen)).clamp(-1, 1) for _ in range(steps)]


def test_replay_rounding_to_nearest_loses_what_stochastic_rounding_and_kahan_restore():
    # the same updates for every scheme: a remedy that did nothing would lose as much as rounding to nearest
    gen = torch.Generator().manual_seed(0)
    for w, nearest_loses in ((torch.ones(2048), 0.99), (0.02 * torch.randn(2048, generator=gen), 0.05)):
        r = L.replay(w, _adamw_like_updates(w.numel(), 400, gen))
        assert r["fp32 (master weights)"] == {"lost": 0.0, "rms_error": 0.0, "never_moved": 0.0}  # the reference itself
        assert r["bf16, nearest"]["lost"] > nearest_loses, r
        assert abs(r["bf16, stochastic"]["lost"]) < 0.05 and abs(r["bf16, kahan"]["lost"]) < 0.02, r
        assert r["bf16, kahan"]["rms_error"] < r["bf16, nearest"]["rms_error"] / 5, r
    # the gains at 1.0 never move under rounding to nearest; every scheme starts from the same bf16 values
    gains = L.replay(torch.ones(256), _adamw_like_updates(256, 50, gen), roundings=("nearest",))
    assert gains["bf16, nearest"]["never_moved"] == 1.0 and set(gains) == {"fp32 (master weights)", "bf16, nearest"}


def test_a_run_logs_the_updates_lost_for_good(splits, tiny):
    # late in a schedule (lr 1e-4) rounding to nearest loses a share of the run's updates; the remedies lose almost
    # none. The running sums behind it are not optimizer state: the bytes per parameter stay 8 (test above).
    cfg = tiny(precision="bf16", steps=6, timing_warmup=1, measure_memory=False, lr=1e-4, weight_decay=0.1)
    lost = {r: L.update_lost(L.train(cfg, r, BF16, splits=splits)) for r in L.ROUNDINGS}
    assert (
        lost["nearest"] > 0.004
        and abs(lost["stochastic"]) < lost["nearest"] / 4
        and abs(lost["kahan"]) < lost["nearest"] / 100
    ), lost
    # fp32 master weights (fp64 arithmetic)
    assert L.update_lost(L.train(cfg, "nearest", torch.float32, splits=splits)) < 1e-6


def test_notebook_03s_panel_runner_shows_op_dtypes_loss_scaling_and_pure_bf16(tiny):
    import matplotlib

    from course_lib.config import ConfigError
    from course_lib.lessons import number_formats as P
    from course_lib.plots import new_figure

    cfg = tiny(batch_size=2, context=32, steps=3, timing_warmup=1, measure_memory=False, lr=1e-4)
    mixed = P.panel_runner(replace(cfg, precision="bf16"), "mixed")
    pure = P.panel_runner(replace(cfg, precision="bf16"), "pure", weights="pure bf16, stochastic rounding")
    fp16 = P.panel_runner(replace(cfg, precision="fp16", loss_scale_init=2.0**30), "fp16")
    assert (
        mixed.details["op_dtypes"]["matmuls (addmm, mm)"] == "bf16"
        and mixed.details["op_dtypes"]["layer norm"] == "fp32"
    )
    # no fp32 left but the loss
    assert pure.details["op_dtypes"]["layer norm"] == pure.details["op_dtypes"]["weights"] == "bf16"
    assert pure.details["op_dtypes"]["loss (log_softmax)"] == "fp32"
    assert "of the updates lost" in pure.reason and "lost_so_far" in pure.details and "lost_so_far" not in mixed.details
    assert (
        fp16.details["underflow"]["scale"] == 2.0**30
        and "steps skipped" in fp16.reason
        and fp16.skipped_optimizer_steps >= 1
    )
    with pytest.raises(ConfigError, match="set precision to bf16"):
        P.panel_runner(replace(cfg, precision="fp16"), "x", weights="pure bf16, nearest")
    for results in ([], [mixed, pure, fp16]):  # every plot draws something, with runs and without
        fig = new_figure((12, 3))
        for ax, plot in zip(fig.subplots(1, 3), (P.plot_op_dtypes, P.plot_scaler_trace, L.plot_update_lost)):
            plot(results, ax)
            assert ax.has_data() or ax.texts, plot.__name__
        assert isinstance(fig, matplotlib.figure.Figure)


def test_the_panel_runner_asks_the_device_first(monkeypatch, tiny):
    # a precision this device cannot run (bf16 on a V100, say) is a ConfigError with the device's reason, before any op
    # runs
    from course_lib import capabilities as K
    from course_lib.config import ConfigError
    from course_lib.lessons import number_formats as P

    real = K._precisions
    monkeypatch.setattr(
        K, "_precisions", lambda dev, cpu: {**real(dev, cpu), "bf16": K.Support(False, "no bf16 tensor cores here")}
    )
    K.capabilities.cache_clear()
    try:
        with pytest.raises(ConfigError, match="no bf16 tensor cores here"):
            P.panel_runner(tiny(precision="bf16", steps=2), "x", weights="pure bf16, nearest")
    finally:
        K.capabilities.cache_clear()
