"""How a technique is declared: once, in its own module of course_lib.techniques, as a `Technique` (a speed or memory
technique: the ladder climbs it, the panel offers it, naive() turns it off) or a `Setting` (part of every training
run: the optimizer, its schedule, clipping, accumulation, data parallelism). Each declaration names its config field,
and the functions of its module that the rest of the course calls: the piece of the exported script it writes
(`export`), and, for a technique, its term in the memory estimate (`memory_term`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..config import TrainConfig, get_setting, with_setting

# What a technique is for: the ladder keeps a speed technique only where it made the step faster on this device, a
# memory technique only where it made the peak smaller (course_lib.ladder.judge).
SPEED, MEMORY = "speed", "memory"
# The precision rung's value before a device is known: the 16-bit format that device runs fast (bf16 where it has bf16
# hardware, fp16 where only fp16 is fast; capabilities.Capabilities.fast_16bit resolves it when a ladder starts).
FAST_16BIT = "fast 16-bit"


@dataclass(frozen=True)
class Technique:
    """A speed or memory technique: one config field, off in the naive loop, switched on by its ladder rungs (one with
    none says why in `no_rung`)."""

    field: str  # a TrainConfig field, or "model.<field>" for a ModelConfig field
    label: str  # the panel's name for it
    off: object  # its value in the naive loop
    help: str  # one sentence: what it does (the panel's tooltip)
    rungs: tuple[tuple[str, object, str], ...] = ()  # the ladder's rungs: (name, value, what it changes), in order
    choices: tuple = ()  # what the panel offers (empty: a checkbox for a bool, the Literal's values otherwise)
    aims: tuple[str, ...] = (SPEED,)  # what it is for: SPEED, MEMORY or both
    # Its term in the memory estimate: the function of its module that memory_estimate calls for it (by name: each term
    # enters the estimate at its own place in the step), or None, and then `memory_note` says why it has none.
    memory_term: Callable | None = None
    memory_note: str = ""
    no_rung: str = (
        ""  # for a technique with no rung of the ladder: why (the ladder's refusal of a --rung-value for it says it)
    )

    @property
    def name(self) -> str:
        return self.field.removeprefix("model.")

    def value(self, cfg: TrainConfig):
        return get_setting(cfg, self.field)

    def set(self, cfg: TrainConfig, value) -> TrainConfig:
        return with_setting(cfg, self.field, value)


@dataclass(frozen=True)
class Rung:
    """One rung of the ladder: a technique switched to one value (none for the naive start)."""

    name: str
    what_changed: str
    technique: Technique | None = None  # None: the naive start
    value: object = None  # what this rung sets the technique's field to

    @property
    def aims(self) -> tuple[str, ...]:
        return self.technique.aims if self.technique else ()

    def apply(self, cfg: TrainConfig, value=None) -> TrainConfig:
        """The config one rung up; `value` replaces the rung's own (a ladder option, e.g. selective checkpointing, or
        the format FAST_16BIT stands for on a device). FAST_16BIT unresolved means bf16, the format most devices run."""
        if self.technique is None:
            return cfg
        value = self.value if value is None else value
        return self.technique.set(cfg, "bf16" if value == FAST_16BIT else value)
