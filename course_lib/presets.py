"""Every preset by name, `auto` among them: on a GPU, `auto` picks a model and batch where arithmetic sets the pace and
says why; on a CPU it is `cpu`. It sits above the memory estimate it asks, so that config stays at the bottom."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from . import config
from .config import PRESETS, ConfigError, TrainConfig, check_device, cpu_preset, default_device, gpt2_small_preset
from .memory_formula import estimate

PRESET_NAMES = ("auto", *PRESETS)


def preset(name: str, device: str | None = None) -> TrainConfig:
    """The preset `name` on `device`: `auto` (sized to the device) or one of config's named presets."""
    return auto_preset(device) if name == "auto" else config.preset(name, device)


@dataclass(frozen=True)
class DeviceDescription:
    """What `auto` needs to know about a device, so that its choice can be tested with made-up devices."""

    type: str  # "cpu", "cuda" or "mps"
    name: str
    total_memory: int = 0  # bytes (a GPU's; 0 where the course does not size by it)


def describe_device(device: str | None = None) -> DeviceDescription:
    dev = torch.device(check_device(device or default_device()))
    if dev.type != "cuda":
        return DeviceDescription(dev.type, dev.type)
    if not torch.cuda.is_available():
        raise ConfigError(f"device={device!r}: torch sees no CUDA GPU on this machine; use 'cpu'")
    props = torch.cuda.get_device_properties(dev)
    return DeviceDescription("cuda", props.name, props.total_memory)


# auto's candidates, most work per step first: GPT-2 small's shape, then half of it (same head size, vocabulary and
# context). Below 8 sequences of 1024 tokens a GPT-2-sized step leaves a GPU idle; above 16 only makes runs longer.
AUTO_SHAPES = {
    "GPT-2 small": dict(n_layer=12, n_head=12, n_embd=768),
    "half GPT-2 small": dict(n_layer=6, n_head=8, n_embd=512),
}
AUTO_BATCHES = {"GPT-2 small": (16, 8), "half GPT-2 small": (16, 8, 4, 2, 1)}
# the share of the GPU naive fp32's predicted peak leaves free: the CUDA context, the allocator's reserve, 16-bit copies
AUTO_HEADROOM = 0.25


@dataclass(frozen=True)
class AutoChoice:
    config: TrainConfig
    reason: str  # one line: the device, its memory, the model and batch chosen, and why


def auto_choice(desc: DeviceDescription, device: str | None = None) -> AutoChoice:
    """`auto`'s pick, a pure function of `desc`: on a CUDA GPU the first of AUTO_SHAPES x AUTO_BATCHES whose naive fp32
    step fits with AUTO_HEADROOM to spare by the memory estimate (else the `cpu` preset's model); elsewhere `cpu`."""
    device = device or desc.type
    if desc.type != "cuda":
        return AutoChoice(cpu_preset(device), f"auto: preset cpu on {desc.name} (sized for a laptop CPU)")
    gib = desc.total_memory / 1024**3
    room = gib * (1 - AUTO_HEADROOM)
    for shape, changes in AUTO_SHAPES.items():
        for batch in AUTO_BATCHES[shape]:
            cfg = replace(gpt2_small_preset(device).with_model(**changes), batch_size=batch)
            if (peak := estimate(cfg).peak_gib) <= room:
                return AutoChoice(
                    cfg,
                    f"auto: {shape} ({cfg.model.n_layer} blocks, width {cfg.model.n_embd}), batch {batch}, context "
                    f"{cfg.context} on {desc.name} ({gib:.1f} GiB): naive fp32's step needs {peak:.1f} "
                    f"GiB by the memory estimate, within the {room:.1f} GiB ({1 - AUTO_HEADROOM:.0%}) auto allows",
                )
    return AutoChoice(
        cpu_preset(device),
        f"auto: preset cpu's small model on {desc.name} ({gib:.1f} GiB): even half GPT-2 small at batch 1 "
        f"needs more than {room:.1f} GiB by the memory estimate",
    )


def auto_preset(device: str | None = None) -> TrainConfig:
    return auto_choice(describe_device(device), device).config


def auto_reason(device: str | None = None) -> str:
    """One line: which model and batch `auto` chose on this device, and why."""
    return auto_choice(describe_device(device), device).reason
