"""Where a step's time goes: torch.profiler around the course's one loop.

`profile_run(cfg)` trains cfg with `Trainer.fit` (the same loop every measurement uses) and steps the profiler from
its per-step callback, so the warm-up steps (compiling, the allocator's first requests) are left out and only the
`active` steps after them are recorded. `summary(...)` turns the record into the operators that took the most time of
their own, on the device that did the work: the GPU's kernels on CUDA, the CPU's operators otherwise. The notebook 01
section "Where the time goes" reads a profile by hand; this is the same reading for any config, from the command line
(`python -m course_lib profile`). `kernel_floor(...)` times the recorded step's matmuls and fused-attention calls
again, one by one and alone (on a GPU also reads their kernels' own time in the recorded steps, and takes the lower):
how fast a step can be while it calls them, the limit a training loop (not a kernel library) can reach."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
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
from .results import RunResult, gflops_text
from .timing import time_fn


@dataclasses.dataclass
class Profile:
    result: RunResult  # the run's own measurements (its profiled steps are slower: the profiler adds overhead)
    prof: torch.profiler.profile
    active: list[int]  # the steps recorded
    device: str  # "cuda" or "cpu": whose time the summary counts
    # the process's minor page faults in each recorded step (cpu_allocator.page_faults), where the system counts them
    page_faults: list[int] | None = None

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
    """Train cfg for its warm-up steps and then `active` recorded steps. With `trace`, also write the record as a
    Chrome trace (open it in chrome://tracing or https://ui.perfetto.dev). `progress(step, steps)` hears each step.
    `name_kernels=False` leaves compile's generated CPU kernels unnamed (one row per compiled graph), and so reuses
    code compiled earlier: the kernel floor does not need their names, and naming them costs a fresh compile."""
    if active < 1:
        raise ConfigError(f"active={active}: profile at least 1 step")
    # At least two warm-up steps: the first compiles and fills the caches, and the profiler warms up on the last
    # one (it starts recording there and throws that step away: starting is slow, and would be in the first step).
    warmup = max(2, cfg.timing_warmup)
    # No memory ledger: on a CPU it would watch one of the steps, and its bookkeeping would be in the profile. No
    # validation: its forwards would be recorded with the last step's work, though no step time includes them.
    cfg = dataclasses.replace(cfg, steps=warmup + active, measure_memory=False, eval_every=0)
    on_cuda = torch.device(cfg.device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    when = schedule(skip_first=warmup - 1, wait=0, warmup=1, active=active, repeat=1)
    from .train import Trainer  # train imports much; this module is imported by the CLI's parser

    trainer = Trainer(cfg)
    # record_shapes: kernel_floor times each matmul and attention call again at its shape (and is_causal)
    with (
        profile(activities=activities, schedule=when, record_shapes=True) as prof,
        _named_cpu_kernels(cfg) if name_kernels else contextlib.nullcontext(),
    ):
        faults: dict[int, int | None] = {}  # each step's page faults (Trainer.last_step_faults)

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
    """Kineto (torch 2.13) writes lines such as 'USDT:... profiler_start' to the process's stderr, beneath Python,
    when the profiler starts and stops recording (inside `prof.step()`): a learner's terminal needs neither. Around
    that call only, the process's stderr goes to a file; what else was written there (a warning) is passed on."""
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
            kept = "".join(line for line in lines if not line.startswith(PROFILER_CHATTER))
            if kept:
                sys.stderr.write(kept)
                sys.stderr.flush()


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
    ("matmuls", lambda name, within: name in MATMUL_OPERANDS),
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


# ---- launch-bound: how long the device sat idle in a step ------------------------------------------------------

# A GPU idle for more than this share of a step waits on the CPU to launch its kernels (a model too small for the
# device): recording the step once as a CUDA graph and replaying it (compile's "reduce-overhead") is worth a try.
LAUNCH_BOUND_IDLE = 0.2


def idle_share(kernels: list[tuple[float, float]], span: tuple[float, float]) -> float:
    """The share of `span` (start, end) in which no kernel ran, from the kernels' (start, end) intervals in the same
    unit: overlapping kernels (two streams) count once, and the parts outside the span not at all."""
    start, end = span
    if not end > start:
        raise ValueError(f"span={span}: the step's end must come after its start")
    busy, reach = 0.0, start  # the union of the intervals, swept in order of their starts
    for a, b in sorted((max(a, start), min(b, end)) for a, b in kernels):
        if b <= max(a, reach):  # outside the span, or inside what is already counted
            continue
        busy += b - max(a, reach)
        reach = b
    return 1 - busy / (end - start)


def kernel_intervals(p: Profile) -> list[tuple[float, float]]:
    """(start, end) in microseconds of every kernel and copy the device ran in the recorded steps (a GPU profile)."""
    return [
        (e.time_range.start, e.time_range.end)
        for e in p.prof.events()
        if e.device_type == DeviceType.CUDA and not e.is_user_annotation
    ]


def recorded_span(p: Profile) -> tuple[float, float] | None:
    """(start, end) in microseconds of the recorded steps, from the profiler's ProfilerStep ranges (each step ends
    with the device synchronised: its kernels lie inside it); None where the profile holds none."""
    steps = [e.time_range for e in p.prof.events() if e.name.startswith("ProfilerStep")]  # "#N", or "*" in a table
    return (min(r.start for r in steps), max(r.end for r in steps)) if steps else None


def device_idle_share(p: Profile) -> float | None:
    """The share of the recorded steps' wall time in which the GPU ran no kernel (idle_share); None on a CPU, whose
    operators are the step itself."""
    span = recorded_span(p)
    if p.device != "cuda" or span is None:
        return None
    return idle_share(kernel_intervals(p), span)


def launch_bound(idle: float | None) -> bool:
    """Whether a device idle for this share of its step waits on kernel launches (LAUNCH_BOUND_IDLE); False where
    nothing was measured (a CPU)."""
    return idle is not None and idle >= LAUNCH_BOUND_IDLE


def timeline_figure(kernels: list[tuple[float, float]], span: tuple[float, float], title: str):
    """The device's timeline over `span`: each kernel a bar at its (start, end) in microseconds, drawn in ms from the
    span's start, and the idle share in the title: the gaps are where the device waited."""
    from .plots import new_figure  # matplotlib only where a figure is drawn

    start, end = span
    fig = new_figure((10, 1.9))
    ax = fig.subplots()
    bars = [((a - start) / 1e3, (b - a) / 1e3) for a, b in kernels if b > start and a < end]
    ax.broken_barh(bars, (0, 1), facecolors="#4c72b0")
    ax.set_xlim(0, (end - start) / 1e3)
    ax.set_yticks([])
    ax.set_xlabel("ms from the start of the recorded steps (a bar: a kernel running; a gap: the device idle)")
    ax.set_title(f"{title}: idle {idle_share(kernels, span):.0%} of the time", fontsize=9)
    return fig


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
        f"Where a step's time goes (the operators' own time per step, by kind):\n{kinds}" + _page_fault_text(p)
    )


def _page_fault_text(p: Profile) -> str:
    """A CPU step's page faults: memory the kernel mapped and zeroed at first touch, time no operator's row shows."""
    if not p.page_faults:
        return ""
    if p.result.config.get("keep_freed_memory"):
        why = " (freed memory is kept: what is left is new memory, the profiler's among it)"
    elif not cpu_allocator.unavailable(p.device):  # where the switch exists
        why = (
            " (freed memory goes back to the kernel and each step maps it again: --set keep_freed_memory=true keeps it)"
        )
    else:
        why = ""
    return f"\nPage faults: {statistics.median(p.page_faults):,.0f} a step, the profiler on{why}"


# ---- the kernel floor ----------------------------------------------------------------------------------------------

# The step's big kernels: matrix multiplies (the operands' positions among the op's inputs) and SDPA's fused attention
# (SDPA_OPS, its forward ops; each backward is the same name + "_backward"). A loop can only call these; their speed
# at a shape is the kernel library's.
MATMUL_OPERANDS = {"aten::mm": (0, 1), "aten::addmm": (1, 2), "aten::bmm": (0, 1), "aten::baddbmm": (1, 2)}
# SDPA's fused forward ops (as the dispatcher names them, without "aten::") and the backend each one is
SDPA_OPS = {
    "_scaled_dot_product_flash_attention_for_cpu": "flash (CPU kernel)",
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_efficient_attention": "memory-efficient",
    "_scaled_dot_product_cudnn_attention": "cuDNN",
    "_scaled_dot_product_fused_attention_overrideable": "fused (device plug-in)",
}
_DTYPES = {"float": torch.float32, "c10::BFloat16": torch.bfloat16, "c10::Half": torch.float16, "double": torch.float64}


@functools.cache
def _input_position(op: str, name: str) -> int:
    """Where the input `name` sits among an aten op's inputs, read from its schema (the profiler records the inputs
    in that order)."""
    schema = getattr(torch.ops.aten, op.removeprefix("aten::")).default._schema
    return [a.name for a in schema.arguments].index(name)


def _sdpa_op(name: str) -> tuple[str, bool] | None:
    """(the SDPA_OPS forward op, whether `name` is its backward) for a fused-attention operator's name, else None."""
    op = name.removeprefix("aten::")
    forward = op.removesuffix("_backward")
    return (forward, forward != op) if forward in SDPA_OPS else None


def _sdpa_backend(op: str):
    """The torch.nn.attention.SDPBackend that runs SDPA op `op`, to time the same kernel alone."""
    from torch.nn.attention import SDPBackend

    for word, backend in (
        ("flash", "FLASH_ATTENTION"),
        ("efficient", "EFFICIENT_ATTENTION"),
        ("cudnn", "CUDNN_ATTENTION"),
    ):
        if word in op:
            return getattr(SDPBackend, backend)
    return SDPBackend.OVERRIDEABLE


@dataclasses.dataclass
class KernelCall:
    """One kind of call of a recorded step: a matmul of two operands, or an SDPA forward (with its backward, when the
    step ran one), in one dtype and layout."""

    kind: str  # "matmul" or "attention"
    op: str  # the aten op timed: mm or bmm (an addmm's product), or the SDPA op recorded
    shapes: tuple  # matmul: the two operands' shapes; attention: (query, key, value)
    strides: tuple  # the same operands' strides (a transposed operand can take another kernel); () where unrecorded
    dtype: torch.dtype
    causal: bool = False  # attention only
    calls: float = 0.0  # per recorded step (attention: forward calls)
    seconds: float = 0.0  # one call, alone (attention: its forward)
    backward_calls: float = 0.0  # attention only: per step
    backward_seconds: float = 0.0  # attention only: one backward, alone

    @property
    def flops(self) -> float:
        """A matmul's FLOPs per call (torch's FLOP counter's formula, 2mkn times the batch); 0 for attention."""
        from torch.utils.flop_counter import bmm_flop, mm_flop

        if self.kind != "matmul":
            return 0.0
        return float((bmm_flop if len(self.shapes[0]) == 3 else mm_flop)(*self.shapes))

    @property
    def step_s(self) -> float:
        return self.calls * self.seconds + self.backward_calls * self.backward_seconds

    def _transposed(self, i: int) -> bool:
        """Whether operand i is stored transposed (its last two dimensions column-major), as autograd's views are."""
        return bool(self.strides) and self.strides[i][-1] != 1 and self.strides[i][-2] == 1

    def text(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        if self.kind == "matmul":
            a, b = (
                "x".join(map(str, shape)) + ("ᵀ" if self._transposed(i) else "") for i, shape in enumerate(self.shapes)
            )
            return f"{self.calls:4g} x matmul {a} @ {b} {dt}: {self.seconds * 1e3:.2f} ms each, " + gflops_text(
                self.flops / self.seconds
            )
        q = "x".join(map(str, self.shapes[0]))
        return (
            f"{self.calls:4g} x attention, {SDPA_OPS[self.op.removeprefix('aten::')]}, query {q} {dt}"
            f"{', causal' if self.causal else ''}: {self.seconds * 1e3:.2f} ms forward"
            + (
                f", {self.backward_calls:g} x {self.backward_seconds * 1e3:.2f} ms backward"
                if self.backward_calls
                else ""
            )
        )


@dataclasses.dataclass
class KernelFloor:
    """A profiled step's matmul and attention calls, each kind timed again alone (KernelCall), against the profiled
    step: how much of the step they are, and what is left to the loop."""

    calls: list[KernelCall]
    profiled_step_s: float  # a recorded step's wall time, the profiler on (it adds a little to every operator)
    profiled_mfu: float | None  # the profiled run's efficiency, over its steps' median time below
    profiled_median_s: float
    # On a GPU: the same calls' kernels as they ran in the recorded steps, per step (the GPU's own time of each kernel,
    # read from the profile, launches and gaps excluded); None on a CPU, where an operator's time includes its overhead
    in_step_s: float | None = None

    @property
    def layout_known(self) -> bool:
        """Whether this torch's profiler recorded the operands' strides (2.13's does, 2.11's does not)."""
        return any(c.strides for c in self.calls)

    @property
    def matmul_s(self) -> float:
        return sum(c.step_s for c in self.calls if c.kind == "matmul")

    @property
    def attention_s(self) -> float:
        return sum(c.step_s for c in self.calls if c.kind == "attention")

    @property
    def timed_alone_s(self) -> float:
        return self.matmul_s + self.attention_s

    @property
    def in_step_is_lower(self) -> bool:
        return bool(self.in_step_s) and self.in_step_s < self.timed_alone_s

    @property
    def total_s(self) -> float:
        """The floor: the calls timed alone, or, on a GPU, their kernels as they ran in the step where that was less
        (an H200 with torch 2.11, whose profiler records no layout, read 23.4 ms alone and 20.8 in the step)."""
        return self.in_step_s if self.in_step_is_lower else self.timed_alone_s

    def _in_step_text(self) -> str:
        """The two readings of a GPU's kernels, alone and in the step, and which one the floor takes."""
        if self.in_step_is_lower:
            which = "the floor is the lower one (timed alone they ran slower: another layout, or cold caches)."
        elif self.in_step_s > 1.1 * self.timed_alone_s:
            which = (
                "more than alone by over a tenth: something beside them in the step slowed them (memory traffic, "
                "another stream), which the loop may be able to remove."
            )
        else:
            which = "more than alone."
        return (
            f"  together {self.timed_alone_s * 1e3:.1f} ms timed alone; in the recorded steps the same kernels took "
            f"{self.in_step_s * 1e3:.1f} ms a step (the GPU's own time of each kernel): {which}"
        )

    @property
    def matmul_flops(self) -> float:
        """A step's matmul FLOPs, summed over its calls."""
        return sum(c.calls * c.flops for c in self.calls)

    @property
    def mfu_at_floor(self) -> float | None:
        """The efficiency of a step that took only its kernels' time: the same model FLOPs in total_s."""
        if not (self.profiled_mfu and self.total_s):
            return None
        return self.profiled_mfu * self.profiled_median_s / self.total_s

    def text(self) -> str:
        if not self.matmul_s:
            return (
                "The recorded steps called no matmul the profiler could see: no kernel floor. (Under CUDA graphs, "
                "compile_mode reduce-overhead or max-autotune, a step replays its kernels without the operators the "
                "floor reads.)"
            )
        layout = "layout (ᵀ: an operand stored transposed) " if self.layout_known else "(this torch records no layout) "
        lines = [
            "The kernel floor: each matmul and fused-attention call of a recorded step timed again by itself, at its "
            f"shape, {layout}and dtype, the median of repeats, counted as often as a step makes it:",
            f"  matmuls: {sum(c.calls for c in self.calls if c.kind == 'matmul'):g} calls per step, "
            f"{self.matmul_s * 1e3:.1f} ms ({self.matmul_flops / 1e9:.2f} GFLOP at "
            f"{gflops_text(self.matmul_flops / self.matmul_s)})",
        ]
        attention = [c for c in self.calls if c.kind == "attention"]
        if attention:
            fwd, bwd = sum(c.calls for c in attention), sum(c.backward_calls for c in attention)
            lines.append(
                f"  fused attention: {fwd:g} forward and {bwd:g} backward calls per step, "
                f"{self.attention_s * 1e3:.1f} ms"
            )
        if self.in_step_s:
            lines.append(self._in_step_text())
        step, rest = self.profiled_step_s, self.profiled_step_s - self.total_s
        lines.append(
            f"  together {self.total_s * 1e3:.1f} ms: about what a step of these kernels alone would take. A recorded "
            f"step took {step * 1e3:.1f} ms (the profiler on, which adds a little to every operator), so "
            + (
                f"the kernels are {self.total_s / step:.0%} of it, and up to {rest * 1e3:.1f} ms (element-wise work, "
                "the loss, the optimizer, overhead) is the loop's to remove."
                if rest > 0
                else "these kernels' time is longer than the whole step (they ran faster inside it, on warm caches "
                "or with another kernel chosen): no floor to read."
            )
        )
        if self.mfu_at_floor and rest > 0:
            lines.append(
                f"  A step that took only the kernels' time would reach {self.mfu_at_floor:.0%} of the peak the "
                f"efficiency is measured against ({self.profiled_mfu:.0%} in the profiled run): the rest of the gap to "
                "the peak is the kernels' own, at these shapes."
            )
        lines += ["  by call:"] + [f"    {c.text()}" for c in sorted(self.calls, key=lambda c: -c.step_s)]
        return "\n".join(lines)


def _recorded_ops(p: Profile):
    """(name, input shapes, input dtypes, input strides, concrete inputs) of each operator the CPU ran in the recorded
    steps, read from the profiler's own events: the public FunctionEvent has no dtypes before torch 2.13, these do.
    Strides where this torch records them (2.13 does, 2.11 does not: [] then)."""
    for ev in p.prof.profiler.kineto_results.events():
        if ev.device_type() != DeviceType.CPU or not ev.shapes():
            continue
        strides = ev.structured_input_strides() if hasattr(ev, "structured_input_strides") else []
        yield ev.name(), ev.shapes(), ev.dtypes(), strides, ev.concrete_inputs()


def _operands(shapes: list, dtypes: list, strides: list, positions) -> tuple[tuple, tuple, torch.dtype | None]:
    """(shapes, strides or () where any is unrecorded, the first one's dtype) of the inputs at `positions`."""
    picked = tuple(tuple(shapes[i]) for i in positions)
    layout = tuple(tuple(strides[i]) if i < len(strides) and strides[i] else () for i in positions)
    if not all(len(st) == len(sh) for st, sh in zip(layout, picked)):
        layout = ()
    return picked, layout, _DTYPES.get(dtypes[positions[0]])


def _kernel_calls(p: Profile) -> list[KernelCall]:
    """The recorded steps' matmul and SDPA calls, grouped by op, shapes, strides, dtype (and is_causal), counted per
    step; not yet timed."""
    found: dict[tuple, KernelCall] = {}
    backwards: dict[tuple, int] = {}  # (forward op, query shape, dtype): calls
    for name, shapes, dtypes, strides, concrete in _recorded_ops(p):
        sdpa = _sdpa_op(name)
        if name in MATMUL_OPERANDS:
            picked, layout, dtype = _operands(shapes, dtypes, strides, MATMUL_OPERANDS[name])
            if dtype is None or len(picked[0]) not in (2, 3):
                continue
            # an addmm is timed as its product (the floor is the multiply): grouped with the mm of its operands
            key = ("matmul", "aten::bmm" if len(picked[0]) == 3 else "aten::mm", picked, layout, dtype, False)
        elif sdpa is not None and not sdpa[1]:
            picked, layout, dtype = _operands(shapes, dtypes, strides, (0, 1, 2))
            if dtype is None:
                continue
            key = ("attention", name, picked, layout, dtype, concrete[_input_position(name, "is_causal")] is True)
        elif sdpa is not None:  # a backward
            q = _input_position(name, "query")
            query = (name.removesuffix("_backward"), tuple(shapes[q]), _DTYPES.get(dtypes[q]))
            backwards[query] = backwards.get(query, 0) + 1
            continue
        else:
            continue
        found.setdefault(key, KernelCall(*key)).calls += 1 / len(p.active)
    for (forward, query, dtype), n in backwards.items():  # each backward to its forward: same op, query and dtype
        match = [c for c in found.values() if (c.op, c.shapes[0], c.dtype) == (forward, query, dtype)]
        for c in match:  # forwards that differ only in key, value or is_causal share the backwards by their calls
            c.backward_calls = n / len(p.active) * c.calls / sum(m.calls for m in match)
    return list(found.values())


def _random(shape: tuple, strides: tuple, dtype: torch.dtype, device: str) -> torch.Tensor:
    """Random numbers laid out with `strides` (contiguous where unknown); a stride of 0 (an expanded operand) shares
    one value along that dimension, as the recorded tensor did."""
    if not strides:
        return torch.randn(shape, device=device, dtype=dtype)
    extent = 1 + sum((n - 1) * st for n, st in zip(shape, strides))  # elements the strided view reaches
    return torch.randn(extent, device=device, dtype=dtype).as_strided(shape, strides)


def _time_alone(c: KernelCall, device: str, precision: str, min_time_s: float) -> tuple[float, float]:
    """(seconds of one call, of one backward or 0) for c by itself, on random inputs of its shapes, strides and dtype,
    under the run's matmul precision (TF32 where the run used it), through the same SDPA backend. On a GPU each timing
    covers 10 calls in a row (a synchronisation per call would add its own microseconds to small kernels)."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    from .tf32 import matmul_precision

    in_a_row = 10 if torch.device(device).type == "cuda" else 1

    def timed(fn) -> float:
        def calls():
            for _ in range(in_a_row):
                fn()

        return time_fn(calls, device, repeats=3, warmup=1, min_time_s=min_time_s, max_repeats=50) / in_a_row

    operands = [_random(sh, c.strides[i] if c.strides else (), c.dtype, device) for i, sh in enumerate(c.shapes)]
    with matmul_precision(precision):
        if c.kind == "matmul":
            a, b = operands
            multiply = torch.bmm if a.dim() == 3 else torch.mm
            with torch.no_grad():
                return timed(lambda: multiply(a, b)), 0.0
        q, k, v = (x.requires_grad_() for x in operands)
        grad_out = torch.randn(q.shape, device=device, dtype=c.dtype)
        with sdpa_kernel(_sdpa_backend(c.op)):
            forward = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=c.causal))
            if not c.backward_calls:
                return forward, 0.0
            both = timed(
                lambda: torch.autograd.grad(
                    F.scaled_dot_product_attention(q, k, v, is_causal=c.causal), (q, k, v), grad_out
                )
            )
        return forward, max(0.0, both - forward)


def kernel_floor(p: Profile, min_time_s: float = 0.1) -> KernelFloor:
    """How fast a recorded step could be while it calls its matmuls and fused attention: each kind of call (op,
    shapes, layout, dtype, is_causal) timed again by itself, under the run's precision and SDPA backend, and counted
    as often as a step makes it. What a step spends beyond that is what the loop can still remove; the kernels' own
    speed at these shapes is the library's. (Random inputs: neither a matmul's speed nor attention's depends on the
    values.)"""
    calls = _kernel_calls(p)
    precision = p.result.config["precision"]
    for c in calls:
        c.seconds, c.backward_seconds = _time_alone(c, p.device, precision, min_time_s)
    r = p.result
    return KernelFloor(calls, p.active_wall_s / len(p.active), r.mfu, r.median_step_s, in_step_kernel_s(p))


def in_step_kernel_s(p: Profile) -> float | None:
    """On a GPU, seconds per recorded step of the same calls' kernels as they ran in the step: each matmul operator's
    own device time, and each fused-attention operator's (SDPA_OPS, forward and backward) device time with the
    operators beneath it, where its kernels are launched. A kernel counts once. None on a CPU (an operator's time
    there is its overhead too), or where the profile holds no such device time."""
    if p.device != "cuda":
        return None
    seconds = sum(
        e.self_device_time_total if e.name in MATMUL_OPERANDS else e.device_time_total
        for e in p.prof.events()
        if e.device_type == DeviceType.CPU and (e.name in MATMUL_OPERANDS or _sdpa_op(e.name) is not None)
    )
    return seconds / 1e6 / len(p.active) if seconds else None
