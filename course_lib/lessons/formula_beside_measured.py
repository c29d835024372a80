"""Notebooks 01, 02 and 09: the memory formula (course_lib.memory_formula) beside a measurement, as a table and as the
panels' runner, and one step accounted by the CPU ledger (`account_step`, under FakeTensorMode: nothing allocated)."""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from .. import measure, techniques
from ..config import TrainConfig
from ..measure import CATEGORIES, MemoryReport
from ..memory_estimate import run_checked
from ..memory_formula import Estimate, estimate
from ..model import GPT
from ..results import RESERVED_PEAK
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
    plots.plot_memory_vs_estimate) and its peak in the note."""
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
