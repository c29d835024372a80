"""course_lib.capabilities: the one answer to "what can this device run, and how fast"."""

import dataclasses
import json
import shutil
import subprocess
import sys

import pytest
import torch

from course_lib import capabilities as K, config as C, techniques as T
from course_lib.ladder import ladder_configs
from course_lib.lessons.hardware import gpu_generation_rows
from course_lib.results import RunResult, table_rows


@pytest.fixture(autouse=True)
def fresh_capabilities():
    K.capabilities.cache_clear()
    yield
    K.capabilities.cache_clear()


@pytest.mark.parametrize(
    "name, key",
    [
        ("NVIDIA L40", "L40"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L4", "L4"),  # "L4" must not be found inside "L40"
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA H200 NVL", "H200 NVL"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA A10G", "A10G"),
        ("NVIDIA A10", "A10"),
        ("Tesla T4", "T4"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
    ],
)
def test_datasheet_matches_whole_names(name, key):
    assert K.datasheet_tflops(name) is K.DATASHEET_TFLOPS[key]


@pytest.mark.parametrize(
    "name", ["NVIDIA L400X", "NVIDIA A1000", "NVIDIA GeForce RTX 3060", "CPU (AMD EPYC, 2 threads)"]
)
def test_an_unknown_device_has_no_datasheet_peak(name):
    assert K.datasheet_tflops(name) is None


def _cpu(**flags):
    base = dict(
        avx2=True, avx512=True, avx512_bf16=False, avx512_fp16=False, amx_bf16=False, amx_fp16=False, onednn_cap=None
    )
    return K.CpuFeatures(**{**base, **flags})


@pytest.mark.parametrize(
    "cap, usable",
    [
        (None, True),
        ("AVX512_CORE_BF16", True),
        ("avx512_core_amx", True),
        ("ALL", True),
        ("AVX512_CORE", False),
        ("AVX2", False),
    ],
)
def test_onednn_cap_hides_bf16_instructions(cap, usable):
    assert _cpu(avx512_bf16=True, onednn_cap=cap).usable("avx512_bf16") is usable


def test_bf16_on_a_cpu_says_whether_hardware_does_it():
    cpu = torch.device("cpu")
    plain = K._precisions(cpu, _cpu())
    assert plain["bf16"].ok and plain["bf16"].native is False and "converted in software" in plain["bf16"].note
    amx = K._precisions(cpu, _cpu(amx_bf16=True, avx512_bf16=True))
    assert amx["bf16"].native is True and "AMX" in amx["bf16"].note
    capped = K._precisions(cpu, _cpu(avx512_bf16=True, onednn_cap="AVX2"))
    assert capped["bf16"].native is False and "capped by ONEDNN_MAX_CPU_ISA" in capped["bf16"].note
    fp16 = K._precisions(cpu, _cpu(avx512_fp16=True))
    assert fp16["fp16"].native is True and plain["fp16"].native is False
    assert plain["tf32"].ok and plain["tf32"].native is False  # runs, changes nothing


def test_this_cpu_is_described_from_its_own_flags():
    caps = K.capabilities("cpu")
    flags = set(K._cpuinfo("flags").split())
    if flags:  # Linux: /proc/cpuinfo is the ground truth torch's probes must agree with
        assert caps.cpu.avx512_bf16 == ("avx512_bf16" in flags)
        assert caps.cpu.amx_bf16 == ("amx_bf16" in flags)
        assert caps.cpu.avx512_fp16 == ("avx512_fp16" in flags)
    rows = dict(caps.rows())
    assert rows["torch"] == torch.__version__ and "CPU" in rows["device"]
    assert caps.sdpa["math"].ok and caps.techniques["fused_adamw"].ok and rows["fused AdamW"].startswith("yes")


def test_a_config_is_data_and_loads_anywhere():
    """A GPU run's config constructs and round-trips on a CPU-only machine; running it is what is refused."""
    cfg = dataclasses.replace(C.gpt2_small_preset("cpu"), device="cuda", precision="bf16", compile=True)
    assert C.TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    if not torch.cuda.is_available():
        with pytest.raises(C.ConfigError, match="CUDA is not available here"):
            K.require(cfg)


def test_compile_without_a_cxx_compiler_is_refused_with_the_fix(monkeypatch, tiny):
    monkeypatch.setattr(shutil, "which", lambda _name: None)
    monkeypatch.delenv("CXX", raising=False)
    caps = K.capabilities("cpu")
    compile_ = caps.techniques["compile"]  # the torch_compile module's probe, asked through the registry
    assert not compile_.ok and caps.unavailable()["compile=True"] == compile_.note
    with pytest.raises(C.ConfigError, match=r"needs a C\+\+ compiler"):
        caps.require(tiny(compile=True))
    rungs = dict((r.name, c) for r, c in ladder_configs(C.cpu_preset("cpu")))
    assert isinstance(rungs["+ compile"], C.ConfigError)
    assert isinstance(rungs["+ fused AdamW"], C.TrainConfig) and not rungs["+ fused AdamW"].compile


def test_a_precision_the_device_cannot_run_is_refused_when_the_run_starts(monkeypatch, tiny):
    real = K._precisions
    monkeypatch.setattr(K, "_precisions", lambda dev, cpu: {**real(dev, cpu), "bf16": K.Support(False, "no bf16 here")})
    cfg = tiny(precision="bf16")  # constructing it is fine: it is data
    from course_lib.train import train

    with pytest.raises(C.ConfigError, match="precision='bf16' cannot run on cpu: no bf16 here"):
        train(cfg)


@pytest.mark.parametrize(
    "settings, says",
    [
        ({"compile": True, "data_parallel": "ddp"}, "compile with data_parallel='ddp' is not offered"),
        ({"fused_adamw": True, "optimizer": "sgd"}, "fused_adamw applies to optimizer='adamw' only"),
    ],
)
def test_a_techniques_own_check_refuses_a_config_with_a_reason(settings, says, tiny):
    """A technique's check (its declaration's `check`), asked through the registry when a run starts and by the
    ladder's rungs; the config itself is data and constructs."""
    cfg = tiny(**settings)
    with pytest.raises(C.ConfigError, match=says):
        K.require(cfg)
    with pytest.raises(C.ConfigError, match=says):
        T.check(cfg)
    assert T.check(tiny()) == tiny()


def test_measured_peak_is_cached_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("COURSE_CACHE_DIR", str(tmp_path))
    calls = []
    monkeypatch.setattr(K, "matmul_tflops", lambda *a, **k: calls.append(a) or 0.5)
    first = K.measured_tflops("cpu", "fp32", shape=(64, 64, 64))
    second = K.measured_tflops("cpu", "fp32", shape=(64, 64, 64))
    assert first == second == 0.5 and len(calls) == 1
    assert K.measured_tflops("cpu", "fp32", shape=(64, 64, 64), refresh=True) == 0.5 and len(calls) == 2
    monkeypatch.setattr(K, "matmul_tflops", lambda *a, **k: 0.1)  # measured again while the machine is busy
    assert K.measured_tflops("cpu", "fp32", shape=(64, 64, 64), refresh=True) == 0.5  # the peak stays the best seen
    (key,) = json.loads((tmp_path / "matmul_peaks.json").read_text())
    assert K.device_name("cpu") in key and torch.__version__ in key


def test_matmul_speed_counts_2mkn_flops(monkeypatch):
    """A matmul that takes exactly 1 ms (a fake clock) at 100 x 200 x 300 is 2*100*200*300 / 1e-3 FLOP/s."""
    from course_lib import timing

    ticks = iter(range(10_000))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(ticks) * 1e-3)
    tflops = K.matmul_tflops("cpu", "fp32", 100, 200, 300, min_time_s=0.0, max_reps=3)
    assert tflops == pytest.approx(2 * 100 * 200 * 300 / 1e-3 / 1e12)


def test_efficiency_is_against_the_measured_peak_off_the_datasheet(monkeypatch):
    monkeypatch.setattr(K, "measured_tflops", lambda device, precision, shape=None, refresh=False: 0.2)
    frac, basis = K.efficiency(1000.0, 10**8, "cpu", "fp32")
    assert basis == "measured matmul peak" and frac == pytest.approx(1000 * 10**8 / 0.2e12)
    r = RunResult("x", "ok", {}, {}, median_step_s=1.0, tokens_per_s=1000.0, mfu=frac, mfu_basis=basis)
    assert table_rows([r])[0]["MFU"] == "50.0% of measured matmul peak"
    gpu = RunResult("y", "ok", {}, {}, median_step_s=1.0, tokens_per_s=1000.0, mfu=0.31, mfu_basis="data-sheet peak")
    assert table_rows([gpu])[0]["MFU"] == "31.0%"
    # a data sheet's peak is per precision: the label names the one divided by (a TF32 rung's share is of TF32's peak)
    tf32 = RunResult("z", "ok", {"precision": "tf32"}, {}, median_step_s=1.0, mfu=0.055, mfu_basis="data-sheet peak")
    assert table_rows([tf32])[0]["MFU"] == "5.5% of tf32 peak"


def test_a_cpu_run_reports_efficiency_of_the_measured_peak(monkeypatch, tmp_path, tiny):
    monkeypatch.setenv("COURSE_CACHE_DIR", str(tmp_path))
    from course_lib.train import train

    r = train(tiny(steps=3, measure_memory=False))
    peak = json.loads((tmp_path / "matmul_peaks.json").read_text())
    (measured,) = peak.values()
    assert r.mfu_basis == "measured matmul peak"
    assert r.mfu == pytest.approx(r.tokens_per_s * r.flops_per_token / (measured * 1e12))


def test_tf32_is_set_through_the_current_api_and_restored():
    from course_lib.techniques import matmul_precision

    m = torch.backends.cuda.matmul
    if not hasattr(m, "fp32_precision"):
        pytest.skip(f"torch {torch.__version__} has no fp32_precision API (the legacy flags are used)")
    before = (m.fp32_precision, torch.backends.cudnn.conv.fp32_precision)
    with matmul_precision("tf32"):
        assert m.fp32_precision == "tf32" and torch.backends.cudnn.conv.fp32_precision == "tf32"
    with matmul_precision("fp32"):
        assert m.fp32_precision == "ieee"
    assert (m.fp32_precision, torch.backends.cudnn.conv.fp32_precision) == before
    assert torch.get_float32_matmul_precision() == "highest"  # the CPU's oneDNN matmuls were never switched


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_info_on_cuda_without_cuda_is_a_message_not_a_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "course_lib", "info", "--device", "cuda"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "CUDA is not available here" in proc.stderr and "device='cpu'" in proc.stderr


# ---- a GPU by its compute capability (no GPU needed: torch.cuda's answers are replaced) ----------------------------
# (compute capability, name, bf16 fast, fp16 fast, TF32, the ladder's 16-bit rung): bf16 and TF32 tensor cores from
# Ampere (8.0) on, fp16 tensor cores from Volta (7.0); a V100 or a T4 gets no bf16 speed-up, so its rung is fp16.
GPUS = [
    ((6, 0), "Tesla P100-PCIE-16GB", False, False, False, None),
    ((7, 0), "Tesla V100-SXM2-16GB", False, True, False, "fp16"),
    ((7, 5), "Tesla T4", False, True, False, "fp16"),
    ((8, 0), "NVIDIA A100-SXM4-80GB", True, True, True, "bf16"),
    ((9, 0), "NVIDIA H100 80GB HBM3", True, True, True, "bf16"),
]


def _gpu(monkeypatch, cc, name):
    """capabilities("cuda") of a made-up GPU: torch.cuda's answers replaced, and the probes that would run a kernel."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cc)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(K, "_sdpa_support", lambda dev, dtype: {"math": K.Support(True, "stand-in")})
    stand_in = lambda dev: K.Support(True, "stand-in")  # noqa: E731
    probed = tuple(dataclasses.replace(t, probe=stand_in) if t.probe else t for t in T.TECHNIQUES)
    monkeypatch.setattr(T, "TECHNIQUES", probed)  # no technique's probe runs a kernel
    return K.capabilities("cuda")


@pytest.mark.parametrize(
    "cc, name, bf16, fp16, tf32, rung", GPUS, ids=lambda v: "sm_%d%d" % v if isinstance(v, tuple) else None
)
def test_a_gpus_16_bit_formats_follow_its_compute_capability(monkeypatch, cc, name, bf16, fp16, tf32, rung, tiny):
    caps = _gpu(monkeypatch, cc, name)
    p = caps.precisions
    assert (p["bf16"].ok and p["bf16"].native) is bf16 and bool(p["fp16"].native) is fp16 and p["tf32"].ok is tf32
    assert p["fp16"].ok  # fp16 runs on every CUDA GPU, with tensor cores from 7.0 on
    assert caps.fast_16bit()[0] == rung
    info = dict(caps.rows())  # what the environment cells and `python -m course_lib info` print
    assert info["compute capability"] == "%d.%d" % cc
    if not bf16:
        assert (
            info["bf16"].startswith("no: ")
            and "no bf16 tensor cores" in info["bf16"]
            and "fp16 with loss scaling" in info["bf16"]
        )
        assert "precision=bf16" in caps.unavailable()  # the panel disables it, a config asking for it is refused
    else:
        assert info["bf16"] == "yes: bf16 tensor cores (compute capability %d.%d)" % cc
    # the ladder's precision rung reads the same answer (techniques.rung_up): fp16 with loss scaling on Volta and Turing
    cfg = tiny(device="cuda")
    (rung16,) = [r for r in T.LADDER if r.value == T.FAST_16BIT]
    up = T.rung_up(cfg, rung16, caps)
    if rung is None:
        assert isinstance(up, C.ConfigError) and "no bf16 tensor cores" in str(up)
    else:
        assert up.precision == rung


def test_the_gpu_generation_table_is_gpu_precisions():
    rows = {r["compute capability"]: r for r in gpu_generation_rows()}
    assert rows["7.0"]["bf16"] == rows["7.5"]["bf16"] == "refused" and rows["7.5"]["fp16"] == "tensor cores"
    assert (
        rows["8.0"]["bf16"] == rows["9.0"]["bf16"] == "tensor cores" and rows["6.0"]["fp16"] == "runs, no tensor cores"
    )
    assert [r["the ladder's 16-bit rung"] for r in rows.values()][:4] == ["skipped (no 16-bit tensor cores)"] * 2 + [
        "fp16"
    ] * 2
