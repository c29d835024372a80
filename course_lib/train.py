"""The one training loop. Every technique reaches it through techniques.build(), and every measurement through
a measurement object with a no-op twin, so there is one code path:

    for each optimizer step:
        for each micro-batch:        (gradient accumulation; 1 micro-batch when it is off)
            forward + loss under autocast (a no-op context in fp32)
            backward of loss scaled by the GradScaler (a no-op scaler unless fp16)
        unscale, global-norm clip, optimizer step, scaler update, zero_grad, LR schedule step

(The micro-batch loop is `setup.forward_backward`, techniques.accumulate_micro_batches; pipeline parallelism
replaces it with its schedule, which runs the micro-batches' forwards and backwards across the stages.)

`Trainer(cfg, model)` builds (the course's GPT by default, or any module that maps inputs to logits) and
exposes what it built (`.setup`) before `fit()` trains; `train(cfg, ...)` is the two in one call, and `run`
turns an out-of-memory error into a result.
"""

from __future__ import annotations

import copy
import gc
import math
import os
from typing import Callable

import torch

from . import capabilities as caps_mod, cpu_allocator, data as data_mod, measure, memory_formula, techniques
from .config import ConfigError, TrainConfig
from .model import GPT
from .results import RunResult, provenance
from .techniques.torch_compile import uses_cuda_graphs

Batches = Callable[[int], list[tuple[torch.Tensor, torch.Tensor]]]


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


def run_step(
    setup: techniques.Setup,
    cfg: TrainConfig,
    params: list[torch.Tensor],
    micro: list[tuple[torch.Tensor, torch.Tensor]],
    meter: measure.NotMeasured = measure.NOT_MEASURED,
    n_targets: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """One optimizer step over its micro-batches, watched by `meter` (a no-op unless it measures).
    Returns (loss per target token, gradient norm before clipping, learning rate used, loss scale used).
    `n_targets` defaults to the count of non-padding targets (give it where tensors hold no values: FakeTensorMode)."""
    # Normalise by the count of real target tokens in the whole accumulated batch, not per micro-batch:
    # a mean of micro-batch means is wrong when micro-batches hold different numbers of padding tokens.
    if n_targets is None:
        n_targets = sum(data_mod.count_targets(y) for _, y in micro)
    with meter.watching(setup):
        setup.begin_step()  # where compile replays CUDA graphs: a new step begins (techniques.torch_compile)
        step_loss = setup.forward_backward(setup, micro, n_targets, meter)  # techniques.accumulate_micro_batches
        with meter.phase("backward"):
            setup.sync_gradients()  # DDP by hand (data_parallel="bucketed"): its last all-reduces; else nothing
        with meter.phase("optimizer"):
            norm, lr, scale = techniques.optimizer_step(setup, cfg, params, on_grads=meter.on_grads)
    return step_loss, norm, lr, scale


class Trainer:
    """The one training loop, built for one config.

    model: the course's GPT of cfg.model by default; any module mapping inputs to logits works (notebook 09
      trains an MLP), with `parts` saying what the techniques may need (its blocks, body and output layer).
    batches(step) -> [(x, y), ...]: the micro-batches of a step; by default random windows of the course's text.
    flops_per_token: by default the GPT formula for a GPT, else counted once with FlopCounterMode.
    After construction `.setup` holds what was built (model, loss module, optimizer, ...), so a caller can look
    at it or hook into it (DDP's communication hook) before `fit()`.
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
        if model is None and parts is None and batches is None:  # the course's GPT on cfg's batches, as the formula
            check_cpu_memory(cfg)
        torch.manual_seed(cfg.seed)
        self.cfg, self.dev = cfg, torch.device(cfg.device)
        if splits is None and (batches is None or cfg.eval_every):
            splits = data_mod.load_splits()
        if model is None and splits is not None and cfg.model.vocab_size < splits.vocab_size:
            raise ConfigError(
                f"model vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {splits.vocab_size} "
                "tokens: raise vocab_size"
            )
        self.splits = splits
        self.batches = batches or data_mod.random_batches(splits.train, cfg, cfg.seed)
        # CUDA: what is already allocated (an earlier run's leftovers, the notebook's tensors, cuBLAS's workspaces)
        # is not this run's.
        measure.warm_up_cuda_libraries(self.dev)
        self.cuda_baseline = torch.cuda.memory_allocated(self.dev) if self.dev.type == "cuda" else 0
        self.cuda_reserved_baseline = torch.cuda.memory_reserved(self.dev) if self.dev.type == "cuda" else 0
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

    def _count_flops_per_token(self, x: torch.Tensor, y: torch.Tensor) -> int:
        """FlopCounterMode over one forward and backward, on a copy of the model (its gradients stay untouched)."""
        return measure.counted_flops_per_token(
            copy.deepcopy(self.setup.model), x, lambda out: techniques.loss_sum(out, y), tokens=y.numel()
        )

    def fit(self, label: str = "run", callback: Callable[[int, RunResult], None] | None = None) -> RunResult:
        """Train `cfg.steps` optimizer steps and return what was measured. `callback(step, result)` is called after
        every step (progress bars); it may raise StopRun to end the run early (the ladder gives up on a rung that is
        far slower than the best loop so far), and the result then holds the steps taken, with the reason."""
        result = self._start(label)
        try:
            for step in range(self.cfg.steps):
                self.step()
                if not math.isfinite(result.losses[-1]):  # nothing after a non-finite loss is training: say so and stop
                    result.status = "diverged"
                    result.reason = (
                        f"diverged: the loss became {result.losses[-1]} at step {step} "
                        f"(learning rate {result.lrs[-1]:g}): "
                        "lower lr, or add warm-up (lr_warmup_steps) or clipping (clip_norm)"
                    )
                if callback:
                    callback(step, result)
                if result.status == "diverged":
                    break
        except StopRun as stop:
            result.stopped_early = str(stop)
        return self._finish()

    def _start(self, label: str) -> RunResult:
        cfg, dev = self.cfg, self.dev
        self.params = params = list(self.setup.model.parameters())
        self.result = RunResult(
            label=label,
            status="ok",
            config=cfg.to_dict(),
            provenance=provenance(self.caps.name),
            n_params=sum(p.numel() for p in {id(p): p for p in params}.values()),
            flops_per_token=self.flops_per_token,
        )
        self._timer = measure.StepTimer(dev)
        self._ledger_step = cfg.steps - 1 if (dev.type == "cpu" and cfg.measure_memory) else None
        self._excluded = set(range(min(cfg.timing_warmup, cfg.steps))) | (
            {self._ledger_step} if self._ledger_step is not None else set()
        )
        if len(self._excluded) >= cfg.steps:
            raise ConfigError(
                f"steps={cfg.steps} leaves no step to time after {cfg.timing_warmup} warm-up step(s)"
                f"{' and the memory-ledger step' if self._ledger_step is not None else ''}: "
                f"raise steps to at least {len(self._excluded) + 1}"
            )
        self._ledger = measure.LedgerMeasurement(self.setup.parts.head) if self._ledger_step is not None else None
        self._cuda_peak = self._cuda_reserved = None
        return self.result

    def is_timed(self, step: int) -> bool:
        """Whether step `step` of the run counts in its timing: not a warm-up step, not the memory-ledger step."""
        return step not in self._excluded

    def step(self) -> float:
        """One optimizer step, the loop's one step body; returns its time in seconds. While fit() runs, the step is
        recorded in the run's result (loss, gradient norm, time; the memory ledger on its step). After the run, a
        caller may take more steps to time this loop beside another one (course_lib.ladder pairs them): those are
        timed the same way and recorded nowhere."""
        cfg, dev, setup, result = self.cfg, self.dev, self.setup, self.result
        step = self.step_index
        recording = result is not None
        micro = [(x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)) for x, y in self.batches(step)]
        if not micro:
            raise ConfigError(
                f"batches({step}) returned no micro-batches: it must return a list of (inputs, targets) pairs, "
                "one per micro-batch (cfg.grad_accum_steps of them)"
            )
        if recording and step == 0:
            result.tokens_per_step = sum(y.numel() for _, y in micro)  # padding included
            result.flops_per_token = self.flops_per_token = self.flops_per_token or self._count_flops_per_token(
                *micro[0]
            )
        # CUDA: the allocator's peak over this run's own timed steps, each read on its own, so that another loop's steps
        # taken in between (the ladder's pairs) never count in it. Under CUDA graphs it is the reserved peak (see
        # measure.cuda_memory_report), which does hold what the allocator kept cached from before: what compiling left
        # is returned before the first timed step; another loop's cached blocks (a ladder's pairs) would count in it.
        first_timed = min(cfg.timing_warmup, cfg.steps - 1)
        cuda_peak = recording and dev.type == "cuda" and step >= first_timed
        if cuda_peak:
            if step == first_timed and uses_cuda_graphs(cfg):
                torch.cuda.empty_cache()  # the graphs' pool is in use, and stays
            torch.cuda.reset_peak_memory_stats(dev)
        meter = self._ledger if recording and step == self._ledger_step else measure.NOT_MEASURED
        timer = self._timer if recording else measure.StepTimer(dev)
        faults_before = cpu_allocator.page_faults()
        with techniques.matmul_precision(cfg.precision), timer.step():
            step_loss, norm, lr, scale_before = run_step(setup, cfg, self.params, micro, meter)
        # the pages this step had the kernel map in (a CPU's memory handed back and fetched again: keep_freed_memory)
        self.last_step_faults = None if faults_before is None else cpu_allocator.page_faults() - faults_before
        self.step_index += 1
        seconds = timer.times[-1]
        if not recording:
            return seconds
        if cuda_peak:
            self._cuda_peak = max(self._cuda_peak or 0, torch.cuda.max_memory_allocated(dev))
            self._cuda_reserved = max(self._cuda_reserved or 0, torch.cuda.max_memory_reserved(dev))
        # Read values back only after the timed region.
        result.losses.append(step_loss.item())
        result.grad_norms.append(norm.item())
        result.lrs.append(lr)
        if setup.scaler.is_enabled():
            result.loss_scales.append(scale_before)
            if setup.scaler.get_scale() < scale_before:
                result.skipped_optimizer_steps += 1
        if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step == cfg.steps - 1):
            result.val_losses.append((step, evaluate(setup.model, self.splits.val, cfg, cfg.eval_batches)))
        result.step_times = list(timer.times)
        return seconds

    def _finish(self) -> RunResult:
        """The run's summary from its recorded steps; after it, step() records nothing."""
        cfg, dev, setup, result = self.cfg, self.dev, self.setup, self.result
        taken = len(result.step_times)
        excluded = {i for i in self._excluded if i < taken}
        result.excluded_steps = sorted(excluded)
        if result.status == "diverged":  # its times are recorded; no speed, MFU or memory is reported for it
            self.result = None
            return result
        if taken == len(excluded):
            raise ConfigError(
                f"the run {result.label!r} stopped after {taken} step(s), before any timed step: {result.stopped_early}"
            )
        if note := cpu_allocator.not_glibcs_own_rule(cfg.device, cfg.keep_freed_memory):
            result.details["allocator"] = note  # shown as the run's note (RunResult.note) in a panel's table
        result.median_step_s = measure.median_excluding(result.step_times, excluded)
        result.tokens_per_s = result.tokens_per_step / result.median_step_s
        if cfg.compile:
            result.compile_s = max(0.0, result.step_times[0] - result.median_step_s)
        result.mfu, result.mfu_basis = caps_mod.efficiency(
            result.tokens_per_s, result.flops_per_token, cfg.device, cfg.precision
        )
        if self._ledger is not None and taken > self._ledger_step:
            result.memory = self._ledger.report().to_dict()
        elif dev.type == "cuda" and self._cuda_peak is not None:
            # With set_to_none=False the gradients live through the whole step, so they are at the peak at full
            # size. With set_to_none=True they exist only from backward on, and the allocator cannot say whether
            # the peak fell before or after: they are "not measured" (inside "other") rather than guessed.
            static: dict = measure.static_bytes(setup.model, setup.optimizer, gradients_at_parameter_size=True)
            static["gradients"] = None if cfg.set_to_none else static["gradients"]
            result.memory = measure.cuda_memory_report(
                dev,
                static,
                peak=self._cuda_peak,
                baseline=self.cuda_baseline,
                reserved=self._cuda_reserved,
                cuda_graphs=uses_cuda_graphs(cfg),
                reserved_baseline=self.cuda_reserved_baseline,
            ).to_dict()
        self.result = None
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


def free_memory() -> None:
    gc.collect()
    cpu_allocator.give_back()  # the heap's free memory to the kernel (all of it after a run that kept freed memory)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _chain(e: BaseException):
    while e is not None:
        yield e
        e = e.__cause__ or e.__context__


def check_cpu_memory(cfg: TrainConfig) -> None:
    """On a CPU, a MemoryError (an out-of-memory the callers report as "oom") before anything is allocated, where the
    memory formula (memory_formula.estimate, notebook 02) puts a step's peak above what this machine has free: past
    that, Linux kills the process rather than fail an allocation, and the result and the notebook's kernel with it."""
    if torch.device(cfg.device).type != "cpu" or (free := measure.available_cpu_memory()) is None:
        return
    free //= int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # torchrun's processes on this machine share what is free
    try:
        need = memory_formula.estimate(cfg).peak_bytes
    except Exception:  # noqa: BLE001 - a config the formula does not model: the allocator is left to say
        return
    if need > free:
        raise MemoryError(
            f"a step needs about {need / measure.GiB:,.1f} GiB (notebook 02's formula), {free / measure.GiB:,.1f} GiB "
            "are free here: not started (the system would kill the process); lower batch_size or context, or add "
            "grad_accum_steps"
        )


def out_of_memory(e: BaseException) -> BaseException | None:
    """The out-of-memory error in `e`'s chain (compile may wrap it), or None. CUDA raises torch.OutOfMemoryError; a
    CPU's allocator a plain RuntimeError ("DefaultCPUAllocator: can't allocate memory" on Linux and macOS, "...: not
    enough memory" on Windows, "std::bad_alloc" from C++ code), and Python its MemoryError (check_cpu_memory's too)."""
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


def run(cfg: TrainConfig, label: str = "run", **kwargs) -> RunResult:
    """train(), but an out-of-memory error becomes a result with status "oom": the memory is freed and the
    caller (a notebook, the ladder) carries on."""
    return catching_oom(lambda: train(cfg, label, **kwargs), cfg, label)


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
    if reason is None:
        return result
    return RunResult(
        label=label,
        status="oom",
        config=cfg.to_dict(),
        provenance=provenance(measure.device_name(cfg.device)),
        reason=reason,
    )
