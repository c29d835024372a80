"""The kernel floor (notebook 09, `python -m course_lib profile`): how fast a profiled step could be while it calls its
matmuls and fused attention, each call timed again by itself. What a step spends beyond that is the loop's to remove."""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch.autograd import DeviceType

from ..profiling import MATMUL_OPERANDS, Profile
from ..results import gflops_text
from ..timing import time_fn

# The step's big kernels, which a loop can only call: the matmuls (MATMUL_OPERANDS) and SDPA's fused attention (its
# forward ops, without "aten::", and their backends; each backward: + "_backward").
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
    """Where the input `name` sits among an aten op's inputs (the profiler records them in its schema's order)."""
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

    backends = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION"}
    return next((getattr(SDPBackend, b) for word, b in backends.items() if word in op), SDPBackend.OVERRIDEABLE)


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

    def _operand(self, i: int) -> str:
        """Operand i's shape, with ᵀ where it is stored transposed (column-major, as autograd's views are)."""
        transposed = bool(self.strides) and self.strides[i][-1] != 1 and self.strides[i][-2] == 1
        return "x".join(map(str, self.shapes[i])) + ("ᵀ" if transposed else "")

    def text(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        if self.kind == "matmul":
            each = f"{self.seconds * 1e3:.2f} ms each, {gflops_text(self.flops / self.seconds)}"
            return f"{self.calls:4g} x matmul {self._operand(0)} @ {self._operand(1)} {dt}: {each}"
        q = "x".join(map(str, self.shapes[0]))
        backward = (
            f", {self.backward_calls:g} x {self.backward_seconds * 1e3:.2f} ms backward" if self.backward_calls else ""
        )
        return (
            f"{self.calls:4g} x attention, {SDPA_OPS[self.op.removeprefix('aten::')]}, query {q} {dt}"
            f"{', causal' if self.causal else ''}: {self.seconds * 1e3:.2f} ms forward{backward}"
        )


@dataclasses.dataclass
class KernelFloor:
    """A profiled step's matmul and attention calls, each kind timed again alone (KernelCall), against the profiled
    step: how much of the step they are, and what is left to the loop."""

    calls: list[KernelCall]
    profiled_step_s: float  # a recorded step's wall time, the profiler on (it adds a little to every operator)
    profiled_mfu: float | None  # the profiled run's efficiency, over its steps' median time below
    profiled_median_s: float
    # On a GPU: the same calls' kernels per step as they ran in the recorded steps (their own device time, launches and
    # gaps excluded); None on a CPU, where an operator's time includes its overhead
    in_step_s: float | None = None

    def _s(self, kind: str) -> float:
        return sum(c.step_s for c in self.calls if c.kind == kind)

    @property
    def timed_alone_s(self) -> float:
        return self._s("matmul") + self._s("attention")

    @property
    def in_step_is_lower(self) -> bool:
        return bool(self.in_step_s) and self.in_step_s < self.timed_alone_s

    @property
    def total_s(self) -> float:
        """The floor: the calls timed alone, or on a GPU their kernels as they ran in the step where that was less
        (timed alone, a torch whose profiler records no layout may take another kernel)."""
        return self.in_step_s if self.in_step_is_lower else self.timed_alone_s

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
        if not self._s("matmul"):
            return (
                "The recorded steps called no matmul the profiler could see: no kernel floor. (Under CUDA graphs, "
                "compile_mode reduce-overhead or max-autotune, a step replays its kernels without the operators the "
                "floor reads.)"
            )
        layout_known = any(c.strides for c in self.calls)  # torch 2.13's profiler records strides, 2.11's does not
        layout = "layout (ᵀ: an operand stored transposed) " if layout_known else "(this torch records no layout) "
        matmul_s, attention = self._s("matmul"), [c for c in self.calls if c.kind == "attention"]
        lines = [
            "The kernel floor: each matmul and fused-attention call of a recorded step timed again by itself, at its "
            f"shape, {layout}and dtype, the median of repeats, counted as often as a step makes it:",
            f"  matmuls: {sum(c.calls for c in self.calls if c.kind == 'matmul'):g} calls per step, "
            f"{matmul_s * 1e3:.1f} ms ({self.matmul_flops / 1e9:.2f} GFLOP at "
            f"{gflops_text(self.matmul_flops / matmul_s)})",
        ]
        if attention:
            fwd, bwd = sum(c.calls for c in attention), sum(c.backward_calls for c in attention)
            lines.append(
                f"  fused attention: {fwd:g} forward and {bwd:g} backward calls per step, "
                f"{self._s('attention') * 1e3:.1f} ms"
            )
        if self.in_step_s:
            lines.append(self._in_step_text())
        lines += self._rest_text() + ["  by call:"]
        return "\n".join(lines + [f"    {c.text()}" for c in sorted(self.calls, key=lambda c: -c.step_s)])

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

    def _rest_text(self) -> list[str]:
        """The floor against the profiled step: what is left to the loop, and the efficiency a step at the floor has."""
        step, rest = self.profiled_step_s, self.profiled_step_s - self.total_s
        lines = [
            f"  together {self.total_s * 1e3:.1f} ms: about what a step of these kernels alone would take. A recorded "
            f"step took {step * 1e3:.1f} ms (the profiler on, which adds a little to every operator), so "
            + (
                f"the kernels are {self.total_s / step:.0%} of it, and up to {rest * 1e3:.1f} ms (element-wise work, "
                "the loss, the optimizer, overhead) is the loop's to remove."
                if rest > 0
                else "these kernels' time is longer than the whole step (they ran faster inside it, on warm caches "
                "or with another kernel chosen): no floor to read."
            )
        ]
        if self.mfu_at_floor and rest > 0:
            lines.append(
                f"  A step that took only the kernels' time would reach {self.mfu_at_floor:.0%} of the peak the "
                f"efficiency is measured against ({self.profiled_mfu:.0%} in the profiled run): the rest of the gap to "
                "the peak is the kernels' own, at these shapes."
            )
        return lines


def _recorded_ops(p: Profile):
    """(name, input shapes, dtypes, strides or [] where this torch records none, concrete inputs) of each CPU operator
    in the recorded steps, from the profiler's own events (the public FunctionEvent has no dtypes before torch 2.13)."""
    for ev in p.prof.profiler.kineto_results.events():
        if ev.device_type() == DeviceType.CPU and ev.shapes():
            strides = ev.structured_input_strides() if hasattr(ev, "structured_input_strides") else []
            yield ev.name(), ev.shapes(), ev.dtypes(), strides, ev.concrete_inputs()


def _operands(shapes: list, dtypes: list, strides: list, positions) -> tuple[tuple, tuple, torch.dtype | None]:
    """(shapes, strides or () where any is unrecorded, the first one's dtype) of the inputs at `positions`."""
    picked = tuple(tuple(shapes[i]) for i in positions)
    layout = tuple(tuple(strides[i]) if i < len(strides) and strides[i] else () for i in positions)
    if not all(len(st) == len(sh) for st, sh in zip(layout, picked)):
        layout = ()
    return picked, layout, _DTYPES.get(dtypes[positions[0]])


def _call_key(name: str, shapes: list, dtypes: list, strides: list, concrete: list) -> tuple | None:
    """A forward matmul or SDPA call's KernelCall fields (kind, op, shapes, strides, dtype, causal), else None."""
    if name in MATMUL_OPERANDS:
        picked, layout, dtype = _operands(shapes, dtypes, strides, MATMUL_OPERANDS[name])
        if dtype is None or len(picked[0]) not in (2, 3):
            return None
        # an addmm is timed as its product (the floor is the multiply): grouped with the mm of its operands
        return ("matmul", "aten::bmm" if len(picked[0]) == 3 else "aten::mm", picked, layout, dtype, False)
    picked, layout, dtype = _operands(shapes, dtypes, strides, (0, 1, 2))
    if dtype is None:
        return None
    return ("attention", name, picked, layout, dtype, concrete[_input_position(name, "is_causal")] is True)


def _kernel_calls(p: Profile) -> list[KernelCall]:
    """The recorded steps' matmul and SDPA calls, grouped by op, shapes, strides, dtype (and is_causal), counted per
    step; not yet timed."""
    found: dict[tuple, KernelCall] = {}
    backwards: dict[tuple, int] = {}  # (forward op, query shape, dtype): calls
    for name, shapes, dtypes, strides, concrete in _recorded_ops(p):
        sdpa = _sdpa_op(name)
        if sdpa is not None and sdpa[1]:  # a backward
            q = _input_position(name, "query")
            query = (name.removesuffix("_backward"), tuple(shapes[q]), _DTYPES.get(dtypes[q]))
            backwards[query] = backwards.get(query, 0) + 1
        elif name in MATMUL_OPERANDS or sdpa is not None:
            key = _call_key(name, shapes, dtypes, strides, concrete)
            if key is not None:
                found.setdefault(key, KernelCall(*key)).calls += 1 / len(p.active)
    for (forward, query, dtype), n in backwards.items():  # each backward to its forward: same op, query and dtype
        match = [c for c in found.values() if (c.op, c.shapes[0], c.dtype) == (forward, query, dtype)]
        for c in match:  # forwards that differ only in key, value or is_causal share the backwards by their calls
            c.backward_calls = n / len(p.active) * c.calls / sum(m.calls for m in match)
    return list(found.values())


def _random(shape: tuple, strides: tuple, dtype: torch.dtype, device: str) -> torch.Tensor:
    """Random numbers laid out with `strides` (contiguous where unknown; a stride of 0 shares one value, as the
    recorded expanded tensor did)."""
    if not strides:
        return torch.randn(shape, device=device, dtype=dtype)
    extent = 1 + sum((n - 1) * st for n, st in zip(shape, strides))  # elements the strided view reaches
    return torch.randn(extent, device=device, dtype=dtype).as_strided(shape, strides)


def _time_alone(c: KernelCall, device: str, precision: str, min_time_s: float) -> tuple[float, float]:
    """(seconds of one call, of one backward or 0) for c alone, on random inputs of its shapes, strides and dtype,
    under the run's matmul precision and SDPA backend. On a GPU each timing covers 10 calls in a row (a
    synchronisation per call would add its own microseconds to small kernels)."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    from ..tf32 import matmul_precision

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
        attend = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=c.causal)  # noqa: E731
        with sdpa_kernel(_sdpa_backend(c.op)):
            forward = timed(attend)
            both = timed(lambda: torch.autograd.grad(attend(), (q, k, v), grad_out)) if c.backward_calls else forward
        return forward, max(0.0, both - forward)


def kernel_floor(p: Profile, min_time_s: float = 0.1) -> KernelFloor:
    """How fast a recorded step could be while it calls its matmuls and fused attention: each kind of call timed again
    by itself (random inputs: neither kernel's speed depends on the values), counted as often as a step makes it.
    What a step spends beyond that is the loop's to remove; the kernels' own speed is the library's."""
    calls = _kernel_calls(p)
    for c in calls:
        c.seconds, c.backward_seconds = _time_alone(c, p.device, p.result.config["precision"], min_time_s)
    r = p.result
    return KernelFloor(calls, p.active_wall_s / len(p.active), r.mfu, r.median_step_s, in_step_kernel_s(p))


def in_step_kernel_s(p: Profile) -> float | None:
    """On a GPU, seconds per recorded step of the same calls' kernels in the step: each matmul's own device time, each
    fused attention's (SDPA_OPS, forward and backward) with the operators beneath it that launch its kernels. None
    on a CPU (an operator's time there is its overhead too), or where the profile holds no such device time."""
    if p.device != "cuda":
        return None
    seconds = sum(
        e.self_device_time_total if e.name in MATMUL_OPERANDS else e.device_time_total
        for e in p.prof.events()
        if e.device_type == DeviceType.CPU and (e.name in MATMUL_OPERANDS or _sdpa_op(e.name) is not None)
    )
    return seconds / 1e6 / len(p.active) if seconds else None
