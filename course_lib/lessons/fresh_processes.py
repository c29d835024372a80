"""Timing a setting that belongs to the process, not to the loop (keeping freed memory: glibc's malloc), the one way
that gives each setting what a program of its own gets: each run in a fresh Python process, the settings taking turns.
Two loops timed step for step in one process share one allocator, and glibc's own rule cannot be had back once mallopt
has changed it (techniques.keep_freed_memory says what that did to a climb). Notebook 02 uses it.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from dataclasses import dataclass

from ..config import TrainConfig

# One process's run: the course's loop for `steps` steps, each step's seconds and page faults, as JSON on the last line.
_RUN = """
import json, sys
from course_lib.config import TrainConfig
from course_lib.train import Trainer
exec(sys.argv[3])  # the label's `before`: a change to the process made before its loop is built, or nothing
trainer = Trainer(TrainConfig.from_dict(json.loads(sys.argv[1])))
steps = [(trainer.step(), trainer.last_step_faults) for _ in range(int(sys.argv[2]))]
print(json.dumps(steps))
"""


@dataclass
class ProcessRuns:
    """One setting's runs, each in a fresh process: the timed steps' (seconds, page faults), all processes' together."""

    steps: list[tuple[float, int | None]]

    @property
    def median_ms(self) -> float:
        return statistics.median(s for s, _ in self.steps) * 1e3

    @property
    def median_faults(self) -> float | None:
        faults = [f for _, f in self.steps if f is not None]
        return statistics.median(faults) if faults else None


def time_in_fresh_processes(
    configs: dict[str, TrainConfig],
    steps: int,
    warmup: int = 2,
    rounds: int = 1,
    timeout_s: float = 600,
    before: dict[str, str] | None = None,
) -> dict[str, ProcessRuns]:
    """Each config of `configs` {label: config} trained for `warmup` + `steps` steps in a process of its own, the
    configs taking turns for `rounds` rounds (so that a machine slowing down over the minutes slows each alike); the
    last `steps` of each process are timed. `before` {label: Python source} runs in that label's processes before
    the loop is built (e.g. "from course_lib.lessons.attention_by_hand import use_query_blocks; use_query_blocks(4)").
    A run that fails raises RuntimeError with its process's last lines."""
    before = before or {}
    unknown = set(before) - set(configs)
    if unknown:
        raise ValueError(f"before names {sorted(unknown)}, which are not among the configs' labels {list(configs)}")
    out = {label: ProcessRuns([]) for label in configs}
    for _ in range(rounds):
        for label, cfg in configs.items():
            proc = subprocess.run(
                [sys.executable, "-c", _RUN, json.dumps(cfg.to_dict()), str(warmup + steps), before.get(label, "")],
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
            if proc.returncode != 0:
                raise RuntimeError(f"{label!r}: its process failed: {proc.stderr.strip()[-600:]}")
            ran = json.loads(proc.stdout.strip().splitlines()[-1])
            out[label].steps += [(float(s), f) for s, f in ran[warmup:]]
    return out
