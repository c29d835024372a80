"""The training loop. `train_step` is one optimizer step, the code to read top to bottom:

    for each micro-batch:            (gradient accumulation; one micro-batch when it is off)
        forward and loss under autocast (bf16 or fp16; fp32 runs without it)
        backward of the loss, scaled by the GradScaler (fp16 only)
    unscale, clip by the global norm, optimizer step, scaler update, zero_grad, learning-rate schedule

Its real variations are `if`s in it: CUDA graphs (compile's reduce-overhead mode), pipeline parallelism (a schedule runs
the micro-batches across the stages), DDP written by hand (its last all-reduces after backward). Nothing measures inside
it: measure.StepRecorder wraps each step from outside (time, memory peaks, the CPU memory ledger, page faults).

`Trainer(cfg, model)` builds what cfg asks for (techniques.build: the course's GPT by default, or any module mapping
inputs to logits) and shows it (`.setup`) before `fit()` trains; `train(cfg, ...)` is the two in one call, and `run`
turns an out-of-memory error into a result (out of memory is handled at the end of this module, and only there).
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

Batches = Callable[[int], list[tuple[torch.Tensor, torch.Tensor]]]


def train_step(
    setup: techniques.Setup,
    cfg: TrainConfig,
    params: list[torch.Tensor],
    micro: list[tuple[torch.Tensor, torch.Tensor]],
    meter: measure.NotMeasured = measure.NOT_MEASURED,
    n_targets: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """One optimizer step over the step's micro-batches [(inputs, targets), ...]. Returns (loss per target token,
    gradient norm before clipping, learning rate used, loss scale used). `meter` is a no-op unless the memory ledger
    watches this step; `n_targets` is given where tensors hold no values (FakeTensorMode)."""
    # Divide by the real target tokens of the whole step, not per micro-batch: a mean of micro-batch means is wrong
    # when micro-batches hold different numbers of padding tokens.
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
    """The training loop, built for one config.

    model: the course's GPT of cfg.model by default; any module mapping inputs to logits works (notebook 09
      trains an MLP), with `parts` saying what the techniques may need (its blocks, body and output layer).
    batches(step) -> [(x, y), ...]: the micro-batches of a step; by default random windows of the course's text.
    flops_per_token: by default the GPT formula for a GPT, else counted once with FlopCounterMode.
    After construction `.setup` holds what was built (model, loss module, optimizer, ...), so a caller can look
    at it or hook into it (DDP's communication hook, a pipeline's schedule) before `fit()`.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        model: torch.nn.Module | None = None,
        *,
        parts: techniques.ModelParts | None = None,
        batches: Batches | None = None,
        splits: data_mod.Splits | None = None,
        flops_per_token: int | None = None,
    ):
        self.caps = caps_mod.capabilities(cfg.device)
        self.caps.require(cfg)  # this device can run cfg, or a ConfigError that says what to change
        # Each run starts clean: an earlier run's garbage must not count in this one's memory, and compiled code
        # from an earlier model would be recompiled against guards anyway (and past dynamo's cache limit, silently
        # run eager), so the compiler starts afresh and this run's first step honestly includes compiling.
        if cfg.compile or torch.device(cfg.device).type == "cuda":
            # first: it also frees an earlier compiled run's CUDA graphs, whose memory pool free_memory then returns
            # (an uncompiled CUDA run must not count them either; a CPU run's memory does not hold them)
            torch._dynamo.reset()
        free_memory()
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
        self.flops_per_token = flops_per_token or (
            measure.flops_per_token(
                model.num_params(non_embedding=True), cfg.model.n_layer, cfg.model.n_embd, cfg.context
            )
            if isinstance(model, GPT)
            else None
        )  # any other model: counted on the first batch, in fit()
        self.params = list(self.setup.model.parameters())  # what the optimizer updates (read again when fit() starts:
        # a caller may replace .setup before)
        self.step_index = 0  # the next step's index: what batches() is asked for
        self.last_step_faults: int | None = None  # the last step's page faults (cpu_allocator.page_faults)
        self.result: RunResult | None = None  # the run being recorded, while fit() runs

    def micro_batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        micro = [(x.to(self.dev, non_blocking=True), y.to(self.dev, non_blocking=True)) for x, y in self.batches(step)]
        if not micro:
            raise ConfigError(
                f"batches({step}) returned no micro-batches: it must return a list of (inputs, targets) pairs, "
                "one per micro-batch (cfg.grad_accum_steps of them)"
            )
        return micro

    def fit(self, label: str = "run", callback: Callable[[int, RunResult], None] | None = None) -> RunResult:
        """Train `cfg.steps` optimizer steps and return what was measured. `callback(step, result)` is called after
        every step (progress bars); it may raise StopRun to end the run early (the ladder gives up on a rung that is
        far slower than the best loop so far), and the result then holds the steps taken, with the reason."""
        cfg, setup, recorder = self.cfg, self.setup, self.recorder
        cfg.check_steps_to_time()
        result = self.result = self._new_result(label)
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
        """One more step of this loop after fit(), timed as fit() times its steps and recorded nowhere (the ladder
        times one loop beside another in pairs); returns its time in seconds."""
        with techniques.matmul_precision(self.cfg.precision), self.recorder.step(self.step_index, self.setup):
            train_step(self.setup, self.cfg, self.params, self.micro_batches(self.step_index))
        self.step_index += 1
        self.last_step_faults = self.recorder.faults
        return self.recorder.timer.times[-1]

    def is_timed(self, step: int) -> bool:
        """Whether step `step` of the run counts in its timing: not a warm-up step, not the memory-ledger step."""
        return step not in self.cfg.untimed_steps

    def _new_result(self, label: str) -> RunResult:
        self.params = params = list(self.setup.model.parameters())
        return RunResult(
            label=label,
            status="ok",
            config=self.cfg.to_dict(),
            provenance=provenance(self.caps.name),
            n_params=sum(p.numel() for p in {id(p): p for p in params}.values()),
            flops_per_token=self.flops_per_token,
        )

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
        excluded = {i for i in cfg.untimed_steps if i < taken}
        result.excluded_steps = sorted(excluded)
        if result.status == "diverged":  # its times are recorded; no speed, MFU or memory is reported for it
            return result
        if taken == len(excluded):
            raise ConfigError(
                f"the run {result.label!r} stopped after {taken} step(s), before any timed step: {result.stopped_early}"
            )
        if note := cpu_allocator.not_glibcs_own_rule(cfg.device, cfg.keep_freed_memory):
            result.details["allocator"] = note  # shown as the run's note (RunResult.note) in a panel's table
        result.median_step_s = median_excluding(result.step_times, excluded)
        result.tokens_per_s = result.tokens_per_step / result.median_step_s
        if cfg.compile:
            result.compile_s = max(0.0, result.step_times[0] - result.median_step_s)
        result.mfu, result.mfu_basis = caps_mod.efficiency(
            result.tokens_per_s, result.flops_per_token, cfg.device, cfg.precision
        )
        result.memory = self.recorder.memory(self.setup.model, self.setup.optimizer, taken)
        return result


def train(
    cfg: TrainConfig,
    label: str = "run",
    callback: Callable[[int, RunResult], None] | None = None,
    splits: data_mod.Splits | None = None,
    batches: Batches | None = None,
    model: torch.nn.Module | None = None,
    **trainer_kwargs,
) -> RunResult:
    """Build and train in one call: `Trainer(cfg, model, ...).fit(label, callback)`."""
    return Trainer(cfg, model, batches=batches, splits=splits, **trainer_kwargs).fit(label, callback)


# ---- out of memory: handled here, and only here ---------------------------------------------------------------------


def free_memory() -> None:
    """What an earlier run left: its garbage collected, a CPU heap's free memory and CUDA's cache given back."""
    gc.collect()
    cpu_allocator.give_back()  # the heap's free memory to the kernel (all of it after a run that kept freed memory)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _chain(e: BaseException):
    while e is not None:
        yield e
        e = e.__cause__ or e.__context__


def out_of_memory(e: BaseException) -> BaseException | None:
    """The out-of-memory error in `e`'s chain (compile may wrap it), or None. CUDA raises torch.OutOfMemoryError; a
    CPU's allocator a plain RuntimeError ("DefaultCPUAllocator: can't allocate memory" on Linux and macOS, "...: not
    enough memory" on Windows, "std::bad_alloc" from C++ code), and Python its MemoryError (as
    memory_estimate.check_cpu_memory raises it)."""
    return next(
        (
            x
            for x in _chain(e)
            if isinstance(x, (torch.OutOfMemoryError, MemoryError))
            or (isinstance(x, RuntimeError) and "DefaultCPUAllocator" in str(x) and "memory" in str(x))
            or (isinstance(x, RuntimeError) and "std::bad_alloc" in str(x))  # C++'s, under a ulimit
        ),
        None,
    )


def run(
    cfg: TrainConfig,
    label: str = "run",
    callback: Callable[[int, RunResult], None] | None = None,
    model: torch.nn.Module | None = None,
    **trainer_kwargs,
) -> RunResult:
    """train(), but an out-of-memory error becomes a result with status "oom": the memory is freed and the
    caller (a notebook, the ladder) carries on."""
    try:
        return Trainer(cfg, model, **trainer_kwargs).fit(label, callback)
    except Exception as e:  # noqa: BLE001 - what is not an out-of-memory is raised again
        reason = out_of_memory_reason(e)
        if reason is None:
            raise
    free_memory()  # outside the except block: the failed run's frames are gone (unless_it_fails says why)
    return RunResult.failed(cfg, label, "oom", reason)


def out_of_memory_reason(e: BaseException) -> str | None:
    """ "out of memory: <the error's first line>" where e is one (out_of_memory), else None."""
    oom = out_of_memory(e)
    return None if oom is None else "out of memory: " + str(oom).splitlines()[0][:200]


def unless_it_fails(
    attempt: Callable[[], object], reason: Callable[[BaseException], str | None] = out_of_memory_reason
) -> tuple[object, str | None]:
    """(attempt(), None), or, where it raised an exception that `reason` names (out of memory by default), (None, that
    name) with the memory freed; any other exception is raised."""
    try:
        return attempt(), None
    except Exception as e:  # noqa: BLE001 - what `reason` does not name is re-raised
        why = reason(e)
        if why is None:
            raise
    # Leaving the except block drops `e`, its traceback and the failed run's frames (the model, the activations), so
    # their memory can be freed now; one held past it would tie them to this frame in a cycle that outlives the return.
    free_memory()
    return None, why


def catching_oom(attempt: Callable[[], RunResult], cfg: TrainConfig, label: str) -> RunResult:
    """attempt(), or, when it runs out of memory, a result with status "oom" and the memory freed."""
    result, reason = unless_it_fails(attempt)
    return result if reason is None else RunResult.failed(cfg, label, "oom", reason)
