"""The panel's runs: configurations run one after another, each one's RunResult kept in a plain list (`results`), never
only in a widget.

A run that cannot go on does not stop the queue: running out of memory is a row with status "oom" (the failed run's
memory freed first, so the next run has it: course_lib.train.catching_oom), a ConfigError a "skipped" row with its
message, any other exception an "error" row with its type and first line. An interrupt (Kernel > Interrupt) is an
"interrupted" row, and then stops the queue and the cell, as an interrupt should. The queue knows no widget: it reports
to three optional callbacks, which the panel points at its progress bar, status line, table and figure.

    on_start(cfg, label)    a run begins
    on_step(done, steps)    after each step the runner reports (`callback(step, result)`, step counted from 0)
    on_result(result)       a result was kept (called after it is in `results`: whatever it raises loses nothing)
"""

from __future__ import annotations

from typing import Callable, Iterable

from .. import config as C
from ..memory_estimate import run_checked
from ..results import RunResult
from ..train import catching_oom, free_memory


def default_runner(cfg: C.TrainConfig, label: str, callback) -> RunResult:
    """The course's loop (course_lib.train.run), refused first on a CPU where the step would not fit (run_checked)."""
    return run_checked(cfg, label, callback=callback)


class RunQueue:
    """runner(cfg, label, callback, **extras) -> RunResult is what each run does (default: the course's loop)."""

    def __init__(
        self,
        runner: Callable[..., RunResult] | None = None,
        *,
        on_start: Callable[[C.TrainConfig, str], None] | None = None,
        on_step: Callable[[int, int], None] | None = None,
        on_result: Callable[[RunResult], None] | None = None,
    ):
        self.runner = runner or default_runner
        self.results: list[RunResult] = []
        self.on_start, self.on_step, self.on_result = on_start, on_step, on_result

    def next_number(self) -> int:
        """The number the next run's label starts with (#1 for the first)."""
        return len(self.results) + 1

    def keep(self, result: RunResult) -> RunResult:
        self.results.append(result)
        if self.on_result:
            self.on_result(result)
        return result

    def not_run(self, label: str, device: str, reason: str) -> RunResult:
        """A configuration that could not be made (invalid controls) kept as a "skipped" row with the reason."""
        return self.keep(RunResult.failed(None, label, "skipped", reason, device))

    def run(self, cfg: C.TrainConfig, label: str, **extras) -> RunResult:
        """Run one configuration and keep its result, whatever happened to it (module docstring)."""
        if self.on_start:
            self.on_start(cfg, label)

        def callback(step: int, _result: RunResult) -> None:
            if self.on_step:
                self.on_step(step + 1, cfg.steps)

        try:
            result = catching_oom(lambda: self.runner(cfg, label, callback, **extras), cfg, label)
        except KeyboardInterrupt:  # Kernel > Interrupt: a row says so, its memory is freed, and the cell stops
            why = "interrupted before it finished: run it again to measure it"
            self.keep(RunResult.failed(cfg, label, "interrupted", why))
            free_memory()
            raise
        except Exception as e:  # noqa: BLE001 - a run that fails is a row that says why; the queue goes on
            status = "skipped" if isinstance(e, C.ConfigError) else "error"
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            result = RunResult.failed(
                cfg, label, status, f"{type(e).__name__}: {first}" if status == "error" else first
            )
        if result.status == "error":
            free_memory()  # what the failed run held (its frames went with the exception): the next run has it
        return self.keep(result)

    def run_all(self, runs: Iterable[tuple[C.TrainConfig, str]], **extras) -> list[RunResult]:
        """Run each (config, label) in turn, one after another; every result is kept, an OOM's too."""
        return [self.run(cfg, label, **extras) for cfg, label in runs]

    def clear(self) -> None:
        self.results.clear()
