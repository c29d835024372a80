"""Data parallelism: each process of a torchrun group trains the whole model on its own slice of the batch. "ddp":
DistributedDataParallel; "fsdp": FSDP2 shards parameters, gradients and optimizer state (ZeRO-3); "bucketed": DDP by
hand (`BucketedDDP`). With accumulation only the last micro-batch communicates. Notebook 07 measures them."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from ..config import ConfigError, TrainConfig
from .model_parts import ModelParts


class SyncOnLastMicroBatch(nn.Module):
    """Before each training forward, tells the wrapped DDP (or FSDP2) module whether this micro-batch's backward
    communicates: only an optimizer step's last does (ddp.no_sync() for the others), or every one with enabled=False."""

    def __init__(self, wrapped: nn.Module, accum_steps: int):
        super().__init__()
        self.wrapped, self.accum_steps, self.enabled, self.calls = wrapped, accum_steps, True, 0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            self.calls += 1
            sync = (not self.enabled) or self.calls % self.accum_steps == 0
            if hasattr(self.wrapped, "set_requires_gradient_sync"):  # FSDP2
                self.wrapped.set_requires_gradient_sync(sync)
            else:  # DistributedDataParallel: the flag no_sync() toggles
                self.wrapped.require_backward_grad_sync = sync
        return self.wrapped(idx)


# ---- DDP by hand (data_parallel="bucketed"; course_lib.distributed.ddp_by_hand runs it beside simpler ones) ---------

BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket size (bucket_cap_mb=25)


class HandDDP:
    """What every hand-written DDP shares: equal starting parameters; its subclass's `finish()`, called after backward,
    leaves each rank's .grad holding the mean of all ranks' gradients."""

    def __init__(self, model: nn.Module):
        self.world = dist.get_world_size()
        self.params = [p for p in model.parameters() if p.requires_grad]  # the tied embedding once
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
        self.calls = 0  # all-reduces launched
        self.launched: list[float] | None = None  # a list to record when each leaves (notebook 07's timeline)

    def _launching(self) -> None:
        self.calls += 1
        if self.launched is not None:
            self.launched.append(time.perf_counter())


def bucket_plan(sizes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Parameter indices all-reduced together (sizes[i]: parameter i's gradient bytes), filled from the last parameter
    (backward makes its gradient first) until a bucket holds `bucket_bytes`: torch DDP's rule (bucket_cap_mb)."""
    buckets: list[list[int]] = [[]]
    held = 0
    for i in reversed(range(len(sizes))):
        if held >= bucket_bytes:
            buckets.append([])
            held = 0
        buckets[-1].append(i)
        held += sizes[i]
    return buckets


class BucketedDDP(HandDDP):
    def __init__(self, model: nn.Module, bucket_bytes: int):
        super().__init__(model)
        sizes = [p.numel() * p.element_size() for p in self.params]
        self.buckets = [[self.params[i] for i in bucket] for bucket in bucket_plan(sizes, bucket_bytes)]
        self.bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.waiting = [len(b) for b in self.buckets]  # gradients each bucket still waits for in this backward
        self.in_flight: list = []
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._ready)

    def _ready(self, p: torch.Tensor) -> None:
        i = self.bucket_of[id(p)]
        self.waiting[i] -= 1
        if self.waiting[i] == 0:  # the bucket is full: one flat all-reduce for all its gradients
            flat = torch.cat([q.grad.reshape(-1) for q in self.buckets[i]])
            self._launching()
            self.in_flight.append((i, flat, dist.all_reduce(flat, async_op=True)))

    def finish(self) -> None:
        for i, flat, work in self.in_flight:
            work.wait()
            flat /= self.world
            for q, part in zip(self.buckets[i], flat.split([q.numel() for q in self.buckets[i]])):
                q.grad.copy_(part.view_as(q.grad))
        self.in_flight.clear()
        self.waiting = [len(b) for b in self.buckets]


def check(cfg: TrainConfig) -> None:
    """What data parallelism cannot be combined with (the loop and the exported script both ask)."""
    if cfg.data_parallel in ("ddp", "fsdp") and cfg.loss_chunks != 1:
        raise ConfigError(
            "data_parallel needs loss_chunks=1 (the chunked loss calls the model's body, which the wrapper hides)"
        )
    if cfg.data_parallel == "bucketed" and cfg.grad_accum_steps != 1:
        raise ConfigError(
            "data_parallel='bucketed' (DDP by hand) all-reduces on every backward: set grad_accum_steps=1, or use "
            "data_parallel='ddp', which skips the sync on all but the last micro-batch"
        )


def apply_data_parallel(cfg: TrainConfig, model: nn.Module, parts: ModelParts) -> tuple[nn.Module, HandDDP | None]:
    """(the module the loss calls, the hand-written DDP whose `finish` the step calls after backward, or None), inside
    an initialised process group. DDP and FSDP2 wrap `model`; "bucketed" hooks its parameters."""
    if cfg.data_parallel == "none":
        return model, None
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(
            f"data_parallel={cfg.data_parallel!r} needs a process group: start it with torchrun "
            "(course_lib.distributed.launch) or set data_parallel='none'"
        )
    check(cfg)
    if cfg.data_parallel == "bucketed":
        return model, BucketedDDP(model, BUCKET_BYTES)
    dev = torch.device(cfg.device)
    if cfg.data_parallel == "ddp":
        wrapped = DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    else:
        shard_with_fsdp2(model, parts, dev.type)
        wrapped = model
    return SyncOnLastMicroBatch(wrapped, cfg.grad_accum_steps), None


def shard_with_fsdp2(
    model: nn.Module,
    parts: ModelParts,
    device_type: str,
    reshard_after_forward: bool | None = None,  # None: fully_shard's default
    offload: bool = False,
    mp_policy=None,
    replicated: tuple[nn.Module, ...] = (),
) -> None:
    """FSDP2 in place: fully_shard on every block, then on the root; each rank keeps 1/N of every parameter, gradient
    and optimizer state (ZeRO-3). reshard_after_forward=False keeps the gathered parameters until backward (ZeRO-2's
    memory); offload keeps the shards in CPU memory; mp_policy: a MixedPrecisionPolicy; `replicated` modules stay
    whole on every rank, their gradients averaged by a hook (get_total_norm then refuses the mix with DTensors)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    kept_whole = {p for m in replicated for p in m.parameters()}  # FSDP2 neither shards nor reduces them
    given = dict(reshard_after_forward=reshard_after_forward, mp_policy=mp_policy, ignored_params=kept_whole or None)
    options = {"offload_policy": CPUOffloadPolicy() if offload else OffloadPolicy()}
    options |= {k: v for k, v in given.items() if v is not None}
    for block in parts.blocks or ():
        fully_shard(block, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    for p in kept_whole:
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(_average_over_ranks)


def _average_over_ranks(p: torch.Tensor) -> None:
    """A replicated parameter's gradient, averaged over the ranks (what DDP does for every parameter)."""
    dist.all_reduce(p.grad)
    p.grad /= dist.get_world_size()
