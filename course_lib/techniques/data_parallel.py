"""Data parallelism: every process trains the whole model on its own slice of the batch, inside a process group that
torchrun starts. "ddp": DistributedDataParallel all-reduces the gradients in buckets during backward; "fsdp": FSDP2
shards every parameter, gradient and optimizer state (ZeRO-3), fully_shard on each block and then the root. With
accumulation, only the last micro-batch communicates (`SyncOnLastMicroBatch`). "bucketed": DDP written by hand
(`BucketedDDP`), hooks on the parameters and a last sync after backward. Notebook 07 (and course_lib.distributed)
measure them.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn

from ..config import ConfigError, TrainConfig
from .model_parts import ModelParts


class SyncOnLastMicroBatch(nn.Module):
    """Data parallelism with gradient accumulation, with no DDP-specific code in the loop: before each training
    forward it tells the wrapped DDP (or FSDP2) module whether this micro-batch's backward should communicate.
    Only the last micro-batch of an optimizer step does (what `ddp.no_sync()` does for the others); with
    `enabled = False` every micro-batch communicates (correct, but more traffic)."""

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


# ---- data parallelism written by hand (data_parallel="bucketed"; course_lib.distributed.ddp_by_hand runs it beside
# torch's DDP and two simpler hand-written ones) ------------------------------------------------------------------

BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket size (bucket_cap_mb=25)


class HandDDP:
    """What every hand-written DDP shares: equal starting parameters, and `finish()` after backward, which leaves
    every rank's .grad holding the mean of all ranks' gradients."""

    def __init__(self, model: nn.Module):
        self.world = dist.get_world_size()
        self.params = [p for p in model.parameters() if p.requires_grad]  # the tied embedding once
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
        self.calls = 0  # all-reduces launched
        self.launched: list[float] | None = None  # a list to record when each leaves (notebook 07's timeline)

    def _launching(self) -> None:
        """Counts an all-reduce about to leave this rank (and records when, where `launched` is a list)."""
        self.calls += 1
        if self.launched is not None:
            self.launched.append(time.perf_counter())

    def finish(self) -> None:
        raise NotImplementedError


def bucket_plan(sizes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Which gradients are all-reduced together. sizes[i]: the bytes of parameter i's gradient, parameters in the
    model's order. Backward makes the last parameters' gradients first, so the buckets fill from the last parameter to
    the first: each bucket a list of parameter indices in the order they are added; a bucket is full, and the next one
    starts, once it holds at least `bucket_bytes` (one all-reduce per bucket, launched as soon as its last gradient is
    ready): the rule of BucketedDDP below, and of torch's DDP (bucket_cap_mb)."""
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
    """Data parallelism applied to `model`, inside an initialised process group (torchrun; see
    course_lib.distributed). Returns the module the loss calls and the hand-written DDP whose `finish` the step calls
    after its last backward, or None: "none": `model` itself; "ddp" / "fsdp": wrapped for DDP / FSDP2, which
    communicate inside backward; "bucketed": `model` itself with the hand-written DDP's hooks on its parameters (its
    `finish` waits for the buckets in flight and divides by the world size). The optimizer keeps `model`'s
    parameters."""
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
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    else:
        shard_with_fsdp2(model, parts, dev.type)
        wrapped = model
    return SyncOnLastMicroBatch(wrapped, cfg.grad_accum_steps), None


def shard_with_fsdp2(
    model: nn.Module,
    parts: ModelParts,
    device_type: str,
    reshard_after_forward: bool | None = None,
    offload: bool = False,
    mp_policy=None,
    replicated: tuple[nn.Module, ...] = (),
) -> None:
    """FSDP2 in place, inside an initialised process group: fully_shard on every block, then on the root (embeddings,
    final LayerNorm, head), so that each block's parameters are all-gathered just before it runs and each rank keeps
    1/N of every parameter, gradient and optimizer state (ZeRO-3). reshard_after_forward: None is fully_shard's own
    default (torch 2.13: free each block's gathered parameters after its forward, keep the root's, which backward
    needs first); False keeps every gathered parameter from forward to backward (ZeRO-2's memory, one all-gather
    less); True frees the root's too. offload keeps the shards in CPU memory.

    mp_policy: a torch.distributed.fsdp.MixedPrecisionPolicy, e.g. param_dtype=torch.bfloat16 (the gathered copy and
    the computation in bf16) and reduce_dtype=torch.float32 (gradients reduced in fp32, into the fp32 shards the
    optimizer updates: its master weights); None computes in the parameters' own dtype. replicated: modules whose
    parameters stay plain tensors, whole on every rank (a norm's weight, too small to gain from sharding); every rank
    must start them equal (the same seed), and a hook averages their gradients over the ranks after each backward.
    (Clipping's global norm, torch.nn.utils.get_total_norm, refuses such a mix of DTensor and plain gradients.)"""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    options = {"offload_policy": CPUOffloadPolicy() if offload else OffloadPolicy()}
    if reshard_after_forward is not None:
        options["reshard_after_forward"] = reshard_after_forward
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    kept_whole = {p for m in replicated for p in m.parameters()}
    if kept_whole:
        options["ignored_params"] = kept_whole  # FSDP2 neither shards them nor reduces their gradients
    for block in parts.blocks if parts.blocks is not None else ():
        fully_shard(block, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    for p in kept_whole:
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(_average_over_ranks)


def _average_over_ranks(p: torch.Tensor) -> None:
    """A replicated parameter's gradient, averaged over the ranks (what DDP does for every parameter)."""
    dist.all_reduce(p.grad)
    p.grad /= dist.get_world_size()
