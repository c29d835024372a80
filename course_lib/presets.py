"""Every preset by name, `auto` among them. The named presets are plain functions in config; `auto` picks, on a GPU, a
model and batch where arithmetic sets the pace (GPT-2 small's shape where it fits, a batch whose naive fp32 step fits
with headroom by the memory estimate, something smaller on a small GPU) and says why; on a CPU it is `cpu`. It sits
here, above the memory estimate it asks, so that config stays at the bottom."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .config import (
    PRESETS,
    ConfigError,
    TrainConfig,
    check_device,
    cpu_preset,
    default_device,
    gpt2_small_preset,
    preset as named_preset,
)
from .memory_formula import estimate

PRESET_NAMES = ("auto", *PRESETS)


def preset(name: str, device: str | None = None) -> TrainConfig:
    """The preset `name` on `device`: `auto` (sized to the device) or one of config's named presets."""
    if name not in PRESET_NAMES:
        raise ConfigError(f"Unknown preset {name!r}: choose one of {', '.join(PRESET_NAMES)}")
    return auto_preset(device) if name == "auto" else named_preset(name, device)


@dataclass(frozen=True)
class DeviceDescription:
    """What `auto` needs to know about a device, so that its choice can be tested with made-up devices."""

    type: str  # "cpu", "cuda" or "mps"
    name: str
    total_memory: int = 0  # bytes (a GPU's; 0 where the course does not size by it)

    @property
    def memory_gib(self) -> float:
        return self.total_memory / 1024**3


def describe_device(device: str | None = None) -> DeviceDescription:
    """This machine's `device` as auto_choice reads it."""
    dev = torch.device(check_device(device or default_device()))
    if dev.type != "cuda":
        return DeviceDescription(type=dev.type, name=dev.type)
    if not torch.cuda.is_available():
        raise ConfigError(f"device={device!r}: torch sees no CUDA GPU on this machine; use 'cpu'")
    props = torch.cuda.get_device_properties(dev)
    return DeviceDescription(
        type="cuda",
        name=props.name,
        total_memory=props.total_memory,
    )


# auto's candidates, most work per step first: GPT-2 small's shape, then half of it (6 blocks of width 512, the same
# head size, vocabulary and context). Below 8 sequences of 1024 tokens a GPT-2-sized step leaves a GPU's arithmetic
# idle; more than 16 only makes every run of the course longer.
AUTO_SHAPES = {
    "GPT-2 small": dict(n_layer=12, n_head=12, n_embd=768),
    "half GPT-2 small": dict(n_layer=6, n_head=8, n_embd=512),
}
AUTO_BATCHES = {"GPT-2 small": (16, 8), "half GPT-2 small": (16, 8, 4, 2, 1)}
# naive fp32's predicted peak must leave this share of the GPU free: the CUDA context, the caching allocator's reserve
# above the peak, and the rungs that hold a little more than naive (16-bit weight copies)
AUTO_HEADROOM = 0.25


@dataclass(frozen=True)
class AutoChoice:
    config: TrainConfig
    reason: str  # one line: the device, its memory, the model and batch chosen, and why


def auto_choice(desc: DeviceDescription, device: str | None = None) -> AutoChoice:
    """`auto`'s pick for a device: on a CPU (or MPS) the `cpu` preset; on a CUDA GPU the first of AUTO_SHAPES x
    AUTO_BATCHES whose naive fp32 step the memory estimate (memory_formula.estimate) predicts to fit in the GPU's
    memory with AUTO_HEADROOM to spare; where none does, the `cpu` preset's small model. A pure function of `desc`."""
    device = device or desc.type
    if desc.type != "cuda":
        return AutoChoice(cpu_preset(device), f"auto: preset cpu on {desc.name} (sized for a laptop CPU)")
    room = desc.memory_gib * (1 - AUTO_HEADROOM)
    for shape, changes in AUTO_SHAPES.items():
        base = gpt2_small_preset(device).with_model(**changes)
        for batch in AUTO_BATCHES[shape]:
            cfg = replace(base, batch_size=batch)
            peak = estimate(cfg).peak_gib
            if peak <= room:
                return AutoChoice(
                    cfg,
                    f"auto: {shape} ({cfg.model.n_layer} blocks, width {cfg.model.n_embd}), batch {batch}, context "
                    f"{cfg.context} on {desc.name} ({desc.memory_gib:.1f} GiB): naive fp32's step needs {peak:.1f} "
                    f"GiB by the memory estimate, within the {room:.1f} GiB ({1 - AUTO_HEADROOM:.0%}) auto allows",
                )
    return AutoChoice(
        cpu_preset(device),
        f"auto: preset cpu's small model on {desc.name} ({desc.memory_gib:.1f} GiB): even half GPT-2 small at batch 1 "
        f"needs more than {room:.1f} GiB by the memory estimate",
    )


def auto_preset(device: str | None = None) -> TrainConfig:
    """The model and batch sized to this device (auto_choice; auto_reason says why)."""
    return auto_choice(describe_device(device), device).config


def auto_reason(device: str | None = None) -> str:
    """One line: which model and batch `auto` chose on this device, and why."""
    return auto_choice(describe_device(device), device).reason
