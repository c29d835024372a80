"""What this device can run, and how fast: the one place the course asks.

Config checks (`require`), the panel's disabled controls (`unavailable`), every notebook's environment cell
and `python -m course_lib info` (`rows`), and MFU (`peak_tflops`) all read from here, so a decision such as
"bf16 needs compute capability 8.0" is written once.

A config is plain data and loads anywhere; whether *this* device can run it is asked here, when a run, a
ladder or a panel starts. The number formats are this module's own facts (peak FLOP/s needs them too); what a technique
needs of a device, and what it checks of a config, are its own module's `probe` and `check` (course_lib.techniques),
asked of every technique in the registry, which this module iterates without naming one.

Speed: a known GPU's peak comes from its data sheet. Any other device (every CPU, an unknown GPU) gets its
peak *measured* with a matmul benchmark per precision, cached per machine, and efficiency is then labelled
"of measured matmul peak", so a CPU learner sees how far a run is from what their hardware can do.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from .cache import cache_dir, write_atomic
from .config import PRECISION_DTYPES, PRECISIONS, ConfigError, TrainConfig, check_device
from .tf32 import matmul_precision
from .timing import time_fn

# ---- the device's name --------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: str | torch.device) -> str:
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    if dev.type == "cpu":
        n = torch.get_num_threads()
        return f"CPU ({cpu_model()}, {n} thread{'s' if n != 1 else ''})"
    return str(dev)


# ---- a CPU's instruction sets -------------------------------------------------------------------

# oneDNN's ISA levels, lowest first; ONEDNN_MAX_CPU_ISA caps the kernels at one of them (names that are
# aliases share a level). A feature above the cap is present in the silicon but not used by the matmuls.
_ONEDNN_LEVELS = {
    "SSE41": 1,
    "AVX": 2,
    "AVX2": 3,
    "AVX2_VNNI": 4,
    "AVX2_VNNI_2": 5,
    "AVX512_CORE": 6,
    "AVX512_CORE_VNNI": 7,
    "AVX512_CORE_BF16": 8,
    "AVX512_CORE_FP16": 9,
    "AVX10_1_512": 9,
    "AVX512_CORE_AMX": 10,
    "AVX10_1_512_AMX": 10,
    "AVX512_CORE_AMX_FP16": 11,
    "AVX10_1_512_AMX_FP16": 11,
    "AVX10_2_512": 12,
    "AVX10_2_512_AMX_2": 13,
}
_FEATURE_LEVEL = {"avx2": 3, "avx512": 6, "avx512_bf16": 8, "avx512_fp16": 9, "amx_bf16": 10, "amx_fp16": 11}


def _cpuinfo_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


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
    def detect(cls) -> "CpuFeatures":
        probe = lambda name: bool(getattr(torch.cpu, name, lambda: False)())  # noqa: E731
        return cls(
            avx2=probe("_is_avx2_supported"),
            avx512=probe("_is_avx512_supported"),
            avx512_bf16=probe("_is_avx512_bf16_supported"),
            avx512_fp16="avx512_fp16" in _cpuinfo_flags(),  # torch has no probe for it
            amx_bf16=probe("_is_amx_tile_supported"),
            amx_fp16=probe("_is_amx_fp16_supported"),
            onednn_cap=(os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or None),
        )

    def usable(self, feature: str) -> bool:
        """Present in the CPU and not above ONEDNN_MAX_CPU_ISA."""
        if not getattr(self, feature):
            return False
        cap = (self.onednn_cap or "").upper()
        return cap in ("", "ALL", "DEFAULT") or _ONEDNN_LEVELS.get(cap, 99) >= _FEATURE_LEVEL[feature]

    def summary(self) -> str:
        names = [f.replace("_", "-").upper() for f in _FEATURE_LEVEL if getattr(self, f)]
        capped = [f.replace("_", "-").upper() for f in _FEATURE_LEVEL if getattr(self, f) and not self.usable(f)]
        text = ", ".join(names) or "none of AVX2, AVX-512, AVX512-BF16/FP16, AMX"
        if self.onednn_cap:
            text += f"; ONEDNN_MAX_CPU_ISA={self.onednn_cap}" + (f" (not used: {', '.join(capped)})" if capped else "")
        others = {k: v for k, v in kernel_caps().items() if k not in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")}
        if others:
            text += "; " + ", ".join(f"{k}={v}" for k, v in others.items())
        return text


# ---- support for each thing the course can switch on -------------------------------------------


@dataclass(frozen=True)
class Support:
    """What a device says of a technique or a number format (course_lib.capabilities asks)."""

    ok: bool  # the course can run it on this device
    note: str = ""  # what it means here, or why it cannot run
    native: bool | None = None  # done in hardware (False: converted or emulated in software; None: not applicable)
    no_effect: bool = False  # accepted, and the computation is the same as without it (TF32 on a CPU)

    def __str__(self) -> str:
        word = ("yes" if self.native is not False else "yes, without hardware support") if self.ok else "no"
        return f"{word}: {self.note}" if self.note else word


# NVIDIA's GPU generations by compute capability (major, minor), and the formats their tensor cores take (data sheets,
# not measured here): Volta and Turing have fp16 tensor cores only; bf16 and TF32 tensor cores start with Ampere.
GPU_GENERATIONS = {
    (6, 0): "Pascal (P100)",
    (6, 1): "Pascal (GTX 10)",
    (7, 0): "Volta (V100)",
    (7, 5): "Turing (T4, RTX 20)",
    (8, 0): "Ampere (A100)",
    (8, 6): "Ampere (RTX 30, A10)",
    (8, 9): "Ada (L4, L40, RTX 40)",
    (9, 0): "Hopper (H100, H200)",
}


def gpu_precisions(major: int, minor: int, name: str = "this GPU") -> dict[str, Support]:
    """TF32, bf16 and fp16 on an NVIDIA GPU of compute capability major.minor, decided by the capability alone
    (torch.cuda.is_bf16_supported() also says yes where bf16 is only emulated). fp16 tensor cores: 7.0+ (Volta, Turing);
    bf16 and TF32 tensor cores: 8.0+ (Ampere and later). Below 8.0 bf16 gets no speed-up (torch computes it without
    tensor cores, or cuBLAS refuses it), so it is refused with the fix: fp16 with loss scaling."""
    cc = f"compute capability {major}.{minor}"
    ampere, volta = major >= 8, major >= 7
    return {
        "tf32": (
            Support(True, f"tensor-core TF32 for fp32 matmuls ({cc})", True)
            if ampere
            else Support(
                False, f"TF32 needs an Ampere or newer GPU (compute capability 8.0+); {name} is {major}.{minor}"
            )
        ),
        "bf16": (
            Support(True, f"bf16 tensor cores ({cc})", True)
            if ampere
            else Support(
                False,
                f"{name} has no bf16 tensor cores ({cc}; they start with Ampere, 8.0): bf16 would get no "
                "speed-up here; use fp16 with loss scaling" + (", which its tensor cores run" if volta else ""),
            )
        ),
        "fp16": (
            Support(True, f"fp16 tensor cores ({cc})", True)
            if volta
            else Support(
                True,
                f"no tensor cores before Volta (compute capability 7.0; this is {major}.{minor}): fp16 runs "
                "without them",
                False,
            )
        ),
    }


def fast_16bit(precisions: dict[str, Support], name: str) -> tuple[str | None, str]:
    """Capabilities.fast_16bit for a table of precisions: bf16 where it runs in hardware, else fp16, else None."""
    for fmt in ("bf16", "fp16"):
        s = precisions.get(fmt)
        if s is not None and s.ok and s.native:
            return fmt, s.note
    notes = "; ".join(f"{fmt}: {precisions[fmt].note}" for fmt in ("bf16", "fp16") if fmt in precisions)
    return None, f"no 16-bit format runs in hardware on {name} ({notes})"


def gpu_generation_rows() -> list[dict[str, str]]:
    """What gpu_precisions answers for each generation of GPU_GENERATIONS (the environment cell on such a GPU says the
    same): data-sheet facts by compute capability, nothing measured."""

    def word(s: Support) -> str:
        return "tensor cores" if s.ok and s.native else "runs, no tensor cores" if s.ok else "refused"

    rows = []
    for (major, minor), gen in GPU_GENERATIONS.items():
        p = gpu_precisions(major, minor)
        fast = fast_16bit(p, gen)[0]  # techniques.rung_up: else bf16, which such a GPU refuses: the rung is skipped
        rows.append(
            {
                "compute capability": f"{major}.{minor}",
                "generation": gen,
                **{f: word(p[f]) for f in ("fp16", "bf16", "tf32")},
                "the ladder's 16-bit rung": fast or "skipped (no 16-bit tensor cores)",
            }
        )
    return rows


def _precisions(dev: torch.device, cpu: CpuFeatures | None) -> dict[str, Support]:
    out = {"fp32": Support(True, "", True)}
    if dev.type == "cuda":
        out.update(gpu_precisions(*torch.cuda.get_device_capability(dev), torch.cuda.get_device_name(dev)))
    elif dev.type == "cpu":
        out["tf32"] = Support(
            True, "accepted but does nothing on a CPU (TF32 is a CUDA tensor-core mode)", False, no_effect=True
        )
        if not torch.amp.autocast_mode.is_autocast_available("cpu"):
            out["bf16"] = out["fp16"] = Support(False, "this torch build has no CPU autocast")
        else:
            if cpu.usable("amx_bf16"):
                out["bf16"] = Support(True, "AMX bf16 matrix tiles", True)
            elif cpu.usable("avx512_bf16"):
                out["bf16"] = Support(True, "AVX512-BF16 dot-product instructions", True)
            else:
                why = " (present but capped by ONEDNN_MAX_CPU_ISA)" if (cpu.amx_bf16 or cpu.avx512_bf16) else ""
                out["bf16"] = Support(
                    True, f"no bf16 instructions in use{why}: converted in software, often slower than fp32", False
                )
            if cpu.usable("amx_fp16"):
                out["fp16"] = Support(True, "AMX-FP16 matrix tiles", True)
            elif cpu.usable("avx512_fp16"):
                out["fp16"] = Support(True, "AVX512-FP16 instructions", True)
            else:
                out["fp16"] = Support(
                    True, "no fp16 arithmetic instructions in use: a slow software path (fp16 is a GPU format)", False
                )
    elif dev.type == "mps":
        out["tf32"] = Support(False, "TF32 is an NVIDIA tensor-core format; MPS has no such mode")
        out["bf16"] = Support(True, "bf16 on Apple GPU (macOS 14+)", True)
        out["fp16"] = Support(True, "fp16 on Apple GPU", True)
    return out  # (config.check_device has refused any other device type)


_SDPA_BACKENDS = {
    "flash": "FLASH_ATTENTION",
    "memory-efficient": "EFFICIENT_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "math": "MATH",
}


def _sdpa_support(dev: torch.device, dtype: torch.dtype) -> dict[str, Support]:
    """Run each SDPA backend on a tiny causal problem: what runs is what is supported (in `dtype`)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = {}
    q = torch.randn(1, 2, 8, 16, device=dev, dtype=dtype)
    for name, member in _SDPA_BACKENDS.items():
        backend = getattr(SDPBackend, member, None)
        if backend is None:
            out[name] = Support(False, "not in this torch")
            continue
        try:
            with sdpa_kernel([backend]):
                torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            out[name] = Support(True, f"runs in {str(dtype).removeprefix('torch.')}")
        except (RuntimeError, NotImplementedError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            why = "" if "No viable backend" in first else f" ({first[:120]})"
            out[name] = Support(False, f"no such kernel on {dev.type} in {str(dtype).removeprefix('torch.')}{why}")
    return out


# ---- peak FLOP/s --------------------------------------------------------------------------------

# Dense (no sparsity) peak TFLOP/s from the vendors' data sheets. A key matches the device name as whole
# words (so "L4" is not found in "L40S"), and more specific keys come first ("H100 PCIe" before "H100").
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
    for key, peaks in DATASHEET_TFLOPS.items():
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", name):
            return peaks
    return None


def matmul_tflops(
    device: str, precision: str, m: int, k: int, n: int, min_time_s: float = 0.2, max_reps: int = 20
) -> float:
    """Achieved TFLOP/s of one (m x k) @ (k x n) matmul in `precision`: 2mkn FLOPs over the median of timed
    repeats after a warm-up (kernel selection, first touch of the output), timed as every step is (timing.time_fn)."""
    dev = torch.device(device)
    a = torch.randn(m, k, device=dev, dtype=PRECISION_DTYPES[precision])
    b = torch.randn(k, n, device=dev, dtype=PRECISION_DTYPES[precision])
    with matmul_precision(precision), torch.no_grad():
        seconds = time_fn(lambda: a @ b, dev, repeats=3, warmup=1, min_time_s=min_time_s, max_repeats=max_reps)
    return 2 * m * k * n / seconds / 1e12


# The environment variables that hold a CPU's kernels to a lower instruction set: oneDNN's (bf16, fp16 and some fp32
# matmuls), MKL's (fp32 matmuls) and ATen's own vector code. A peak measured under one setting is not another's.
KERNEL_CAPS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY")


def kernel_caps() -> dict[str, str]:
    """Those of KERNEL_CAPS that are set, {name: value}."""
    return {k: os.environ[k] for k in KERNEL_CAPS if os.environ.get(k)}


def _cache_key(device: str, precision: str, shape: tuple[int, int, int]) -> str:
    caps = capabilities(device)
    held = ",".join(f"{k}={v}" for k, v in kernel_caps().items()) if caps.cpu else ""
    return f"{caps.name}|torch {torch.__version__}|{precision}|{'x'.join(map(str, shape))}|isa cap {held or 'none'}"


def _read_cache() -> dict:
    """The cached peaks {key: TFLOP/s}; an entry that is not a positive number (a file damaged, or written by hand) is
    dropped with a line saying so, and measured again when asked for."""
    try:
        entries = json.loads((cache_dir() / "matmul_peaks.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(entries, dict):
        print(
            f"course_lib: {cache_dir() / 'matmul_peaks.json'} holds no table of peaks: ignored, measuring again",
            file=sys.stderr,
        )
        return {}
    good = {k: v for k, v in entries.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0}
    if len(good) < len(entries):
        print(
            f"course_lib: {len(entries) - len(good)} unreadable "
            f"entr{'y' if len(entries) - len(good) == 1 else 'ies'} of "
            f"{cache_dir() / 'matmul_peaks.json'} dropped: measured again when needed",
            file=sys.stderr,
        )
    return good


def _write_cache(entries: dict) -> None:
    write_atomic(
        cache_dir() / "matmul_peaks.json", lambda f: f.write_text(json.dumps(entries, indent=1, sort_keys=True))
    )


def measured_tflops(
    device: str, precision: str, shape: tuple[int, int, int] | None = None, refresh: bool = False
) -> float:
    """This machine's matmul speed in `precision`, cached per machine (device name with thread count, torch
    version, oneDNN cap). Without `shape`: the peak over square sizes, growing until a matmul takes long
    enough to be a fair measure (2048 on a CPU, 8192 on a GPU). With `shape` (m, k, n): that shape only.
    `refresh` measures again, and the cache keeps the larger of the two (a value taken while the machine was busy
    is low, never high)."""
    dev_type = torch.device(device).type
    if dev_type == "cpu" and precision == "tf32":
        precision = "fp32"  # TF32 changes nothing on a CPU
    key_shape = shape or (0, 0, 0)
    key = _cache_key(device, precision, key_shape)
    cache = _read_cache()
    if key in cache and not refresh:
        return cache[key]
    if shape:
        value = matmul_tflops(device, precision, *shape)
    else:
        value, size = 0.0, 256
        biggest = 8192 if dev_type == "cuda" else 2048
        while size <= biggest:
            t0 = time.perf_counter()
            value = max(value, matmul_tflops(device, precision, size, size, size))
            if time.perf_counter() - t0 > 2.0:  # a slow path (fp16 without hardware): larger sizes add nothing but time
                break
            size *= 2
    cache = _read_cache()
    # A peak is the best this machine has shown: a measurement taken while it was busy must not lower it.
    cache[key] = value = max(value, cache.get(key, 0.0))
    _write_cache(cache)
    return value


def model_matmul_shapes(cfg: TrainConfig) -> dict[str, tuple[int, int, int]]:
    """The largest matmuls of one micro-batch's forward: (tokens x width) @ (width x 4·width) in the MLP and
    (tokens x width) @ (width x vocab) in the output layer."""
    tokens, width = cfg.micro_batch_size * cfg.context, cfg.model.n_embd
    return {
        "MLP up-projection": (tokens, width, 4 * width),
        "output layer": (tokens, width, cfg.model.padded_vocab_size),
    }


# ---- the answer ---------------------------------------------------------------------------------

# The techniques (course_lib.techniques.Technique), as their registry, a layer above, hands them over when it is
# imported: this module probes the device for each and asks each its check, and names none of them.
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
    datasheet: dict[str, float] | None = field(default=None)

    def supports(self, precision: str) -> Support:
        if precision not in self.precisions:
            raise ConfigError(f"precision={precision!r} is not one of {', '.join(map(repr, PRECISIONS))}")
        return self.precisions[precision]

    def fast_16bit(self) -> tuple[str | None, str]:
        """(the 16-bit format this device runs in hardware, why): bf16 where it has bf16 units (Ampere and later GPUs,
        AVX512-BF16 or AMX CPUs), else fp16 where it has fp16 units (Volta and Turing tensor cores, AVX512-FP16 or
        AMX-FP16 CPUs), else None: each is converted in software here, usually slower than fp32."""
        return fast_16bit(self.precisions, self.name)

    def unavailable(self) -> dict[str, str]:
        """ "name=value" -> why this device cannot run that value of a technique (course_lib.techniques):
        what the panel disables and the ladder skips."""
        out = {f"precision={p}": s.note for p, s in self.precisions.items() if not s.ok}
        for t in _registry():
            if t.name in self.techniques and not self.techniques[t.name].ok:
                out.update((f"{t.name}={v}", self.techniques[t.name].note) for v in t.on_values)
        return out

    def problems(self, cfg: TrainConfig) -> list[str]:
        """Why this device cannot run `cfg` (empty when it can), with the techniques' own checks of it."""
        out = [] if torch.device(cfg.device).type == self.type else [f"device={cfg.device!r} but this is {self.device}"]
        unavailable = self.unavailable()
        for name, value in [("precision", cfg.precision)] + [(t.name, t.value(cfg)) for t in _registry()]:
            if why := unavailable.get(f"{name}={value}"):
                out.append(f"{name}={value!r} cannot run on {self.device}: {why}")
        return out + config_problems(cfg)

    def require(self, cfg: TrainConfig) -> TrainConfig:
        """`cfg` itself when this device can run it, else a ConfigError that says what to change."""
        problems = self.problems(cfg)
        if problems:
            raise ConfigError("; ".join(problems))
        return cfg

    def peak_tflops(self, precision: str, measure: bool = True) -> tuple[float | None, str]:
        """(peak TFLOP/s, where it comes from): the data sheet for a known GPU; otherwise this machine's
        measured matmul peak (measured once and cached), or (None, "") when `measure` is False."""
        if self.datasheet is not None:
            value = self.datasheet.get(precision)
            return value, "data-sheet peak" if value else ""
        support = self.supports(precision)
        if not measure or not support.ok:
            return None, ""
        peak = measured_tflops(self.device, precision)
        if support.native is False and precision != "fp32":
            # No instructions for this format here: its matmuls are converted and computed by the fp32 units, whose
            # speed is then the hardware's limit (a big matmul in the converted format can be slower still).
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


def _normalise(device: str | torch.device | None) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return check_device(device)


def capabilities(device: str | torch.device | None = None) -> Capabilities:
    """What `device` (default: CUDA when available, else the CPU) can run. Raises ConfigError with what to do
    when the device itself is not there (CUDA on a CPU-only torch)."""
    return _capabilities(_normalise(device))


@functools.lru_cache(maxsize=None)
def _capabilities(device: str) -> Capabilities:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        build = (
            "this torch is a CPU-only build"
            if torch.version.cuda is None
            else "no CUDA GPU is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)"
        )
        raise ConfigError(
            f"device={device!r} but CUDA is not available here: {build}. Use device='cpu', or on a machine "
            "with an NVIDIA GPU install torch's CUDA build (see docs/gpu.md)"
        )
    if dev.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ConfigError(f"device={device!r} but MPS is not available here: use device='cpu'")
    cpu = CpuFeatures.detect() if dev.type == "cpu" else None
    cc = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None
    name = device_name(dev)
    sdpa_dtype = torch.bfloat16 if cc and cc[0] >= 8 else torch.float16 if dev.type == "cuda" else torch.float32
    return Capabilities(
        device=device,
        type=dev.type,
        name=name,
        torch_version=torch.__version__,
        precisions=_precisions(dev, cpu),
        sdpa=_sdpa_support(dev, sdpa_dtype),
        techniques={t.name: t.probe(dev) for t in _registry() if t.probe is not None},
        cpu=cpu,
        compute_capability=cc,
        datasheet=datasheet_tflops(name) if dev.type == "cuda" else None,
    )


capabilities.cache_clear = _capabilities.cache_clear  # tests change the environment and ask again


def require(cfg: TrainConfig) -> TrainConfig:
    """`cfg` when its device can run it, else a ConfigError that says what to change."""
    return capabilities(cfg.device).require(cfg)


def efficiency(
    tokens_per_s: float, flops_per_token: int, device: str, precision: str, measure: bool = True
) -> tuple[float | None, str]:
    """(model FLOP/s over the device's peak, what the peak is): MFU against the data sheet on a known GPU,
    or against this machine's measured matmul peak elsewhere."""
    peak, basis = capabilities(device).peak_tflops(precision, measure=measure)
    if not peak:
        return None, ""
    return tokens_per_s * flops_per_token / (peak * 1e12), basis
