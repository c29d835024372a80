"""Where a step's time goes: torch.profiler around the course's one loop.

`profile_run(cfg)` trains cfg with `Trainer.fit` (the same loop every measurement uses) and steps the profiler from
its per-step callback, so the warm-up steps (compiling, the allocator's first requests) are left out and only the
`active` steps after them are recorded. `summary(...)` turns the record into the operators that took the most time of
their own, on the device that did the work: the GPU's kernels on CUDA, the CPU's operators otherwise. The notebook 01
section "Where the time goes" reads a profile by hand; this is the same reading for any config, from the command line
(`python -m course_lib profile`)."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, schedule

from .config import ConfigError, TrainConfig
from .results import RunResult


@dataclasses.dataclass
class Profile:
    result: RunResult  # the run's own measurements (its profiled steps are slower: the profiler adds overhead)
    prof: torch.profiler.profile
    active: list[int]  # the steps recorded
    device: str  # "cuda" or "cpu": whose time the summary counts

    @property
    def active_wall_s(self) -> float:
        return sum(self.result.step_times[i] for i in self.active)

    @property
    def self_time(self) -> str:
        """The events' attribute this profile counts, in microseconds: the device's own time of each event."""
        return "self_device_time_total" if self.device == "cuda" else "self_cpu_time_total"


def profile_run(
    cfg: TrainConfig,
    active: int = 3,
    trace: str | Path | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Profile:
    """Train cfg for its warm-up steps and then `active` recorded steps. With `trace`, also write the record as a
    Chrome trace (open it in chrome://tracing or https://ui.perfetto.dev). `progress(step, steps)` hears each step."""
    if active < 1:
        raise ConfigError(f"active={active}: profile at least 1 step")
    # At least two warm-up steps: the first compiles and fills the caches, and the profiler warms up on the last
    # one (it starts recording there and throws that step away: starting is slow, and would be in the first step).
    warmup = max(2, cfg.timing_warmup)
    # No memory ledger: on a CPU it would watch one of the steps, and its bookkeeping would be in the profile.
    cfg = dataclasses.replace(cfg, steps=warmup + active, measure_memory=False)
    on_cuda = torch.device(cfg.device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    when = schedule(skip_first=warmup - 1, wait=0, warmup=1, active=active, repeat=1)
    from .train import Trainer  # train imports much; this module is imported by the CLI's parser

    trainer = Trainer(cfg)
    with profile(activities=activities, schedule=when) as prof, _named_cpu_kernels(cfg):

        def after(step: int, _r) -> None:
            prof.step()
            if progress:
                progress(step + 1, cfg.steps)

        result = trainer.fit("profiled", callback=after)
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    return Profile(result, prof, list(range(warmup, warmup + active)), "cuda" if on_cuda else "cpu")


@contextlib.contextmanager
def _named_cpu_kernels(cfg: TrainConfig):
    """On a CPU with compile: Inductor's generated C++ kernels each record their own profiler event (cpp's
    enable_kernel_profile, on Linux and Windows: Inductor adds the events nowhere else), named after what they fuse
    (graph_0_cpp_fused_gelu_...); without it their time is the self time of the compiled graph's call, one opaque
    row. Compiled code from earlier in the process would lack the events, and code compiled here would keep them
    after: both are forgotten (torch._dynamo.reset(), before and after)."""
    if not (cfg.compile and torch.device(cfg.device).type == "cpu"):
        yield
        return
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    try:
        with inductor_config.patch({"cpp.enable_kernel_profile": True}):
            yield
    finally:
        torch._dynamo.reset()


# What `by_kind` sorts a CPU profile's operators into: (kind, does this event belong to it?), first match wins.
# `name` is the event's, `within` the names of the events it ran inside.
KINDS: tuple[tuple[str, Callable[[str, list[str]], bool]], ...] = (
    ("optimizer (AdamW's update, zero_grad)", lambda name, within: any(w.startswith("Optimizer.") for w in within)),
    ("matmuls", lambda name, within: name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")),
    ("attention (SDPA's fused kernel)", lambda name, within: "scaled_dot_product" in name),
    ("torch.compile's generated kernels", lambda name, within: "cpp_fused_" in name),
    ("compiled graphs' Python wrappers", lambda name, within: "Call CompiledFxGraph" in name),
    ("copies and fills", lambda name, within: name in ("aten::copy_", "aten::fill_", "aten::zero_")),
    ("everything else (eager element-wise ops, norms, softmax, loss, clipping, autograd)", lambda name, within: True),
)


def by_kind(p: Profile) -> dict[str, float]:
    """{kind: seconds per recorded step} for a CPU profile: the operators' own time (busy_s's, all threads) sorted
    into KINDS, the largest first."""
    out: dict[str, float] = {}
    for e in p.prof.events():
        if e.device_type != DeviceType.CPU or e.is_user_annotation:
            continue
        within, parent = [], e.cpu_parent
        while parent is not None:
            within.append(parent.name)
            parent = parent.cpu_parent
        kind = next(k for k, belongs in KINDS if belongs(e.name, within))
        out[kind] = out.get(kind, 0.0) + e.self_cpu_time_total / 1e6 / len(p.active)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def busy_s(p: Profile) -> float:
    """Seconds of work the device did in the recorded steps. On CUDA: the GPU's kernels and copies, each counted
    once, as torch's own "Self CUDA time total" counts them (summing the table's rows would count a kernel again in
    the operator that launched it, and again in the device-side span of a named range such as
    `Optimizer.step#AdamW.step`). On a CPU: the operators' own time, on all threads (named ranges and ProfilerStep#N
    are left out: their own time is the gaps between operators)."""
    kind = DeviceType.CUDA if p.device == "cuda" else DeviceType.CPU
    return (
        sum(getattr(e, p.self_time) for e in p.prof.events() if e.device_type == kind and not e.is_user_annotation)
        / 1e6
    )


def summary(p: Profile, rows: int = 20) -> str:
    """The profile's table (operators, and on CUDA their kernels, by the time of their own on the device that did
    the work) and how much of the recorded steps' wall time the device spent working; on a CPU, also a step's time
    by kind (by_kind)."""
    table = p.prof.key_averages().table(sort_by=p.self_time, row_limit=rows, max_name_column_width=60)
    wall_s, work_s = p.active_wall_s, busy_s(p)
    if p.device == "cuda":
        busy = (
            f"the GPU's kernels and copies: {work_s * 1e3:.1f} ms = {work_s / wall_s:.0%} of it (the rest: the GPU "
            f"idle, waiting for the CPU to launch work or for a synchronisation)"
        )
        return f"{table}\n{len(p.active)} recorded steps, {wall_s * 1e3:.1f} ms of wall time; {busy}"
    busy = f"the operators' own CPU time, all threads: {work_s * 1e3:.1f} ms"
    kinds = "\n".join(
        f"  {kind:<82} {s * 1e3:8.1f} ms  {s * len(p.active) / work_s:4.0%}" for kind, s in by_kind(p).items()
    )
    return (
        f"{table}\n{len(p.active)} recorded steps, {wall_s * 1e3:.1f} ms of wall time; {busy}\n"
        f"Where a step's time goes (the operators' own time per step, by kind):\n{kinds}"
    )
