"""Number formats and mixed precision, measured (notebook 03).

- The formats side by side, read from `torch.finfo` (TF32 is not a storage dtype: its row is computed from
  its bit layout, and a rounding function emulates it on any device).
- Which dtype autocast gives each operation of a real forward pass, loss and backward (recorded with a
  TorchDispatchMode, the same mechanism the memory ledger uses).
- Gradient magnitudes of one real step, and how many of them fp16 flushes to zero with and without scaling.
- Error against an fp64 reference: a matmul, and one step's loss and gradients.
- Matmul throughput per format on this device.
- Why master weights: one real update added to the weights stored in each format (`updates_lost_by_format`).
- The notebook's panel (`panel_runner`, with `plot_op_dtypes` and `plot_scaler_trace`): a run's op dtypes, its loss
  scale, and pure bf16 through pure_bf16.train.

The training runs go through course_lib.train (or pure_bf16.train, the same loop); nothing here is a second loop.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..config import TrainConfig
from .pure_bf16 import placeholder

SHORT = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
for _name, _short in (("float8_e4m3fn", "fp8 e4m3"), ("float8_e5m2", "fp8 e5m2")):
    if hasattr(torch, _name):
        SHORT[getattr(torch, _name)] = _short
DTYPES = {v: k for k, v in SHORT.items()}  # "bf16" -> torch.bfloat16 ...

FP16_SMALLEST_SUBNORMAL = 2.0**-24  # below half of this, a value rounds to zero in fp16
FP16_SMALLEST_NORMAL = 2.0**-14


def short(dtype: torch.dtype) -> str:
    return SHORT.get(dtype, str(dtype).replace("torch.", ""))


# ---- the formats -------------------------------------------------------------------------------


@dataclass(frozen=True)
class FloatFormat:
    name: str
    bits: int
    exponent_bits: int
    mantissa_bits: int  # stored fraction bits (the leading 1 of a normal number is implicit)
    max: float
    smallest_normal: float
    smallest_subnormal: float
    eps: float  # gap between 1 and the next value: 2^-mantissa_bits
    dtype: torch.dtype | None  # None for TF32, which is a matmul mode, not a storage type
    source: str  # where the numbers come from

    @property
    def unit_roundoff(self) -> float:
        """Largest relative error of rounding to nearest: eps / 2."""
        return self.eps / 2

    @property
    def decimal_digits(self) -> float:
        return (self.mantissa_bits + 1) * math.log10(2)


def from_finfo(name: str, dtype: torch.dtype) -> FloatFormat:
    fi = torch.finfo(dtype)
    mant = round(-math.log2(fi.eps))
    return FloatFormat(
        name=name,
        bits=fi.bits,
        exponent_bits=fi.bits - 1 - mant,
        mantissa_bits=mant,
        max=float(fi.max),
        smallest_normal=float(fi.smallest_normal),
        smallest_subnormal=float(fi.smallest_normal) * float(fi.eps),
        eps=float(fi.eps),
        dtype=dtype,
        source=f"torch.finfo({dtype})",
    )


def tf32_format() -> FloatFormat:
    """TF32: fp32's 8 exponent bits with fp16's 10 mantissa bits (19 bits; stored in 32). From the bit layout."""
    e, m = 8, 10
    bias = 2 ** (e - 1) - 1
    return FloatFormat(
        name="tf32",
        bits=19,
        exponent_bits=e,
        mantissa_bits=m,
        max=(2 - 2.0**-m) * 2.0**bias,
        smallest_normal=2.0 ** (1 - bias),
        smallest_subnormal=2.0 ** (1 - bias - m),
        eps=2.0**-m,
        dtype=None,
        source="bit layout (1 + 8 + 10 bits); tensor cores round fp32 matmul inputs to it",
    )


def formats(include_fp8: bool = True) -> list[FloatFormat]:
    """fp32, tf32, bf16, fp16 and, where this torch has them, the two fp8 formats used for training."""
    out = [
        from_finfo("fp32", torch.float32),
        tf32_format(),
        from_finfo("bf16", torch.bfloat16),
        from_finfo("fp16", torch.float16),
    ]
    if include_fp8:
        for attr, name in (("float8_e4m3fn", "fp8 e4m3"), ("float8_e5m2", "fp8 e5m2")):
            if hasattr(torch, attr):
                out.append(from_finfo(name, getattr(torch, attr)))
    return out


def _pow2(x: float) -> str:
    return f"2^{math.log2(x):.0f}" if x > 0 and float(math.log2(x)).is_integer() else f"{x:.4g}"


def format_rows(fmts: list[FloatFormat]) -> list[dict[str, str]]:
    """Rows for results.text_table / html_table."""
    return [
        {
            "format": f.name,
            "bits": str(f.bits),
            "exponent": str(f.exponent_bits),
            "mantissa": str(f.mantissa_bits),
            "max": f"{f.max:.4g}",
            "smallest normal": f"{f.smallest_normal:.3g} ({_pow2(f.smallest_normal)})",
            "smallest subnormal": f"{f.smallest_subnormal:.3g} ({_pow2(f.smallest_subnormal)})",
            "eps": f"{f.eps:.3g} ({_pow2(f.eps)})",
            "~decimal digits": f"{f.decimal_digits:.1f}",
            "from": f.source,
        }
        for f in fmts
    ]


def representable_values(dtype: torch.dtype) -> torch.Tensor:
    """Every positive finite value of an 8- or 16-bit float dtype, by enumerating its bit patterns (as fp64)."""
    bits = torch.finfo(dtype).bits
    if bits == 16:
        patterns = torch.arange(0, 2**15, dtype=torch.int32).to(torch.int16)
    elif bits == 8:
        patterns = torch.arange(0, 2**7, dtype=torch.int32).to(torch.uint8)
    else:
        raise ValueError(
            f"{dtype} has {bits} bits: only 8- and 16-bit formats can be enumerated (fp32 has 2^31 patterns)"
        )
    values = patterns.view(dtype).to(torch.float64)
    return values[torch.isfinite(values) & (values > 0)]


def values_per_binade(fmt: FloatFormat) -> dict[int, int]:
    """{e: how many positive values lie in [2^e, 2^(e+1))}, from the format's layout: 2^mantissa_bits per
    binade of normal numbers (fewer in the top one when the format stops short of it), and
    2^(k) in the k-th binade of subnormals, counted up from the smallest."""
    m = fmt.mantissa_bits
    e_min = round(math.log2(fmt.smallest_normal))
    e_max = math.floor(math.log2(fmt.max))
    out = {e_min - m + k: 2**k for k in range(m)}
    for e in range(e_min, e_max + 1):
        full = 2**m
        if e == e_max:
            full = min(full, math.floor((fmt.max / 2.0**e - 1) * 2**m + 1e-9) + 1)
        out[e] = full
    return out


def round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to TF32's 10 mantissa bits (round to nearest, ties to even), kept in fp32. This is
    what a tensor core does to a matmul's inputs in TF32 mode; here it runs on any device (an emulation)."""
    x = x.to(torch.float32)
    b = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    lsb = (b >> 13) & 1
    b = (b + 0xFFF + lsb) & ~0x1FFF & 0xFFFFFFFF
    b = torch.where(b >= 2**31, b - 2**32, b)
    out = b.to(torch.int32).view(torch.float32)
    return torch.where(torch.isfinite(x), out, x)


def round_to(x: torch.Tensor, name: str) -> torch.Tensor:
    """x rounded to format `name` and returned in x's dtype."""
    if name == "tf32":
        return round_to_tf32(x).to(x.dtype)
    return x.to(DTYPES[name]).to(x.dtype)


def magnitude_classes(values: torch.Tensor, dtype: torch.dtype) -> dict[str, float]:
    """Of the nonzero `values`, the fraction that becomes zero, subnormal, normal or inf when cast to `dtype`."""
    v = values[values != 0]
    if v.numel() == 0:
        return {"zero": 0.0, "subnormal": 0.0, "normal": 0.0, "overflow": 0.0}
    c = v.to(dtype).to(torch.float64).abs()
    tiny = torch.finfo(dtype).smallest_normal
    n = v.numel()
    return {
        "zero": (c == 0).sum().item() / n,
        "subnormal": ((c > 0) & (c < tiny)).sum().item() / n,
        "normal": ((c >= tiny) & torch.isfinite(c)).sum().item() / n,
        "overflow": torch.isinf(c).sum().item() / n,
    }


def flush_fraction(values: torch.Tensor, dtype: torch.dtype) -> float:
    """Fraction of the nonzero `values` that round to zero in `dtype`."""
    return magnitude_classes(values, dtype)["zero"]


def lost_to_zero(reference: torch.Tensor, test: torch.Tensor) -> float:
    """Fraction of elements that are nonzero in `reference` but exactly zero in `test` (same shape)."""
    nz = reference != 0
    return ((test == 0) & nz).sum().item() / max(1, nz.sum().item())


# ---- what autocast does to each operation -----------------------------------------------------

VIEW_OPS = {
    "view",
    "_unsafe_view",
    "t",
    "transpose",
    "split",
    "expand",
    "detach",
    "alias",
    "permute",
    "slice",
    "select",
    "unsqueeze",
    "squeeze",
    "reshape",
    "as_strided",
    "unbind",
    "_reshape_alias",
}


@dataclass(frozen=True)
class OpRecord:
    phase: str  # "forward" (the model), "loss" (cross-entropy) or "backward"
    module: str  # where in the model (blocks.N. prefix dropped), "" outside any module
    op: str  # aten op name, e.g. "addmm"
    inputs: tuple[str, ...]  # dtypes of the floating-point tensor inputs
    output: str  # dtype of the first floating-point output


class _DtypeRecorder(TorchDispatchMode):
    def __init__(self, skip_views: bool = True):
        super().__init__()
        self.records: list[OpRecord] = []
        self.phase, self.module = "forward", ""
        self.skip_views = skip_views

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        op = func.overloadpacket.__name__
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if outs and not (self.skip_views and op in VIEW_OPS):
            ins = tuple(
                short(t.dtype)
                for t in tree_flatten((args, kwargs))[0]
                if isinstance(t, torch.Tensor) and t.is_floating_point()
            )
            self.records.append(OpRecord(self.phase, self.module, op, ins, short(outs[0].dtype)))
        return out


def _generic_name(name: str) -> str:
    parts = name.split(".")
    if len(parts) >= 2 and parts[0] == "blocks" and parts[1].isdigit():
        parts = parts[2:]
    return ".".join(parts)


def record_dtypes(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, precision: str, backward: bool = True, skip_views: bool = True
) -> list[OpRecord]:
    """Run forward and loss under the autocast of `precision` (as the training loop does), then backward
    outside it, recording the dtype of every operation. Gradients are left in the model's .grad."""
    from ..techniques import autocast_context, loss_sum

    device = next(model.parameters()).device
    autocast = autocast_context(precision, str(device))
    rec = _DtypeRecorder(skip_views)
    stack: list[str] = []
    names = {m: _generic_name(n) for n, m in model.named_modules() if n}

    def pre(mod, _inp):
        stack.append(names[mod])
        rec.module = stack[-1]

    def post(mod, _inp, _out):
        stack.pop()
        rec.module = stack[-1] if stack else ""

    handles = [m.register_forward_pre_hook(pre) for m in names] + [m.register_forward_hook(post) for m in names]
    try:
        with rec:
            with autocast():
                logits = model(x)
                rec.phase, rec.module = "loss", ""
                loss = loss_sum(logits, y) / y.numel()
            if backward:
                rec.phase = "backward"
                loss.backward()
    finally:
        for h in handles:
            h.remove()
    return rec.records


def summarize_ops(records: list[OpRecord], phases=("forward", "loss", "backward")) -> list[dict[str, str]]:
    """One row per (phase, module, op, dtypes), in first-seen order, with how many times it ran."""
    counts: dict[tuple, int] = {}
    for r in records:
        if r.phase in phases:
            key = (r.phase, r.module if r.phase != "backward" else "", r.op, r.inputs, r.output)
            counts[key] = counts.get(key, 0) + 1
    return [
        {"phase": p, "module": m or "-", "op": op, "inputs": ", ".join(ins) or "-", "output": out, "count": str(n)}
        for (p, m, op, ins, out), n in counts.items()
    ]


def output_dtypes(records: list[OpRecord], op: str, phase: str | None = None) -> set[str]:
    """The dtypes that operation `op` produced (in `phase`, or any)."""
    return {r.output for r in records if r.op == op and (phase is None or r.phase == phase)}


# ---- gradients of one real step ---------------------------------------------------------------


@dataclass
class GradientSample:
    """The gradients of one forward + backward: parameter gradients (fp32 master weights, unscaled), and the
    gradients flowing backward through every Linear output (the activations' gradients, as they were: in
    the autocast dtype, and still multiplied by `loss_scale`)."""

    precision: str
    loss_scale: float
    parameters: torch.Tensor  # |grad|, flat, fp64, unscaled
    activations: torch.Tensor  # |grad| of Linear outputs (logits included), flat, fp64, as stored (scaled)
    activation_dtype: str
    loss: float

    @property
    def activations_unscaled(self) -> torch.Tensor:
        return self.activations / self.loss_scale


def _batch(cfg: TrainConfig, seed: int):
    from .. import data as data_mod

    splits = data_mod.load_splits()
    gen = torch.Generator().manual_seed(seed)
    x, y = data_mod.random_windows(splits.train, cfg.micro_batch_size, cfg.context, gen)
    return x.to(cfg.device), y.to(cfg.device)


def fresh_model(cfg: TrainConfig) -> nn.Module:
    """The GPT of `cfg`, initialised with cfg.seed exactly as the training loop initialises it."""
    from ..model import GPT

    torch.manual_seed(cfg.seed)
    return GPT(cfg.model).to(cfg.device)


def gradient_sample(
    cfg: TrainConfig,
    precision: str = "fp32",
    loss_scale: float = 1.0,
    model: nn.Module | None = None,
    batch: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> GradientSample:
    """One forward + backward of the model of `cfg` on one batch, under the autocast of `precision`, the loss
    (mean over target tokens, as in the loop) multiplied by `loss_scale` before backward. No optimizer step."""
    from ..data import count_targets
    from ..techniques import autocast_context, loss_sum

    model = copy.deepcopy(model) if model is not None else fresh_model(cfg)
    x, y = batch if batch is not None else _batch(cfg, cfg.seed)
    acts: list[torch.Tensor] = []
    dtypes: set[str] = set()

    def store(g: torch.Tensor) -> None:
        acts.append(g.detach().abs().flatten().to(torch.float64).cpu())
        dtypes.add(short(g.dtype))

    def keep(_mod, _inp, out):
        if out.requires_grad:
            out.register_hook(store)

    handles = [m.register_forward_hook(keep) for m in model.modules() if isinstance(m, nn.Linear)]
    autocast = autocast_context(precision, cfg.device)
    try:
        model.zero_grad(set_to_none=True)
        with autocast():
            loss = loss_sum(model(x), y) / count_targets(y)
        (loss * loss_scale).backward()
    finally:
        for h in handles:
            h.remove()
    params = torch.cat(
        [
            p.grad.detach().abs().flatten().to(torch.float64).cpu() / loss_scale
            for p in {id(p): p for p in model.parameters()}.values()
            if p.grad is not None
        ]
    )
    return GradientSample(precision, loss_scale, params, torch.cat(acts), "/".join(sorted(dtypes)), loss.item())


# ---- error against fp64 ------------------------------------------------------------------------


def rel_error(test: torch.Tensor, ref: torch.Tensor) -> float:
    """||test - ref|| / ||ref|| (Frobenius), computed in fp64."""
    ref = ref.to(torch.float64)
    return ((test.to(torch.float64) - ref).norm() / ref.norm()).item()


def matmul_errors(n: int = 512, device: str = "cpu", seed: int = 0) -> dict[str, float]:
    """Relative error of an (n x n) @ (n x n) matmul of N(0,1) matrices in each format against fp64.
    fp32: plain fp32. tf32 (emulated): inputs rounded to TF32, product in fp32, on any device. bf16 and fp16:
    inputs and output in that dtype, sums accumulated in fp32. On CUDA Ampere+, also the real TF32 tensor-core
    matmul."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    a = torch.randn(n, n, generator=gen, dtype=torch.float64).to(device)
    b = torch.randn(n, n, generator=gen, dtype=torch.float64).to(device)
    ref = a @ b
    from ..capabilities import capabilities
    from ..techniques import matmul_precision

    m = torch.backends.cuda.matmul
    prev = (m.allow_fp16_reduced_precision_reduction, m.allow_bf16_reduced_precision_reduction)
    try:
        # measure the format, with fp32 accumulation: no TF32, no 16-bit partial sums in split-K kernels
        m.allow_fp16_reduced_precision_reduction = m.allow_bf16_reduced_precision_reduction = False
        with matmul_precision("fp32"):
            out = {
                "fp32": rel_error(a.float() @ b.float(), ref),
                "tf32 (emulated)": rel_error(round_to_tf32(a.float()) @ round_to_tf32(b.float()), ref),
                "bf16": rel_error(a.bfloat16() @ b.bfloat16(), ref),
                "fp16": rel_error(a.half() @ b.half(), ref),
            }
        if torch.device(device).type == "cuda" and capabilities(device).precisions["tf32"].ok:
            with matmul_precision("tf32"):
                out["tf32 (tensor cores)"] = rel_error(a.float() @ b.float(), ref)
    finally:
        m.allow_fp16_reduced_precision_reduction, m.allow_bf16_reduced_precision_reduction = prev
    return out


@dataclass
class StepError:
    precision: str
    loss: float
    loss_rel_error: float
    grad_rel_error: float
    loss_scale: float = 1.0
    note: str = ""


def one_step_errors(
    cfg: TrainConfig, precisions=("fp32", "bf16", "fp16"), fp16_loss_scale: float = 2.0**16
) -> list[StepError]:
    """One step's loss and parameter gradients in each precision against the same step in fp64 (same initial
    weights, same batch). fp16 runs with and without `fp16_loss_scale`. TF32 is measured on CUDA Ampere+ only."""
    from ..capabilities import capabilities

    model = fresh_model(cfg)
    batch = _batch(cfg, cfg.seed)
    ref64 = gradient_sample_with_grads(model.double(), batch, "fp32", 1.0)
    model = model.float()
    out = []
    for p in precisions:
        runs = [(p, 1.0)] + ([("fp16", fp16_loss_scale)] if p == "fp16" and fp16_loss_scale != 1.0 else [])
        for prec, scale in runs:
            if prec == "tf32" and not (
                torch.device(cfg.device).type == "cuda" and capabilities(cfg.device).precisions["tf32"].ok
            ):
                out.append(
                    StepError(
                        "tf32",
                        float("nan"),
                        float("nan"),
                        float("nan"),
                        note="skipped: TF32 needs CUDA on Ampere or newer",
                    )
                )
                continue
            loss, grads = gradient_sample_with_grads(model, batch, prec, scale)
            out.append(StepError(prec, loss, abs(loss - ref64[0]) / abs(ref64[0]), rel_error(grads, ref64[1]), scale))
    return out


def gradient_sample_with_grads(
    model: nn.Module, batch, precision: str, loss_scale: float
) -> tuple[float, torch.Tensor]:
    """(loss, all parameter gradients as one flat fp64 vector, unscaled) of one forward + backward on a copy of
    `model`."""
    from ..data import count_targets
    from ..techniques import autocast_context, loss_sum, matmul_precision

    m = copy.deepcopy(model)
    x, y = batch
    device = next(m.parameters()).device
    with matmul_precision(precision):
        with autocast_context(precision, str(device))():
            loss = loss_sum(m(x), y) / count_targets(y)
        (loss * loss_scale).backward()
    params = {id(p): p for p in m.parameters()}.values()
    return loss.item(), torch.cat([p.grad.flatten().to(torch.float64).cpu() / loss_scale for p in params])


# ---- why master weights: one real update, stored in each format ---------------------------------------


def tensor_kind(name: str, p: torch.Tensor) -> str:
    """ "matrices, embeddings" (>= 2-D), "LayerNorm gains" or "biases, LayerNorm shifts"."""
    if p.dim() >= 2:
        return "matrices, embeddings"
    return (
        "LayerNorm gains"
        if name.split(".")[-2].startswith("ln") and name.endswith("weight")
        else "biases, LayerNorm shifts"
    )


def updates_lost_by_format(
    cfg: TrainConfig, optimizers: dict, formats=("fp32", "bf16", "fp16")
) -> tuple[dict, list[dict]]:
    """One real optimizer step on the model of `cfg` (the fp32 gradient of one batch), from fresh state with each of
    `optimizers` {label: make(params) -> Optimizer}, added exactly to the weights stored in each format and rounded
    once: ({(label, kind, format): share of the weights with a nonzero update whose stored value did not change}, table
    rows)."""
    from ..data import count_targets
    from ..techniques import loss_sum

    model = fresh_model(cfg)
    x, y = _batch(cfg, cfg.seed)
    (loss_sum(model(x), y) / count_targets(y)).backward()
    named = list(model.named_parameters())
    kinds = list(dict.fromkeys(tensor_kind(n, p) for n, p in named))
    lost, rows = {}, []
    for label, make in optimizers.items():
        m = copy.deepcopy(model)  # fresh optimizer state, the same gradient
        for p, q in zip(m.parameters(), model.parameters()):
            p.grad = q.grad.clone()
        before = [p.detach().clone() for p in m.parameters()]
        make(list(m.parameters())).step()
        deltas = [p.detach() - b for p, b in zip(m.parameters(), before)]
        for kind in kinds:
            w = torch.cat([p.detach().flatten() for n, p in named if tensor_kind(n, p) == kind]).cpu()
            d = torch.cat([u.flatten() for (n, p), u in zip(named, deltas) if tensor_kind(n, p) == kind]).cpu()
            w, d = w[d != 0], d[d != 0]
            row = {
                "update": label,
                "tensors": kind,
                "median |update|": f"{d.abs().median():.1e}",
                "median |weight|": f"{w.abs().median():.2g}",
            }
            for fmt in formats:
                stored = w.to(DTYPES[fmt])
                lost[(label, kind, fmt)] = float(
                    ((stored.double() + d.double()).to(DTYPES[fmt]) == stored).double().mean()
                )
                row[f"{fmt}: not moved"] = f"{100 * lost[(label, kind, fmt)]:.1f}%"
            rows.append(row)
    return lost, rows


# ---- speed of one matmul ------------------------------------------------------------------------


def matmul_tflops(
    n: int, precision: str, device: str = "cpu", min_time_s: float = 0.3, max_reps: int = 50
) -> tuple[float | None, str]:
    """Achieved TFLOP/s of an n x n matmul in `precision` on `device` (course_lib.capabilities.matmul_tflops),
    or (None, why) where it would not mean anything (TF32 off CUDA Ampere+)."""
    from .. import capabilities as caps

    if precision == "tf32" and not (
        torch.device(device).type == "cuda" and caps.capabilities(device).precisions["tf32"].ok
    ):
        return None, "TF32 is a CUDA tensor-core mode (Ampere or newer): on this device it would time plain fp32"
    return caps.matmul_tflops(
        device, precision, n, n, n, min_time_s=min_time_s, max_reps=max_reps
    ), "median of timed matmuls"


# ---- plots ---------------------------------------------------------------------------------------

FORMAT_COLORS = {
    "fp32": "#4c72b0",
    "tf32": "#64b5cd",
    "bf16": "#dd8452",
    "fp16": "#55a868",
    "fp8 e4m3": "#c44e52",
    "fp8 e5m2": "#8172b3",
}


def plot_formats(fmts: list[FloatFormat]):
    """Left: the range of each format on a log2 axis (solid: normal numbers, light: subnormals). Right: how
    many values each format has per binade [2^e, 2^(e+1)), i.e. its precision, across that range."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 3.6), layout="constrained")
    for i, f in enumerate(fmts):
        c = FORMAT_COLORS.get(f.name, None)
        lo, mid, hi = math.log2(f.smallest_subnormal), math.log2(f.smallest_normal), math.log2(f.max)
        ax1.barh(i, mid - lo, left=lo, color=c, alpha=0.35)
        ax1.barh(i, hi - mid, left=mid, color=c)
        ax1.annotate(f"{f.exponent_bits}e{f.mantissa_bits}m", (hi + 2, i), va="center", fontsize=8)
        per = values_per_binade(f)
        es = sorted(per)
        ax2.step(es, [per[e] for e in es], where="post", color=c, label=f.name)
    ax1.set_yticks(range(len(fmts)), [f.name for f in fmts])
    ax1.axvline(-24, color="k", lw=0.8, ls=":")
    ax1.annotate("2^-24", (-24, len(fmts) - 0.5), fontsize=7, ha="center")
    ax1.set_xlabel("log2 |value|   (light: subnormal range, solid: normal range)")
    ax1.set_title("Range: smallest subnormal to largest finite value", fontsize=9)
    ax1.invert_yaxis()
    ax2.set_yscale("log", base=2)
    ax2.set_xlabel("binade e: values in [2^e, 2^(e+1))")
    ax2.set_ylabel("representable values per binade")
    ax2.set_title("Precision: 2^(mantissa bits) values in every normal binade", fontsize=9)
    ax2.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def plot_magnitudes(named: dict[str, torch.Tensor], ax=None, title: str = "", bins: int = 120):
    """Histogram of log2 |value| of the nonzero values of each tensor, with fp16's limits marked."""
    import matplotlib.pyplot as plt

    if ax is None:
        fig, ax = plt.subplots(figsize=(8, 3.4), layout="constrained")
    fig = ax.figure
    allv = [torch.log2(v[v > 0]) for v in named.values()]
    lo = min(float(v.min()) for v in allv if v.numel()) - 1
    hi = max(float(v.max()) for v in allv if v.numel()) + 1
    for (name, _), lv in zip(named.items(), allv):
        ax.hist(lv.numpy(), bins=bins, range=(min(lo, -30), max(hi, 0)), histtype="step", lw=1.3, label=name)
    ax.axvspan(min(lo, -30), -24, color="#c44e52", alpha=0.12, label="fp16: rounds to 0 (< 2^-24)")
    ax.axvspan(-24, -14, color="#dd8452", alpha=0.10, label="fp16 subnormal (fewer bits)")
    ax.axvline(-24, color="#c44e52", lw=1)
    ax.axvline(-14, color="#dd8452", lw=1)
    ax.set_yscale("log")
    ax.set_xlabel("log2 |gradient|")
    ax.set_ylabel("count of elements")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    return fig


def plot_loss_scale(result, ax=None):
    """The GradScaler's scale per step of an fp16 run (log2 axis), skipped steps marked."""
    import matplotlib.pyplot as plt

    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 3), layout="constrained")
    fig = ax.figure
    scales = result.loss_scales
    ax.step(range(len(scales)), scales, where="post", label="loss scale used in the step")
    skipped = [i for i, g in enumerate(result.grad_norms) if not math.isfinite(g)]
    ax.plot(skipped, [scales[i] for i in skipped], "x", color="#c44e52", ms=8, label="step skipped (inf/nan gradient)")
    ax.set_yscale("log", base=2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss scale")
    ax.set_title(
        f"GradScaler over time: {result.label}\n"
        f"{result.provenance.get('device', '?')}, torch {result.provenance.get('torch', '?')}",
        fontsize=9,
    )
    ax.legend(fontsize=7)
    return fig


# ---- the panel's plots (notebook 03): every run on the Axes they are given, no pyplot ----------------

FP16_MAX = 65504.0


def plot_scaler_trace(results, ax):
    """The GradScaler's scale per optimizer step of every fp16 run (log2 axis), each run's skipped steps (inf/nan
    gradients: the scale halves) marked x, and the share of one step's activation gradients fp16 lost to zero at the
    starting scale (r.details["underflow"], where measured); a run without a scaler (not fp16) is left out."""
    for r in results:
        if not r.loss_scales:
            continue
        scales = r.loss_scales
        skipped = [i for i, g in enumerate(r.grad_norms) if not math.isfinite(g)]
        u = (getattr(r, "details", None) or {}).get("underflow")
        zeros = f"; fp16 lost {u['lost_to_zero']:.1%} to zero at S=2^{math.log2(u['scale']):g}" if u else ""
        (line,) = ax.step(
            range(len(scales)),
            scales,
            where="post",
            lw=1.3,
            label=f"{r.label}: {r.skipped_optimizer_steps} of {len(scales)} steps skipped{zeros}",
        )
        ax.plot(skipped, [scales[i] for i in skipped], "x", color=line.get_color(), ms=8)
    if not ax.lines:
        placeholder(ax, "no fp16 run yet\n(precision: fp16)")
    else:
        ax.set_yscale("log", base=2)
    ax.set_xlabel("optimizer step (x: step skipped, inf/nan gradient)")
    ax.set_ylabel("loss scale used in the step")
    devices = sorted({r.provenance.get("device", "?") for r in results})
    ax.set_title(f"GradScaler over time\n{' / '.join(devices)}", fontsize=9)
    if ax.lines:
        ax.legend(fontsize=7)
    return ax.figure


def plot_op_dtypes(results, ax, last: int = 6):
    """The dtype each group of operations ran in (r.details["op_dtypes"], panel_runner), one column per run (the
    `last` runs), coloured by format: a panel plot, fn(results, ax)."""
    from matplotlib.patches import Rectangle

    runs = [r for r in results if (getattr(r, "details", None) or {}).get("op_dtypes")][-last:]
    rows = list(dict.fromkeys([*OP_GROUPS, "weights", "weight gradients"]))
    rows = [g for g in rows if any(g in r.details["op_dtypes"] for r in runs)]
    for j, r in enumerate(runs):
        for i, g in enumerate(rows):
            dt = r.details["op_dtypes"].get(g, "")
            ax.add_patch(
                Rectangle(
                    (j, i),
                    1,
                    1,
                    facecolor=FORMAT_COLORS.get(dt.split(",")[0], "#eeeeee"),
                    edgecolor="white",
                    alpha=0.55 if dt else 1.0,
                )
            )
            ax.text(j + 0.5, i + 0.5, dt or "-", ha="center", va="center", fontsize=7)
    ax.set_xlim(0, max(1, len(runs)))
    ax.set_ylim(len(rows), 0)
    ax.set_yticks([i + 0.5 for i in range(len(rows))], rows, fontsize=7)
    ax.set_xticks([j + 0.5 for j in range(len(runs))], [r.label.split(" ")[0] for r in runs], fontsize=7)
    ax.tick_params(length=0)
    if not runs:
        placeholder(ax, "no run yet")
    ax.set_title("The dtype each op ran in (one step, forward unless named)", fontsize=9)
    return ax.figure


# ---- notebook 03's panel: precision, the dtype of each op, loss scaling, pure bf16 ------------------------

# Groups of operations shown on the panel: (phase, aten ops). The matmuls and attention are on autocast's 16-bit list,
# the loss on its fp32 list; the rest follows its inputs (so the residual stream stays fp32 with fp32 weights).
OP_GROUPS = {
    "matmuls (addmm, mm)": ("forward", ("addmm", "mm")),
    "attention (bmm or SDPA)": (
        "forward",
        (
            "bmm",
            "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_efficient_attention",
        ),
    ),
    "softmax": ("forward", ("_softmax",)),
    "GELU": ("forward", ("gelu",)),
    "layer norm": ("forward", ("native_layer_norm",)),
    "residual add": ("forward", ("add",)),
    "loss (log_softmax)": ("loss", ("_log_softmax",)),
    "backward matmuls": ("backward", ("mm", "bmm")),
}


def op_dtypes(records: list[OpRecord], model: nn.Module | None = None) -> dict[str, str]:
    """{group of OP_GROUPS: the dtypes its ops produced}, and with `model` (after record_dtypes' backward) the dtypes
    of its weights and their gradients."""
    out = {}
    for group, (phase, ops) in OP_GROUPS.items():
        found = set().union(*(output_dtypes(records, op, phase) for op in ops))
        if found:
            out[group] = ", ".join(sorted(found))
    if model is not None:
        params = list(model.parameters())
        out["weights"] = ", ".join(sorted({short(p.dtype) for p in params}))
        out["weight gradients"] = ", ".join(sorted({short(p.grad.dtype) for p in params if p.grad is not None}))
    return out


def panel_runner(cfg: TrainConfig, label: str, callback=None, weights: str = "fp32 master weights"):
    """What Run does on notebook 03's panel (widgets.Panel's runner; `weights` is its extra control, a key of
    pure_bf16.SCHEMES). Records the dtype each op of one step runs in (op_dtypes), then trains `cfg` through the
    course's loop with fp32 master weights, or with the weights, gradients and AdamW state in bf16 (pure_bf16.train:
    the update lost per step). An fp16 run also measures one step's activation gradients lost to zero at its starting
    loss scale. The result's note (the table's last column) says what it found."""
    from ..capabilities import require
    from ..config import ConfigError
    from ..train import run
    from . import pure_bf16 as L

    # before the dtype recording runs anything this device cannot (bf16 on a V100: a ConfigError, the fix named)
    require(cfg)
    dtype, rounding = L.SCHEMES[weights]
    if dtype != torch.float32 and cfg.precision != "bf16":
        raise ConfigError(f"weights in bf16 train under bf16 autocast: set precision to bf16 (it is {cfg.precision})")
    model = fresh_model(cfg).to(dtype)
    ops = op_dtypes(record_dtypes(model, *_batch(cfg, cfg.seed), cfg.precision), model)
    if dtype == torch.float32:
        result = run(cfg, label, callback=callback)
    else:
        result = L.train(cfg, rounding, dtype, label=label, callback=callback)
    result.with_details(op_dtypes=ops)
    note = [
        f"matmuls in {ops.get('matmuls (addmm, mm)', '-')}, layer norm {ops.get('layer norm', '-')}, "
        f"loss {ops.get('loss (log_softmax)', '-')}, weights {ops['weights']}"
    ]
    if cfg.precision == "fp16":
        S = cfg.loss_scale_init
        g32, g16 = gradient_sample(cfg, "fp32"), gradient_sample(cfg, "fp16", loss_scale=S)
        u = {
            "scale": S,
            "lost_to_zero": lost_to_zero(g32.activations, g16.activations),
            "overflow": torch.isinf(g16.activations).double().mean().item(),
        }
        result.with_details(underflow=u)
        note.append(
            f"{result.skipped_optimizer_steps} steps skipped, fp16 lost {u['lost_to_zero']:.2%} of the activation "
            f"gradients to zero at S=2^{math.log2(S):g}"
        )
    if (lost := L.update_lost(result)) is not None:
        note.append(f"{round(100 * lost, 2) + 0.0:.2f}% of the updates lost over the run")  # + 0.0: no "-0.00"
    if result.ok:
        result.reason = "; ".join(note)
    return result
