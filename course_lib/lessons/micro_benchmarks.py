"""Small benchmarks for notebook 04: timing and peak memory of one call, "ugly" sizes, AdamW implementations,
and what torch.compile does when shapes change. The training runs themselves go through course_lib.train.

Every function returns what it measured (plain numbers, with units in the names); nothing is hard-coded.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from ..measure import MemoryLedger
from ..techniques.torch_compile import TANH_THROUGH_EXP
from ..timing import time_fn

# ---- one call: time and memory -------------------------------------------------------------------


def peak_bytes(fn: Callable[[], object], device="cpu") -> tuple[int, str]:
    """Peak bytes that fn() allocates on top of what already exists, and how that was measured.

    CUDA: max_memory_allocated after reset_peak_memory_stats, minus what was allocated before.
    CPU: the course's MemoryLedger follows every tensor storage the operators create (a fused kernel's
    internal scratch buffers, which never become tensors, are not seen).
    """
    dev = torch.device(device)
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        out = fn()
        torch.cuda.synchronize(dev)
        del out
        return torch.cuda.max_memory_allocated(dev) - before, "CUDA max_memory_allocated - allocated before"
    ledger = MemoryLedger(keep_timeline=False)
    with ledger:
        out = fn()
    del out
    return ledger.peak, "CPU ledger: tensor storages created by the call"


# ---- ugly numbers ---------------------------------------------------------------------------------


@dataclass
class SizePoint:
    n: int
    ms: float
    gflops: float  # achieved GFLOP/s

    @property
    def multiple_of_64(self) -> bool:
        return self.n % 64 == 0


def matmul_sweep(
    sizes: Sequence[int], m: int = 1024, k: int = 256, device="cpu", dtype=torch.float32, repeats: int = 5
) -> list[SizePoint]:
    """(m x k) @ (k x n) for each n: median time and achieved GFLOP/s (2·m·k·n FLOPs)."""
    out = []
    a = torch.randn(m, k, device=device, dtype=dtype)
    for n in sizes:
        b = torch.randn(k, n, device=device, dtype=dtype)
        s = time_fn(lambda: a @ b, device=device, repeats=repeats, warmup=2)
        out.append(SizePoint(n, s * 1e3, 2 * m * k * n / s / 1e9))
    return out


def lm_head_time(
    vocab: int, tokens: int = 1024, width: int = 256, device="cpu", dtype=torch.float32, repeats: int = 5
) -> float:
    """Seconds for the output layer and its loss, forward and backward: logits = h @ W^T (tokens x vocab), then
    cross-entropy. The part of a GPT step whose shape the vocabulary size sets."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, width, generator=gen).to(device, dtype).requires_grad_()
    w = (0.02 * torch.randn(vocab, width, generator=gen)).to(device, dtype).requires_grad_()
    y = torch.randint(0, min(vocab, 50257), (tokens,), generator=gen).to(device)

    def step():
        loss = F.cross_entropy(h @ w.t(), y)
        loss.backward()
        h.grad = w.grad = None

    return time_fn(step, device=device, repeats=repeats, warmup=1)


# ---- AdamW: for-loop, foreach, fused ------------------------------------------------------------------

ADAMW_IMPLS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def adamw_step_times(
    params: Sequence[torch.Tensor], impls=tuple(ADAMW_IMPLS), repeats: int = 10, device="cpu"
) -> dict[str, float]:
    """Median seconds of optimizer.step() for each AdamW implementation on copies of `params` with random
    gradients (the same for each implementation). An implementation this build cannot run is left out."""
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=gen).to(device) * 1e-3 for p in params]
    out = {}
    for name in impls:
        ps = [p.detach().clone().to(device).requires_grad_() for p in params]
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        try:
            opt = torch.optim.AdamW(ps, lr=1e-3, **ADAMW_IMPLS[name])
            out[name] = time_fn(opt.step, device=device, repeats=repeats, warmup=2)
        except (RuntimeError, ValueError):
            continue
    return out


def adamw_operator_calls(params: Sequence[torch.Tensor], device="cpu") -> dict[str, int]:
    """Operator calls one AdamW step dispatches on tensors of more than one element (the parameters, their gradients
    and moments; the 0-d step counters left out), per implementation, counted after a first step has made the state.
    On a GPU each such call is at least one kernel launch: the for-loop makes several per parameter tensor, while a
    foreach or fused call launches one kernel per group of tensors (multi_tensor_apply)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class _Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            flat, _ = tree_flatten((args, kwargs or {}))
            self.n += any(isinstance(t, torch.Tensor) and t.numel() > 1 for t in flat)
            return func(*args, **(kwargs or {}))

    out = {}
    for name, kw in ADAMW_IMPLS.items():
        ps = [p.detach().clone().to(device).requires_grad_() for p in params]
        for p in ps:
            p.grad = torch.ones_like(p) * 1e-3
        try:
            opt = torch.optim.AdamW(ps, lr=1e-3, **kw)
            opt.step()  # the first step creates the moments
        except (RuntimeError, ValueError):
            continue
        with _Calls() as calls:
            opt.step()
        out[name] = calls.n
    return out


def adamw_results_agree(params: Sequence[torch.Tensor], steps: int = 3) -> float:
    """Largest difference between the parameters the three AdamW implementations produce after `steps` steps."""
    gen = torch.Generator().manual_seed(0)
    grads = [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(steps)]
    finals = []
    for kw in ADAMW_IMPLS.values():
        ps = [p.detach().clone().requires_grad_() for p in params]
        opt = torch.optim.AdamW(ps, lr=1e-2, **kw)
        for g in grads:
            for p, gi in zip(ps, g):
                p.grad = gi.clone()
            opt.step()
        finals.append(ps)
    return max((a - b).abs().max().item() for other in finals[1:] for a, b in zip(finals[0], other))


# ---- torch.compile: compile events -------------------------------------------------------------------


class CompileCounter:
    """A torch.compile backend that runs the captured graph as it is (no code generation, so it is quick) and
    records every graph Dynamo hands it, with its input shapes: each entry is one (re)compilation.

        counter = CompileCounter()
        f = torch.compile(fn, backend=counter)
    """

    def __init__(self):
        self.graphs: list[dict] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        shapes = [tuple(str(d) for d in t.shape) if isinstance(t, torch.Tensor) else repr(t) for t in example_inputs]
        n_ops = sum(1 for node in gm.graph.nodes if node.op in ("call_function", "call_method", "call_module"))
        self.graphs.append(
            {
                "input_shapes": shapes,
                "ops": n_ops,
                "dynamic": any(isinstance(t, torch.SymInt) for t in example_inputs)
                or any(not s.isdigit() for sh in shapes if isinstance(sh, tuple) for s in sh),
                "code": gm.code,
            }
        )
        return gm.forward

    @property
    def compiles(self) -> int:
        return len(self.graphs)


# What Inductor is told about tanh on a CPU: its exact vectorised tanh (SLEEF), or 2 / (1 + exp(-2x)) - 1 (the setting
# the course's compile passes on a CPU: course_lib.techniques.torch_compile.CPU_INDUCTOR_OPTIONS).
TANH_FORMS = {"exact tanh (SLEEF)": False, "tanh through exp": True}


def compiled_gelu_times(rows: int = 4096, width: int = 512, repeats: int = 10) -> dict[str, tuple[float, float]]:
    """{tanh form: (median seconds of GPT-2's tanh GELU, forward and backward, on a (rows, width) fp32 tensor on the
    CPU, compiled by Inductor with that form of tanh; its largest error in the forward, against float64)}. Each form
    is compiled afresh (torch._dynamo.reset() first: code compiled earlier in the process is forgotten)."""
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(rows, width, generator=gen)).requires_grad_()  # most of GELU's interesting range, [-15, 15]
    grad = torch.randn(rows, width, generator=gen)
    exact = F.gelu(x.detach().double(), approximate="tanh")
    out = {}
    for form, through_exp in TANH_FORMS.items():
        torch._dynamo.reset()
        gelu = torch.compile(lambda v: F.gelu(v, approximate="tanh"), options={TANH_THROUGH_EXP: through_exp})
        error = (gelu(x).detach().double() - exact).abs().max().item()

        def step():
            gelu(x).backward(grad)
            x.grad = None

        out[form] = (time_fn(step, repeats=repeats, warmup=2), error)
    torch._dynamo.reset()
    return out


def break_even_steps(compile_s: float, eager_step_s: float, compiled_step_s: float) -> float | None:
    """Steps after which compiling has paid for itself: compile_s / (eager - compiled); None if it never does."""
    saved = eager_step_s - compiled_step_s
    return compile_s / saved if saved > 0 else None
