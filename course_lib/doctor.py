"""`python -m course_lib doctor`: each device-specific path run for real; nothing passes that did not run."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from . import config as C
from .cache import write_atomic
from .capabilities import SDPA_BACKENDS, Capabilities, capabilities, measured_tflops, sdpa_dtype
from .results import RunResult, gflops_text, provenance

PASS, FAIL, NA, SKIPPED = "pass", "fail", "n/a", "skipped"


@dataclass
class Check:
    name: str
    status: str
    detail: str
    seconds: float = 0.0


@dataclass
class DoctorReport:
    device: str
    checks: list[Check] = field(default_factory=list)
    provenance: dict = field(default_factory=dict)
    capabilities: dict = field(default_factory=dict)
    interrupted: str = ""  # the check Ctrl-C stopped, where one did: the report holds the checks before it

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == FAIL]

    def table(self) -> str:
        width = max((len(c.name) for c in self.checks), default=0)
        lines = [f"doctor on {self.device}, torch {self.provenance.get('torch')}", ""]
        lines += [f"{c.name:<{width}}  {c.status.upper():<7}  {c.seconds:5.1f} s  {c.detail}" for c in self.checks]
        counts = {s: sum(c.status == s for c in self.checks) for s in (PASS, FAIL, NA, SKIPPED)}
        lines += ["", ", ".join(f"{n} {s}" for s, n in counts.items())]
        if self.interrupted:
            lines.append(f"interrupted (Ctrl-C) at {self.interrupted}: the checks after it did not run")
        return "\n".join(lines)


class _NotApplicable(Exception):
    """Raised inside a check: this device has no such path (the message says why)."""


def _needs(ok: bool, why: str) -> None:
    """A check's path that this device lacks: n/a, and why."""
    if not ok:
        raise _NotApplicable(why)


def check_config(device: str, **changes) -> C.TrainConfig:
    """The run every check trains: the tiny preset, 3 steps (tests that compile use it too: compiled once per run)."""
    changes = {"steps": 3, "timing_warmup": 1, "measure_memory": False, **changes}
    return dataclasses.replace(C.tiny_preset(device), **changes)


def _checked_run(cfg: C.TrainConfig) -> RunResult:
    """One run of the course's loop: an AssertionError unless it ran with finite losses and gradient norms."""
    from .train import run

    result = run(cfg, f"doctor {cfg.precision}")
    assert result.ok, f"{result.status}: {result.reason}"
    finite = all(math.isfinite(x) for x in result.losses + result.grad_norms)
    assert finite, f"non-finite loss or gradient norm: losses {result.losses}, norms {result.grad_norms}"
    return result


def _reference_run(cfg: C.TrainConfig) -> Callable[[], RunResult]:
    """The checked run of cfg, trained when first asked for; a failed one is not retrained, each later ask raises."""

    @functools.cache
    def outcome() -> RunResult | Exception:
        try:
            return _checked_run(cfg)
        except Exception as e:  # noqa: BLE001 - reported by every check that needs the reference
            return e

    def get() -> RunResult:
        if isinstance(result := outcome(), Exception):
            raise AssertionError(f"the {cfg.precision} reference run failed: {type(result).__name__}: {result}")
        return result

    return get


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


# ---- the checks: each returns its detail, or raises _NotApplicable / AssertionError
def check_precision(caps: Capabilities, precision: str, fp32: Callable[[], RunResult]) -> str:
    """fp32(): the fp32 run of check_config, trained once per doctor run (fp32's own check, the others' reference)."""
    support = caps.supports(precision)
    _needs(support.ok and not support.no_effect, support.note)  # TF32 on a CPU runs fp32: not passed off as tested
    if precision == "fp32":
        result = fp32()
        return f"{result.tokens_per_s:,.0f} tokens/s, finite losses and gradient norms over {len(result.losses)} steps"
    fp32_loss = fp32().losses[0]  # the reference first: a failed one is named before another run is trained
    result = _checked_run(check_config(caps.device, precision=precision))
    # The first step's loss is computed from the same weights and batch: a lower precision may round, not wander.
    loss, tol = result.losses[0], {"tf32": 5e-3, "bf16": 2e-2, "fp16": 1e-2}[precision]
    rel = _relative(loss, fp32_loss)
    assert rel <= tol, f"first-step loss {loss:.5f} differs from fp32's {fp32_loss:.5f} by {rel:.2e} (> {tol:g})"
    hw = ", without hardware support" if support.native is False else ""
    return (
        f"{result.tokens_per_s:,.0f} tokens/s, first loss within {rel:.1e} of fp32's{hw} ({support.note or precision})"
    )


def check_compile(caps: Capabilities, eager: Callable[[], RunResult]) -> str:
    """eager(): the fp32 run of check_config without compile (check_precision's fp32 run)."""
    _needs(caps.techniques["compile"].ok, caps.techniques["compile"].note)
    from torch._dynamo.utils import counters

    reference, t0, graphs = eager(), time.perf_counter(), counters["stats"]["unique_graphs"]
    compiled = _checked_run(check_config(caps.device, compile=True))
    assert counters["stats"]["unique_graphs"] > graphs, "compile=True ran without torch.compile capturing a graph"
    # every step, so that the compiled backward and optimizer step count; kernels may sum in another order: 1e-4
    rel = {}
    for what in ("losses", "grad_norms"):
        e, c = getattr(reference, what), getattr(compiled, what)
        rel[what] = max(_relative(ci, ei) for ei, ci in zip(e, c, strict=True))
        assert rel[what] <= 1e-4, f"compiled {what} {c} differ from eager's {e} by up to {rel[what]:.1e} (relative)"
    return (
        f"compiled training agrees with eager over {len(reference.losses)} steps (largest relative difference: losses "
        f"{rel['losses']:.1e}, gradient norms {rel['grad_norms']:.1e}); first step {compiled.step_times[0]:.1f} s, "
        f"whole check {time.perf_counter() - t0:.0f} s"
    )


def check_sdpa(caps: Capabilities, backend: str) -> str:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .model import naive_attention

    _needs(caps.sdpa[backend].ok, caps.sdpa[backend].note)
    dtype, gen = sdpa_dtype(caps.type, caps.precisions), torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 128, 32, generator=gen).to(caps.device, dtype) for _ in range(3))
    with sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[backend])]):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    err = (out.float() - naive_attention(q.float(), k.float(), v.float())).abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert err <= tol, f"differs from naive attention by {err:.2e} (> {tol:g})"
    return f"equals naive attention within {err:.1e} in {str(dtype).removeprefix('torch.')}"


def check_memory_report(caps: Capabilities) -> str:
    from .measure import tensor_bytes
    from .model import GPT
    from .train import run

    cfg = check_config(caps.device, measure_memory=True)
    result = run(cfg, "doctor memory")
    assert result.ok and result.memory, f"no memory report: {result.status} {result.reason}"
    by, peak = result.memory["by_category"], result.memory["peak_bytes"]
    params = tensor_bytes(GPT(cfg.model).parameters())
    assert by["parameters"] == params, f"parameters {by['parameters']} bytes, expected {params}"
    assert by["optimizer state"] >= 2 * params, f"AdamW state {by['optimizer state']} bytes < 2 x parameters"
    known = sum(v for v in by.values() if v)
    assert known <= peak + 1, f"categories sum to {known} > peak {peak}"
    return f"peak {peak / 2**20:.1f} MiB; parameters exact; {result.memory['method']}"


def check_all_reduce(caps: Capabilities, backend: str) -> str:
    from .distributed.launch import launch

    gpus = torch.cuda.device_count() if caps.type == "cuda" else 0
    _needs(backend != "nccl" or gpus >= 2, f"NCCL between processes needs 2 GPUs; this machine has {gpus}")
    r = launch("selftest", 2, device="cuda" if backend == "nccl" else "cpu", timeout_s=120, show_errors=False)
    assert r.ok, r.why()
    sums, backends = [rank["sum_of_ranks"] for rank in r.ranks], {rank["backend"] for rank in r.ranks}
    assert backends == {backend}, f"ran on {backends}, not {backend}"
    assert sums == [1.0, 1.0], f"all-reduce of ranks 0 and 1 gave {sums}, not [1.0, 1.0]"
    return f"2 processes, {backend}: 0 + 1 = 1 on both ranks; {r.wall_s:.1f} s with start-up"


def check_matmul_peak(caps: Capabilities) -> str:
    parts = []
    for p in (p for p in ("fp32", "bf16") if caps.supports(p).ok):
        measured = measured_tflops(caps.device, p, refresh=True)
        assert measured > 0
        sheet = f" (data sheet {caps.datasheet[p]:g})" if caps.datasheet and p in caps.datasheet else ""
        parts.append(f"{p} {gflops_text(measured * 1e12)}{sheet}")
    return "measured matmul peak: " + ", ".join(parts)


def check_reserved(caps: Capabilities) -> str:
    _needs(caps.type == "cuda", "CUDA only")
    from .train import run

    run(check_config(caps.device), "doctor reserved")
    alloc, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    assert reserved >= alloc, f"reserved {reserved} < allocated {alloc}"
    return f"peak allocated {alloc / 2**20:.1f} MiB, reserved {reserved / 2**20:.1f} MiB (the allocator keeps blocks)"


def check_oom(caps: Capabilities) -> str:
    _needs(caps.type == "cuda", "CUDA only")
    from .measure import cuda_index, warm_up_cuda_libraries
    from .train import run

    index = cuda_index(caps.device)
    warm_up_cuda_libraries(index)  # cuBLAS's workspaces, allocated by the first run otherwise, are not the OOM's
    before = torch.cuda.memory_allocated(index)
    total = torch.cuda.get_device_properties(index).total_memory
    # a cap of 1 GiB above what it reserves now: the same OutOfMemoryError, without filling a GPU others share
    cap = torch.cuda.memory_reserved(index) + 2**30
    base = check_config(caps.device)
    batch = math.ceil(2 * cap / (base.context * base.model.vocab_size * 4))  # the logits alone: twice the cap
    previous = torch.cuda.get_per_process_memory_fraction(index)
    torch.cuda.set_per_process_memory_fraction(min(previous, cap / total), index)
    try:
        result = run(dataclasses.replace(base, batch_size=batch), "doctor oom")
    finally:
        torch.cuda.set_per_process_memory_fraction(previous, index)
    assert result.status == "oom", f"a batch of {batch} was expected to run out of memory, got {result.status}"
    after = torch.cuda.memory_allocated(index)
    assert after <= before + 2**20, f"{(after - before) / 2**20:.1f} MiB still allocated after the OOM"
    again = run(base, "doctor after oom")
    assert again.ok, f"the next run failed: {again.status} {again.reason}"
    return (
        f"batch {batch} reported as OOM at a cap of {cap / 2**30:.1f} GiB for this process, memory back to "
        f"{after / 2**20:.1f} MiB, the next run succeeded"
    )


def check_tf32(caps: Capabilities) -> str:
    _needs(caps.type == "cuda", "CUDA only")
    _needs(caps.precisions["tf32"].ok, caps.precisions["tf32"].note)
    from .techniques import matmul_precision

    a, b = (torch.randn(1024, 1024, device=caps.device, dtype=torch.float64) for _ in range(2))
    exact, errors = a @ b, {}
    for mode in ("fp32", "tf32"):
        with matmul_precision(mode):
            errors[mode] = ((a.float() @ b.float()).double() - exact).norm().item() / exact.norm().item()
    fp32, tf32 = errors["fp32"], errors["tf32"]
    assert tf32 > 10 * fp32, f"TF32 error {tf32:.1e} is not above fp32's {fp32:.1e}: TF32 did not switch on"
    return f"fp32_precision API: relative error fp32 {fp32:.1e}, tf32 {tf32:.1e}; the setting is restored afterwards"


def check_snapshot(caps: Capabilities) -> str:
    _needs(caps.type == "cuda", "CUDA only")
    from .train import run

    path = Path(tempfile.mkdtemp(prefix="course_snapshot_")) / "snapshot.pickle"
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        run(check_config(caps.device), "doctor snapshot")
        torch.cuda.memory._dump_snapshot(str(path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    assert path.stat().st_size > 0
    return f"{path} ({path.stat().st_size / 1024:.0f} KiB): open it at pytorch.org/memory_viz"


def _checks(caps: Capabilities) -> list[tuple[str, Callable[[], str], bool]]:
    """(name, check, slow) in the order they run; the fp32 run (each precision's and compile's reference) is shared."""
    fp32 = _reference_run(check_config(caps.device))
    return [
        *((f"train step {p}", (lambda p=p: check_precision(caps, p, fp32)), False) for p in C.PRECISIONS),
        ("compile", lambda: check_compile(caps, fp32), True),
        *((f"SDPA {b}", (lambda b=b: check_sdpa(caps, b)), False) for b in caps.sdpa),
        ("memory report", lambda: check_memory_report(caps), False),
        ("all-reduce gloo", lambda: check_all_reduce(caps, "gloo"), True),
        ("all-reduce nccl", lambda: check_all_reduce(caps, "nccl"), True),
        ("matmul peak", lambda: check_matmul_peak(caps), False),
        ("reserved vs allocated", lambda: check_reserved(caps), False),
        ("out of memory", lambda: check_oom(caps), False),
        ("TF32", lambda: check_tf32(caps), False),
        ("memory snapshot", lambda: check_snapshot(caps), False),
    ]


def _outcome(fn: Callable[[], str]) -> tuple[str, str]:
    """(status, detail) of one check: a failing path is the doctor's finding, not its crash."""
    try:
        return PASS, fn()
    except _NotApplicable as e:
        return NA, str(e)
    except Exception as e:  # noqa: BLE001
        detail = f"{type(e).__name__}: {e}".strip().splitlines()[0][:300]
        if not isinstance(e, AssertionError):
            detail += " | " + traceback.format_exc().strip().splitlines()[-3][:200]
        return FAIL, detail


def run_doctor(device: str | None = None, quick=False, json_path=None, only=None, progress=None) -> DoctorReport:
    """Every check (or those named in `only`) on `device`: the report, also written to `json_path` where given."""
    caps = capabilities(device)
    report = DoctorReport(device=caps.name, provenance=provenance(caps.name), capabilities=dict(caps.rows()))
    for name, fn, slow in _checks(caps):
        if only is not None and name not in only:
            continue
        if progress:
            progress(name)
        if quick and slow:
            report.checks.append(Check(name, SKIPPED, "left out by --quick"))
            continue
        t0 = time.perf_counter()
        try:
            status, detail = _outcome(fn)
        except KeyboardInterrupt:  # the checks so far are a report too: kept, shown and written
            report.interrupted = name
            break
        report.checks.append(Check(name, status, detail, time.perf_counter() - t0))
    if json_path:
        text = json.dumps(dataclasses.asdict(report), indent=1)
        write_atomic(Path(json_path), lambda f: f.write_text(text), strict=True)
    return report
