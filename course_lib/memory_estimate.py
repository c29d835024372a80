"""The memory formula (course_lib.memory_formula) checked before a CPU run starts (`run_checked`), and `account_step`:
one step under the CPU ledger, optionally under FakeTensorMode, so a model too big for this machine is accounted."""

from __future__ import annotations

import contextlib
import dataclasses
import os

import torch

from . import measure, techniques
from .config import TrainConfig
from .measure import MemoryReport
from .memory_formula import estimate


def check_cpu_memory(cfg: TrainConfig) -> None:
    """On a CPU, a MemoryError (reported as "oom") before anything is allocated where the formula puts a step's peak
    above what is free: past that, Linux kills the process, and the notebook's kernel with it."""
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
    """train.run, refused first (an "oom" result) where check_cpu_memory says the step would not fit."""
    from .train import catching_oom, run

    def attempt():
        check_cpu_memory(cfg)
        return run(cfg, label, **kwargs)

    return catching_oom(attempt, cfg, label)


# ---- accounting one step with the ledger, optionally without allocating ----------------------------


def account_step(cfg: TrainConfig, fake: bool = True, warm_steps: int = 1) -> MemoryReport:
    """The memory of one training step of `cfg` (the loop's own step body, random token ids) by the CPU ledger, with a
    per-op timeline of live bytes, after `warm_steps` unwatched steps (the optimizer state exists). fake=True: under
    FakeTensorMode tensors have sizes but no memory, so GPT-2 small is accounted on a laptop. Compile is turned off:
    the ledger needs eager ops."""
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
