"""Notebooks 01, 02 and 09: the memory formula (course_lib.memory_formula) beside a measurement, as a table, a figure
and the panels' runner; the FLOPs' time at the peak beside the measured step; and one step accounted by the CPU ledger
(`account_step`, under FakeTensorMode: nothing allocated)."""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from matplotlib.figure import Figure

from .. import measure, techniques
from ..config import TrainConfig
from ..measure import CATEGORIES, MemoryReport
from ..memory_estimate import run_checked
from ..memory_formula import Estimate, estimate
from ..model import GPT
from ..plots import CATEGORY_COLORS, devices_text, new_axes, tick
from ..results import RESERVED_PEAK, RunResult
from ..train import train_step


def beside_measured(est: Estimate, measured: dict | MemoryReport) -> list[dict[str, str]]:
    """Rows for a table: the formula's prediction beside a measurement (a RunResult's `memory` or a MemoryReport) in
    MiB, category by category, then the peak, with the difference as a share of the measured peak."""
    by = measured["by_category"] if isinstance(measured, dict) else measured.by_category
    peak = measured["peak_bytes"] if isinstance(measured, dict) else measured.peak_bytes
    pairs = [(c, est.by_category[c], by.get(c)) for c in CATEGORIES] + [(f"peak ({est.when})", est.peak_bytes, peak)]
    return [
        {
            "": name,
            "formula MiB": f"{pred / 2**20:.2f}",
            "measured MiB": measure.mib_text(meas).removesuffix(" MiB"),  # "not measured": inside CUDA's "other"
            "formula - measured": "" if meas is None else f"{(pred - meas) / peak:+.2%} of the peak",
        }
        for name, pred, meas in pairs
    ]


def run_beside_estimate(cfg: TrainConfig, label: str, callback=None, **kwargs):
    """A run (memory_estimate.run_checked) with the formula's prediction in details["estimate"] (drawn by
    plot_memory_vs_estimate) and its peak in the note."""
    result = run_checked(cfg, label, callback=callback, **kwargs)
    if not result.ok or not result.memory:
        return result
    est = estimate(cfg)
    peak = result.memory["peak_bytes"]
    against = (  # the formula counts live tensors: against a reserved peak, no percentage
        f"measured {fmt_bytes(peak)} ({RESERVED_PEAK}: not the live tensors the formula counts)"
        if result.peak_is_reserved
        else f"measured {fmt_bytes(peak)} ({round((est.peak_bytes - peak) / peak, 3) + 0.0:+.1%})"
    )
    note = f"peak: formula {fmt_bytes(est.peak_bytes)}, {against}, {est.when}" + (
        " (the formula counts eager PyTorch, not compiled code)" if cfg.compile else ""
    )
    result.reason = "; ".join(filter(None, (result.reason, note)))
    return result.with_details(
        estimate={"by_category": est.by_category, "peak_bytes": est.peak_bytes, "when": est.when}
    )


def fmt_bytes(n: int | float) -> str:
    """Bytes with a binary unit (KiB, MiB, GiB = 1024^3)."""
    for unit, k in (("GiB", 3), ("MiB", 2), ("KiB", 1)):
        if abs(n) >= 1024**k:
            return f"{n / 1024**k:.2f} {unit}"
    return f"{int(n)} B"


def account_step(cfg: TrainConfig, fake: bool = True, warm_steps: int = 1) -> MemoryReport:
    """The memory of one training step of `cfg` (the loop's own step body, random token ids) by the CPU ledger, with a
    per-op timeline of live bytes, after `warm_steps` unwatched steps (the optimizer state exists). fake=True: under
    FakeTensorMode tensors have sizes but no memory, so GPT-2 small is accounted on a laptop. Compile is turned off:
    the ledger needs eager ops."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if fake and cfg.precision == "fp16":
        raise ValueError(
            "precision='fp16' cannot be accounted under FakeTensorMode: its GradScaler reads the loss scale with "
            ".item(), which a fake tensor cannot answer. Use fake=False on a config that fits, or bf16 (the same "
            "bytes but for the scaler's few scalars)."
        )
    cfg = dataclasses.replace(cfg, compile=False, device="cpu")
    mode = FakeTensorMode() if fake else contextlib.nullcontext()
    torch.manual_seed(cfg.seed)
    with mode:
        model = GPT(cfg.model)
        setup = techniques.build(cfg, model)
        params = list(model.parameters())
        V, shape = cfg.model.vocab_size, (cfg.micro_batch_size, cfg.context)
        micro = [(torch.randint(0, V, shape), torch.randint(0, V, shape)) for _ in range(cfg.grad_accum_steps)]
        n_targets = cfg.batch_size * cfg.context  # random ids: no padding
        for _ in range(warm_steps):
            train_step(setup, cfg, params, micro, n_targets=n_targets)
        meter = measure.LedgerMeasurement(setup.parts.head)
        with meter.watching(setup):
            train_step(setup, cfg, params, micro, meter, n_targets=n_targets)
        report = meter.report()
    if fake:
        report.method = "CPU ledger under FakeTensorMode: shapes only, nothing allocated"
    return report


def _pair_ticks(ax, names: list[str]) -> None:
    ticks = [3 * i + j for i in range(len(names)) for j in range(2)]
    labels = [f"{tick(n)} ({w})" for n in names for w in ("formula", "measured")]
    ax.set_xticks(ticks, labels, rotation=35, ha="right", fontsize=7)


def plot_formula_beside_measured(
    pairs: dict[str, tuple[dict, dict | None]], ax=None, title: str = "Memory by category"
) -> Figure:
    """For each name, the formula's bytes by category (hatched) beside the measured bytes (solid; a category measured
    as None has no bar), labelled with the totals' difference. MiB, or GiB where a total passes 1 GiB."""
    fig, ax = new_axes(ax)
    total = lambda d: sum(v or 0 for v in d.values())  # noqa: E731
    big = max((total(d) for p in pairs.values() for d in p if d), default=0) > 2**30
    unit, size = ("GiB", 2**30) if big else ("MiB", 2**20)
    # the course's categories, then any a caller merged (plot_memory_vs_estimate on CUDA), in their order
    keys = [*CATEGORIES, *dict.fromkeys(k for p in pairs.values() for d in p for k in (d or {}) if k not in CATEGORIES)]
    present = [c for c in keys if any((d or {}).get(c) for p in pairs.values() for d in p)]
    for i, (name, (predicted, measured)) in enumerate(pairs.items()):
        for j, d in enumerate((predicted, measured)):
            bottom = 0.0
            for cat in present:
                v = ((d or {}).get(cat) or 0) / size
                label = cat if (i, j) == (0, 1) else None
                hatch = "//" if j == 0 else None
                color = CATEGORY_COLORS.get(cat, "#d0d0d0")
                ax.bar(3 * i + j, v, bottom=bottom, color=color, hatch=hatch, edgecolor="white", label=label)
                bottom += v
        if measured:
            diff = f"{round(total(measured) / total(predicted) - 1, 3) + 0.0:+.1%}"
            ax.annotate(diff, (3 * i + 1, total(measured) / size), ha="center", va="bottom", fontsize=7)
    _pair_ticks(ax, list(pairs))
    ax.set_ylabel(f"bytes ({unit})")
    ax.set_title(f"{title}: formula (hatched) beside measured", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.margins(y=0.12)
    return fig


def _measured_apart(predicted: dict, measured: dict) -> tuple[dict, dict, str]:
    """(predicted, measured, the merged bar's name or "") with the categories measured as None merged into "other" on
    both sides: the CUDA allocator gives one peak, so no bar may claim a split nobody measured."""
    merged = [c for c in CATEGORIES if c != "other" and measured.get(c) is None]
    if not merged:
        return predicted, measured, ""
    name = f"{' + '.join(merged)} + other (one total)"

    def fold(d: dict) -> dict:
        kept = {c: v for c, v in d.items() if c not in merged and c != "other"}
        return {**kept, name: sum(d.get(c) or 0 for c in (*merged, "other"))}

    return fold(predicted), fold(measured), name


def plot_memory_vs_estimate(results: list[RunResult], ax=None, last: int = 3) -> Figure:
    """The last `last` runs with the formula's prediction (details["estimate"]): its peak by category beside the
    measured one (plot_formula_beside_measured), on CUDA only the categories the allocator lets apart."""
    shown = [r for r in results if r.ok and r.memory and "estimate" in r.details][-last:]
    split = {r.label: _measured_apart(r.details["estimate"]["by_category"], r.memory["by_category"]) for r in shown}
    fig = plot_formula_beside_measured({label: s[:2] for label, s in split.items()}, ax, "Peak by category")
    merged = {name for _, _, name in split.values() if name}
    ax = ax or fig.axes[0]
    note = "; ".join(sorted({r.memory.get("method", "").split(":")[0] for r in shown})) or "no run with an estimate"
    if merged:
        one_bar = "; ".join(n.removesuffix(" (one total)") for n in sorted(merged))
        note += f" (the allocator gives only the peak, not its split: {one_bar} drawn as one bar)"
    ax.set_title(f"{ax.get_title()}\n{note}\n{devices_text(shown or results)}", fontsize=9)
    return fig


def plot_time_vs_flops(results: list[RunResult], ax=None, last: int = 3) -> Figure:
    """For the last `last` runs with an MFU: the time the model's FLOPs (measure.flops_per_token) take at the peak
    (hatched: step time x MFU) beside the measured median step (solid). Log scale: on a CPU they are far apart."""
    fig, ax = new_axes(ax)
    shown = [r for r in results if r.ok and r.median_step_s and r.mfu][-last:]
    for i, r in enumerate(shown):
        ms, first = r.median_step_s * 1e3, i == 0
        at_peak = "6N + 12Lhs FLOPs at the peak" if first else None
        ax.bar(3 * i, ms * r.mfu, color="white", edgecolor="#4c72b0", hatch="//", label=at_peak)
        ax.bar(3 * i + 1, ms, color="#4c72b0", label="measured median step" if first else None)
        # MFU proper against a data sheet; elsewhere the efficiency against this machine's measured matmul peak
        kind = "MFU" if r.mfu_basis == "data-sheet peak" else "efficiency"
        ax.annotate(f"{kind} {r.mfu:.1%}", (3 * i + 1, ms), ha="center", va="bottom", fontsize=7)
    _pair_ticks(ax, [r.label for r in shown])
    ax.set_yscale("log")
    ax.set_ylabel("ms per optimizer step (log scale)")
    basis = "; ".join(sorted({r.mfu_basis for r in shown})) or "no run with an MFU"
    title = f"Step time: FLOPs at the peak ({basis}) beside measured"
    ax.set_title(f"{title}\n{devices_text(shown or results)}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig
