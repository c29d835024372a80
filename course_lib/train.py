"""The training loop: `train_step` is one optimizer step, the code to read top to bottom.

Its variations are `if`s in it (CUDA graphs, a pipeline schedule, DDP by hand); nothing measures inside it:
measure.StepRecorder wraps each step from outside. `Trainer(cfg, model)` builds what cfg asks for and `fit()` trains;
`train` is the two in one call, and `run` turns an out-of-memory error into a result (handled here, and only here).
"""

from __future__ import annotations

import copy
import gc
import math
import warnings
from typing import Callable

import torch

from . import capabilities as caps_mod, cpu_allocator, data as data_mod, measure, techniques
from .config import ConfigError, TrainConfig
from .model import GPT
from .results import RunResult, provenance
from .techniques import keep_freed_memory
from .techniques.torch_compile import CUDA_GRAPH_MODES, begin_cuda_graph_step, uses_cuda_graphs
from .timing import median_excluding

Callback = Callable[[int, RunResult], None]


def train_step(setup: techniques.Setup, cfg: TrainConfig, params, micro, meter=measure.NOT_MEASURED, n_targets=None):
    """One optimizer step over the micro-batches [(inputs, targets), ...]: (loss per target token, gradient norm before
    clipping, learning rate, loss scale). `meter` is a no-op unless the memory ledger watches this step; `n_targets` is
    given where tensors hold no values (FakeTensorMode)."""
    # Divide by the whole step's target tokens: a mean of micro-batch means is wrong when their padding differs.
    if n_targets is None:
        n_targets = sum(data_mod.count_targets(y) for _, y in micro)
    if cfg.compile and cfg.compile_mode in CUDA_GRAPH_MODES:  # a new step: CUDA graphs may overwrite the last one's
        begin_cuda_graph_step(params, grads_kept=not cfg.set_to_none)
    if setup.pipeline is not None:  # pipeline parallelism: its schedule runs forward and backward across the stages
        step_loss = setup.pipeline.forward_backward(setup, micro, n_targets, meter)
    else:
        loss_fn = meter.loss_fn(setup)  # the (maybe compiled) model and loss; the ledger follows the eager one
        step_loss = torch.zeros((), device=micro[0][1].device)
        for x, y in micro:  # each backward adds its gradients into .grad
            with setup.autocast(), meter.phase("forward"):
                loss = loss_fn(x, y) / n_targets
            with meter.phase("backward"):
                setup.scaler.scale(loss).backward()
            step_loss += loss.detach()
            del loss  # the graph and its activations go now, not when the next micro-batch replaces it
    if setup.hand_ddp is not None:  # DDP by hand: wait for its last all-reduces, then every rank holds the mean
        with meter.phase("backward"):
            setup.hand_ddp.finish()
    with meter.phase("optimizer"):
        setup.scaler.unscale_(setup.optimizer)  # fp16: the true gradients, before clipping
        grads = [p.grad for p in params if p.grad is not None]
        meter.on_grads(grads)  # the ledger names them before zero_grad may free them
        norm = setup.pipeline.grad_norm(grads) if setup.pipeline else torch.nn.utils.get_total_norm(grads)
        if cfg.clip_norm is not None and cfg.clip_kind == "global":  # one factor for all: the direction is kept
            torch.nn.utils.clip_grads_with_norm_(params, cfg.clip_norm, norm)
        elif cfg.clip_norm is not None:
            techniques.clip_by_tensor_norm(params, cfg.clip_norm)
        lr = setup.optimizer.param_groups[0]["lr"]
        scale = setup.scaler.get_scale() if setup.scaler.is_enabled() else 1.0
        setup.scaler.step(setup.optimizer)  # skipped, under fp16, where a gradient is inf or nan
        setup.scaler.update()
        setup.optimizer.zero_grad(set_to_none=cfg.set_to_none)
        with warnings.catch_warnings():  # a step the fp16 scaler skipped still advances the schedule, on purpose
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            setup.scheduler.step()
    return step_loss, norm, lr, scale


class StopRun(Exception):
    """Raised by a fit() callback to end the run after the step it was called for; the message says why."""


@torch.no_grad()
def evaluate(model: torch.nn.Module, stream: torch.Tensor, cfg: TrainConfig, n_batches: int, seed: int = 1234) -> float:
    """Mean loss per token over `n_batches` fixed random windows of `stream` (the same windows every call)."""
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    total, count = 0.0, 0
    autocast = techniques.autocast_context(cfg.precision, cfg.device)
    for _ in range(n_batches):
        x, y = data_mod.random_windows(stream, cfg.micro_batch_size, cfg.context, gen)
        x, y = x.to(cfg.device), y.to(cfg.device)
        with autocast():
            total += techniques.loss_sum(model(x), y).item()
        count += data_mod.count_targets(y)
    model.train(was_training)
    return total / count


class Trainer:
    """The training loop built for one config. model: the course's GPT, or any module mapping inputs to logits, with
    `parts` naming its blocks, body and output layer; batches(step) -> the step's micro-batches [(x, y), ...] (random
    windows of the plays by default); flops_per_token: the GPT formula, else counted on the first batch. `.setup` holds
    what was built, for a caller to hook into (DDP's communication hook, a pipeline's schedule) before `fit()`."""

    def __init__(self, cfg: TrainConfig, model=None, *, parts=None, batches=None, splits=None, flops_per_token=None):
        self.caps = caps_mod.capabilities(cfg.device)
        self.caps.require(cfg)  # this device can run cfg, or a ConfigError that says what to change
        # A fresh compiler: an earlier model's guards would decide what compiles, and the first step honestly includes
        # compiling; it also frees an earlier run's CUDA graphs, which would count in this run's memory.
        if cfg.compile or torch.device(cfg.device).type == "cuda":
            torch._dynamo.reset()
        free_memory()  # an earlier run's garbage must not count in this one's memory
        keep_freed_memory.apply(cfg)  # the process's allocator, as cfg asks (a CPU's)
        torch.manual_seed(cfg.seed)
        self.cfg, self.dev = cfg, torch.device(cfg.device)
        if splits is None and (batches is None or cfg.eval_every):
            splits = data_mod.load_splits()
        if model is None and splits is not None:
            data_mod.check_vocabulary(cfg.model.vocab_size, splits.vocab_size)
        self.splits = splits
        self.batches = batches or data_mod.random_batches(splits.train, cfg, cfg.seed)
        self.recorder = measure.StepRecorder(cfg, uses_cuda_graphs(cfg))  # before the model: CUDA's baseline
        model = (model if model is not None else GPT(cfg.model)).to(self.dev)
        self.setup = techniques.build(cfg, model, parts)
        if flops_per_token is None and isinstance(model, GPT):  # any other model's: counted in fit(), on a batch
            n, m = model.num_params(non_embedding=True), cfg.model
            flops_per_token = measure.flops_per_token(n, m.n_layer, m.n_embd, cfg.context)
        self.flops_per_token = flops_per_token
        self.params = list(self.setup.model.parameters())  # what the optimizer updates
        self.step_index = 0  # the next step's index: what batches() is asked for
        self.last_step_faults: int | None = None  # the last step's page faults (cpu_allocator.page_faults)
        self.result: RunResult | None = None  # the run being recorded, while fit() runs

    def micro_batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        micro = [(x.to(self.dev, non_blocking=True), y.to(self.dev, non_blocking=True)) for x, y in self.batches(step)]
        if not micro:
            raise ConfigError(f"batches({step}) returned no micro-batches: it must return [(inputs, targets), ...]")
        return micro

    def fit(self, label: str = "run", callback: Callback | None = None) -> RunResult:
        """Train `cfg.steps` steps and return what was measured. `callback(step, result)` runs after every step and
        may raise StopRun to end the run early (the result then holds the steps taken, with the reason)."""
        cfg, setup, recorder = self.cfg, self.setup, self.recorder
        cfg.check_steps_to_time()
        n_params = sum(p.numel() for p in self.params)  # parameters() yields a tied weight once
        result = self.result = RunResult(label, "ok", cfg.to_dict(), provenance(self.caps.name), n_params=n_params)
        recorder.start(setup.parts.head)
        try:
            for step in range(cfg.steps):
                micro = self.micro_batches(step)
                with techniques.matmul_precision(cfg.precision), recorder.step(step, setup):
                    loss, norm, lr, scale = train_step(setup, cfg, self.params, micro, recorder.meter(step))
                self._record(step, micro, loss, norm, lr, scale)
                if callback:
                    callback(step, result)
                if result.status == "diverged":
                    break
        except StopRun as stop:
            result.stopped_early = str(stop)
        return self._finish()

    def step(self) -> float:
        """One more step after fit(), timed like fit()'s and recorded nowhere (the ladder pairs loops): seconds."""
        with techniques.matmul_precision(self.cfg.precision), self.recorder.step(self.step_index, self.setup):
            train_step(self.setup, self.cfg, self.params, self.micro_batches(self.step_index))
        self.step_index += 1
        self.last_step_faults = self.recorder.faults
        return self.recorder.timer.times[-1]

    def is_timed(self, step: int) -> bool:
        """Whether step `step` counts in the run's timing: not a warm-up step, not the memory-ledger step."""
        return step not in self.cfg.untimed_steps

    def _record(self, step: int, micro, loss: torch.Tensor, norm: torch.Tensor, lr: float, scale: float) -> None:
        """The step's values in the run's result, read back only after its timed region."""
        cfg, setup, result = self.cfg, self.setup, self.result
        self.step_index += 1
        self.last_step_faults = self.recorder.faults
        if step == 0:
            result.tokens_per_step = sum(y.numel() for _, y in micro)  # padding included
            if self.flops_per_token is None:  # counted on a copy of the model: its gradients stay untouched
                x, y = micro[0]
                self.flops_per_token = measure.counted_flops_per_token(
                    copy.deepcopy(setup.model), x, lambda out: techniques.loss_sum(out, y), tokens=y.numel()
                )
            result.flops_per_token = self.flops_per_token
        result.losses.append(loss.item())
        result.grad_norms.append(norm.item())
        result.lrs.append(lr)
        if setup.scaler.is_enabled():
            result.loss_scales.append(scale)
            result.skipped_optimizer_steps += setup.scaler.get_scale() < scale
        if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step == cfg.steps - 1):
            result.val_losses.append((step, evaluate(setup.model, self.splits.val, cfg, cfg.eval_batches)))
        result.step_times = list(self.recorder.timer.times)
        if not math.isfinite(result.losses[-1]):  # nothing after a non-finite loss is training: say so and stop
            result.status = "diverged"
            result.reason = (
                f"diverged: the loss became {result.losses[-1]} at step {step} (learning rate {lr:g}): "
                "lower lr, or add warm-up (lr_warmup_steps) or clipping (clip_norm)"
            )

    def _finish(self) -> RunResult:
        """The run's summary from its recorded steps; after it, step() records nothing."""
        cfg, result = self.cfg, self.result
        self.result = None
        self.recorder.stop()
        taken = len(result.step_times)
        result.excluded_steps = excluded = sorted(i for i in cfg.untimed_steps if i < taken)
        if result.status == "diverged":  # its times are recorded; no speed, MFU or memory is reported for it
            return result
        if taken == len(excluded):
            raise ConfigError(
                f"the run {result.label!r} stopped after {taken} step(s), before any timed step: {result.stopped_early}"
            )
        if note := cpu_allocator.not_glibcs_own_rule(cfg.device, cfg.keep_freed_memory):
            result.details["allocator"] = note  # shown as the run's note (RunResult.note) in a panel's table
        result.median_step_s = median_excluding(result.step_times, set(excluded))
        result.tokens_per_s = result.tokens_per_step / result.median_step_s
        if cfg.compile:
            result.compile_s = max(0.0, result.step_times[0] - result.median_step_s)
        result.mfu, result.mfu_basis = caps_mod.efficiency(
            result.tokens_per_s, result.flops_per_token, cfg.device, cfg.precision
        )
        result.memory = self.recorder.memory(self.setup.model, self.setup.optimizer, taken)
        return result


def train(cfg: TrainConfig, label: str = "run", callback: Callback | None = None, model=None, **kwargs) -> RunResult:
    """Build and train in one call: `Trainer(cfg, model, **kwargs).fit(label, callback)`."""
    return Trainer(cfg, model, **kwargs).fit(label, callback)


def run(cfg: TrainConfig, label: str = "run", callback: Callback | None = None, model=None, **kwargs) -> RunResult:
    """train(), but out of memory becomes a result with status "oom", the memory freed: the caller carries on."""
    return catching_oom(lambda: Trainer(cfg, model, **kwargs).fit(label, callback), cfg, label)


# ---- out of memory: handled here, and only here ---------------------------------------------------------------------


def free_memory() -> None:
    """What an earlier run left: its garbage collected, a CPU heap's free memory and CUDA's cache given back."""
    gc.collect()
    cpu_allocator.give_back()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def out_of_memory_reason(e: BaseException | None) -> str | None:
    """ "out of memory: <its first line>" where e, or an error in its chain (compile may wrap it), is one; else None.
    CUDA raises torch.OutOfMemoryError, Python MemoryError, a CPU's allocator a RuntimeError ("DefaultCPUAllocator:
    can't allocate memory" on Linux and macOS, "...: not enough memory" on Windows, C++'s "std::bad_alloc")."""
    while e is not None:
        text = str(e)
        cpu = "DefaultCPUAllocator" in text and "memory" in text or "std::bad_alloc" in text
        if isinstance(e, (torch.OutOfMemoryError, MemoryError)) or (isinstance(e, RuntimeError) and cpu):
            return "out of memory: " + text.partition("\n")[0][:200]
        e = e.__cause__ or e.__context__
    return None


def unless_it_fails(attempt: Callable[[], object], reason=out_of_memory_reason) -> tuple[object, str | None]:
    """(attempt(), None), or (None, reason(e)) with the memory freed where it raised an exception `reason` names (out
    of memory by default); any other exception is raised."""
    try:
        return attempt(), None
    except Exception as e:  # noqa: BLE001 - what `reason` does not name is re-raised
        why = reason(e)
        if why is None:
            raise
    # Past the except block `e` and its traceback are gone: the failed run's frames (model, activations) can be freed.
    free_memory()
    return None, why


def catching_oom(attempt: Callable[[], RunResult], cfg: TrainConfig, label: str) -> RunResult:
    """attempt(), or, when it runs out of memory, a result with status "oom" and the memory freed."""
    result, reason = unless_it_fails(attempt)
    return result if reason is None else RunResult.failed(cfg, label, "oom", reason)
