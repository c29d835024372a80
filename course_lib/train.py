"""The one training loop. Every technique reaches it through techniques.build(), so there is one code path.

    for each optimizer step:
        for each micro-batch:        (gradient accumulation; 1 micro-batch when it is off)
            forward + loss under autocast (a no-op context in fp32)
            backward of loss scaled by the GradScaler (a no-op scaler unless fp16)
        unscale, global-norm clip, optimizer step, scaler update, zero_grad, LR schedule step
"""
from __future__ import annotations

import contextlib
import gc
from typing import Callable

import torch

from . import capabilities as caps_mod
from . import data as data_mod
from . import measure, techniques
from .config import ConfigError, TrainConfig
from .model import GPT
from .results import RunResult, provenance


@torch.no_grad()
def evaluate(model: torch.nn.Module, stream: torch.Tensor, cfg: TrainConfig, n_batches: int, seed: int = 1234) -> float:
    """Mean loss per token over `n_batches` fixed random windows of `stream` (the same windows every call)."""
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    total, count = 0.0, 0
    autocast = techniques.autocast_context(cfg)
    for _ in range(n_batches):
        x, y = data_mod.random_windows(stream, cfg.micro_batch_size, cfg.context, gen)
        x, y = x.to(cfg.device), y.to(cfg.device)
        with autocast():
            total += techniques.loss_sum(model(x), y).item()
        count += data_mod.count_targets(y)
    model.train(was_training)
    return total / count


def _static_tensors(model, optimizer) -> dict[str, list[torch.Tensor]]:
    return {"parameters": list(model.parameters()),
            "gradients": [p.grad for p in model.parameters() if p.grad is not None],
            "optimizer state": measure.optimizer_state_tensors(optimizer)}


def train(cfg: TrainConfig, label: str = "run", callback: Callable[[int, RunResult], None] | None = None,
          splits: data_mod.Splits | None = None, batches: Callable[[int], list[tuple[torch.Tensor, torch.Tensor]]] | None = None) -> RunResult:
    """Train `cfg.steps` optimizer steps and return what was measured.

    `batches(step)` may supply the micro-batches of a step (a list of (x, y)); by default they are random
    windows of the training text. `callback(step, result)` is called after every step (progress bars).
    """
    caps = caps_mod.capabilities(cfg.device)
    caps.require(cfg)  # this device can run cfg, or a ConfigError that says what to change
    # Each run starts clean: an earlier run's garbage must not count in this one's memory, and compiled code
    # from an earlier model would be recompiled against guards anyway (and past dynamo's cache limit, silently
    # run eager), so the compiler starts afresh and this run's first step honestly includes compiling.
    free_memory()
    if cfg.compile:
        torch._dynamo.reset()
    torch.manual_seed(cfg.seed)
    splits = splits or data_mod.load_splits()
    if cfg.model.vocab_size < splits.vocab_size:
        raise ConfigError(f"model vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {splits.vocab_size} tokens: raise vocab_size")
    dev = torch.device(cfg.device)
    gen = torch.Generator().manual_seed(cfg.seed)
    if batches is None:
        def batches(step: int):
            return [data_mod.random_windows(splits.train, cfg.micro_batch_size, cfg.context, gen) for _ in range(cfg.grad_accum_steps)]

    # CUDA: what is already allocated (an earlier run's leftovers, the notebook's tensors) is not this run's.
    cuda_baseline = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    model = GPT(cfg.model).to(dev)
    setup = techniques.build(cfg, model)
    name = caps.name
    result = RunResult(label=label, status="ok", config=cfg.to_dict(), provenance=provenance(name),
                       n_params=model.num_params(), tokens_per_step=cfg.tokens_per_step,
                       flops_per_token=measure.flops_per_token(model.num_params(non_embedding=True), cfg.model.n_layer, cfg.model.n_embd, cfg.context))
    timer = measure.StepTimer(dev)
    ledger_step = cfg.steps - 1 if (dev.type == "cpu" and cfg.measure_memory) else None
    excluded = set(range(min(cfg.timing_warmup, cfg.steps))) | ({ledger_step} if ledger_step is not None else set())
    if len(excluded) >= cfg.steps:
        raise ConfigError(f"steps={cfg.steps} leaves no step to time after {cfg.timing_warmup} warm-up step(s)"
                          f"{' and the memory-ledger step' if ledger_step is not None else ''}: raise steps to at least {len(excluded) + 1}")
    params = [p for p in model.parameters()]
    with techniques.matmul_precision(cfg.precision):
        _loop(cfg, setup, model, params, splits, batches, dev, timer, ledger_step, result, callback)
    result.excluded_steps = sorted(excluded)
    result.median_step_s = measure.median_excluding(timer.times, excluded)
    result.tokens_per_s = cfg.tokens_per_step / result.median_step_s
    if cfg.compile:
        result.compile_s = max(0.0, timer.times[0] - result.median_step_s)
    result.mfu, result.mfu_basis = caps_mod.efficiency(result.tokens_per_s, result.flops_per_token, cfg.device, cfg.precision)
    if dev.type == "cuda":
        static = {k: measure.tensor_bytes(v) for k, v in _static_tensors(model, setup.optimizer).items()}
        # With set_to_none=False the gradients live through the whole step, so they are at the peak at full
        # size. With set_to_none=True they exist only from backward on, and the allocator cannot say whether
        # the peak fell before or after: they are "not measured" (inside "other") rather than guessed.
        static["gradients"] = None if cfg.set_to_none else measure.tensor_bytes(params)
        result.memory = measure.cuda_memory_report(dev, static, baseline=cuda_baseline).to_dict()
    return result


def _loop(cfg, setup, model, params, splits, batches, dev, timer, ledger_step, result, callback) -> None:
    ledger = None
    for step in range(cfg.steps):
        micro = [(x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)) for x, y in batches(step)]
        # Normalise by the count of real target tokens in the whole accumulated batch, not per micro-batch:
        # a mean of micro-batch means is wrong when micro-batches hold different numbers of padding tokens.
        n_targets = sum(data_mod.count_targets(y) for _, y in micro)
        if dev.type == "cuda" and step == min(cfg.timing_warmup, cfg.steps - 1):
            torch.cuda.reset_peak_memory_stats(dev)
        if step == ledger_step:
            ledger = measure.MemoryLedger()
            for category, tensors in _static_tensors(model, setup.optimizer).items():
                ledger.register(tensors, category)
        measuring = step == ledger_step
        # The ledger follows eager ops; a compiled graph would hide its inside, so that one step runs eager.
        loss_fn = setup.loss_module if measuring else setup.loss_fn
        step_loss = torch.zeros((), device=dev)
        with timer.step(), (ledger.watch(model.lm_head) if measuring else contextlib.nullcontext()):
            for x, y in micro:
                with setup.autocast(), (ledger.phase("forward") if measuring else contextlib.nullcontext()):
                    loss = loss_fn(x, y) / n_targets
                with (ledger.phase("backward") if measuring else contextlib.nullcontext()):
                    setup.scaler.scale(loss).backward()
                step_loss += loss.detach()
                del loss
            with (ledger.phase("optimizer") if measuring else contextlib.nullcontext()):
                norm, lr, scale_before = techniques.optimizer_step(
                    setup, cfg, params, on_grads=(lambda g: ledger.reclassify(g, "gradients")) if measuring else None)
        if step == ledger_step:
            for category, tensors in _static_tensors(model, setup.optimizer).items():
                ledger.reclassify(tensors, category)
        # Read values back only after the timed region.
        result.losses.append(step_loss.item())
        result.grad_norms.append(norm.item())
        result.lrs.append(lr)
        if setup.scaler.is_enabled():
            result.loss_scales.append(scale_before)
            if setup.scaler.get_scale() < scale_before:
                result.skipped_optimizer_steps += 1
        if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step == cfg.steps - 1):
            result.val_losses.append((step, evaluate(setup.model, splits.val, cfg, cfg.eval_batches)))
        result.step_times = list(timer.times)
        if callback:
            callback(step, result)

    if ledger is not None:
        result.memory = ledger.report().to_dict()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _chain(e: BaseException):
    while e is not None:
        yield e
        e = e.__cause__ or e.__context__


def run(cfg: TrainConfig, label: str = "run", **kwargs) -> RunResult:
    """train(), but an out-of-memory error becomes a result with status "oom": the memory is freed and the
    caller (a notebook, the ladder) carries on."""
    try:
        return train(cfg, label, **kwargs)
    except Exception as e:  # noqa: BLE001 - only out-of-memory is handled; anything else is re-raised
        oom = next((x for x in _chain(e) if isinstance(x, torch.OutOfMemoryError)), None)  # compile may wrap it
        if oom is None:
            raise
        reason = "out of memory: " + str(oom).splitlines()[0][:200]
    # Leaving the except block drops the traceback, and with it the frames that held the model.
    free_memory()
    return RunResult(label=label, status="oom", config=cfg.to_dict(), provenance=provenance(measure.device_name(cfg.device)), reason=reason)
