"""Measurement: memory and FLOPs, the same way on any device (time: course_lib.timing, re-exported here).

- Memory on CUDA: the allocator's peak (`max_memory_allocated`) and what it reserved.
- Memory on a CPU: an exact ledger. Every tensor storage an operation creates is followed from birth to
  death (a TorchDispatchMode sees every op, forward and backward), so the live total and its peak are
  exact for tensor memory. Each storage is put in a category: parameters, gradients, optimizer state,
  activations (created in the forward pass and still alive), logits (the output layer and the loss), and
  other (temporaries, mostly in backward). Saved-for-backward bytes are also counted on their own, once
  per storage, with saved_tensors_hooks.
- FLOPs: 6N + 12·L·h·s per token (PaLM, appendix B), checkable against FlopCounterMode.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from . import cpu_allocator
from .capabilities import device_name  # noqa: F401 - re-exported: the notebooks use measure.device_name
from .config import TrainConfig
from .timing import StepTimer, median_excluding, synchronize, time_fn  # noqa: F401 - re-exported for the notebooks

GiB = 1024**3
CATEGORIES = ("parameters", "gradients", "optimizer state", "activations", "logits", "other")


def available_cpu_memory(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this machine can still give a process before the kernel's out-of-memory killer ends it (Linux's
    MemAvailable, or less under a container's limit, cgroup v2's memory.max); None where it cannot be read (not Linux).
    A CPU allocation past it is not an error Python could catch: the process is killed, the notebook's kernel dies."""
    try:
        meminfo = (proc / "meminfo").read_text()
        available = int(re.search(r"^MemAvailable:\s+(\d+) kB", meminfo, re.MULTILINE).group(1)) * 1024
    except (OSError, AttributeError, ValueError):
        return None
    with contextlib.suppress(OSError, ValueError, AttributeError):
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            # the container's use less the file cache the kernel drops before it kills anything
            used = int((cgroup / "memory.current").read_text())
            stat = (cgroup / "memory.stat").read_text()
            used -= int(re.search(r"^inactive_file (\d+)$", stat, re.MULTILINE).group(1))
            available = min(available, int(limit) - used)
    return available


def mib_text(n_bytes: int | None, digits: int = 2) -> str:
    """A memory category for printing: '1.25 MiB', or 'not measured' where the device cannot tell it apart (on CUDA
    activations and logits are None: the allocator knows only the total, so they are inside 'other')."""
    return "not measured" if n_bytes is None else f"{n_bytes / 2**20:.{digits}f} MiB"


# ---- time: course_lib.timing (below the device's capabilities, which time a matmul with it) -------------------

# ---- memory ------------------------------------------------------------------------------------


def cuda_index(device: str | torch.device) -> int:
    """The GPU's index ("cuda" alone means the current one): torch.cuda's memory-limit calls reject a device without
    one."""
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


_WARMED_GPUS: set[int] = set()


def warm_up_cuda_libraries(device: str | torch.device) -> None:
    """Once per process and GPU, before a run takes its memory baseline: a small matmul and a linear layer with a
    bias, forward and backward, in fp32 (and bf16 where the GPU has it), so that cuBLAS and cuBLASLt (addmm with a
    bias goes there) allocate their workspaces now (on Hopper 32 MiB per cuBLAS handle; forward and autograd's
    backward thread use different handles). They are the libraries', kept for the whole process: without this the
    first run of a process would count them in its "other" memory and later runs not."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    index = cuda_index(device)
    if index in _WARMED_GPUS:
        return
    dtypes = [torch.float32] + ([torch.bfloat16] if torch.cuda.is_bf16_supported() else [])
    for dtype in dtypes:
        a = torch.ones(64, 64, device=device, dtype=dtype, requires_grad=True)
        bias = torch.ones(64, device=device, dtype=dtype, requires_grad=True)
        ((a @ a).sum() + torch.nn.functional.linear(a, a, bias).sum()).backward()
    torch.cuda.synchronize(device)
    _WARMED_GPUS.add(index)


def tensor_bytes(tensors) -> int:
    """Bytes of distinct storages among `tensors` (a view or a tied weight is counted once)."""
    seen, total = set(), 0
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            continue
        for t in plain_tensors(tensor):  # a DTensor (FSDP2, tensor parallel): the local shard this process holds
            st = t.untyped_storage()
            key = (st.data_ptr(), t.device) if t.device.type != "meta" else id(st)
            if key not in seen:
                seen.add(key)
                total += st.nbytes()
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    # `step` counters are scalar tensors too; they count, as they do on a GPU.
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


@dataclass
class MemoryReport:
    """Peak memory of one step, split by category, in bytes."""

    peak_bytes: int
    by_category: dict[str, int]
    saved_for_backward_bytes: int | None = None  # activations saved by autograd (ledger only)
    reserved_bytes: int | None = None  # CUDA only: what the caching allocator holds
    method: str = ""
    timeline: list[tuple[str, int]] = field(default_factory=list)  # (phase, live bytes) after each op

    def gib(self) -> dict[str, float]:
        return {k: v / GiB for k, v in self.by_category.items()}

    def to_dict(self) -> dict:
        return {
            "peak_bytes": self.peak_bytes,
            "by_category": self.by_category,
            "saved_for_backward_bytes": self.saved_for_backward_bytes,
            "reserved_bytes": self.reserved_bytes,
            "method": self.method,
        }


# one sequence for every ledger: an id an earlier ledger left on a storage never matches
_LEDGER_IDS = itertools.count()


def plain_tensors(t: torch.Tensor):
    """The plain tensors that hold `t`'s bytes: `t` itself, or the inner tensors of a wrapper subclass (a DTensor's
    local shard), whose own storage is a placeholder that raises when asked for."""
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        for a in attrs:
            inner = getattr(t, a)
            if isinstance(inner, torch.Tensor):
                yield from plain_tensors(inner)
    else:
        yield t


def _aliasing_returns(func, out) -> list[bool]:
    """For each tensor `func` returned: does it alias an input (a view, an in-place or out= result)? Such a result
    allocates nothing: its storage is an input's, counted where that was made (or before the ledger started)."""
    flat = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    if func.__name__.startswith("lift"):  # torch.tensor(data): a storage born outside dispatch, shown here first
        return [False] * len(flat)
    returns = func._schema.returns
    if len(returns) == len(flat):
        return [r.alias_info is not None for r in returns]
    return [any(r.alias_info is not None for r in returns)] * len(flat)


class MemoryLedger(TorchDispatchMode):
    """Follows every tensor storage created while active; knows the live total, its peak and what it holds.

    Use `phase("forward" | "loss" | "backward" | "optimizer")` around the parts of a step so that new storages
    get a category; call `register(...)` first for what exists before the step (parameters, gradients,
    optimizer state). A storage's size is read again whenever an operation touches it (resize_, and FSDP2's
    resize to 0 and back), a view of a storage made before the ledger allocates nothing, and a tensor subclass
    (DTensor) is counted by its local tensors. Storages still alive when the ledger closes are re-examined, so a
    gradient made in backward is counted as a gradient, not as a temporary.
    """

    PHASE_CATEGORY = {
        "forward": "activations",
        "loss": "logits",
        "backward": "other",
        "optimizer": "other",
        "other": "other",
    }

    def __init__(self, keep_timeline: bool = True):
        super().__init__()
        self._info: dict[int, list] = {}  # storage id -> [nbytes, category]
        self._refs: dict[int, weakref.ref] = {}
        self.live = 0
        self.peak = 0
        self._peak_members: dict[int, list] = {}
        self._phase = "other"
        self.keep_timeline = keep_timeline
        self.timeline: list[tuple[str, int]] = []
        self.saved_bytes = 0

    # A storage is identified by an id stored on its Python object, which PyTorch keeps alive (and the same
    # object) as long as the storage lives; a weak reference tells the ledger when it dies.
    def _sid(self, st) -> int | None:
        sid = getattr(st, "_course_ledger_id", None)
        return sid if sid in self._info else None

    def _track(self, t: torch.Tensor, category: str) -> None:
        for plain in plain_tensors(t):
            st = plain.untyped_storage()
            sid = self._sid(st)
            if sid is not None:
                self._resize(sid, st.nbytes())
                continue
            sid = next(_LEDGER_IDS)
            try:
                st._course_ledger_id = sid
            except AttributeError:
                continue
            self._info[sid] = [0, category]
            self._refs[sid] = weakref.ref(st, lambda _r, sid=sid: self._free(sid))
            self._resize(sid, st.nbytes())

    def _resize(self, sid: int, nbytes: int) -> None:
        info = self._info[sid]
        if nbytes == info[0]:
            return
        self.live += nbytes - info[0]
        info[0] = nbytes
        if self.live > self.peak:
            self.peak = self.live
            self._peak_members = {k: v[:] for k, v in self._info.items()}

    def _refresh(self, tensors) -> None:
        """Read again the sizes of tracked storages among `tensors` (they may have been resized)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                for plain in plain_tensors(t):
                    st = plain.untyped_storage()
                    sid = self._sid(st)
                    if sid is not None:
                        self._resize(sid, st.nbytes())

    def _free(self, sid: int) -> None:
        info = self._info.pop(sid, None)
        self._refs.pop(sid, None)
        if info is not None:
            self.live -= info[0]

    def register(self, tensors, category: str) -> None:
        """Count tensors that already exist (parameters, gradients, optimizer state) under `category`."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._track(t, category)
                self.reclassify([t], category)

    def category_of(self, t: torch.Tensor) -> str | None:
        """The category a tensor's bytes are counted in, or None when the ledger does not follow them."""
        for plain in plain_tensors(t):
            sid = self._sid(plain.untyped_storage())
            if sid is not None:
                return self._info[sid][1]
        return None

    @contextlib.contextmanager
    def phase(self, name: str):
        prev, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = prev

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        category = self.PHASE_CATEGORY.get(self._phase, "other")
        self._refresh(tree_flatten((args, kwargs))[0])  # resize_ and friends change an input's storage
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        for t, aliases in zip(outs, _aliasing_returns(func, out)):
            if aliases:
                self._refresh([t])
            else:
                self._track(t, category)
        if self.keep_timeline:
            self.timeline.append((self._phase, self.live))
        return out

    @contextlib.contextmanager
    def watch(self, output_layer: torch.nn.Module | None = None):
        """Follow one training step. Inside `phase("forward")`, new storages are "activations" until
        `output_layer` runs (the module that makes the logits); its result and everything after it (the loss) are
        "logits". The bytes autograd saves for backward during the forward are counted too, once per storage and
        without the parameters themselves (a matmul saves its weight, which is no activation). Usage:

            with ledger.watch(model.lm_head):
                with ledger.phase("forward"): loss = loss_fn(x, y)
                with ledger.phase("backward"): loss.backward()
                with ledger.phase("optimizer"): opt.step()
        """

        def pack(t: torch.Tensor):
            if self._phase in ("forward", "loss") and self.category_of(t) != "parameters":
                for plain in plain_tensors(t):
                    st = plain.untyped_storage()
                    # Mark the storage itself (its Python object lives as long as it does) rather than holding it:
                    # holding it would keep every micro-batch's activations alive until the step ends.
                    if getattr(st, "_course_saved_by", None) is not saved_token:
                        try:
                            st._course_saved_by = saved_token
                        except AttributeError:
                            pass
                        self.saved_bytes += st.nbytes()
            return t

        def into_loss(_module, _inputs):
            if self._phase == "forward":
                self._phase = "loss"

        def logits_out(_module, _inputs, output):
            self.register([output], "logits")

        saved_token = object()  # this watch's mark on the storages it has counted
        handles = (
            [output_layer.register_forward_pre_hook(into_loss), output_layer.register_forward_hook(logits_out)]
            if output_layer is not None
            else []
        )
        try:
            with self, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield self
        finally:
            for h in handles:
                h.remove()
            if self.keep_timeline:  # what is still live when the step ends (after zero_grad freed what it frees)
                self.timeline.append(("optimizer", self.live))

    def reclassify(self, tensors, category: str) -> None:
        """Storages in `tensors` belong to `category`, now and in the peak's snapshot (a gradient is made in
        backward, where it first counts as "other")."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                for plain in plain_tensors(t):
                    sid = self._sid(plain.untyped_storage())
                    for members in (self._info, self._peak_members):
                        if sid is not None and sid in members:
                            members[sid][1] = category

    def report(self) -> MemoryReport:
        by = dict.fromkeys(CATEGORIES, 0)
        for nbytes, category in self._peak_members.values():
            by[category] += nbytes
        return MemoryReport(
            peak_bytes=self.peak,
            by_category=by,
            saved_for_backward_bytes=self.saved_bytes,
            method="CPU ledger: every tensor storage followed through one training step",
            timeline=list(self.timeline),
        )


# ---- how one step is watched: the same step body either way ------------------------------------------


class NotMeasured:
    """The step runs as it is: every hook of the step body is a no-op. The ledger's twin below has the same
    methods, so the loop (and memory_estimate.account_step) has no measurement branch."""

    def watching(self, setup):
        return contextlib.nullcontext()

    def phase(self, name: str):
        return contextlib.nullcontext()

    def loss_fn(self, setup):
        return setup.loss_fn

    def on_grads(self, grads) -> None:
        pass


NOT_MEASURED = NotMeasured()


def static_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
    """What a model and its optimizer hold between steps: parameters, gradients (when they exist), optimizer state."""
    params = list(model.parameters())
    return {
        "parameters": params,
        "gradients": [p.grad for p in params if p.grad is not None],
        "optimizer state": optimizer_state_tensors(optimizer),
    }


def static_bytes(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, gradients_at_parameter_size: bool = False
) -> dict[str, int]:
    """Bytes this process holds in parameters, gradients and optimizer state (each storage once, a DTensor's local
    shard). gradients_at_parameter_size: count the gradients as they are at the end of backward, whether or not
    zero_grad(set_to_none=True) has freed them since."""
    tensors = static_tensors(model, optimizer)
    if gradients_at_parameter_size:
        tensors["gradients"] = tensors["parameters"]
    return {k: tensor_bytes(v) for k, v in tensors.items()}


class LedgerMeasurement(NotMeasured):
    """The step under the CPU memory ledger: what exists before it is registered by category, every storage the
    step makes is followed, the gradients are named as such when the optimizer sees them, and afterwards what
    remains is classified again. The step runs the eager loss module: a compiled graph would hide its inside."""

    def __init__(self, output_layer: torch.nn.Module | None = None, ledger: MemoryLedger | None = None):
        self.ledger = ledger or MemoryLedger()
        self.output_layer = output_layer

    @contextlib.contextmanager
    def watching(self, setup):
        for category, tensors in static_tensors(setup.model, setup.optimizer).items():
            self.ledger.register(tensors, category)
        with self.ledger.watch(self.output_layer):
            yield
        for category, tensors in static_tensors(setup.model, setup.optimizer).items():
            self.ledger.reclassify(tensors, category)

    def phase(self, name: str):
        return self.ledger.phase(name)

    def loss_fn(self, setup):
        return setup.loss_module

    def on_grads(self, grads) -> None:
        self.ledger.reclassify(grads, "gradients")

    def report(self) -> MemoryReport:
        return self.ledger.report()


class StepRecorder:
    """What a run measures around each training step, from outside it (course_lib.train.train_step measures nothing):
    - the step's wall time (timing.StepTimer: the device synchronised before the clock is read);
    - the page faults it made (a CPU's memory handed back and fetched again: techniques.keep_freed_memory);
    - on CUDA, the allocator's peaks over the run's own timed steps, each step read on its own, so that another loop's
      steps taken in between (the ladder's pairs) never count;
    - on a CPU, the memory ledger over its one step (cfg.ledger_step), through the `meter` the step is given.
    Built before the run's model, so that what CUDA already holds (an earlier run's leftovers, the notebook's tensors,
    cuBLAS's workspaces) is its baseline, not this run's memory. Between `start` and `stop` it records; outside, a
    step is only timed (the ladder's extra paired steps)."""

    def __init__(self, cfg: TrainConfig, cuda_graphs: bool = False):
        self.dev, self.cfg, self.cuda_graphs = torch.device(cfg.device), cfg, cuda_graphs
        warm_up_cuda_libraries(self.dev)
        cuda = self.dev.type == "cuda"
        self.baseline = torch.cuda.memory_allocated(self.dev) if cuda else 0
        self.reserved_baseline = torch.cuda.memory_reserved(self.dev) if cuda else 0
        self.recording, self.ledger, self.faults = False, None, None
        self.timer = StepTimer(self.dev)

    def start(self, output_layer: torch.nn.Module | None) -> None:
        """A run begins: its own clock, ledger and peaks."""
        self.recording, self.timer = True, StepTimer(self.dev)
        self.ledger = LedgerMeasurement(output_layer) if self.cfg.ledger_step is not None else None
        self.cuda_peak = self.cuda_reserved = None

    def stop(self) -> None:
        self.recording, self.timer = False, StepTimer(self.dev)

    def meter(self, step: int) -> NotMeasured:
        """What watches step `step` from inside: the ledger on its step, else nothing."""
        return self.ledger if self.recording and step == self.cfg.ledger_step else NOT_MEASURED

    @contextlib.contextmanager
    def step(self, step: int, setup):
        """Around step `step` of the loop built as `setup` (techniques.Setup): its clock, its page faults, its peaks,
        and on its step the ledger, which registers what exists before it and follows what it makes."""
        first_timed = min(self.cfg.timing_warmup, self.cfg.steps - 1)
        cuda_peak = self.recording and self.dev.type == "cuda" and step >= first_timed
        if cuda_peak:
            if step == first_timed and self.cuda_graphs:
                torch.cuda.empty_cache()  # what compiling left goes; the graphs' pool is in use, and stays
            torch.cuda.reset_peak_memory_stats(self.dev)
        faults_before = cpu_allocator.page_faults()
        with self.timer.step(), self.meter(step).watching(setup):
            yield
        self.faults = None if faults_before is None else cpu_allocator.page_faults() - faults_before
        if cuda_peak:
            self.cuda_peak = max(self.cuda_peak or 0, torch.cuda.max_memory_allocated(self.dev))
            self.cuda_reserved = max(self.cuda_reserved or 0, torch.cuda.max_memory_reserved(self.dev))

    def memory(self, model: torch.nn.Module, optimizer, steps_taken: int) -> dict | None:
        """The run's memory report (MemoryReport.to_dict()): the ledger's, or the CUDA allocator's peaks, or None."""
        if self.ledger is not None and steps_taken > self.cfg.ledger_step:
            return self.ledger.report().to_dict()
        if self.dev.type != "cuda" or self.cuda_peak is None:
            return None
        # With set_to_none=False the gradients live through the whole step, so they are at the peak at full size.
        # With set_to_none=True they exist only from backward on, and the allocator cannot say whether the peak fell
        # before or after: they are "not measured" (inside "other") rather than guessed.
        static: dict = static_bytes(model, optimizer, gradients_at_parameter_size=True)
        static["gradients"] = None if self.cfg.set_to_none else static["gradients"]
        report = cuda_memory_report(
            self.dev,
            static,
            peak=self.cuda_peak,
            baseline=self.baseline,
            reserved=self.cuda_reserved,
            cuda_graphs=self.cuda_graphs,
            reserved_baseline=self.reserved_baseline,
        )
        return report.to_dict()


GRAPHS_METHOD = "CUDA graphs"  # how a reserved peak's method begins (results.peak_text labels it)


def cuda_memory_report(
    device,
    static: dict[str, int | None],
    peak: int | None = None,
    baseline: int = 0,
    reserved: int | None = None,
    cuda_graphs: bool = False,
    reserved_baseline: int = 0,
) -> MemoryReport:
    """CUDA: the allocator's peak (`peak`, else max_memory_allocated since the last reset), less `baseline` (what was
    allocated before the run: an earlier run's leftovers must not inflate this one). Parameters, gradients and optimizer
    state come from the tensors themselves (None where they cannot be known at the peak); activations and logits are
    None, "not measured", since the allocator does not know what a block was for: they are inside "other", the rest of
    the peak. Reserved is the caching allocator's peak (`reserved`, read over the run's own steps, else since the last
    reset): what it held from the driver, this process's other tensors included.

    `cuda_graphs`: the steps replayed CUDA graphs, whose activations live in the graphs' private memory pool, allocated
    once when the graphs were recorded. A replay allocates nothing, so the allocated peak of a timed step misses them
    (a small fraction of the step's real peak). The peak is then what the allocator
    reserved over the timed steps, the pool included, less what it reserved before the run: at least the live tensors'
    peak, with the cache's slack on top, and said so (`method` starts with GRAPHS_METHOD)."""
    reserved = torch.cuda.max_memory_reserved(device) if reserved is None else reserved
    if cuda_graphs:
        peak, baseline = reserved, reserved_baseline
    peak = torch.cuda.max_memory_allocated(device) if peak is None else peak
    # An allocator that returned cached blocks mid-run (or a process that freed older tensors) can hold less than
    # before the run: then nothing is subtracted, and the method says so, rather than a peak of 0 or less.
    unsubtracted = peak < baseline
    peak -= 0 if unsubtracted else baseline
    by: dict[str, int | None] = dict.fromkeys(CATEGORIES, None)
    by.update(static)
    by["other"] = max(0, peak - sum(v for k, v in by.items() if v and k != "other"))
    method = (
        f"{GRAPHS_METHOD}: torch.cuda.max_memory_reserved over the run's timed steps (the graphs' private memory pool "
        "included, which a replay's allocated peak does not see), less what was reserved before the run, the "
        "cache's slack included"
        if cuda_graphs
        else "CUDA: torch.cuda.max_memory_allocated over the run's timed steps (the peak reset before each), "
        "less what was allocated before the run"
    )
    return MemoryReport(
        peak_bytes=peak,
        by_category=by,
        reserved_bytes=reserved,
        method=method
        + ("; here nothing was subtracted: the run held less than before it, at its peak" if unsubtracted else "")
        + "; activations and logits are not measured separately (inside 'other')",
    )


# ---- FLOPs and MFU ------------------------------------------------------------------------------


def flops_per_token(n_params_non_embedding: int, n_layer: int, n_embd: int, context: int) -> int:
    """Training FLOPs per token, forward and backward: 6N for the weight matmuls and 12·L·h·s for
    attention's scores and weighted sum (PaLM, appendix B). Causal masking is not subtracted."""
    return 6 * n_params_non_embedding + 12 * n_layer * n_embd * context


def counted_flops_per_token(model: torch.nn.Module, idx: torch.Tensor, loss_fn, tokens: int | None = None) -> int:
    """The same quantity counted by torch's FlopCounterMode over one forward and backward, per token (per
    element of `idx`, or per `tokens` when an input is not one token per element, e.g. a sample of features)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        loss_fn(model(idx)).backward()
    return counter.get_total_flops() // (tokens or idx.numel())
