"""Gradient accumulation (notebook 06): the arithmetic of the big batch, exact gradient comparisons, and the
padding trap.

The training loop itself lives in course_lib.train (TrainConfig.grad_accum_steps splits batch_size into
micro-batches and divides every micro-batch's summed loss by the number of real target tokens in the whole
accumulated batch). This module only

- does the batch arithmetic (tokens per optimizer step, how many micro-steps a token budget needs),
- builds micro-batches with deliberately different amounts of padding,
- computes the gradient of one accumulated batch under several normalisations (the correct one and the
  classic mistakes), with one forward and backward per micro-batch and no optimizer, so that they can be
  compared with the big batch's gradient,
- runs the one loop (course_lib.train.train) on the same data as one big batch and as micro-batches,
- sweeps accumulation steps at a fixed effective batch through course_lib.train.run.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from .. import data as data_mod
from ..config import TrainConfig
from ..model import GPT
from ..results import RunResult
from ..techniques import loss_sum

Batch = tuple[torch.Tensor, torch.Tensor]

NORMALISATIONS = {
    "global": "sum of the loss over each micro-batch / real target tokens in the whole batch (correct)",
    "mean_of_means": (
        "mean loss of each micro-batch / number of micro-steps "
        "(right only if every micro-batch has as many real tokens)"
    ),
    "no_division": "mean loss of each micro-batch, not divided by the number of micro-steps (K times too large)",
    "divide_after_backward": (
        "loss.backward() first, loss / K afterwards (the division comes too late to change the gradient)"
    ),
    "zero_grad_inside": "zero_grad() inside the micro-batch loop (only the last micro-batch's gradient survives)",
}


# ---- the arithmetic of the batch ----------------------------------------------------------------


def tokens_per_optimizer_step(micro_batch: int, context: int, accum_steps: int = 1, processes: int = 1) -> int:
    """Tokens that one optimizer step sees: micro-batch x context x accumulation steps x processes."""
    for name, v in (
        ("micro_batch", micro_batch),
        ("context", context),
        ("accum_steps", accum_steps),
        ("processes", processes),
    ):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    return micro_batch * context * accum_steps * processes


def accumulation_steps_for(target_tokens: int, micro_batch: int, context: int, processes: int = 1) -> int:
    """How many micro-steps reach `target_tokens` per optimizer step, as an int (range() needs one).

    Raises ValueError when the target is not a whole multiple of the tokens one micro-step of all processes
    handles, rather than silently rounding the batch you asked for."""
    per_micro_step = tokens_per_optimizer_step(micro_batch, context, 1, processes)
    steps, rest = divmod(target_tokens, per_micro_step)
    if rest or steps < 1:
        raise ValueError(
            f"target_tokens={target_tokens} is not a whole multiple of micro_batch x context x processes = "
            f"{micro_batch} x {context} x {processes} = {per_micro_step}: change the micro-batch or the target"
        )
    return steps


# ---- data ----------------------------------------------------------------------------------------


def padded_micro_batches(
    stream: torch.Tensor, lengths: list[int], micro_batch: int, context: int, pad: int, seed: int = 0
) -> list[Batch]:
    """One micro-batch per entry of `lengths`: `micro_batch` random text pieces with `lengths[i]` real target
    tokens each, padded to `context` (padded targets are IGNORE_INDEX). Different lengths give micro-batches with
    different numbers of real tokens, the situation where a mean of per-micro-batch means goes wrong."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        if not 1 <= n <= context:
            raise ValueError(f"each length must be in [1, context={context}], got {n}")
        starts = torch.randint(0, len(stream) - n - 1, (micro_batch,), generator=gen).tolist()
        out.append(data_mod.pad_sequences([stream[s : s + n + 1] for s in starts], context, pad))
    return out


def full_micro_batches(
    stream: torch.Tensor, n_micro: int, micro_batch: int, context: int, seed: int = 0
) -> list[Batch]:
    """`n_micro` micro-batches of random windows with no padding."""
    gen = torch.Generator().manual_seed(seed)
    return [data_mod.random_windows(stream, micro_batch, context, gen) for _ in range(n_micro)]


def concat(micro: list[Batch]) -> Batch:
    """The micro-batches stacked into the one big batch they are slices of."""
    return torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro])


def target_counts(micro: list[Batch]) -> list[int]:
    """Real (non-padding) target tokens in each micro-batch."""
    return [data_mod.count_targets(y) for _, y in micro]


# ---- gradients -----------------------------------------------------------------------------------


def make_model(cfg: TrainConfig, seed: int | None = None) -> GPT:
    """A freshly initialised GPT of cfg.model (same seed, same weights), in training mode, on cfg.device."""
    torch.manual_seed(cfg.seed if seed is None else seed)
    return GPT(cfg.model).to(cfg.device).train()


def gradients(model: torch.nn.Module, micro: list[Batch], normalisation: str = "global") -> dict[str, torch.Tensor]:
    """The gradient one accumulated batch leaves in `model` (forward and backward per micro-batch, no optimizer
    step), as {parameter name: gradient copy}. `normalisation` is one of NORMALISATIONS: "global" is what
    course_lib.train does; the others are the classic mistakes, kept here so they can be measured."""
    if normalisation not in NORMALISATIONS:
        raise ValueError(f"normalisation={normalisation!r} is not one of {', '.join(NORMALISATIONS)}")
    dev = next(model.parameters()).device
    model.zero_grad(set_to_none=True)
    k = len(micro)
    total = sum(target_counts(micro))
    for x, y in micro:
        x, y = x.to(dev), y.to(dev)
        if normalisation == "zero_grad_inside":
            model.zero_grad(set_to_none=True)
        summed = loss_sum(model(x), y)
        if normalisation == "global":
            loss = summed / total
        else:
            loss = summed / data_mod.count_targets(y)  # this micro-batch's mean
            if normalisation in ("mean_of_means", "zero_grad_inside"):
                loss = loss / k
        loss.backward()
        if normalisation == "divide_after_backward":
            loss = loss / k  # too late: backward() has already added this micro-batch's full gradient
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def big_batch_gradients(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """The reference: the whole batch in one forward and backward, loss averaged over its real target tokens."""
    return gradients(model, [(x, y)], "global")


def flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1).double() for g in grads.values()])


def relative_error(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """||g - g_ref|| / ||g_ref|| over all parameters together (global 2-norm)."""
    if grads.keys() != reference.keys():
        raise ValueError("the two gradients cover different parameters")
    ref = flat(reference)
    return float((flat(grads) - ref).norm() / ref.norm())


def norm_ratio(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """||g|| / ||g_ref||: 1 when the scale is right."""
    return float(flat(grads).norm() / flat(reference).norm())


def compare_normalisations(
    model: torch.nn.Module, micro: list[Batch], normalisations=tuple(NORMALISATIONS)
) -> dict[str, dict[str, float]]:
    """Each normalisation's gradient against the big batch's: {name: {"relative_error", "norm_ratio"}}."""
    ref = big_batch_gradients(model, *concat(micro))
    out = {}
    for name in normalisations:
        g = gradients(model, micro, name)
        out[name] = {"relative_error": relative_error(g, ref), "norm_ratio": norm_ratio(g, ref)}
    return out


# ---- the one loop, big batch against accumulation -------------------------------------------------


def loop_equivalence(
    cfg: TrainConfig, micro_per_step: Callable[[int], list[Batch]], label: str = ""
) -> tuple[RunResult, RunResult]:
    """Train the same model on the same data twice with course_lib.train.train: once as one big batch per step
    (grad_accum_steps=1), once as the micro-batches (grad_accum_steps=K). Returns (big, accumulated) results;
    their losses and gradient norms should agree to rounding."""
    from ..train import train

    k = len(micro_per_step(0))
    base = replace(cfg, batch_size=k * cfg.micro_batch_size, measure_memory=False)
    big = train(
        replace(base, grad_accum_steps=1), f"{label}big batch", batches=lambda step: [concat(micro_per_step(step))]
    )
    acc = train(replace(base, grad_accum_steps=k), f"{label}{k} micro-batches", batches=micro_per_step)
    return big, acc


def max_relative_difference(a: list[float], b: list[float]) -> float:
    if len(a) != len(b) or not a:
        raise ValueError("need two non-empty lists of the same length")
    return max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b))


# ---- the cost: accumulation steps at a fixed effective batch ---------------------------------------


def accumulation_sweep(
    base: TrainConfig,
    accum_steps: list[int],
    callback: Callable[[int, RunResult], None] | None = None,
    runner: Callable[..., RunResult] | None = None,
) -> list[RunResult]:
    """One run of the one loop (course_lib.train.run) per number of accumulation steps, all with the effective
    batch base.batch_size; the micro-batch is batch_size / K."""
    from ..train import run

    runner = runner or run
    results = []
    for k in accum_steps:
        cfg = replace(base, grad_accum_steps=k)
        results.append(runner(cfg, label=f"K={k} (micro-batch {cfg.micro_batch_size})", callback=callback))
    return results


# ---- the panel (notebook 06): one accumulated batch with uneven padding, under one normalisation ------


def imbalanced_lengths(context: int, k: int, imbalance: float) -> list[int]:
    """Real tokens per sequence for each of `k` micro-batches, from `context` down to context / imbalance
    geometrically: imbalance 1 means no padding, 8 means the last micro-batch holds 8 times fewer real tokens."""
    if imbalance < 1:
        raise ValueError(f"imbalance must be >= 1 (longest / shortest), got {imbalance}")
    return [max(1, round(context / imbalance ** (i / max(1, k - 1)))) for i in range(k)]


def normalisation_run(
    cfg: TrainConfig,
    stream: torch.Tensor,
    pad: int,
    imbalance: float,
    normalisation: str,
    label: str,
    callback: Callable[[int, RunResult], None] | None = None,
) -> tuple[RunResult, dict]:
    """The gradient of one accumulated batch of cfg.grad_accum_steps micro-batches of cfg.micro_batch_size
    sequences, padded unevenly (imbalanced_lengths), under `normalisation`, against the big batch's gradient.
    The accumulated gradient is computed cfg.steps times on a fresh model of cfg (timed, the first
    cfg.timing_warmup left out of the median); returns (the run as a RunResult, details for the plots)."""
    from ..capabilities import device_name
    from ..results import provenance
    from ..timing import StepTimer, median_excluding

    k, b, s = cfg.grad_accum_steps, cfg.micro_batch_size, cfg.context
    lengths = imbalanced_lengths(s, k, imbalance)
    micro = padded_micro_batches(stream, lengths, b, s, pad, seed=cfg.seed)
    model = make_model(cfg)
    ref = big_batch_gradients(model, *concat(micro))
    dev = torch.device(cfg.device)
    result = RunResult(
        label=label,
        status="ok",
        config=cfg.to_dict(),
        provenance=provenance(device_name(dev)),
        n_params=model.num_params(),
        tokens_per_step=sum(y.numel() for _, y in micro),
    )
    timer = StepTimer(dev)
    for step in range(cfg.steps):
        with timer.step():
            grads = gradients(model, micro, normalisation)
        result.step_times = list(timer.times)
        if callback:
            callback(step, result)
    excluded = set(range(min(cfg.timing_warmup, cfg.steps - 1)))
    result.excluded_steps = sorted(excluded)
    result.median_step_s = median_excluding(timer.times, excluded)
    result.tokens_per_s = result.tokens_per_step / result.median_step_s
    error, ratio = relative_error(grads, ref), norm_ratio(grads, ref)
    result.grad_norms = [float(flat(grads).norm())]
    result.reason = f"gradient vs big batch: relative error {error:.2e}, norm ratio {ratio:.3f}"
    details = {
        "normalisation": normalisation,
        "imbalance": imbalance,
        "lengths": lengths,
        "target_counts": target_counts(micro),
        "relative_error": error,
        "norm_ratio": ratio,
    }
    return result, details


def plot_gradient_errors(results: list[RunResult], ax):
    """Each run's relative error of the accumulated gradient against the big batch's (log scale; details from
    normalisation_run), its norm ratio written on the bar; the dotted line is fp32 rounding (1e-6)."""
    runs = [r for r in results if getattr(r, "details", {}).get("relative_error") is not None]
    colors = {n: f"C{i}" for i, n in enumerate(NORMALISATIONS)}
    for i, r in enumerate(runs):
        d = r.details
        bar = ax.bar(i, max(d["relative_error"], 1e-12), color=colors.get(d["normalisation"], "#888888"))[0]
        ax.annotate(
            f"x{d['norm_ratio']:.2f}",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=7,
        )
    ax.axhline(1e-6, ls=":", color="#888888", lw=1, label="fp32 rounding (1e-6)")
    ax.set_yscale("log")
    ax.set_xticks(range(len(runs)), [r.label for r in runs], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("relative error of the gradient vs big batch")
    devices = sorted({r.provenance.get("device", "?") for r in runs})
    ax.set_title(f"Accumulated vs big-batch gradient (x: norm ratio)\n{' / '.join(devices)}", fontsize=9)
    ax.legend(fontsize=7)
    return ax.figure


def plot_target_counts(results: list[RunResult], ax):
    """Real (non-padding) target tokens in each micro-batch of each run: the imbalance the normalisation meets."""
    for r in results:
        counts = getattr(r, "details", {}).get("target_counts")
        if counts:
            ax.plot(range(len(counts)), counts, "o-", lw=1.2, ms=4, label=r.label)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("micro-batch")
    ax.set_ylabel("real target tokens (log2)")
    ax.set_title("Padding: real tokens per micro-batch", fontsize=9)
    if ax.lines:
        ax.legend(fontsize=7)
    return ax.figure
