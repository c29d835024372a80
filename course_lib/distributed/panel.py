"""A runner for widgets.Panel: data_parallel "none" trains in this process (course_lib.train.run); "ddp" or
"fsdp" launches `nproc` torchrun processes (course_lib.distributed.fsdp with {"only": ...}) and turns rank 0's
record into the panel's RunResult, with throughput for the global batch and memory per rank."""
from __future__ import annotations

from typing import Callable

from ..config import TrainConfig
from ..results import RunResult
from . import launch as L


def panel_runner(nproc: int = 2, timeout_s: float = 300) -> Callable[[TrainConfig, str, Callable], RunResult]:
    def runner(cfg: TrainConfig, label: str, callback) -> RunResult:
        if cfg.data_parallel == "none":
            from ..train import run

            return run(cfg, f"{label} (1 process)", callback=callback)
        res = L.launch("fsdp", nproc, cfg=cfg, options={"only": cfg.data_parallel}, timeout_s=timeout_s)
        if not res.ok:
            return RunResult(label=label, status="error", config=cfg.to_dict(), provenance={}, reason=res.why()[:300])
        rank0 = res.ranks[0][cfg.data_parallel]
        r = RunResult.from_dict(rank0["result"])
        r.label = f"{label} ({nproc} processes)"
        r.tokens_per_step = cfg.tokens_per_step * nproc
        r.tokens_per_s = r.tokens_per_step / r.median_step_s
        mem = rank0["memory"]
        r.memory = {"peak_bytes": sum(mem.values()), "by_category": {**mem, "activations": 0, "logits": 0, "other": 0},
                    "saved_for_backward_bytes": None, "reserved_bytes": None,
                    "method": "per rank: parameters + gradients + optimizer state held by rank 0 (activations not counted)"}
        r.reason = f"rank 0 of {nproc}; tokens/s for the global batch of {nproc} x {cfg.batch_size} sequences"
        callback(cfg.steps - 1, r)
        return r

    return runner
