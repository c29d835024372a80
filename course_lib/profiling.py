"""Where a step's time goes: torch.profiler around the course's one loop (`python -m course_lib profile`).
`profile_run(cfg)` records the `active` steps after the warm-up; `summary(...)` lists the operators by their own time
on the device that did the work; `device_idle_share` says how long the GPU waited for the CPU."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, schedule

from . import cpu_allocator
from .cache import write_atomic
from .config import ConfigError, TrainConfig
from .results import RunResult


@dataclasses.dataclass
class Profile:
    result: RunResult  # the run's own measurements (its profiled steps are slower: the profiler adds overhead)
    prof: torch.profiler.profile
    active: list[int]  # the steps recorded
    device: str  # "cuda" or "cpu": whose time the summary counts
    page_faults: list[int] | None = None  # minor page faults in each recorded step, where the system counts them

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
    name_kernels: bool = True,
) -> Profile:
    """Train cfg for its warm-up steps, then `active` recorded ones; `trace`: also a Chrome trace (ui.perfetto.dev).
    `name_kernels=False` reuses code compiled earlier, leaving compile's CPU kernels unnamed (one row per graph)."""
    if active < 1:
        raise ConfigError(f"active={active}: profile at least 1 step")
    # the first warm-up step compiles; the profiler starts on the last one and throws it away (starting is slow)
    warmup = max(2, cfg.timing_warmup)
    # no ledger, no validation: their work would be recorded, though no step time includes it
    cfg = dataclasses.replace(cfg, steps=warmup + active, measure_memory=False, eval_every=0)
    on_cuda = torch.device(cfg.device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    when = schedule(skip_first=warmup - 1, wait=0, warmup=1, active=active, repeat=1)
    from .train import Trainer  # train imports much; this module is imported by the CLI's parser

    trainer = Trainer(cfg)
    faults: dict[int, int | None] = {}  # each step's page faults (Trainer.last_step_faults)
    # record_shapes: kernel_floor times each matmul and attention call again at its shape (and is_causal)
    with (
        profile(activities=activities, schedule=when, record_shapes=True) as prof,
        _named_cpu_kernels(cfg) if name_kernels else contextlib.nullcontext(),
    ):

        def after(step: int, _r) -> None:
            faults[step] = trainer.last_step_faults
            with _without_profiler_chatter():
                prof.step()
            if progress:
                progress(step + 1, cfg.steps)

        result = trainer.fit("profiled", callback=after)
    if trace is not None:  # in one step: a full disk leaves no half trace
        write_atomic(Path(trace), lambda f: prof.export_chrome_trace(str(f)), strict=True)
    recorded = list(range(warmup, warmup + active))
    per_step = [faults[i] for i in recorded if faults.get(i) is not None] or None  # (a run stopped early: fewer)
    return Profile(result, prof, recorded, "cuda" if on_cuda else "cpu", per_step)


PROFILER_CHATTER = ("USDT:", "STAGE:")  # how the lines Kineto writes when recording starts and stops begin


@contextlib.contextmanager
def _without_profiler_chatter():
    """Hide the lines Kineto writes to the process's stderr (beneath Python) as recording starts and stops; pass on
    anything else written there meanwhile."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            lines = caught.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(line for line in lines if not line.startswith(PROFILER_CHATTER)))
            sys.stderr.flush()


@contextlib.contextmanager
def _named_cpu_kernels(cfg: TrainConfig):
    """Compiled on a CPU: each Inductor C++ kernel records its own event, named after what it fuses (else one opaque
    row per graph). Code compiled before or here differs in that, so dynamo forgets it before and after."""
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


# What `by_kind` sorts a CPU profile's operators into: (kind, does an event of this name, inside these, belong?)
KINDS: tuple[tuple[str, Callable[[str, list[str]], bool]], ...] = (
    ("optimizer (AdamW's update, zero_grad)", lambda name, within: any(w.startswith("Optimizer.") for w in within)),
    ("matmuls", lambda name, within: name in MATMUL_OPERANDS),
    ("attention (SDPA's fused kernel)", lambda name, within: "scaled_dot_product" in name),
    ("torch.compile's generated kernels", lambda name, within: "cpp_fused_" in name),
    ("compiled graphs' Python wrappers", lambda name, within: "Call CompiledFxGraph" in name),
    ("copies and fills", lambda name, within: name in ("aten::copy_", "aten::fill_", "aten::zero_")),
    ("everything else (eager element-wise ops, norms, softmax, loss, clipping, autograd)", lambda name, within: True),
)


def by_kind(p: Profile) -> dict[str, float]:
    """{kind: seconds per recorded step} of a CPU profile's operators' own time, by KINDS, the largest first."""
    out: dict[str, float] = {}
    for e in _device_events(p, DeviceType.CPU):
        within, parent = [], e.cpu_parent
        while parent is not None:
            within.append(parent.name)
            parent = parent.cpu_parent
        kind = next(k for k, belongs in KINDS if belongs(e.name, within))
        out[kind] = out.get(kind, 0.0) + e.self_cpu_time_total / 1e6 / len(p.active)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _device_events(p: Profile, kind: DeviceType) -> list:
    """The events that ran on a device of this kind, named ranges left out (their own time is the gaps)."""
    return [e for e in p.prof.events() if e.device_type == kind and not e.is_user_annotation]


def busy_s(p: Profile) -> float:
    """Seconds of work the device did in the recorded steps, each kernel counted once (as torch's "Self CUDA time
    total"); on a CPU the operators' own time, all threads."""
    events = _device_events(p, DeviceType.CUDA if p.device == "cuda" else DeviceType.CPU)
    return sum(getattr(e, p.self_time) for e in events) / 1e6


# ---- launch-bound: how long the device sat idle in a step ------------------------------------------------------

# A GPU idle for more than this share of a step waits on the CPU to launch its kernels (a model too small for the
# device): recording the step once as a CUDA graph and replaying it (compile's "reduce-overhead") is worth a try.
LAUNCH_BOUND_IDLE = 0.2


def idle_share(kernels: list[tuple[float, float]], span: tuple[float, float]) -> float:
    """The share of `span` (start, end) in which no kernel (start, end) ran: overlaps count once, outside not at all."""
    start, end = span
    if not end > start:
        raise ValueError(f"span={span}: the step's end must come after its start")
    busy, reach = 0.0, start  # the union of the intervals, swept in order of their starts
    for a, b in sorted((max(a, start), min(b, end)) for a, b in kernels):
        if b > max(a, reach):  # inside the span, and past what is already counted
            busy += b - max(a, reach)
            reach = b
    return 1 - busy / (end - start)


def kernel_intervals(p: Profile) -> list[tuple[float, float]]:
    """(start, end) in microseconds of every kernel and copy the device ran in the recorded steps (a GPU profile)."""
    return [(e.time_range.start, e.time_range.end) for e in _device_events(p, DeviceType.CUDA)]


def recorded_span(p: Profile) -> tuple[float, float] | None:
    """(start, end) in microseconds of the recorded steps' ProfilerStep ranges (the device is synchronised at each
    step's end: its kernels lie inside); None where the profile holds none."""
    steps = [e.time_range for e in p.prof.events() if e.name.startswith("ProfilerStep")]  # "#N", or "*" in a table
    return (min(r.start for r in steps), max(r.end for r in steps)) if steps else None


def device_idle_share(p: Profile) -> float | None:
    """The share of the recorded steps in which the GPU ran no kernel; None on a CPU (its operators are the step)."""
    span = recorded_span(p)
    return idle_share(kernel_intervals(p), span) if p.device == "cuda" and span is not None else None


def launch_bound(idle: float | None) -> bool:
    """Whether a device idle for this share of its step waits on kernel launches; False where unmeasured (a CPU)."""
    return idle is not None and idle >= LAUNCH_BOUND_IDLE


def summary(p: Profile, rows: int = 20) -> str:
    """The profiler's table (by each operator's own time on the device that did the work) and the share of the wall
    time the device worked; on a CPU also a step's time by kind (by_kind) and its page faults."""
    table = p.prof.key_averages().table(sort_by=p.self_time, row_limit=rows, max_name_column_width=60)
    wall_s, work_s = p.active_wall_s, busy_s(p)
    head = f"{table}\n{len(p.active)} recorded steps, {wall_s * 1e3:.1f} ms of wall time; "
    if p.device == "cuda":
        return head + (
            f"the GPU's kernels and copies: {work_s * 1e3:.1f} ms = {work_s / wall_s:.0%} of it (the rest: the GPU "
            f"idle, waiting for the CPU to launch work or for a synchronisation)"
        )
    kinds = "\n".join(
        f"  {kind:<82} {s * 1e3:8.1f} ms  {s * len(p.active) / work_s:4.0%}" for kind, s in by_kind(p).items()
    )
    return (
        head + f"the operators' own CPU time, all threads: {work_s * 1e3:.1f} ms\n"
        f"Where a step's time goes (the operators' own time per step, by kind):\n{kinds}" + _page_fault_text(p)
    )


def _page_fault_text(p: Profile) -> str:
    """A CPU step's page faults: memory the kernel mapped and zeroed at first touch, time no operator's row shows."""
    if not p.page_faults:
        return ""
    why = ""
    if p.result.config.get("keep_freed_memory"):
        why = " (freed memory is kept: what is left is new memory, the profiler's among it)"
    elif not cpu_allocator.unavailable(p.device):  # where the switch exists
        why = (
            " (freed memory goes back to the kernel and each step maps it again: --set keep_freed_memory=true keeps it)"
        )
    return f"\nPage faults: {statistics.median(p.page_faults):,.0f} a step, the profiler on{why}"


# The matrix multiplies a step calls, and their operands' positions among the op's inputs.
MATMUL_OPERANDS = {"aten::mm": (0, 1), "aten::addmm": (1, 2), "aten::bmm": (0, 1), "aten::baddbmm": (1, 2)}
