"""The memory model beside measurements: `course_lib.memory_formula`'s formulas (import them from there) set beside
what the ledger measured (`beside_measured`, `run_beside_estimate`), the check a learner's run gets before it starts
on a CPU (`check_cpu_memory`, `run_checked`), and `account_step`, which runs one training step of a config under the
CPU ledger, optionally under FakeTensorMode, so that a model too big for this machine (GPT-2 small at batch 32, context
1024) is accounted without allocating. It is one step for accounting only (no data, no timing, no results): the
training loop is course_lib.train. Sharding the static memory across GPUs (ZeRO) is notebook 07's calculator
(course_lib.distributed.zero_memory).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import torch

from . import measure, techniques
from .config import TrainConfig
from .measure import CATEGORIES, MemoryReport
from .memory_formula import Estimate, estimate
from .results import RESERVED_PEAK


def beside_measured(est: Estimate, measured: dict | MemoryReport) -> list[dict[str, str]]:
    """Rows for a table: the formula's prediction beside a measurement (a RunResult's `memory` dict or a MemoryReport),
    category by category, then the peak, in MiB, with the difference as a share of the measured peak. A category the
    device cannot measure (CUDA: activations and logits are inside the allocator's total) says so."""
    by = measured["by_category"] if isinstance(measured, dict) else measured.by_category
    peak = measured["peak_bytes"] if isinstance(measured, dict) else measured.peak_bytes
    rows = []
    for name, pred, meas in [*((c, est.by_category[c], by.get(c)) for c in CATEGORIES), ("peak", est.peak_bytes, peak)]:
        rows.append(
            {
                "": name,
                "formula MiB": f"{pred / 2**20:.2f}",
                "measured MiB": measure.mib_text(meas).removesuffix(" MiB"),
                "formula - measured": "" if meas is None else f"{(pred - meas) / peak:+.2%} of the peak",
            }
        )
    rows[-1][""] = f"peak ({est.when})"
    return rows


def check_cpu_memory(cfg: TrainConfig) -> None:
    """On a CPU, a MemoryError (an out-of-memory the callers report as "oom") before anything is allocated, where the
    formula (estimate, notebook 02) puts a step's peak above what this machine has free: past that, Linux kills the
    process rather than fail an allocation, and the result and the notebook's kernel with it."""
    if torch.device(cfg.device).type != "cpu" or (free := measure.available_cpu_memory()) is None:
        return
    free //= int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # torchrun's processes on this machine share what is free
    try:
        need = estimate(cfg).peak_bytes
    except Exception:  # noqa: BLE001 - a config the formula does not model: the allocator is left to say
        return
    if need > free:
        raise MemoryError(
            f"a step needs about {need / measure.GiB:,.1f} GiB (notebook 02's formula), {free / measure.GiB:,.1f} GiB "
            "are free here: not started (the system would kill the process); lower batch_size or context, or add "
            "grad_accum_steps"
        )


def run_checked(cfg: TrainConfig, label: str = "run", **kwargs):
    """train.run of the course's GPT, refused first (an "oom" result) where check_cpu_memory says the step would not
    fit: the panels' runs and the ladder's, whose sizes a learner picks."""
    from .train import catching_oom, run

    def attempt():
        check_cpu_memory(cfg)
        return run(cfg, label, **kwargs)

    return catching_oom(attempt, cfg, label)


def run_beside_estimate(cfg: TrainConfig, label: str, callback=None, **kwargs):
    """A run of the course's loop (train.run) with the formula beside it: widgets.Panel's runner in notebooks 01 and 02.
    estimate's prediction of the step's peak goes in the result's details ("estimate": by_category, peak_bytes,
    when), and its note sets the predicted peak beside the measured one (plots.plot_memory_vs_estimate draws both,
    category by category). kwargs go to train.run (splits=...)."""
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


# ---- accounting one step with the ledger, optionally without allocating ----------------------------


def account_step(cfg: TrainConfig, fake: bool = True, warm_steps: int = 1) -> MemoryReport:
    """The memory of one training step of `cfg`, by the CPU ledger, with a per-op timeline of live bytes.

    fake=True runs under FakeTensorMode: every tensor has its shape, dtype and size but no memory, so GPT-2 small at
    batch 32, context 1024 is accounted on a laptop in seconds. warm_steps steps run first (unwatched) so that the
    optimizer state exists, as in a steady-state step. One step for accounting, not a training loop: random token
    ids, no timing, no loss values; the techniques come from techniques.build as in course_lib.train.
    Activation checkpointing, chunked loss and autocast are followed; compile is not (the ledger needs eager ops).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .model import GPT
    from .train import train_step

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
        V = cfg.model.vocab_size
        micro = [
            (
                torch.randint(0, V, (cfg.micro_batch_size, cfg.context)),
                torch.randint(0, V, (cfg.micro_batch_size, cfg.context)),
            )
            for _ in range(cfg.grad_accum_steps)
        ]
        n_targets = cfg.batch_size * cfg.context  # random ids: no padding
        for _ in range(warm_steps):  # so that the optimizer state exists, as in a steady-state step
            train_step(setup, cfg, params, micro, n_targets=n_targets)
        meter = measure.LedgerMeasurement(setup.parts.head)
        # the loop's own step body, watched by the ledger
        with meter.watching(setup):
            train_step(setup, cfg, params, micro, meter, n_targets=n_targets)
        report = meter.report()
    report.method = (
        "CPU ledger under FakeTensorMode: shapes only, nothing allocated"
        if fake
        else "CPU ledger: every tensor storage followed through one training step"
    )
    return report


def timeline_by_phase(report: MemoryReport) -> dict[str, list[tuple[int, int]]]:
    """The ledger's timeline as {phase: [(op index, live bytes), ...]} for plotting."""
    out: dict[str, list[tuple[int, int]]] = {}
    for i, (phase, live) in enumerate(report.timeline):
        out.setdefault(phase, []).append((i, live))
    return out


def fmt_bytes(n: int | float) -> str:
    """Bytes with a binary unit (KiB, MiB, GiB = 1024^3)."""
    for unit, k in (("GiB", 3), ("MiB", 2), ("KiB", 1)):
        if abs(n) >= 1024**k:
            return f"{n / 1024**k:.2f} {unit}"
    return f"{int(n)} B"
