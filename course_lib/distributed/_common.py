"""What every strategy module does inside a torchrun process: read its arguments, join the process group
(NCCL on GPUs, gloo on CPU processes), measure, and write one JSON file per rank.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT; nothing here
assumes one machine, so the same module runs on a multi-GPU node or across nodes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from ..cache import write_atomic
from ..capabilities import device_name
from ..config import ConfigError, TrainConfig, did_you_mean, tiny_preset
from ..results import provenance

# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor (the old names now warn) to *_single;
# torch 2.11 has only the old names
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Ctx:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str
    out: Path
    options: dict
    cfg: TrainConfig
    strategy: str = ""

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world - 1

    def socket_bytes(self, counter: CollectiveCounter) -> int | None:
        """What this rank wrote to its sockets while `counter` counted: gloo's traffic (NCCL's does not pass there)."""
        return counter.written if self.backend == "gloo" else None


def choose_backend(device_pref: str, local_world: int) -> tuple[str, str]:
    """(backend, device type): NCCL when every local process can have its own GPU, else gloo on CPU."""
    if device_pref in ("auto", "cuda") and torch.cuda.is_available() and torch.cuda.device_count() >= local_world:
        return "nccl", "cuda"
    if device_pref == "cuda":
        raise RuntimeError(
            f"device='cuda' asked for, but {torch.cuda.device_count()} GPU(s) for {local_world} local processes"
        )
    return "gloo", "cpu"


def check_options(options, declared: dict, strategy: str) -> dict:
    """A strategy's options, each a key of its module's OPTIONS ({name: default}) with a value of its default's kind
    (an int where the default is an int, a list where a list...; None as the default takes anything), with the defaults
    filled in. A ConfigError names an unknown key's closest option or says what a value should be."""
    if not isinstance(options, dict):
        raise ConfigError(f"{strategy} options are a JSON object, e.g. {json.dumps(declared)}; got {options!r}")
    for key, value in options.items():
        if key not in declared:
            raise ConfigError(
                f"{strategy} has no option {key!r}{did_you_mean(key, declared)}; its options (defaults): "
                f"{json.dumps(declared, default=str)}"
            )
        default = declared[key]
        kind = (
            bool
            if isinstance(default, bool)
            else (int, float)
            if isinstance(default, float)
            else int
            if isinstance(default, int)
            else type(default)
        )
        if default is not None and (not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))):
            what = {bool: "true or false", int: "an integer", list: "a list", str: "a string"}.get(kind, "a number")
            raise ConfigError(
                f"{strategy} option {key}={json.dumps(value)}: takes {what}, like its default {json.dumps(default)}"
            )
    return {**declared, **options}


def start(argv=None, options: dict | None = None, strategy: str = "") -> Ctx:
    """Read a strategy's arguments and join the process group. `options`: the module's OPTIONS, {name: default}: what
    --options may set (check_options); a bad --options, or a run without torchrun, ends with one line saying why."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="folder for rank<r>.json")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--config", default=None, help="a TrainConfig as JSON (file path); default: the tiny preset")
    ap.add_argument("--options", default="{}", help="strategy options as a JSON object")
    args = ap.parse_args(argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise SystemExit(
            f"error: {strategy or 'this module'} runs under torchrun, which starts its processes: "
            f"torchrun --nproc_per_node=2 -m course_lib.distributed.{strategy or '<strategy>'} --out runs/x "
            "(or from Python: course_lib.distributed.launch.launch)"
        )
    try:
        parsed = json.loads(args.options)
        if options is not None:
            parsed = check_options(parsed, options, strategy)
        cfg = TrainConfig.from_dict(json.loads(Path(args.config).read_text())) if args.config else tiny_preset("cpu")
    except (ValueError, OSError) as e:  # JSONDecodeError and ConfigError are ValueErrors
        if os.environ.get("RANK") == "0":
            print(f"error: {strategy}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", world))
    backend, dev_type = choose_backend(args.device, local_world)
    device = torch.device("cuda", local_rank) if dev_type == "cuda" else torch.device("cpu")
    if dev_type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():  # joined already where several strategies run in one launch (series.py)
        dist.init_process_group(backend=backend, device_id=device if dev_type == "cuda" else None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"pid_rank{rank}").write_text(str(os.getpid()))  # lets a test check that nothing is left running
    from dataclasses import replace

    cfg = replace(cfg, device=str(device), measure_memory=False)
    return Ctx(rank, world, local_rank, device, backend, out, parsed, cfg, strategy)


def write(ctx: Ctx, payload: dict) -> None:
    """rank<r>.json: the rank's measurements plus where they came from."""
    base = {
        "rank": ctx.rank,
        "world_size": ctx.world,
        "backend": ctx.backend,
        "device": str(ctx.device),
        "provenance": provenance(device_name(ctx.device)),
        "time": time.time(),
    }
    text = json.dumps({**base, **payload}, indent=1, default=float)
    # in one step: a rank killed while writing leaves no half file for the launcher to read
    write_atomic(ctx.out / f"rank{ctx.rank}.json", lambda f: f.write_text(text), strict=True)
    # one line for whoever started it by hand (the series says it per run)
    if ctx.is_first and ctx.strategy != "series":
        print(
            f"{ctx.strategy or 'strategy'}: {ctx.world} processes ({ctx.backend}, {ctx.device.type}) done; results in "
            f"{ctx.out}/rank*.json",
            flush=True,
        )


_group_kept = False  # True while series.py runs several strategies in the one process group


@contextlib.contextmanager
def keep_group():
    """Within this context a strategy's finish() waits for the other ranks but leaves the process group standing."""
    global _group_kept
    _group_kept = True
    try:
        yield
    finally:
        _group_kept = False


def finish(ctx: Ctx, payload: dict) -> None:
    """The end of a strategy's run: write this rank's results, then leave the process group."""
    write(ctx, payload)
    leave()


def leave() -> None:
    """Wait for every rank, then leave the process group (unless a series keeps it for its next run)."""
    if dist.is_initialized():
        dist.barrier()
        if not _group_kept:
            dist.destroy_process_group()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of a tensor this rank holds: a DTensor's local shard, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def cuda_peak(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    return {
        "cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(device),
        "cuda_max_reserved_bytes": torch.cuda.max_memory_reserved(device),
    }


def global_batches(cfg: TrainConfig, world: int, seed: int = 0):
    """The same global batches on every rank: step -> list of micro-batches of world * micro_batch_size
    sequences. A rank takes its slice with `shard`."""
    from .. import data as data_mod

    splits = data_mod.load_splits()
    cache: dict[int, list] = {}

    def at(step: int):
        if step not in cache:
            gen = torch.Generator().manual_seed(seed * 100_003 + step)
            cache[step] = [
                data_mod.random_windows(splits.train, world * cfg.micro_batch_size, cfg.context, gen)
                for _ in range(cfg.grad_accum_steps)
            ]
        return cache[step]

    return splits, at


def shard(batch, rank: int, world: int):
    x, y = batch
    n = x.size(0) // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def train_rank(ctx: Ctx, cfg: TrainConfig, at, label: str, on_build, callback, model=None):
    """This rank's run of the course's one loop on its shard of the global batches. `on_build(setup)` sees what
    the Trainer built (model, wrapped loss module, optimizer) before the first step; `model`: one already prepared
    (e.g. sharded by the caller), else the Trainer's GPT. Returns (result, setup)."""
    from ..train import Trainer

    trainer = Trainer(cfg, model, batches=lambda step: [shard(b, ctx.rank, ctx.world) for b in at(step)])
    on_build(trainer.setup)
    return trainer.fit(label, callback), trainer.setup


# ---- counting the collectives ----------------------------------------------------------------------------

# The collective operators' names, as the dispatcher sees them (c10d's, and the functional ones DTensor issues), and
# what the course calls them. Point to point: a "send" is bytes this rank sends, a "receive" bytes it receives.
KINDS = {
    "allreduce_": "all-reduce",
    "allreduce_coalesced_": "all-reduce",
    "all_reduce": "all-reduce",
    "all_reduce_": "all-reduce",
    "all_reduce_coalesced": "all-reduce",
    "broadcast_": "broadcast",
    "broadcast": "broadcast",
    "_allgather_base_": "all-gather",
    "allgather_into_tensor_coalesced_": "all-gather",
    "allgather_": "all-gather",
    "all_gather_into_tensor": "all-gather",
    "all_gather_into_tensor_out": "all-gather",
    "all_gather_into_tensor_coalesced": "all-gather",
    "_reduce_scatter_base_": "reduce-scatter",
    "reduce_scatter_tensor_coalesced_": "reduce-scatter",
    "reduce_scatter_": "reduce-scatter",
    "reduce_scatter_tensor": "reduce-scatter",
    "reduce_scatter_tensor_coalesced": "reduce-scatter",
    "alltoall_base_": "all-to-all",
    "alltoall_": "all-to-all",
    "all_to_all_single": "all-to-all",
    "send": "send",
    "recv_": "receive",
}
# synchronisation, no payload to count
NOT_DATA = {"barrier", "monitored_barrier_", "wait_tensor", "_wrap_tensor_autograd"}


def _tensors(arg) -> list[torch.Tensor]:
    if isinstance(arg, torch.Tensor):
        return [arg]
    if isinstance(arg, (list, tuple)):
        return [t for a in arg for t in _tensors(a)]
    return []


def group_size(func, args) -> int | None:
    """The number of ranks in the process group a collective runs on: c10d's operators take the ProcessGroup itself (a
    ScriptObject at the dispatcher), the functional ones (DTensor's) its registered name, their last string argument.
    None where neither is found."""
    for a in args:
        if isinstance(a, torch.ScriptObject) and a._type().qualified_name().endswith(".ProcessGroup"):
            return dist.ProcessGroup.unbox(a).size()
    if "functional" in func.namespace:
        name = next((a for a in reversed(args) if isinstance(a, str)), None)
        if name is not None:
            from torch.distributed.distributed_c10d import _resolve_process_group

            return _resolve_process_group(name).size()
    return dist.get_world_size() if dist.is_initialized() else None


def bytes_written() -> int | None:
    """Bytes this process has passed to write() and its kin so far (Linux: /proc/self/io's wchar; None elsewhere). gloo
    sends over TCP sockets with such calls, so the difference across a step is what this rank sent (plus a few bytes of
    message headers, and whatever else it wrote meanwhile: nothing, in a training step). NCCL's traffic does not pass
    through them."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))
    except (OSError, StopIteration, ValueError):
        return None


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives this process issues while active: every c10d operator reaches the dispatcher, whoever
    calls it (DDP's C++ reducer, ZeroRedundancyOptimizer, FSDP2, a pipeline schedule's sends and receives), and so do
    the functional collectives of DTensor's layers (tensor parallelism), so one mechanism serves every strategy. Bytes
    are those of the full side of the exchange: the largest tensor among the arguments and the result (a list of tensors
    counted together), i.e. the gathered output of an all-gather, the unreduced input of a reduce-scatter, the tensor of
    an all-reduce or a broadcast. Each kind also keeps its bytes by the size of the process group the call ran on
    ("by_group_size", {"2": bytes}): a collective on a subgroup (the pipeline's tied-embedding all-reduce between its
    two end stages) is shared among that group's ranks, not the world's. Not seen: collectives issued inside a DTensor
    operator (the scalar all-reduce of the gradient norm). What each rank sends of those bytes depends on the algorithm
    and the group's size: `zero_memory.bytes_sent`.

    `written` is what the process wrote to its sockets while counting (`bytes_written`, Linux): the bytes a gloo rank
    really sent, to compare with that formula; None where it cannot be read."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, dict] = defaultdict(lambda: {"calls": 0, "bytes": 0, "by_group_size": {}})
        self.written: int | None = None
        self._written_at_start: int | None = None

    def __enter__(self):
        self._written_at_start = bytes_written()
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        end = bytes_written()
        if end is not None and self._written_at_start is not None:
            self.written = (self.written or 0) + end - self._written_at_start
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if "c10d" in func.namespace:  # c10d, _c10d_functional
            name = func.__name__.split(".")[0]
            if name not in NOT_DATA:
                sizes = [sum(t.numel() * t.element_size() for t in _tensors(a)) for a in (*args, result)]
                entry = self.counts[KINDS.get(name, name)]
                entry["calls"] += 1
                entry["bytes"] += max(sizes, default=0)
                size = str(group_size(func, args))  # a string: the key survives the rank's JSON unchanged
                entry["by_group_size"][size] = entry["by_group_size"].get(size, 0) + max(sizes, default=0)
        return result

    def summary(self) -> dict:
        """{"collectives": {kind: {"calls", "bytes", "by_group_size"}}, "written_bytes": int | None}: what a rank's JSON
        keeps."""
        return {"collectives": dict(self.counts), "written_bytes": self.written}

    @contextlib.contextmanager
    def last_step_of(self, steps: int):
        """A fit() callback that turns counting on once step steps-2 has ended, so that from there to the end of
        the run (which this context closes) exactly the last step's collectives are counted."""
        on: list[bool] = []

        def callback(step, _result):
            if step == steps - 2:
                self.__enter__()
                on.append(True)

        try:
            yield callback
        finally:
            if on:
                self.__exit__(None, None, None)
