"""Memory (CUDA: the allocator's peak; CPU: a ledger of every tensor storage by CATEGORIES) and FLOPs (PaLM's 6N +
12·L·h·s per token), the same way on any device; time: course_lib.timing."""

from __future__ import annotations

import contextlib
import itertools
import re
import weakref
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from . import cpu_allocator
from .config import TrainConfig
from .timing import StepTimer

GiB = 1024**3
CATEGORIES = ("parameters", "gradients", "optimizer state", "activations", "logits", "other")


def available_cpu_memory(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes left before Linux's OOM killer ends the process, uncatchably (MemAvailable, cgroup v2); None off Linux."""
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
    """'1.25 MiB', or 'not measured' for None (on CUDA activations and logits are inside 'other')."""
    return "not measured" if n_bytes is None else f"{n_bytes / 2**20:.{digits}f} MiB"


def cuda_index(device: str | torch.device) -> int:
    """The GPU's index ("cuda" alone: the current one); torch.cuda's memory-limit calls need one."""
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


_WARMED_GPUS: set[int] = set()


def warm_up_cuda_libraries(device: str | torch.device) -> None:
    """Once per GPU: cuBLAS and cuBLASLt allocate their workspaces before a run's baseline, not in its "other"."""
    device = torch.device(device)
    if device.type != "cuda" or cuda_index(device) in _WARMED_GPUS:
        return
    for dtype in [torch.float32] + ([torch.bfloat16] if torch.cuda.is_bf16_supported() else []):
        a = torch.ones(64, 64, device=device, dtype=dtype, requires_grad=True)
        bias = torch.ones(64, device=device, dtype=dtype, requires_grad=True)
        ((a @ a).sum() + torch.nn.functional.linear(a, a, bias).sum()).backward()
    torch.cuda.synchronize(device)
    _WARMED_GPUS.add(cuda_index(device))


def _storages(tensors):
    """The storages holding the bytes of `tensors`; a wrapper subclass (DTensor) by its inner ones (its own raises)."""
    for t in tensors:
        if is_traceable_wrapper_subclass(t):
            yield from _storages(getattr(t, a) for a in t.__tensor_flatten__()[0])
        elif isinstance(t, torch.Tensor):
            yield t.untyped_storage()


def tensor_bytes(tensors) -> int:
    """Bytes of distinct storages among `tensors` (a view or a tied weight is counted once)."""
    distinct = {(st.data_ptr(), st.device) if st.device.type != "meta" else id(st): st for st in _storages(tensors)}
    return sum(st.nbytes() for st in distinct.values())


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

    def to_dict(self) -> dict:  # what a results file keeps: all but the timeline
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "timeline"}


# one sequence for every ledger: an id an earlier ledger left on a storage never matches
_LEDGER_IDS = itertools.count()


def _aliasing_returns(func, out) -> list[bool]:
    """For each tensor `func` returned: does it alias an input (a view, in-place or out=), allocating nothing?"""
    flat = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    if func.__name__.startswith("lift"):  # torch.tensor(data): a storage born outside dispatch, shown here first
        return [False] * len(flat)
    returns = func._schema.returns
    if len(returns) == len(flat):
        return [r.alias_info is not None for r in returns]
    return [any(r.alias_info is not None for r in returns)] * len(flat)


class MemoryLedger(TorchDispatchMode):
    """Every storage's bytes by category, live and at the peak; sizes read again at each op (resize_, FSDP2)."""

    PHASE_CATEGORY = {"forward": "activations", "loss": "logits"}  # any other phase makes "other"

    def __init__(self, keep_timeline: bool = True):
        super().__init__()
        self._info: dict[int, list] = {}  # storage id -> [nbytes, category]
        self._refs: dict[int, weakref.ref] = {}
        self.live = self.peak = self.saved_bytes = 0
        self._peak_members: dict[int, list] = {}  # _info at the peak
        self._phase = "other"
        self.keep_timeline = keep_timeline
        self.timeline: list[tuple[str, int]] = []

    # A storage's id is kept on its Python object, the same one while the storage lives; a weakref tells its death.
    def _sid(self, st) -> int | None:
        sid = getattr(st, "_course_ledger_id", None)
        return sid if sid in self._info else None

    def _track(self, tensors, category: str | None = None) -> None:
        """Read again the sizes of the followed storages among `tensors`; with a category, follow the others too."""
        for st in _storages(tensors):
            sid = self._sid(st)
            if sid is None and category is not None:
                sid = next(_LEDGER_IDS)
                try:
                    st._course_ledger_id = sid
                except AttributeError:
                    continue
                self._info[sid] = [0, category]
                self._refs[sid] = weakref.ref(st, lambda _r, sid=sid: self._free(sid))
            if sid is not None:
                self._resize(sid, st.nbytes())

    def _resize(self, sid: int, nbytes: int) -> None:
        info = self._info[sid]
        self.live += nbytes - info[0]
        info[0] = nbytes
        if self.live > self.peak:
            self.peak = self.live
            # copied in one step first: a storage freed meanwhile (its weakref's callback, run by a garbage collection
            # or autograd's GPU thread) would change _info while the snapshot iterates it
            self._peak_members = {k: v[:] for k, v in dict(self._info).items()}

    def _free(self, sid: int) -> None:
        self._refs.pop(sid, None)
        self.live -= self._info.pop(sid, [0])[0]

    def register(self, tensors, category: str) -> None:
        """Count tensors that already exist (parameters, gradients, optimizer state) under `category`."""
        tensors = list(tensors)
        self._track(tensors, category)
        self.reclassify(tensors, category)

    def category_of(self, t: torch.Tensor) -> str | None:
        """The category a tensor's bytes are counted in, or None when the ledger does not follow them."""
        sids = (self._sid(st) for st in _storages([t]))
        return next((self._info[sid][1] for sid in sids if sid is not None), None)

    def reclassify(self, tensors, category: str) -> None:
        """`tensors` count as `category`, in the peak's snapshot too (a gradient is born in backward, as "other")."""
        for st in _storages(tensors):
            sid = self._sid(st)
            for members in (self._info, self._peak_members):
                if sid in members:
                    members[sid][1] = category

    @contextlib.contextmanager
    def phase(self, name: str):
        prev, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = prev

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._track(tree_flatten((args, kwargs))[0])  # resize_ and friends change an input's storage
        category = self.PHASE_CATEGORY.get(self._phase, "other")
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        for t, aliases in zip(outs, _aliasing_returns(func, out)):
            self._track([t], None if aliases else category)
        if self.keep_timeline:
            self.timeline.append((self._phase, self.live))
        return out

    @contextlib.contextmanager
    def watch(self, output_layer: torch.nn.Module | None = None):
        """Follow one step; `saved_bytes`: autograd's saved storages, each once, the parameters left out."""
        saved_token = object()  # this watch's mark on the storages it has counted

        def pack(t: torch.Tensor):
            if self._phase in ("forward", "loss") and self.category_of(t) != "parameters":
                for st in _storages([t]):
                    # a mark on the storage, not a reference, which would keep every micro-batch's activations alive
                    if getattr(st, "_course_saved_by", None) is not saved_token:
                        with contextlib.suppress(AttributeError):
                            st._course_saved_by = saved_token
                        self.saved_bytes += st.nbytes()
            return t

        def into_loss(_module, _inputs):
            if self._phase == "forward":
                self._phase = "loss"

        hooks = []
        if output_layer is not None:
            hooks.append(output_layer.register_forward_pre_hook(into_loss))
            hooks.append(output_layer.register_forward_hook(lambda _m, _i, out: self.register([out], "logits")))
        try:
            with self, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield self
        finally:
            for h in hooks:
                h.remove()
            if self.keep_timeline:  # what is still live when the step ends (after zero_grad freed what it frees)
                self.timeline.append(("optimizer", self.live))

    def report(self) -> MemoryReport:
        by = dict.fromkeys(CATEGORIES, 0)
        for nbytes, category in self._peak_members.values():
            by[category] += nbytes
        method = "CPU ledger: every tensor storage followed through one training step"
        return MemoryReport(self.peak, by, self.saved_bytes, method=method, timeline=list(self.timeline))


class NotMeasured:
    """The step runs as it is; the ledger's twin below has the same methods, so the loop has no measurement branch."""

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
    grads = [p.grad for p in params if p.grad is not None]
    return {"parameters": params, "gradients": grads, "optimizer state": optimizer_state_tensors(optimizer)}


def static_bytes(model, optimizer, gradients_at_parameter_size: bool = False) -> dict[str, int]:
    """Bytes this process holds by static_tensors' category; the gradients as at backward's end where asked."""
    tensors = static_tensors(model, optimizer)
    if gradients_at_parameter_size:
        tensors["gradients"] = tensors["parameters"]
    return {k: tensor_bytes(v) for k, v in tensors.items()}


class LedgerMeasurement(NotMeasured):
    """The step under the CPU memory ledger, by category; the loss runs eagerly (a compiled graph hides its tensors)."""

    def __init__(self, output_layer: torch.nn.Module | None = None):
        self.ledger = MemoryLedger()
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
    """Each step's time, page faults and (from `start` to `stop`) memory; built before the model: CUDA's baseline."""

    def __init__(self, cfg: TrainConfig, cuda_graphs: bool = False):
        self.dev, self.cfg, self.cuda_graphs = torch.device(cfg.device), cfg, cuda_graphs
        warm_up_cuda_libraries(self.dev)
        cuda = self.dev.type == "cuda"
        self.baseline = torch.cuda.memory_allocated(self.dev) if cuda else 0
        self.reserved_baseline = torch.cuda.memory_reserved(self.dev) if cuda else 0
        self.recording, self.ledger, self.faults = False, None, None
        self.cuda_peak = self.cuda_reserved = None  # memory() before any start(): nothing recorded, not an error
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
        """Around step `step` of the loop built as `setup` (techniques.Setup): its clock, page faults and peaks."""
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
        # set_to_none: gradients exist from backward on, before or after the peak? "not measured" rather than guessed
        static: dict = static_bytes(model, optimizer, gradients_at_parameter_size=True)
        static["gradients"] = None if self.cfg.set_to_none else static["gradients"]
        peaks = (self.cuda_peak, self.baseline, self.cuda_reserved, self.cuda_graphs, self.reserved_baseline)
        return cuda_memory_report(self.dev, static, *peaks).to_dict()


GRAPHS_METHOD = "CUDA graphs"  # how a reserved peak's method begins (results.peak_text labels it)


def cuda_memory_report(device, static, peak=None, baseline=0, reserved=None, cuda_graphs=False, reserved_baseline=0):
    """The allocator's peak less `baseline`, `static` by category and the rest "other" (the allocator knows no more);
    under `cuda_graphs` the reserved peak, as a replay allocates nothing (its activations are in the graphs' pool)."""
    reserved = torch.cuda.max_memory_reserved(device) if reserved is None else reserved
    if cuda_graphs:
        peak, baseline = reserved, reserved_baseline
    peak = torch.cuda.max_memory_allocated(device) if peak is None else peak
    # A run that holds less than before it (cached blocks returned mid-run) has nothing subtracted, and says so.
    unsubtracted = peak < baseline
    peak -= 0 if unsubtracted else baseline
    by: dict[str, int | None] = {**dict.fromkeys(CATEGORIES, None), **static}
    by["other"] = max(0, peak - sum(v for k, v in by.items() if v and k != "other"))
    what = "reserved" if cuda_graphs else "allocated"
    method = f"torch.cuda.max_memory_{what} over the run's timed steps, less what was {what} before the run"
    method = f"{GRAPHS_METHOD}: {method} (the graphs' pool included)" if cuda_graphs else f"CUDA: {method}"
    if unsubtracted:
        method += "; here nothing was subtracted: the run held less than before it, at its peak"
    method += "; activations and logits are not measured separately (inside 'other')"
    return MemoryReport(peak_bytes=peak, by_category=by, reserved_bytes=reserved, method=method)


def flops_per_token(n_params_non_embedding: int, n_layer: int, n_embd: int, context: int) -> int:
    """Training FLOPs per token: 6N for the weight matmuls, 12·L·h·s for attention (causal masking not subtracted)."""
    return 6 * n_params_non_embedding + 12 * n_layer * n_embd * context


def counted_flops_per_token(model: torch.nn.Module, idx: torch.Tensor, loss_fn, tokens: int | None = None) -> int:
    """The same counted by FlopCounterMode over one forward and backward, per element of `idx` (or per `tokens`)."""
    from torch.utils.flop_counter import FlopCounterMode  # imported here: a slow import, for this count only

    with FlopCounterMode(display=False) as counter:
        loss_fn(model(idx)).backward()
    return counter.get_total_flops() // (tokens or idx.numel())
