"""What this device can run, and how fast: the one place that says "bf16 needs compute capability 8.0" (a technique's
own needs: its `probe` and `check`). A known GPU's peak is its data sheet's; any other's a measured matmul's, cached."""

from __future__ import annotations

import functools
import json
import os
import platform
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from .cache import cache_dir, write_atomic
from .config import PRECISION_DTYPES, ConfigError, TrainConfig, check_device, default_device
from .tf32 import matmul_precision
from .timing import time_fn


def _cpuinfo(key: str) -> str:
    """The value of the first `key` line of /proc/cpuinfo, or "" (no such file: not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(key)), "")
    except OSError:
        return ""


def cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def device_name(device: str | torch.device) -> str:
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    if dev.type == "cpu":
        n = torch.get_num_threads()
        return f"CPU ({cpu_model()}, {n} thread{'s' if n != 1 else ''})"
    return str(dev)


# oneDNN's ISA levels, lowest first ("=" joins aliases): a feature above ONEDNN_MAX_CPU_ISA is present but unused.
_ONEDNN_ISAS = (
    "SSE41 AVX AVX2 AVX2_VNNI AVX2_VNNI_2 AVX512_CORE AVX512_CORE_VNNI AVX512_CORE_BF16 AVX512_CORE_FP16=AVX10_1_512 "
    "AVX512_CORE_AMX=AVX10_1_512_AMX AVX512_CORE_AMX_FP16=AVX10_1_512_AMX_FP16 AVX10_2_512 AVX10_2_512_AMX_2"
)
_ONEDNN_LEVELS = {name: level for level, names in enumerate(_ONEDNN_ISAS.split(), 1) for name in names.split("=")}
_FEATURE_LEVEL = {"avx2": 3, "avx512": 6, "avx512_bf16": 8, "avx512_fp16": 9, "amx_bf16": 10, "amx_fp16": 11}
# What holds a CPU's kernels (oneDNN's, MKL's, ATen's) to a lower instruction set: a peak under one is not another's.
KERNEL_CAPS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY")


def kernel_caps() -> dict[str, str]:
    return {k: os.environ[k] for k in KERNEL_CAPS if os.environ.get(k)}


@dataclass(frozen=True)
class CpuFeatures:
    """The matmul-relevant instruction sets of this CPU, and oneDNN's cap on using them."""

    avx2: bool
    avx512: bool
    avx512_bf16: bool
    avx512_fp16: bool
    amx_bf16: bool
    amx_fp16: bool
    onednn_cap: str | None  # ONEDNN_MAX_CPU_ISA, when set

    @classmethod
    def detect(cls) -> CpuFeatures:
        found = {f: getattr(torch.cpu, f"_is_{f}_supported")() for f in ("avx2", "avx512", "avx512_bf16", "amx_fp16")}
        found["amx_bf16"] = torch.cpu._is_amx_tile_supported()
        found["avx512_fp16"] = "avx512_fp16" in _cpuinfo("flags").split()  # torch has no probe for it
        cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or None
        return cls(**found, onednn_cap=cap)

    def usable(self, feature: str) -> bool:
        """Present in the CPU and not above ONEDNN_MAX_CPU_ISA."""
        cap = (self.onednn_cap or "").upper()
        uncapped = cap in ("", "ALL", "DEFAULT") or _ONEDNN_LEVELS.get(cap, 99) >= _FEATURE_LEVEL[feature]
        return getattr(self, feature) and uncapped

    def summary(self) -> str:
        named = {f: f.replace("_", "-").upper() for f in _FEATURE_LEVEL if getattr(self, f)}
        text = ", ".join(named.values()) or "none of AVX2, AVX-512, AVX512-BF16/FP16, AMX"
        if self.onednn_cap:
            capped = [n for f, n in named.items() if not self.usable(f)]
            text += f"; ONEDNN_MAX_CPU_ISA={self.onednn_cap}" + (f" (not used: {', '.join(capped)})" if capped else "")
        others = [f"{k}={v}" for k, v in kernel_caps().items() if k not in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")]
        return text + ("; " + ", ".join(others) if others else "")


@dataclass(frozen=True)
class Support:
    """What a device says of a technique or a number format."""

    ok: bool  # the course can run it on this device
    note: str = ""  # what it means here, or why it cannot run
    native: bool | None = None  # done in hardware (False: converted or emulated in software; None: not applicable)
    no_effect: bool = False  # accepted, and the computation is the same as without it (TF32 on a CPU)

    def __str__(self) -> str:
        word = ("yes" if self.native is not False else "yes, without hardware support") if self.ok else "no"
        return f"{word}: {self.note}" if self.note else word


def gpu_precisions(major: int, minor: int, name: str = "this GPU") -> dict[str, Support]:
    """By compute capability alone (is_bf16_supported() says yes to emulated bf16): fp16 from 7.0, bf16 and TF32 8.0."""
    cc, ampere, volta = f"compute capability {major}.{minor}", major >= 8, major >= 7
    no_bf16 = f"{name} has no bf16 tensor cores ({cc}; they start with Ampere, 8.0): bf16 would get no speed-up here; "
    no_bf16 += "use fp16 with loss scaling" + (", which its tensor cores run" if volta else "")
    no_tf32 = f"TF32 needs an Ampere or newer GPU (compute capability 8.0+); {name} is {major}.{minor}"
    no_tensor_cores = f"no tensor cores ({cc}; they start with Volta, 7.0): fp16 runs without them"
    return {
        "tf32": Support(True, f"tensor-core TF32 for fp32 matmuls ({cc})", True) if ampere else Support(False, no_tf32),
        "bf16": Support(True, f"bf16 tensor cores ({cc})", True) if ampere else Support(False, no_bf16),
        "fp16": Support(True, f"fp16 tensor cores ({cc})", True) if volta else Support(True, no_tensor_cores, False),
    }


def fast_16bit(precisions: dict[str, Support], name: str) -> tuple[str | None, str]:
    """(the 16-bit format `precisions` run in hardware, why): bf16 where it does, else fp16, else None."""
    for fmt in ("bf16", "fp16"):
        if (s := precisions.get(fmt)) is not None and s.ok and s.native:
            return fmt, s.note
    notes = "; ".join(f"{fmt}: {precisions[fmt].note}" for fmt in ("bf16", "fp16") if fmt in precisions)
    return None, f"no 16-bit format runs in hardware on {name} ({notes})"


# A CPU's 16-bit formats: the instruction sets that compute each in hardware, best first, and what each is called.
_CPU_16BIT = {
    "bf16": (("amx_bf16", "AMX bf16 matrix tiles"), ("avx512_bf16", "AVX512-BF16 dot-product instructions")),
    "fp16": (("amx_fp16", "AMX-FP16 matrix tiles"), ("avx512_fp16", "AVX512-FP16 instructions")),
}
_CPU_SOFTWARE = {
    "bf16": "no bf16 instructions in use{}: converted in software, often slower than fp32",
    "fp16": "no fp16 arithmetic instructions in use{}: a slow software path (fp16 is a GPU format)",
}


def _cpu_precisions(cpu: CpuFeatures) -> dict[str, Support]:
    out = {"tf32": Support(True, "accepted but does nothing on a CPU (TF32 is a CUDA tensor-core mode)", False, True)}
    for fmt, features in _CPU_16BIT.items():
        if usable := [note for feature, note in features if cpu.usable(feature)]:
            out[fmt] = Support(True, usable[0], True)
        else:
            capped = fmt == "bf16" and any(getattr(cpu, feature) for feature, _ in features)
            why = " (present but capped by ONEDNN_MAX_CPU_ISA)" if capped else ""
            out[fmt] = Support(True, _CPU_SOFTWARE[fmt].format(why), False)
    return out


def _precisions(dev: torch.device, cpu: CpuFeatures | None) -> dict[str, Support]:
    if dev.type == "cuda":
        others = gpu_precisions(*torch.cuda.get_device_capability(dev), torch.cuda.get_device_name(dev))
    elif dev.type == "cpu":
        others = _cpu_precisions(cpu)
    else:  # mps: config.check_device refuses any other type
        others = {
            "tf32": Support(False, "TF32 is an NVIDIA tensor-core format; MPS has no such mode"),
            "bf16": Support(True, "bf16 on Apple GPU (macOS 14+)", True),
            "fp16": Support(True, "fp16 on Apple GPU", True),
        }
    return {"fp32": Support(True, "", True), **others}


SDPA_BACKENDS = {
    "flash": "FLASH_ATTENTION",
    "memory-efficient": "EFFICIENT_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "math": "MATH",
}


def sdpa_dtype(device_type: str, precisions: dict[str, Support]) -> torch.dtype:
    """What the SDPA backends are tried in: a GPU's fastest 16-bit format (bf16 from Ampere on), fp32 elsewhere."""
    return torch.float32 if device_type != "cuda" else torch.bfloat16 if precisions["bf16"].ok else torch.float16


def _sdpa_support(dev: torch.device, dtype: torch.dtype) -> dict[str, Support]:
    """Run each SDPA backend on a tiny causal problem: what runs is what is supported (in `dtype`)."""
    out, in_dtype = {}, str(dtype).removeprefix("torch.")
    q = torch.randn(1, 2, 8, 16, device=dev, dtype=dtype)
    for name, member in SDPA_BACKENDS.items():
        try:
            with sdpa_kernel([getattr(SDPBackend, member)]):
                torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            out[name] = Support(True, f"runs in {in_dtype}")
        except (RuntimeError, NotImplementedError) as e:
            first = (str(e).strip() or type(e).__name__).splitlines()[0]
            why = "" if "No viable backend" in first else f" ({first[:120]})"
            out[name] = Support(False, f"no such kernel on {dev.type} in {in_dtype}{why}")
    return out


# Dense peak TFLOP/s, from data sheets. A key matches as whole words ("L4" not in "L40S"), the more specific first.
DATASHEET_TFLOPS: dict[str, dict[str, float]] = {
    "H200 NVL": {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0},
    "H200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},  # SXM
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2},
    "H100 NVL": {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0},
    "H100": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},  # SXM
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "A10G": {"bf16": 70.0, "fp16": 70.0, "tf32": 35.0, "fp32": 31.2},
    "A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6},
    "L40": {"bf16": 181.0, "fp16": 181.0, "tf32": 90.5, "fp32": 90.5},
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "RTX 4090": {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6},
    "RTX 3090": {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6},
    "V100": {"fp16": 125.0, "fp32": 15.7},
    "T4": {"fp16": 65.0, "fp32": 8.1},
}


def datasheet_tflops(name: str) -> dict[str, float] | None:
    """The data-sheet peaks of a GPU by its name, or None for a device not in the table (every CPU)."""
    keys = (k for k in DATASHEET_TFLOPS if re.search(rf"(?<![A-Za-z0-9]){re.escape(k)}(?![A-Za-z0-9])", name))
    return next((DATASHEET_TFLOPS[k] for k in keys), None)


def matmul_tflops(device: str, precision: str, m: int, k: int, n: int, min_time_s=0.2, max_reps=20) -> float:
    """Achieved TFLOP/s of one (m x k) @ (k x n) matmul in `precision`, timed as every step is (timing.time_fn)."""
    dev, dtype = torch.device(device), PRECISION_DTYPES[precision]
    a, b = torch.randn(m, k, device=dev, dtype=dtype), torch.randn(k, n, device=dev, dtype=dtype)
    with matmul_precision(precision), torch.no_grad():
        seconds = time_fn(lambda: a @ b, dev, repeats=3, warmup=1, min_time_s=min_time_s, max_repeats=max_reps)
    return 2 * m * k * n / seconds / 1e12


def _read_cache() -> dict:
    """The cached peaks {key: TFLOP/s}; an entry that is no positive number is dropped, saying so."""
    path = cache_dir() / "matmul_peaks.json"
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(entries, dict):
        print(f"course_lib: {path} holds no table of peaks: ignored, measuring again", file=sys.stderr)
        return {}
    good = {k: v for k, v in entries.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0}
    if dropped := len(entries) - len(good):
        word = "entry" if dropped == 1 else "entries"
        print(f"course_lib: {dropped} unreadable {word} of {path} dropped: measured again", file=sys.stderr)
    return good


def measured_tflops(device: str, precision: str, shape: tuple | None = None, refresh: bool = False) -> float:
    """This machine's matmul TFLOP/s, cached: the best of growing squares (or of `shape`); `refresh` measures again."""
    dev_type = torch.device(device).type
    if dev_type == "cpu" and precision == "tf32":
        precision = "fp32"  # TF32 changes nothing on a CPU
    held = ",".join(f"{k}={v}" for k, v in kernel_caps().items()) if dev_type == "cpu" else ""
    dims = "x".join(map(str, shape or (0, 0, 0)))
    key = f"{device_name(device)}|torch {torch.__version__}|{precision}|{dims}|isa cap {held or 'none'}"
    if key in (cache := _read_cache()) and not refresh:
        return cache[key]
    if shape:
        value = matmul_tflops(device, precision, *shape)
    else:
        value = 0.0
        for size in (256, 512, 1024, 2048) + ((4096, 8192) if dev_type == "cuda" else ()):
            t0 = time.perf_counter()
            value = max(value, matmul_tflops(device, precision, size, size, size))
            if time.perf_counter() - t0 > 2.0:  # a slow path (fp16 without hardware): larger sizes add nothing but time
                break
    cache = _read_cache()
    cache[key] = value = max(value, cache.get(key, 0.0))  # the best this machine has shown: a busy moment lowers none
    write_atomic(cache_dir() / "matmul_peaks.json", lambda f: f.write_text(json.dumps(cache, indent=1, sort_keys=True)))
    return value


# The techniques, handed over by their registry (a layer above) when imported: probed and checked here, never named.
_registry: Callable[[], Sequence] = tuple


def use_registry(techniques: Callable[[], Sequence]) -> None:
    """Called once by course_lib.techniques with what returns its TECHNIQUES (read anew at every call)."""
    global _registry
    _registry = techniques


def config_problems(cfg: TrainConfig) -> list[str]:
    """What each technique's own check says is wrong with `cfg` (what to change), in the registry's order."""
    return [why for t in _registry() if t.check is not None and (why := t.check(cfg))]


@dataclass(frozen=True)
class Capabilities:
    device: str
    type: str
    name: str
    torch_version: str
    precisions: dict[str, Support]
    sdpa: dict[str, Support]
    techniques: dict[str, Support]  # a technique's name -> whether this device runs it switched on (its probe)
    cpu: CpuFeatures | None = None
    compute_capability: tuple[int, int] | None = None
    datasheet: dict[str, float] | None = None

    def supports(self, precision: str) -> Support:
        """What this device says of `precision` (a config's: config checked its name)."""
        return self.precisions[precision]

    def fast_16bit(self) -> tuple[str | None, str]:
        """(the 16-bit format this device runs in hardware, why): bf16 where it can, else fp16, else None."""
        return fast_16bit(self.precisions, self.name)

    def unavailable(self) -> dict[str, str]:
        """ "name=value" -> why this device cannot run that value: what the panel disables and the ladder skips."""
        out = {f"precision={p}": s.note for p, s in self.precisions.items() if not s.ok}
        for t in _registry():
            if t.name in self.techniques and not self.techniques[t.name].ok:
                out.update((f"{t.name}={v}", self.techniques[t.name].note) for v in t.on_values)
        return out

    def require(self, cfg: TrainConfig) -> TrainConfig:
        """`cfg` itself when this device can run it, else a ConfigError that says what to change."""
        out = [] if torch.device(cfg.device).type == self.type else [f"device={cfg.device!r} but this is {self.device}"]
        unavailable = self.unavailable()
        for name, value in ((t.name, t.value(cfg)) for t in _registry()):  # precision is one of them
            if why := unavailable.get(f"{name}={value}"):
                out.append(f"{name}={value!r} cannot run on {self.device}: {why}")
        if problems := out + config_problems(cfg):
            raise ConfigError("; ".join(problems))
        return cfg

    def peak_tflops(self, precision: str) -> tuple[float | None, str]:
        """(peak TFLOP/s, its source): a known GPU's data sheet, else the measured peak."""
        if self.datasheet is not None:
            value = self.datasheet.get(precision)
            return value, "data-sheet peak" if value else ""
        support = self.supports(precision)
        if not support.ok:
            return None, ""
        peak = measured_tflops(self.device, precision)
        if support.native is False and precision != "fp32":
            # no instructions for this format here: converted, its matmuls run on the fp32 units, the hardware's limit
            peak = max(peak, measured_tflops(self.device, "fp32"))
        return peak, "measured matmul peak"

    def rows(self) -> list[tuple[str, str]]:
        """What the environment cell and `info` show, one (what, answer) per line."""
        rows = [("device", self.name), ("torch", self.torch_version)]
        if self.cpu:
            rows.append(("CPU instruction sets", self.cpu.summary()))
            rows.append(("ATen vector code", torch.backends.cpu.get_cpu_capability()))
        if self.compute_capability:
            rows.append(("compute capability", "%d.%d" % self.compute_capability))
        rows += [(p, str(s)) for p, s in self.precisions.items() if p != "fp32"]
        rows += [(f"SDPA {name}", str(s)) for name, s in self.sdpa.items()]
        rows += [(t.label, str(self.techniques[t.name])) for t in _registry() if t.name in self.techniques]
        if self.datasheet:
            rows.append(("peak (data sheet)", ", ".join(f"{k} {v:g} TFLOP/s" for k, v in self.datasheet.items())))
        else:
            rows.append(("peak", "not in the data-sheet table: measured with a matmul benchmark when first needed"))
        return rows

    def to_dict(self) -> dict:
        return asdict(self)


@functools.cache  # tests change the environment, then cache_clear() and ask again
def capabilities(device: str | torch.device | None = None) -> Capabilities:
    """What `device` (default: CUDA when available) can run; a ConfigError where the device is not there."""
    device = check_device(default_device() if device is None else device)
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        no_gpu = "no CUDA GPU is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)"
        why = "this torch is a CPU-only build" if torch.version.cuda is None else no_gpu
        fix = "Use device='cpu', or on a machine with an NVIDIA GPU install torch's CUDA build (see docs/gpu.md)"
        raise ConfigError(f"device={device!r} but CUDA is not available here: {why}. {fix}")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device={device!r} but MPS is not available here: use device='cpu'")
    cpu = CpuFeatures.detect() if dev.type == "cpu" else None
    name, precisions = device_name(dev), _precisions(dev, cpu)
    return Capabilities(
        device=device,
        type=dev.type,
        name=name,
        torch_version=torch.__version__,
        precisions=precisions,
        sdpa=_sdpa_support(dev, sdpa_dtype(dev.type, precisions)),
        techniques={t.name: t.probe(dev) for t in _registry() if t.probe is not None},
        cpu=cpu,
        compute_capability=torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None,
        datasheet=datasheet_tflops(name) if dev.type == "cuda" else None,
    )


def require(cfg: TrainConfig) -> TrainConfig:
    """`cfg` when its device can run it, else a ConfigError that says what to change."""
    return capabilities(cfg.device).require(cfg)


def efficiency(tokens_per_s: float, flops_per_token: int, device: str, precision: str) -> tuple[float | None, str]:
    """(MFU, the peak's source): model FLOP/s over the device's peak (Capabilities.peak_tflops)."""
    peak, basis = capabilities(device).peak_tflops(precision)
    return (tokens_per_s * flops_per_token / (peak * 1e12), basis) if peak else (None, "")
