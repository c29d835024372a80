"""Turn a TrainConfig into the objects the training loop uses: `build(cfg, model, parts)`.

A technique that is off becomes a no-op object (nullcontext, a disabled GradScaler, a clipper that does nothing), so
the loop in train.py has one code path. Each technique is declared once, as a config field with its metadata
(course_lib.config.TECHNIQUES), and applied here, in one fixed order (as torchtitan's parallelize.py does):
  1. activation checkpointing wraps each block (it must see the eager blocks),
  2. data parallelism wraps the model (DDP, or FSDP2 sharding each block and then the root),
  3. the model and its loss become one module (LossModule), optionally with the loss in chunks,
  4. torch.compile wraps that module (it then traces through the checkpointed blocks and the loss),
  5. the optimizer (fused or not), its schedule, autocast and the GradScaler,
and the optimizer always holds the original parameters. What a technique needs to know about the model (its
blocks, its body and its output layer) is given explicitly as `ModelParts`: no attribute name is assumed.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .config import PRECISION_DTYPES, ConfigError, TrainConfig
from .data import IGNORE_INDEX
from .tf32 import matmul_precision  # noqa: F401 - TF32's switch, below the device's capabilities, which time with it

AUTOCAST_DTYPES = {p: PRECISION_DTYPES[p] for p in ("bf16", "fp16")}  # the precisions autocast runs in


@dataclass
class ModelParts:
    """What the techniques need to know about a model, given explicitly."""

    blocks: nn.ModuleList | None = None  # the repeated layers: checkpointing wraps each one, FSDP2 shards each one
    body: Callable[[torch.Tensor], torch.Tensor] | None = None  # inputs -> final hidden states (the chunked loss)
    head: nn.Module | None = None  # hidden states -> logits (the chunked loss; the memory ledger's "logits" start here)

    @classmethod
    def of(cls, model: nn.Module) -> "ModelParts":
        """The course's GPT names its parts; any other model has none unless the caller says."""
        from .model import GPT

        if isinstance(model, GPT):
            return cls(blocks=model.blocks, body=model.hidden, head=model.lm_head)
        return cls()


# What selective checkpointing keeps: the outputs of the matmuls and of attention (torch's selective-checkpoint policy
# as torchtitan uses it; SelectiveCheckpointedBlock says how it differs from Korthikanti et al.'s selection).
_SAVED_BY_SELECTIVE = tuple(
    getattr(torch.ops.aten, name).default
    for name in (
        "mm",
        "addmm",
        "bmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(torch.ops.aten, name)
)


def _selective_policy(_ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_BY_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


class CheckpointedBlock(nn.Module):
    """Full activation checkpointing: forward keeps only the block's input, and backward runs the block's forward
    again to get what it needs (non-reentrant): one block's activations at a time, for about one more forward."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # evaluation: no backward, nothing to keep or recompute
            return self.block(x)
        return checkpoint(self.block, x, use_reentrant=False, **self.checkpoint_options())

    def checkpoint_options(self) -> dict:
        return {}


class SelectiveCheckpointedBlock(CheckpointedBlock):
    """Selective activation checkpointing as the course does it: forward also keeps what is expensive to recompute,
    the outputs of the matmuls and of attention, and backward recomputes only the cheap element-wise work in between
    (LayerNorm, GELU, softmax, dropout, residual adds). Korthikanti et al. (2022) propose another selection: keep the
    rest and recompute the attention core (QK^T, softmax, its dropout, the product with V), whose s x s tensors are
    large but cheap to recompute; this policy keeps naive attention's s x s scores (a matmul output) and recomputes
    only their softmax. Notebook 02 measures what each mode keeps."""

    def checkpoint_options(self) -> dict:
        return {"context_fn": functools.partial(create_selective_checkpoint_contexts, _selective_policy)}


CHECKPOINTED_BLOCKS = {"full": CheckpointedBlock, "selective": SelectiveCheckpointedBlock}


def loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over the positions that count (padding is IGNORE_INDEX)."""
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


class HeadLossInSlices(torch.autograd.Function):
    """The output layer and the summed cross-entropy of `hidden` (T, d), one slice of `chunks` at a time, each slice's
    gradients computed in the forward pass: only one slice of the (T, V) logits ever exists, and nothing is recomputed
    (backward scales the two kept gradients by the loss's own gradient, a number: the loop's 1/targets and loss scale).

    Per slice of c tokens: the logits, head(h) (c, V), a 16-bit matmul under autocast; in fp32 the loss, log-sum-exp
    minus the target's logit, and its gradient with respect to the logits, softmax - onehot (zero for padding); that
    gradient, in the matmul's dtype as autograd would carry it, times the weight is the slice's input gradient (c, d),
    and its transpose times the input is the slice's share of the weight gradient (V, d). The FLOPs are those of the
    plain loss's forward and backward; the memory is one slice's logits instead of three (T, V) fp32 tensors."""

    @staticmethod
    def forward(
        ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, head: nn.Module, chunks: int
    ) -> torch.Tensor:
        # this function makes the gradients itself: its slices are plain tensors (no autograd history)
        hidden = hidden.detach()
        grad_hidden = torch.empty_like(hidden)  # (T, d), filled slice by slice
        grad_weight = torch.zeros_like(weight)  # (V, d), the slices' shares summed
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for h, t, gh in zip(hidden.chunk(chunks), targets.chunk(chunks), grad_hidden.chunk(chunks)):
            logits = head(h)  # (c, V), 16-bit under autocast
            # the loss in fp32: a copy of 16-bit logits, or the fp32 logits themselves, used up in place
            p = logits.float()
            valid = t != IGNORE_INDEX  # (c,)
            t0 = t.clamp(min=0)[:, None]  # (c, 1): padding's index made a valid one; its row is zeroed below
            picked = p.gather(1, t0).squeeze(1)  # the target's logit (c,)
            m = p.amax(dim=-1, keepdim=True)  # (c, 1): exp never overflows
            p.sub_(m).exp_()
            s = p.sum(dim=-1, keepdim=True)
            total = total + ((m.squeeze(1) + s.log().squeeze(1) - picked) * valid).sum()  # log-sum-exp - target logit
            # softmax - onehot; 0 on padding
            p.div_(s).scatter_add_(1, t0, -valid[:, None].to(p.dtype)).mul_(valid[:, None])
            g = p.to(logits.dtype)  # d loss / d logits (c, V), in the matmul's dtype
            gh.copy_(g @ weight)  # (c, d)
            grad_weight += (g.t() @ h).float()  # (V, d)
            del logits, p, g  # this slice's (c, V) tensors go before the next slice makes its own
        ctx.save_for_backward(grad_hidden, grad_weight)
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_total, grad_weight * grad_total, None, None, None


class LossModule(nn.Module):
    """Model and loss as one module: inputs and targets in, summed loss out.

    Compiling this (not just the model) lets the compiler fuse the cross-entropy too. With loss_chunks > 1 the
    output layer and the loss run on slices of the tokens (HeadLossInSlices), so only one slice of the
    (tokens x vocab) logits exists at a time and none is recomputed; that needs the model's body and output layer
    (`ModelParts`), a linear layer without bias.
    """

    def __init__(self, model: nn.Module, loss_chunks: int = 1, parts: ModelParts | None = None):
        super().__init__()
        self.model, self.loss_chunks = model, loss_chunks
        self._body, self.head = (parts.body, parts.head) if parts else (None, None)
        if loss_chunks > 1 and (self._body is None or self.head is None):
            raise ConfigError(
                "loss_chunks > 1 needs the model's body and output layer: pass ModelParts(body=..., head=...) "
                "or set loss_chunks=1"
            )
        if loss_chunks > 1 and (not isinstance(self.head, nn.Linear) or self.head.bias is not None):
            raise ConfigError(
                "loss_chunks > 1 needs an output layer nn.Linear(..., bias=False): use such a head or set loss_chunks=1"
            )

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.loss_chunks == 1:
            return loss_sum(self.model(idx), targets)
        hidden = self._body(idx)
        hidden = hidden.reshape(-1, hidden.size(-1))  # (tokens, width)
        return HeadLossInSlices.apply(hidden, self.head.weight, targets.reshape(-1), self.head, self.loss_chunks)


def apply_activation_checkpointing(blocks: nn.ModuleList, mode: str) -> None:
    """Wrap every block in place (the ModuleList is the model's own, so the model sees the wrapped blocks)."""
    for i, block in enumerate(blocks):
        if not isinstance(block, CheckpointedBlock):
            blocks[i] = CHECKPOINTED_BLOCKS[mode](block)


def autocast_context(precision: str, device: str) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of the context to run forward and loss in: autocast for bf16/fp16, else nothing."""
    if precision in AUTOCAST_DTYPES:
        device_type, dtype = torch.device(device).type, AUTOCAST_DTYPES[precision]
        return lambda: torch.autocast(device_type=device_type, dtype=dtype)
    return contextlib.nullcontext


def make_grad_scaler(cfg: TrainConfig) -> torch.amp.GradScaler:
    """Loss scaling only for fp16 (its narrow exponent flushes small gradients to zero); bf16 needs none."""
    return torch.amp.GradScaler(
        torch.device(cfg.device).type,
        init_scale=cfg.loss_scale_init,
        growth_interval=cfg.loss_scale_growth_interval,
        enabled=cfg.precision == "fp16",
    )


def param_groups(model: nn.Module, weight_decay: float, decay_2d_only: bool = True) -> list[dict]:
    """A list of dicts for the optimizer: decay on >=2-D tensors (matmul weights, embeddings), none on
    biases and LayerNorm gains. Each parameter appears once (the tied embedding too)."""
    params = list({id(p): p for p in model.parameters() if p.requires_grad}.values())
    if not decay_2d_only:
        return [{"params": params, "weight_decay": weight_decay}]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def optimizer_for(
    kind: str,
    params,
    lr: float,
    *,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    momentum: float = 0.9,
    fused: bool = False,
) -> torch.optim.Optimizer:
    """Every optimizer the course uses, made in one place. AdamW's baseline is the for-loop implementation
    (foreach=False), the naive loop's; fused is one kernel for all tensors."""
    if kind == "adamw":
        return torch.optim.AdamW(
            params, lr=lr, betas=betas, eps=eps, **({"fused": True} if fused else {"foreach": False})
        )
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if kind == "sgd_momentum":
        return torch.optim.SGD(params, lr=lr, momentum=momentum)
    if kind == "adagrad":  # eps in the denominator, as AdamW's (torch's default for AdaGrad is 1e-10)
        return torch.optim.Adagrad(params, lr=lr, eps=eps, foreach=False)
    if kind == "rmsprop":  # torch's defaults otherwise: alpha 0.99, no momentum, not centered
        return torch.optim.RMSprop(params, lr=lr, eps=eps, foreach=False)
    if kind == "adafactor":
        return torch.optim.Adafactor(params, lr=lr, foreach=False)
    raise ValueError(f"unknown optimizer kind {kind!r}: adamw, sgd, sgd_momentum, adagrad, rmsprop or adafactor")


def make_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    return optimizer_for(
        cfg.optimizer,
        param_groups(model, cfg.weight_decay, cfg.decay_2d_only),
        cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        momentum=cfg.momentum,
        fused=cfg.fused_adamw,
    )


# ---- learning-rate schedules: the lr of optimizer step `step` (0-based), as plain functions ----------


def _warmup(step: int, lr: float, warmup: int) -> float:
    return lr * (step + 1) / warmup


def constant_lr(step: int, lr: float, warmup: int = 0) -> float:
    return _warmup(step, lr, warmup) if step < warmup else lr


def warmup_cosine_lr(step: int, lr: float, warmup: int, total: int, min_lr_ratio: float = 0.1) -> float:
    """Linear warmup to `lr` over `warmup` steps, then half a cosine down to min_lr_ratio * lr, reached at
    the last step (total - 1). GPT-3 decays to 10% of the maximum."""
    if step < warmup:
        return _warmup(step, lr, warmup)
    progress = min(1.0, (step - warmup) / max(1, total - 1 - warmup))
    floor = min_lr_ratio * lr
    return floor + 0.5 * (lr - floor) * (1 + math.cos(math.pi * progress))


def inverse_sqrt_lr(step: int, lr: float, warmup: int) -> float:
    """The original Transformer's schedule, scaled to peak at `lr`: with t = step + 1,
    lr * min(t / warmup, sqrt(warmup / t)): linear up to t = warmup, then proportional to 1/sqrt(t)."""
    if warmup < 1:
        raise ValueError("inverse_sqrt_lr needs warmup >= 1 (it peaks at t = warmup)")
    t = step + 1
    return lr * min(t / warmup, math.sqrt(warmup / t))


def step_decay_lr(step: int, lr: float, step_size: int, gamma: float = 0.1, warmup: int = 0) -> float:
    """After the warmup, multiply the rate by `gamma` every `step_size` steps: lr * gamma^floor((step - warmup) /
    step_size)."""
    if step < warmup:
        return _warmup(step, lr, warmup)
    return lr * gamma ** ((step - warmup) // step_size)


def wsd_lr(
    step: int, lr: float, warmup: int, total: int, decay_fraction: float = 0.2, min_lr_ratio: float = 0.0
) -> float:
    """Warmup-stable-decay: linear warmup, a long flat stretch at `lr`, then a linear cool-down over the last
    `decay_fraction` of the steps, reaching min_lr_ratio * lr at the last step (total - 1)."""
    if step < warmup:
        return _warmup(step, lr, warmup)
    decay_steps = max(1, math.ceil(decay_fraction * total))
    start = total - decay_steps  # first step of the cool-down
    if step < start:
        return lr
    progress = min(1.0, (step - start + 1) / decay_steps)
    floor = min_lr_ratio * lr
    return lr - (lr - floor) * progress


def exponential_gamma(warmup: int, total: int, min_lr_ratio: float) -> float:
    """The per-step factor of exponential_lr: min_lr_ratio reached at the last step, total - 1."""
    return min_lr_ratio ** (1 / max(1, total - 1 - warmup))


def exponential_lr(step: int, lr: float, warmup: int, total: int, min_lr_ratio: float = 0.1) -> float:
    """Linear warmup, then multiply the rate by the same factor gamma at every step: lr * gamma^(step - warmup)
    (torch.optim.lr_scheduler.ExponentialLR after the warmup). gamma is chosen so that the last step (total - 1)
    reaches min_lr_ratio * lr, as the cosine does: gamma = min_lr_ratio^(1 / (total - 1 - warmup))."""
    if step < warmup:
        return _warmup(step, lr, warmup)
    return lr * exponential_gamma(warmup, total, min_lr_ratio) ** (step - warmup)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """The learning rate of optimizer step `step` (0-based) for cfg.schedule, from the functions above."""
    w = cfg.lr_warmup_steps
    if cfg.schedule == "constant":
        return constant_lr(step, cfg.lr, w)
    if cfg.schedule == "cosine":
        return warmup_cosine_lr(step, cfg.lr, w, cfg.steps, cfg.min_lr_ratio)
    if cfg.schedule == "wsd":
        return wsd_lr(step, cfg.lr, w, cfg.steps, min_lr_ratio=cfg.min_lr_ratio)
    if cfg.schedule == "exponential":
        return exponential_lr(step, cfg.lr, w, cfg.steps, cfg.min_lr_ratio)
    return inverse_sqrt_lr(step, cfg.lr, w)


def make_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, cfg) / cfg.lr)


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


def wrap_data_parallel(cfg: TrainConfig, model: nn.Module, parts: ModelParts) -> nn.Module:
    """The module the loss calls: `model` itself ("none"), or wrapped for DDP / FSDP2 inside an initialised
    process group (torchrun; see course_lib.distributed). The optimizer keeps `model`'s parameters."""
    if cfg.data_parallel == "none":
        return model
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(
            f"data_parallel={cfg.data_parallel!r} needs a process group: start it with torchrun "
            "(course_lib.distributed.launch) or set data_parallel='none'"
        )
    if cfg.loss_chunks != 1:
        raise ConfigError(
            "data_parallel needs loss_chunks=1 (the chunked loss calls the model's body, which the wrapper hides)"
        )
    dev = torch.device(cfg.device)
    if cfg.data_parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    else:
        shard_with_fsdp2(model, parts, dev.type)
        wrapped = model
    return SyncOnLastMicroBatch(wrapped, cfg.grad_accum_steps)


def shard_with_fsdp2(
    model: nn.Module,
    parts: ModelParts,
    device_type: str,
    reshard_after_forward: bool | None = None,
    offload: bool = False,
) -> None:
    """FSDP2 in place, inside an initialised process group: fully_shard on every block, then on the root (embeddings,
    final LayerNorm, head), so that each block's parameters are all-gathered just before it runs and each rank keeps
    1/N of every parameter, gradient and optimizer state (ZeRO-3). reshard_after_forward: None is fully_shard's own
    default (torch 2.13: free each block's gathered parameters after its forward, keep the root's, which backward
    needs first); False keeps every gathered parameter from forward to backward (ZeRO-2's memory, one all-gather
    less); True frees the root's too. offload keeps the shards in CPU memory."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    options = {"offload_policy": CPUOffloadPolicy() if offload else OffloadPolicy()}
    if reshard_after_forward is not None:
        options["reshard_after_forward"] = reshard_after_forward
    for block in parts.blocks if parts.blocks is not None else ():
        fully_shard(block, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)


def _no_clip(params: list[torch.Tensor], total_norm: torch.Tensor) -> None:
    """Clipping off (clip_norm=None)."""


def clip_by_global_norm(params: list[torch.Tensor], total_norm: torch.Tensor, max_norm: float) -> None:
    """Every gradient times one factor, min(1, max_norm / ||g||) with ||g|| the norm of all of them together: the
    direction of the whole gradient is kept (GPT-3's clipping; torch's clip_grad_norm_)."""
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm)


def clip_by_tensor_norm(params: list[torch.Tensor], max_norm: float) -> list[torch.Tensor]:
    """Each gradient times its own factor, min(1, max_norm / (||g_i|| + 1e-6)): a tensor is clipped on its own norm,
    so the direction of the whole gradient changes. Returns each gradient's norm before clipping, as tensors: no
    value is read back to the host."""
    grads = [p.grad for p in params if p.grad is not None]
    norms = torch._foreach_norm(grads)
    torch._foreach_mul_(grads, [(max_norm / (n + 1e-6)).clamp(max=1.0) for n in norms])
    return norms


def make_clipper(cfg: TrainConfig) -> Callable[[list[torch.Tensor], torch.Tensor], None]:
    """clip(params, total_norm) for cfg.clip_kind at cfg.clip_norm, or a no-op when clip_norm is None."""
    if cfg.clip_norm is None:
        return _no_clip
    if cfg.clip_kind == "global":
        return functools.partial(clip_by_global_norm, max_norm=cfg.clip_norm)

    def clip_each(params: list[torch.Tensor], _total_norm: torch.Tensor) -> None:  # its own norms: the total unused
        clip_by_tensor_norm(params, cfg.clip_norm)

    return clip_each


def optimizer_step(
    setup: "Setup",
    cfg: TrainConfig,
    params: list[torch.Tensor],
    on_grads: Callable[[list[torch.Tensor]], None] | None = None,
) -> tuple[torch.Tensor, float, float]:
    """The end of every training step, written once: unscale (fp16), clip (setup.clip), step, scaler update,
    zero_grad, schedule. Returns (gradient norm before clipping, learning rate used, loss scale used).
    `on_grads` sees the gradients before zero_grad may free them (the memory ledger names them)."""
    setup.scaler.unscale_(setup.optimizer)
    grads = [p.grad for p in params if p.grad is not None]
    if on_grads:
        on_grads(grads)
    norm = setup.grad_norm(grads)
    setup.clip(params, norm)
    lr = setup.optimizer.param_groups[0]["lr"]
    scale = setup.scaler.get_scale() if setup.scaler.is_enabled() else 1.0
    setup.scaler.step(setup.optimizer)
    setup.scaler.update()
    setup.optimizer.zero_grad(set_to_none=cfg.set_to_none)
    with warnings.catch_warnings():  # a step the fp16 scaler skipped still advances the schedule, on purpose
        warnings.filterwarnings(
            "ignore", message=r"Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`"
        )
        setup.scheduler.step()
    return norm, lr, scale


def accumulate_micro_batches(
    setup: "Setup", micro: list[tuple[torch.Tensor, torch.Tensor]], n_targets: int, meter
) -> torch.Tensor:
    """Forward and backward of a step's micro-batches (one when accumulation is off), their gradients summing in
    .grad; returns the step's loss per target token. `meter` names the phases (a no-op unless it measures)."""
    loss_fn = meter.loss_fn(setup)
    step_loss = torch.zeros((), device=micro[0][1].device)
    for x, y in micro:
        with setup.autocast(), meter.phase("forward"):
            loss = loss_fn(x, y) / n_targets
        with meter.phase("backward"):
            setup.scaler.scale(loss).backward()
        step_loss += loss.detach()
        del loss  # the graph and its activations go now, not when the next micro-batch reassigns it
    return step_loss


@dataclass
class Setup:
    """Everything the loop needs, built from one TrainConfig. The last two fields are the step's two pieces that a
    parallelism may own: pipeline parallelism runs forward and backward through its schedule, and its gradient
    norm must be summed over the stages (course_lib.distributed.pipeline sets both)."""

    model: nn.Module  # the module the optimizer updates (eager, maybe with checkpointed blocks)
    loss_module: LossModule  # eager: (x, y) -> summed loss
    loss_fn: nn.Module | Callable  # what the loop calls: loss_module, or its compiled version
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    autocast: Callable[[], contextlib.AbstractContextManager]
    scaler: torch.amp.GradScaler
    parts: ModelParts
    clip: Callable[[list[torch.Tensor], torch.Tensor], None] = _no_clip  # make_clipper(cfg): global, per tensor or off
    # (setup, micro-batches, n_targets, meter) -> the step's loss, gradients left in .grad
    forward_backward: Callable[..., torch.Tensor] = accumulate_micro_batches
    grad_norm: Callable[[list[torch.Tensor]], torch.Tensor] = torch.nn.utils.get_total_norm  # of all gradients together


def build(cfg: TrainConfig, model: nn.Module, parts: ModelParts | None = None) -> Setup:
    """Apply the config's techniques to `model` (already on cfg.device) in the one correct order (module docstring)."""
    parts = parts if parts is not None else ModelParts.of(model)
    if cfg.activation_checkpointing != "none":
        if parts.blocks is None:
            raise ConfigError(
                "activation checkpointing needs the model's blocks: pass ModelParts(blocks=...) or turn it off"
            )
        apply_activation_checkpointing(parts.blocks, cfg.activation_checkpointing)
    loss_module = LossModule(wrap_data_parallel(cfg, model, parts), cfg.loss_chunks, parts)
    loss_fn = (
        torch.compile(loss_module, mode=None if cfg.compile_mode == "default" else cfg.compile_mode)
        if cfg.compile
        else loss_module
    )
    optimizer = make_optimizer(cfg, model)
    return Setup(
        model=model,
        loss_module=loss_module,
        loss_fn=loss_fn,
        optimizer=optimizer,
        scheduler=make_scheduler(cfg, optimizer),
        autocast=autocast_context(cfg.precision, cfg.device),
        scaler=make_grad_scaler(cfg),
        parts=parts,
        clip=make_clipper(cfg),
    )
