"""course_lib.lessons.number_formats: the formats, autocast's dtypes, fp16 underflow and loss scaling, accuracy vs
fp64."""

import dataclasses
import math
import time

import pytest
import torch

from course_lib.config import ConfigError, TrainConfig, tiny_preset
from course_lib.lessons import number_formats as P
from course_lib.train import run

HAS_AMPERE = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8


def small(**changes) -> TrainConfig:
    """tiny preset, smaller still: a step takes milliseconds (fp16 on a CPU is slow: keep the logits small)."""
    return dataclasses.replace(tiny_preset("cpu"), batch_size=2, context=32, measure_memory=False, **changes)


# ---- formats -------------------------------------------------------------------------------------


def test_format_bits_and_limits():
    f = {x.name: x for x in P.formats()}
    assert (f["fp32"].exponent_bits, f["fp32"].mantissa_bits) == (8, 23)
    assert (f["bf16"].exponent_bits, f["bf16"].mantissa_bits) == (8, 7)
    assert (f["fp16"].exponent_bits, f["fp16"].mantissa_bits) == (5, 10)
    assert (f["tf32"].exponent_bits, f["tf32"].mantissa_bits, f["tf32"].bits) == (8, 10, 19)
    assert (
        f["fp16"].max == 65504.0 and f["fp16"].smallest_subnormal == 2.0**-24 and f["fp16"].smallest_normal == 2.0**-14
    )
    assert f["bf16"].smallest_normal == f["fp32"].smallest_normal == 2.0**-126  # same exponent range
    assert f["tf32"].max == pytest.approx(f["fp32"].max, rel=1e-3)
    if hasattr(torch, "float8_e4m3fn"):
        assert f["fp8 e4m3"].max == 448.0 and f["fp8 e5m2"].max == 57344.0


@pytest.mark.parametrize("name", ["bf16", "fp16", "fp8 e4m3", "fp8 e5m2"])
def test_binade_counts_match_enumeration(name):
    fmt = {x.name: x for x in P.formats()}.get(name)
    if fmt is None:
        pytest.skip(f"this torch has no {name}")
    values = P.representable_values(fmt.dtype)
    counted = P.values_per_binade(fmt)
    assert sum(counted.values()) == values.numel()
    assert values.min().item() == fmt.smallest_subnormal and values.max().item() == fmt.max
    bins = torch.floor(torch.log2(values)).long()
    for e, n in counted.items():
        assert (bins == e).sum().item() == n, e


def test_smallest_subnormal_really_is_the_smallest():
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        fmt = P.from_finfo("x", dtype)
        assert torch.tensor(fmt.smallest_subnormal, dtype=torch.float64).to(dtype).item() == fmt.smallest_subnormal
        # the tie goes to even: zero
        assert torch.tensor(fmt.smallest_subnormal / 2, dtype=torch.float64).to(dtype).item() == 0.0


def test_round_to_tf32():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    r = P.round_to_tf32(x)
    assert r.dtype == torch.float32
    assert ((r.view(torch.int32) & 0x1FFF) == 0).all()  # only 10 mantissa bits left
    assert ((r - x).abs() / x.abs()).max().item() <= 2.0**-11  # unit roundoff of 10 mantissa bits
    assert torch.equal(P.round_to_tf32(r), r)  # representable values stay
    one_and_half_ulp = torch.tensor([1 + 2.0**-11, 1 + 3 * 2.0**-11])  # ties: to even
    assert P.round_to_tf32(one_and_half_ulp).tolist() == [1.0, 1 + 2 * 2.0**-10]
    assert torch.isinf(P.round_to_tf32(torch.tensor([float("inf")]))).all()


# ---- underflow -----------------------------------------------------------------------------------


def test_fp16_flushes_what_bf16_keeps():
    v = torch.tensor([2.0**-26, 2.0**-20, 1e-3, 2.0**-30], dtype=torch.float64)
    assert P.flush_fraction(v, torch.float16) == 0.5
    assert P.flush_fraction(v, torch.bfloat16) == 0.0
    c = P.magnitude_classes(v, torch.float16)
    assert c == {"zero": 0.5, "subnormal": 0.25, "normal": 0.25, "overflow": 0.0}
    assert P.magnitude_classes(torch.tensor([1e5]), torch.float16)["overflow"] == 1.0


def test_real_gradients_underflow_in_fp16_and_scaling_fixes_it():
    cfg = small()
    g32 = P.gradient_sample(cfg, "fp32")
    # most activation gradients of a real step lie below fp16's smallest normal number
    assert P.magnitude_classes(g32.activations, torch.float16)["normal"] < 0.5
    g16 = P.gradient_sample(cfg, "fp16")
    g16s = P.gradient_sample(cfg, "fp16", loss_scale=2.0**16)
    gbf = P.gradient_sample(cfg, "bf16")
    assert g16.activation_dtype == "fp16" and gbf.activation_dtype == "bf16"
    lost, lost_scaled = (
        P.lost_to_zero(g32.activations, g16.activations),
        P.lost_to_zero(g32.activations, g16s.activations),
    )
    assert lost > 0.0  # unscaled fp16 loses gradients to zero...
    assert lost_scaled < lost / 10  # ...scaling by 2^16 brings (nearly) all of them back
    assert P.flush_fraction(g32.activations, torch.bfloat16) == 0.0  # bf16 has fp32's range: nothing is below it
    assert P.lost_to_zero(g32.activations, gbf.activations) < lost / 10  # (an exact zero can still come from rounding)
    # The failure is fp16's range, whatever the kernels: the real fp16 step flushes at least about the share of
    # gradients that lie below fp16's rounding-to-zero threshold in the fp32 step (more where a CPU's fp16 kernels
    # flush subnormals too), and shifted 16 binades up none of them is that small any more.
    predicted = P.flush_fraction(g32.activations, torch.float16)
    assert predicted > 0 and P.flush_fraction(g32.activations * 2.0**16, torch.float16) == 0.0
    assert lost > predicted / 2, (lost, predicted)
    # The weight gradients too: unscaled fp16 flushes some to zero that fp32 has nonzero, scaling brings them back.
    # (Not the end-to-end error: how much the surviving gradients' rounding moves it depends on the CPU's fp16
    # kernels, e.g. AMX-FP16 or AVX512-FP16 against a software path, and can go either way by a hair.)
    lost_w, lost_w_scaled = (
        P.lost_to_zero(g32.parameters, g16.parameters),
        P.lost_to_zero(g32.parameters, g16s.parameters),
    )
    assert lost_w > 0 and lost_w_scaled < lost_w / 10, (lost_w, lost_w_scaled)


# ---- autocast ------------------------------------------------------------------------------------


def test_autocast_dtypes_in_a_real_forward_pass():
    cfg = small()
    model = P.fresh_model(cfg)
    x, y = P._batch(cfg, 0)
    recs = P.record_dtypes(model, x, y, "bf16")
    assert P.output_dtypes(recs, "addmm", "forward") == {"bf16"}  # Linear layers: 16-bit matmuls
    assert P.output_dtypes(recs, "mm", "forward") == {"bf16"}  # the output layer
    assert P.output_dtypes(recs, "native_layer_norm", "forward") == {"fp32"}
    assert P.output_dtypes(recs, "_log_softmax", "loss") == {"fp32"}  # the loss in fp32
    assert "bf16" in P.output_dtypes(recs, "mm", "backward")  # backward follows forward's dtypes without autocast
    # fp32 master weights
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    rows = P.summarize_ops(recs)
    assert {"phase", "module", "op", "inputs", "output", "count"} == set(rows[0])
    fp32 = P.record_dtypes(P.fresh_model(cfg), x, y, "fp32")
    assert {r.output for r in fp32} == {"fp32"}


# ---- accuracy ------------------------------------------------------------------------------------


def test_matmul_errors_follow_the_mantissa():
    err = P.matmul_errors(96)
    f = {x.name: x for x in P.formats(include_fp8=False)}
    assert err["fp32"] < 1e-5
    assert err["fp32"] < err["fp16"] < err["bf16"]
    for name in ("bf16", "fp16"):
        assert f[name].eps / 40 < err[name] < f[name].eps, (name, err[name])
    assert f["tf32"].eps / 40 < err["tf32 (emulated)"] < f["tf32"].eps


def test_one_step_errors_against_fp64():
    errs = {(e.precision, e.loss_scale): e for e in P.one_step_errors(small())}
    assert errs[("fp32", 1.0)].grad_rel_error < 1e-5
    assert errs[("bf16", 1.0)].grad_rel_error < 0.05 and errs[("fp16", 65536.0)].grad_rel_error < 0.01
    assert (
        errs[("fp32", 1.0)].grad_rel_error < errs[("fp16", 65536.0)].grad_rel_error < errs[("bf16", 1.0)].grad_rel_error
    )


# ---- training runs: tolerance and the scaler ------------------------------------------------------


def test_each_precision_tracks_fp32_within_tolerance():
    base = small(steps=3, timing_warmup=1)
    losses = {p: run(dataclasses.replace(base, precision=p)).losses for p in ("fp32", "tf32", "bf16", "fp16")}
    assert losses["tf32"] == losses["fp32"]  # TF32 is a CUDA mode: on a CPU it changes nothing, bit for bit
    for p in ("bf16", "fp16"):
        for a, b in zip(losses[p], losses["fp32"]):
            assert abs(a - b) / b < 0.01, (p, a, b)  # stated tolerance: 1% of the fp32 loss per step


def test_grad_scaler_skips_overflowing_steps_and_backs_off():
    r = run(small(precision="fp16", steps=3, timing_warmup=1, loss_scale_init=2.0**32, loss_scale_growth_interval=1000))
    assert r.skipped_optimizer_steps >= 1
    assert not math.isfinite(r.grad_norms[0])  # the step was skipped because its gradients overflowed
    assert r.loss_scales[1] == r.loss_scales[0] / 2  # and the scale halved
    ok = run(small(precision="fp16", steps=4, timing_warmup=1))  # torch's default scale: nothing skipped here
    assert ok.skipped_optimizer_steps == 0 and ok.loss_scales == [65536.0] * 4
    assert all(math.isfinite(g) for g in ok.grad_norms)
    assert run(small(steps=3, timing_warmup=1, precision="bf16")).loss_scales == []  # bf16: no scaler


def test_loss_scale_fields_are_checked():
    with pytest.raises(ConfigError):
        small(loss_scale_init=0.0)
    with pytest.raises(ConfigError):
        small(loss_scale_growth_interval=0)


# ---- speed ---------------------------------------------------------------------------------------


def test_matmul_tflops_on_cpu_and_tf32_refused():
    tf, why = P.matmul_tflops(64, "tf32", "cpu")
    assert tf is None and "CUDA" in why
    n = 64
    t0 = time.perf_counter()
    v, _ = P.matmul_tflops(n, "fp32", "cpu", min_time_s=0.01)
    wall = time.perf_counter() - t0
    # The rate is real time in seconds: the call ran a warm-up and at least two timed matmuls inside `wall`, so the
    # median matmul took at most wall / 2; and no 64 x 64 matmul finishes in under 0.1 us (dispatch alone costs more).
    assert 2 * n**3 / (wall / 2) / 1e12 <= v <= 2 * n**3 / 1e-7 / 1e12, (v, wall)


@pytest.mark.skipif(not HAS_AMPERE, reason="TF32 tensor cores need a CUDA GPU of compute capability 8.0+ (none here)")
def test_tf32_on_cuda_changes_the_matmul():
    err = P.matmul_errors(256, device="cuda")
    assert err["fp32"] < err["tf32 (tensor cores)"] < 2.0**-10
    v, _ = P.matmul_tflops(2048, "tf32", "cuda")
    assert v is not None and v > 0


@pytest.mark.skipif(not HAS_AMPERE, reason="TF32 tensor cores need a CUDA GPU of compute capability 8.0+ (none here)")
def test_tf32_with_compile_trains_on_cuda(tiny):
    """The loop sets TF32 through torch's fp32_precision API; inside it, code that reads the legacy flags
    (allow_tf32, get_float32_matmul_precision) raises. torch.compile's code generation must not be such code."""
    from course_lib.train import train

    r = train(
        dataclasses.replace(tiny(device="cuda"), precision="tf32", compile=True, steps=3, measure_memory=False),
        "tf32 + compile",
    )
    assert r.ok and all(math.isfinite(x) for x in r.losses), r.losses


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_the_loss_is_computed_in_fp32_whatever_the_logits_format(dtype):
    """The course's loss casts 16-bit logits up (on CUDA, autocast leaves F.cross_entropy's log-softmax in the logits'
    format): its sum is fp32 and equals the loss of those same logits computed in fp64 within fp32's rounding, where
    F.cross_entropy on the 16-bit logits themselves returns a 16-bit number, off by far more (or inf past 65504)."""
    from course_lib.techniques import loss_sum

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 2048, 97, generator=gen).to(dtype)  # 16,384 tokens
    targets = torch.randint(0, 97, (8, 2048), generator=gen)
    ours = loss_sum(logits, targets)
    x = logits.double().flatten(0, 1)
    exact = (x.logsumexp(-1) - x.gather(1, targets.flatten()[:, None]).squeeze(1)).sum().item()
    assert ours.dtype == torch.float32 and abs(ours.item() - exact) <= 1e-5 * exact
    native = torch.nn.functional.cross_entropy(x.to(dtype), targets.flatten(), reduction="sum")
    assert native.dtype == dtype and not abs(native.item() - exact) <= 1e-5 * exact


def test_the_loss_keeps_fp64_logits_in_fp64():
    """The cast goes up only: an fp64 reference step (notebook 03's errors against fp64) computes its loss in fp64."""
    from course_lib.techniques import loss_sum

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 64, 97, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, 97, (4, 64), generator=gen)
    ours = loss_sum(logits, targets)
    exact = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    assert ours.dtype == torch.float64 and ours.item() == exact.item()
