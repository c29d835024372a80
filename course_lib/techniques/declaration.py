"""How a technique is declared: once, in its own module, as a `Technique`: its config field, ladder rungs and panel
control, and the functions the course calls through the registry (a device's probe, a config's check, its memory)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..capabilities import Support
from ..config import TrainConfig, get_setting, with_setting

# What a technique is for: the ladder keeps a speed technique only where it made the step faster on this device, a
# memory technique only where it made the peak smaller (course_lib.ladder.judge).
SPEED, MEMORY = "speed", "memory"
# The 16-bit rung's value before a device is known: the format that device runs fast (Capabilities.fast_16bit).
FAST_16BIT = "fast 16-bit"


@dataclass(frozen=True)
class Technique:
    """A speed or memory technique: one config field, off in the naive loop, switched on by its ladder rungs."""

    field: str  # a TrainConfig field, or "model.<field>" for a ModelConfig field
    label: str  # the panel's name for it
    off: object  # its value in the naive loop
    help: str  # one sentence: what it does (the panel's tooltip)
    rungs: tuple[tuple[str, object, str], ...] = ()  # the ladder's rungs: (name, value, what it changes), in order
    choices: tuple = ()  # what the panel offers (empty: a checkbox for a bool, the Literal's values otherwise)
    aims: tuple[str, ...] = (SPEED,)  # what it is for: SPEED, MEMORY or both
    probe: Callable[[torch.device], Support] | None = None  # whether a device runs it (None: every device does)
    check: Callable[[TrainConfig], str] | None = None  # why a config cannot use it as set, or "" (None: no check)
    # {term: (ledger category, bytes)} it adds to every moment of a step's peak (None: none, or counted elsewhere)
    memory: Callable[[TrainConfig], dict[str, tuple[str, int]]] | None = None
    memory_note: str = ""  # why switching it on does not move the estimate, where it does not
    no_rung: str = ""  # for a technique with no ladder rung: why (the ladder's refusal of a --rung-value says it)

    @property
    def on_values(self) -> tuple:
        """The values that switch it on, as the panel offers them (True for a checkbox)."""
        if self.off is False:
            return (True,)
        return tuple(v for v in self.choices or [r[1] for r in self.rungs] if v != self.off)

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
        """The config one rung up; `value` replaces the rung's own (a ladder option, or the format FAST_16BIT stands
        for on a device). FAST_16BIT unresolved means bf16, the format most devices run."""
        if self.technique is None:
            return cfg
        value = self.value if value is None else value
        return self.technique.set(cfg, "bf16" if value == FAST_16BIT else value)
