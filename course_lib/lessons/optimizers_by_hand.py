"""The optimiser and its hyperparameters from first principles (notebook 05).

- AdamW written from its update rule (`adamw_update`, `HandAdamW`), checked equal to torch.optim.AdamW; what its
  bias correction does (`bias_correction_ratio`, `adam_step_sizes`) and per-step updates of any optimizer
  (`step_updates`). Its ancestors AdaGrad and RMSProp the same way (`adagrad_update`, `rmsprop_update`), all on one loop
  (`HandOptimizer`), each compared with torch's over real steps (`max_difference_after_steps`).
- Learning-rate schedules as plain functions of the step (written once, in techniques, where the loop's
  `lr_at` uses them): constant, linear warmup + cosine decay, inverse square root, step decay,
  warmup-stable-decay and exponential decay; and the torch.optim.lr_scheduler constructions they are checked against.
- Gradient clipping: the global norm over all parameters (what GPT-3 clips) beside per-tensor clipping.
- Optimizer state bytes, measured from the tensors and from the formula.
- The figures of notebook 05 that are more drawing than lesson (`plot_bias_correction`), and its schedules' curves.
- Weight-decay groups listed by name, and batch sources for the loop (an injected bad batch, a batch ramp).

Nothing here trains a model: the experiments run through course_lib.train.
"""

from __future__ import annotations

import copy
import math
from typing import Callable, Iterable

import torch
import torch.nn as nn

from .. import data as data_mod, measure, techniques
from ..model import GPT
from ..techniques.lr_schedule import constant_lr, exponential_lr, inverse_sqrt_lr, warmup_cosine_lr, wsd_lr  # noqa: F401 - the schedules, here for notebook 05
from ..techniques.optimizer import STATES_PER_PARAMETER, state_bytes as state_bytes_formula

# ---- AdamW from its update rule -------------------------------------------------------------------


@torch.no_grad()
def adamw_update(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    t: int,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    bias_correction: bool = True,
) -> None:
    """One AdamW step for one tensor, in place. `t` is the step number, starting at 1.

        theta <- theta - lr * wd * theta                 (decoupled weight decay: not part of the gradient)
        m <- b1 m + (1 - b1) g,    v <- b2 v + (1 - b2) g^2
        m_hat = m / (1 - b1^t),    v_hat = v / (1 - b2^t)   (bias correction: m and v start at zero)
        theta <- theta - lr * m_hat / (sqrt(v_hat) + eps)

    Written in the order of torch.optim.AdamW's for-loop (foreach=False), so that the two give the same bits: m moves
    towards g by lerp, and the last line is computed as theta - (lr / (1 - b1^t)) m / (sqrt(v) / sqrt(1 - b2^t) + eps).
    bias_correction=False uses m and v as they are: no optimizer does that; it is here to measure what the
    correction does (notebook 05).
    """
    b1, b2 = betas
    if weight_decay:
        p.mul_(1 - lr * weight_decay)
    m.lerp_(g, 1 - b1)  # b1 m + (1 - b1) g
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    bias_correction1, bias_correction2 = (1 - b1**t, 1 - b2**t) if bias_correction else (1.0, 1.0)
    sqrt_v_hat = v.sqrt() / bias_correction2**0.5
    p.addcdiv_(m, sqrt_v_hat.add_(eps), value=-(lr / bias_correction1))


def bias_correction_ratio(t: int, betas: tuple[float, float]) -> float:
    """How many times larger Adam's step t would be without bias correction, for a constant gradient g (eps
    negligible). Then m_t = (1 - b1^t) g and v_t = (1 - b2^t) g^2 exactly, so the corrected step m_hat/sqrt(v_hat)
    is g/|g|, of size 1, and the uncorrected m/sqrt(v) is (1 - b1^t)/sqrt(1 - b2^t) times that.
    With betas (0.9, 0.999): 0.1/sqrt(0.001) = 3.16 at t=1, at most 6.57 (t=12), 1.26 at t=1000."""
    b1, b2 = betas
    return (1 - b1**t) / math.sqrt(1 - b2**t)


def adam_step_sizes(
    grads: Iterable[float], lr: float, betas: tuple[float, float], eps: float = 1e-8, bias_correction: bool = True
) -> list[float]:
    """|update| of `adamw_update` at each step, for one scalar parameter (float64, no weight decay) fed the
    gradients `grads` in turn: the update rule run, to check the closed form above against."""
    p, m, v = (torch.zeros(1, dtype=torch.float64) for _ in range(3))
    sizes = []
    for t, g in enumerate(grads, start=1):
        p.zero_()  # without weight decay the update does not depend on theta: read it from zero, exactly
        adamw_update(p, torch.full_like(p, float(g)), m, v, t, lr, betas, eps, bias_correction=bias_correction)
        sizes.append(abs(float(p)))
    return sizes


def step_updates(
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer], grads: list[torch.Tensor]
) -> list[torch.Tensor]:
    """The update theta_t - theta_(t-1) at each step of the optimizer `make_optimizer([param])`, for one parameter
    that starts at zero and is fed the gradients `grads` in turn (use float64 gradients to compare optimizers)."""
    p = nn.Parameter(torch.zeros_like(grads[0]))
    opt = make_optimizer([p])
    updates = []
    for g in grads:
        before = p.detach().clone()
        p.grad = g.clone()
        opt.step()
        updates.append(p.detach() - before)
    return updates


@torch.no_grad()
def adagrad_update(
    p: torch.Tensor,
    g: torch.Tensor,
    s: torch.Tensor,
    t: int,
    lr: float,
    eps: float = 1e-10,
    weight_decay: float = 0.0,
    lr_decay: float = 0.0,
) -> None:
    """One AdaGrad step (Duchi et al., 2011) for one tensor, in place, as torch.optim.Adagrad does it:

        g <- g + wd * theta                   (L2 weight decay: added to the gradient, not decoupled)
        s <- s + g^2                          (the sum of every squared gradient so far: it only grows)
        theta <- theta - lr_t * g / (sqrt(s) + eps),   lr_t = lr / (1 + (t - 1) lr_decay)

    Each coordinate's step shrinks like 1/sqrt(number of steps) once its gradients settle: good for rare features
    (a rare token's embedding row keeps large steps), too fast a decay for a long non-convex run.
    """
    if weight_decay:
        g = g.add(p, alpha=weight_decay)
    s.addcmul_(g, g)
    p.addcdiv_(g, s.sqrt().add_(eps), value=-lr / (1 + (t - 1) * lr_decay))


@torch.no_grad()
def rmsprop_update(
    p: torch.Tensor,
    g: torch.Tensor,
    v: torch.Tensor,
    lr: float,
    alpha: float = 0.99,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    momentum_buffer: torch.Tensor | None = None,
    momentum: float = 0.0,
    grad_avg: torch.Tensor | None = None,
) -> None:
    """One RMSProp step (Hinton's lecture notes, 2012) for one tensor, in place, as torch.optim.RMSprop does it:

        g <- g + wd * theta                   (L2 weight decay, as in AdaGrad)
        v <- alpha v + (1 - alpha) g^2        (a running average of g^2: AdaGrad's sum, made to forget)
        d = sqrt(v) + eps                     (centered: sqrt(v - gbar^2) + eps, gbar a running average of g)
        theta <- theta - lr * g / d           (with momentum: b <- mu b + g / d, theta <- theta - lr * b)

    It is Adam with beta1 = 0 (no average of g) and no bias correction: v starts at zero, so the first steps are
    1/sqrt(1 - alpha) = 10 times larger than lr (alpha 0.99) until v fills.
    """
    if weight_decay:
        g = g.add(p, alpha=weight_decay)
    v.mul_(alpha).addcmul_(g, g, value=1 - alpha)
    if grad_avg is not None:
        grad_avg.lerp_(g, 1 - alpha)
        denom = v.addcmul(grad_avg, grad_avg, value=-1).sqrt_().add_(eps)
    else:
        denom = v.sqrt().add_(eps)
    if momentum_buffer is not None:
        momentum_buffer.mul_(momentum).addcdiv_(g, denom)
        p.add_(momentum_buffer, alpha=-lr)
    else:
        p.addcdiv_(g, denom, value=-lr)


class HandOptimizer(torch.optim.Optimizer):
    """The loop every hand-written optimizer of the course shares: for each parameter that has a gradient, its state
    (made at its first step, zeros like the parameter) and one call of the update rule. A parameter whose .grad is None
    (frozen, or unused this step) is skipped as torch.optim skips it: no weight decay, no step, its state untouched.
    A subclass names its state tensors (`state_names`) and its rule (`update`); nothing else."""

    def state_names(self, group: dict) -> tuple[str, ...]:
        return ()

    def update(self, p: torch.Tensor, g: torch.Tensor, state: dict, group: dict) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    # a Python int: no tensor, no bytes (torch keeps a 4-byte tensor per parameter tensor)
                    state["t"] = 0
                    state.update({name: torch.zeros_like(p) for name in self.state_names(group)})
                state["t"] += 1
                self.update(p, p.grad, state, group)
        return loss


class HandAdamW(HandOptimizer):
    """AdamW built on `adamw_update`; two state tensors (m, v) per parameter, as in torch's."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def state_names(self, group):
        return ("m", "v")

    def update(self, p, g, state, group):
        adamw_update(
            p, g, state["m"], state["v"], state["t"], group["lr"], group["betas"], group["eps"], group["weight_decay"]
        )


class HandAdagrad(HandOptimizer):
    """AdaGrad built on `adagrad_update`; one state tensor (the sum of squared gradients) per parameter."""

    def __init__(self, params, lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0.0, lr_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, eps=eps, weight_decay=weight_decay, lr_decay=lr_decay))

    def state_names(self, group):
        return ("s",)

    def update(self, p, g, state, group):
        adagrad_update(
            p, g, state["s"], state["t"], group["lr"], group["eps"], group["weight_decay"], group["lr_decay"]
        )


class HandRMSprop(HandOptimizer):
    """RMSProp built on `rmsprop_update`; one state tensor (v) per parameter, one more for momentum, one more
    centered."""

    def __init__(
        self,
        params,
        lr: float = 1e-2,
        alpha: float = 0.99,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        centered: bool = False,
    ):
        super().__init__(
            params, dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum, centered=centered)
        )

    def state_names(self, group):
        return ("v",) + (("b",) if group["momentum"] else ()) + (("gbar",) if group["centered"] else ())

    def update(self, p, g, state, group):
        rmsprop_update(
            p,
            g,
            state["v"],
            group["lr"],
            group["alpha"],
            group["eps"],
            group["weight_decay"],
            state.get("b"),
            group["momentum"],
            state.get("gbar"),
        )


def max_difference_after_steps(
    make_a: Callable[[list[dict]], torch.optim.Optimizer],
    make_b: Callable[[list[dict]], torch.optim.Optimizer],
    model_cfg,
    steps: int = 4,
    weight_decay: float = 0.0,
    seed: int = 0,
) -> float:
    """Train two float64 copies of the course's GPT (same initial weights, same batches) `steps` steps, one with the
    optimizer `make_a(param_groups)`, one with `make_b(param_groups)`; the largest |difference| of any parameter.
    float64, so that rounding cannot hide a real difference between two update rules."""
    copies = []
    for _ in range(2):
        torch.manual_seed(seed)
        copies.append(GPT(model_cfg).double())
    opts = [make(techniques.param_groups(m, weight_decay)) for make, m in zip((make_a, make_b), copies)]
    gen = torch.Generator().manual_seed(seed + 1)
    stream = data_mod.load_splits().train
    for _ in range(steps):
        x, y = data_mod.random_windows(stream, 4, min(32, model_cfg.block_size), gen)
        for m, opt in zip(copies, opts):
            opt.zero_grad()
            (techniques.loss_sum(m(x), y) / y.numel()).backward()
            opt.step()
    return max(float((a - b).detach().abs().max()) for a, b in zip(copies[0].parameters(), copies[1].parameters()))


# ---- learning-rate schedules: the functions the loop's techniques.lr_at uses, and torch's own ------------


def step_decay_lr(step: int, lr: float, step_size: int, gamma: float = 0.1) -> float:
    """The rate times `gamma` every `step_size` steps (torch's StepLR)."""
    return lr * gamma ** (step // step_size)


SCHEDULES: dict[str, Callable[..., float]] = {
    "constant": constant_lr,
    "cosine": warmup_cosine_lr,
    "inverse sqrt": inverse_sqrt_lr,
    "step": step_decay_lr,
    "wsd": wsd_lr,
    "exponential": exponential_lr,
}


def curve(fn: Callable[[int], float], steps: int) -> list[float]:
    return [fn(s) for s in range(steps)]


def schedule_curves(peak: float, warmup: int, steps: int) -> dict[str, list[float]]:
    """Notebook 05's schedules over `steps` steps, peaking at `peak` after `warmup` warm-up steps: cosine and
    exponential decay to 10%, constant, inverse square root, step decay (x0.5 every steps/4), WSD (cool-down over the
    last 20%)."""
    fns = {
        "warm-up + cosine to 10% (GPT-3)": lambda t: warmup_cosine_lr(t, peak, warmup, steps, 0.1),
        "constant after warm-up": lambda t: constant_lr(t, peak, warmup),
        "inverse square root": lambda t: inverse_sqrt_lr(t, peak, warmup),
        "step decay (x0.5 every S/4)": lambda t: step_decay_lr(t, peak, step_size=max(1, steps // 4), gamma=0.5),
        "warmup-stable-decay": lambda t: wsd_lr(t, peak, warmup, steps, decay_fraction=0.2),
        "exponential decay to 10%": lambda t: exponential_lr(t, peak, warmup, steps, 0.1),
    }
    return {name: curve(fn, steps) for name, fn in fns.items()}


def _dummy_optimizer(lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=lr)


def torch_scheduler_curve(
    make: Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler], lr: float, steps: int
) -> list[float]:
    """The lr a torch.optim.lr_scheduler construction gives at each of `steps` steps (read before each step,
    as the training loop reads it)."""
    opt = _dummy_optimizer(lr)
    sched = make(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def torch_warmup_cosine(opt: torch.optim.Optimizer, warmup: int, total: int, min_lr_ratio: float = 0.1):
    """The warmup + cosine schedule from torch's own building blocks: LinearLR from lr/warmup to lr over the
    first `warmup` steps, then CosineAnnealingLR down to min_lr_ratio * lr at the last step."""
    lr = opt.param_groups[0]["lr"]
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(
        opt, T_max=max(1, total - 1 - warmup), eta_min=min_lr_ratio * lr
    )
    if warmup == 0:
        return cosine
    if warmup == 1:
        warm = torch.optim.lr_scheduler.ConstantLR(opt, factor=1.0, total_iters=1)
    else:
        warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / warmup, end_factor=1.0, total_iters=warmup - 1)
    return torch.optim.lr_scheduler.SequentialLR(opt, [warm, cosine], milestones=[warmup])


# ---- gradient clipping ----------------------------------------------------------------------------


def _grads(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def global_grad_norm(params: Iterable[torch.Tensor]) -> float:
    """||g|| over all parameters at once, as if every gradient were one long vector: sqrt(sum of all g^2)."""
    return math.sqrt(sum(float(g.double().pow(2).sum()) for g in _grads(params)))


@torch.no_grad()
def clip_global_(params: Iterable[torch.Tensor], max_norm: float) -> float:
    """Scale every gradient by the same factor min(1, max_norm / ||g||): the direction is kept. Returns the
    norm before clipping (as torch.nn.utils.clip_grad_norm_ does; 1e-6 guards against division by zero)."""
    params = list(params)
    norm = global_grad_norm(params)
    coef = min(1.0, max_norm / (norm + 1e-6))
    for g in _grads(params):
        g.mul_(coef)
    return norm


@torch.no_grad()
def clip_per_tensor_(params: Iterable[torch.Tensor], max_norm: float) -> list[float]:
    """Clip each tensor's gradient on its own norm (not what GPT-3 does): the loop's rule,
    techniques.clip_by_tensor_norm. Returns each tensor's norm before clipping."""
    return [float(n) for n in techniques.clip_by_tensor_norm(list(params), max_norm)]


def cosine_similarity(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Cosine of the angle between two whole gradients (lists of tensors seen as one vector)."""
    dot = sum(float((x.double() * y.double()).sum()) for x, y in zip(a, b))
    na = math.sqrt(sum(float(x.double().pow(2).sum()) for x in a))
    nb = math.sqrt(sum(float(y.double().pow(2).sum()) for y in b))
    return dot / (na * nb)


def update_norm(
    model: nn.Module,
    grads: list[torch.Tensor],
    scale: float,
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    clip: float | None = None,
) -> float:
    """||theta_after - theta_before|| of ONE optimizer step from fresh state, on a copy of `model`, with the
    gradient `grads` multiplied by `scale` (and clipped to `clip` first when given). A small illustration of
    what the gradient's scale does to the update, not a training run."""
    m = copy.deepcopy(model)
    params = list(m.parameters())
    before = [p.detach().clone() for p in params]
    for p, g in zip(params, grads):
        p.grad = g.detach().clone() * scale
    if clip is not None:
        clip_global_(params, clip)
    make_optimizer(params).step()
    return math.sqrt(sum(float((p.detach() - b).double().pow(2).sum()) for p, b in zip(params, before)))


# ---- optimizer state --------------------------------------------------------------------------------


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors (moments, step counters), measured from the tensors."""
    return measure.tensor_bytes(measure.optimizer_state_tensors(optimizer))


def expected_state_bytes(kind: str, params: list[torch.Tensor]) -> int:
    """The formula for fp32 state. N = number of parameters, T = number of tensors.
    adamw: m and v, 2 x 4N bytes, + one 4-byte step counter per tensor.  sgd: nothing.  sgd_momentum: one
    buffer, 4N.  adafactor (torch's, no first moment): per matrix of shape (r, c) a row and a column
    second-moment vector, 4(r + c) bytes instead of 4rc; a vector keeps its full 4n; + a step counter per tensor.
    adagrad (its sum of g^2) and rmsprop (its average of g^2; torch's defaults: no momentum, not centered): one
    buffer, 4N, + a step counter per tensor."""
    n = sum(p.numel() for p in params)
    t = len(params)
    if kind in STATES_PER_PARAMETER:  # the memory estimate's own term
        return state_bytes_formula(kind, n, t)
    if kind == "adafactor":
        total = 0
        for p in params:
            if p.dim() >= 2:
                r, c = p.shape[-2], p.shape[-1]
                lead = p.numel() // (r * c)
                total += 4 * lead * (r + c)
            else:
                total += 4 * p.numel()
        return total + 4 * t
    raise ValueError(f"unknown optimizer kind {kind!r}: adamw, sgd, sgd_momentum, adagrad, rmsprop or adafactor")


def make_named_optimizer(kind: str, params: list[torch.Tensor], lr: float = 1e-3) -> torch.optim.Optimizer:
    return techniques.optimizer_for(kind, params, lr)


def measured_state_bytes(kind: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """State bytes after one real step (state is created lazily, at the first step) on a copy of `model`."""
    m = copy.deepcopy(model)
    params = list(m.parameters())
    opt = make_named_optimizer(kind, params)
    techniques.loss_sum(m(x), y).backward()
    opt.step()
    return state_bytes(opt)


# ---- weight-decay groups ------------------------------------------------------------------------------


def describe_param_groups(model: nn.Module, weight_decay: float, decay_2d_only: bool = True) -> list[dict]:
    """The groups techniques.param_groups builds (what the loop's optimizer gets), with names and counts."""
    names = {}
    for name, p in model.named_parameters():  # a tied weight keeps its first name
        names.setdefault(id(p), name)
    rows = []
    for i, g in enumerate(techniques.param_groups(model, weight_decay, decay_2d_only)):
        rows.append(
            {
                "group": i,
                "weight_decay": g["weight_decay"],
                "tensors": len(g["params"]),
                "parameters": sum(p.numel() for p in g["params"]),
                "names": [f"{names[id(p)]} {tuple(p.shape)}" for p in g["params"]],
            }
        )
    return rows


# ---- batch sources for train(..., batches=...) ---------------------------------------------------------


def default_batches(splits: data_mod.Splits, cfg, seed: int | None = None):
    """The loop's own default batches (random windows of the training text, same generator and order)."""
    return data_mod.random_batches(splits.train, cfg, cfg.seed if seed is None else seed)


def with_bad_batch(
    splits: data_mod.Splits,
    cfg,
    bad_steps: Iterable[int],
    kind: str = "repeated",
    token: int = 0,
    seed: int | None = None,
):
    """The default batches, except that at `bad_steps` the targets are corrupted: kind="repeated" makes every
    target the same token (`token`, by default id 0, a byte that never occurs in the plays), like a broken document
    of one repeated character; kind="random" draws the targets uniformly at random. The good steps get exactly the
    batches they would get without it, so a run with and a run without the bad batch differ only there."""
    if kind not in ("repeated", "random"):
        raise ValueError(f"kind={kind!r}: use 'repeated' or 'random'")
    good = default_batches(splits, cfg, seed)
    bad = set(bad_steps)
    noise = torch.Generator().manual_seed(10_000 + (cfg.seed if seed is None else seed))

    def batches(step: int):
        micro = good(step)
        if step in bad:
            if kind == "repeated":
                micro = [(x, torch.full_like(y, token)) for x, y in micro]
            else:
                micro = [(x, torch.randint(0, splits.vocab_size, y.shape, generator=noise)) for x, y in micro]
        return micro

    return batches


def ramp_batch_size(step: int, start: int, end: int, ramp_steps: int) -> int:
    """GPT-3's batch-size ramp: grow linearly from `start` to `end` sequences over `ramp_steps` steps, then stay."""
    if step >= ramp_steps:
        return end
    return max(1, round(start + (end - start) * step / ramp_steps))


def ramped_batches(splits: data_mod.Splits, cfg, start: int, ramp_steps: int, seed: int | None = None):
    """Batches whose size follows ramp_batch_size up to cfg.batch_size (one micro-batch per step). The loop
    divides the summed loss by the tokens of each step's batch, so a varying size is handled exactly."""
    gen = torch.Generator().manual_seed(cfg.seed if seed is None else seed)

    def batches(step: int):
        b = ramp_batch_size(step, start, cfg.batch_size, ramp_steps)
        return [data_mod.random_windows(splits.train, b, cfg.context, gen)]

    return batches


# ---- notebook 05's figures (outside pyplot: plots.new_figure) ------------------------------------------


def bias_correction_runs(betas: dict[str, tuple[float, float]], steps: int) -> tuple[dict, dict]:
    """For a constant gradient (|g| = 1, so eps = 1e-8 is negligible): ({name: the closed-form ratio of the uncorrected
    to the corrected step, per step}, {name: the same ratio measured by running adamw_update with and without the
    correction})."""
    closed = {n: [bias_correction_ratio(t, b) for t in range(1, steps + 1)] for n, b in betas.items()}
    ran = {
        n: [
            u / c
            for u, c in zip(
                adam_step_sizes([1.0] * steps, 1e-3, b, bias_correction=False), adam_step_sizes([1.0] * steps, 1e-3, b)
            )
        ]
        for n, b in betas.items()
    }
    return closed, ran


def plot_bias_correction(closed: dict, ran: dict):
    """The closed form as lines, the update rule's run as dots (steps spaced evenly on a log axis), the first step and
    the peak of the first series annotated."""
    from ..plots import new_figure

    fig = new_figure((7, 3.2))
    ax = fig.subplots()
    steps = len(next(iter(closed.values())))
    marks = sorted({round(10 ** (k / 8)) for k in range(0, 28) if round(10 ** (k / 8)) <= steps})
    for name in closed:
        (line,) = ax.plot(range(1, steps + 1), closed[name], lw=1.5, label=f"betas {name}: closed form")
        ax.plot(
            marks,
            [ran[name][t - 1] for t in marks],
            "o",
            color=line.get_color(),
            ms=3,
            label=f"betas {name}: update rule run",
        )
    first = next(iter(ran.values()))
    peak = max(range(steps), key=first.__getitem__)
    ax.axhline(1, color="grey", lw=0.8, ls=":")
    ax.annotate(
        f"step 1: {first[0]:.2f}x",
        (1, first[0]),
        xytext=(1.5, first[0] - 1.6),
        fontsize=8,
        arrowprops=dict(arrowstyle="->", lw=0.6),
    )
    ax.annotate(
        f"peak: {first[peak]:.2f}x at step {peak + 1}",
        (peak + 1, first[peak]),
        xytext=(1.2, first[peak] - 0.3),
        fontsize=8,
        arrowprops=dict(arrowstyle="->", lw=0.6),
    )
    ax.set(xscale="log", xlabel="optimizer step t", ylabel="|uncorrected step| / |corrected step|")
    ax.set_title(
        "What Adam's bias correction removes, constant gradient\n"
        f"(arithmetic: the same on every device), torch {torch.__version__}",
        fontsize=9,
    )
    ax.legend(fontsize=7, loc="upper right")
    return fig
