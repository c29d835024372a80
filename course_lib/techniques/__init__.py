"""The techniques, one module each (declaration, application, memory terms), and TECHNIQUES, their registry in ladder
order. Adding one: its module, its entry in TECHNIQUES, its config field, its test (tests/test_technique_registry.py).
"""

from __future__ import annotations

import functools

from .. import capabilities
from ..config import ConfigError, TrainConfig, did_you_mean
from . import (
    activation_checkpointing,
    chunked_loss,
    fused_adamw,
    fused_attention,
    keep_freed_memory,
    mixed_precision,
    set_to_none,
    torch_compile,
    vocab_padding,
)

# The modules' public names, for `techniques.X` (course_lib.train, the notebooks and the tests use them).
from .assemble import Setup, build  # noqa: F401
from .chunked_loss import HeadLossInSlices, loss_sum  # noqa: F401
from .clipping import clip_by_tensor_norm  # noqa: F401
from .data_parallel import SyncOnLastMicroBatch, apply_data_parallel, shard_with_fsdp2  # noqa: F401
from .declaration import FAST_16BIT, MEMORY, SPEED, Rung, Technique  # noqa: F401
from .lr_schedule import lr_at, make_scheduler, warmup_cosine_lr  # noqa: F401
from .mixed_precision import AUTOCAST_RUNG, autocast_context, make_grad_scaler, matmul_precision  # noqa: F401
from .model_parts import ModelParts  # noqa: F401
from .optimizer import make_optimizer, optimizer_for, param_groups  # noqa: F401

TECHNIQUES: tuple[Technique, ...] = (
    mixed_precision.TECHNIQUE,
    fused_attention.TECHNIQUE,
    torch_compile.TECHNIQUE,
    vocab_padding.TECHNIQUE,
    fused_adamw.TECHNIQUE,
    set_to_none.TECHNIQUE,
    chunked_loss.TECHNIQUE,
    activation_checkpointing.TECHNIQUE,
    keep_freed_memory.TECHNIQUE,  # no rung: the process's setting (its module says why)
)


@functools.cache
def _derived(techniques: tuple[Technique, ...]) -> dict:
    """TECHNIQUE (by name), LADDER (naive fp32, then one change per rung, in TECHNIQUES' order) and RUNGS (by name)."""
    naive_rung = Rung("naive fp32", "plain fp32, naive attention, for-loop AdamW, gradients zeroed in place")
    ladder = (naive_rung, *(Rung(name, what, t, value) for t in techniques for name, value, what in t.rungs))
    return {"TECHNIQUE": {t.name: t for t in techniques}, "LADDER": ladder, "RUNGS": {r.name: r for r in ladder}}


def __getattr__(name: str):
    """TECHNIQUE, LADDER and RUNGS as TECHNIQUES makes them now (a test may add a technique)."""
    if name in ("TECHNIQUE", "LADDER", "RUNGS"):
        return _derived(TECHNIQUES)[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def module_of(t: Technique) -> str:
    """The module that declares `t` (what `python -m course_lib config` points a reader to)."""
    found = (m.__name__ for m in globals().values() if getattr(m, "TECHNIQUE", None) is t)
    return next(found, "declared outside course_lib.techniques")


capabilities.use_registry(lambda: TECHNIQUES)  # it probes each device for them and asks their checks


def check(cfg: TrainConfig) -> TrainConfig:
    """`cfg` when every technique's own check passes it, else a ConfigError that says what to change."""
    if found := capabilities.config_problems(cfg):
        raise ConfigError("; ".join(found))
    return cfg


def technique_named(name: str) -> Technique | None:
    """The technique `--set NAME=...` means, by its name or its config field; None for any other setting."""
    t = _derived(TECHNIQUES)["TECHNIQUE"].get(name.removeprefix("model."))
    return t if t is not None and name in (t.name, t.field) else None


# ---- the ladder, derived from the declarations -----------------------------------------------------------------


def naive(cfg: TrainConfig) -> TrainConfig:
    """The naive baseline of any config: every technique off."""
    for t in TECHNIQUES:
        cfg = t.set(cfg, t.off)
    return cfg


def check_rung_name(name) -> None:
    """A ConfigError, with "did you mean", unless `name` names a rung of the ladder ('compile' finds '+ compile')."""
    names = [r.name for r in _derived(TECHNIQUES)["LADDER"]]
    if name not in names:
        near = did_you_mean(name, names) or did_you_mean(f"+ {str(name).lstrip('+ ')}", names)
        raise ConfigError(f"{name!r} is not a rung of the ladder{near}; the rungs are {', '.join(map(repr, names))}")


def check_ladder_arguments(options: dict | None, leave_out: dict | None) -> None:
    """A ConfigError naming what is not a technique (`options`) or not a rung (`leave_out`) of the ladder."""
    options, leave_out = options or {}, leave_out or {}
    TECHNIQUE, names = _derived(TECHNIQUES)["TECHNIQUE"], [r.name for r in _derived(TECHNIQUES)["LADDER"]]
    if unknown := [k for k in options if k not in TECHNIQUE]:
        ladder = ", ".join(n for n, t in TECHNIQUE.items() if t.rungs)
        raise ConfigError(f"{unknown} are not techniques of the ladder; they are {ladder}")
    if unknown := [n for n in leave_out if n not in names]:
        raise ConfigError(f"{unknown} are not rungs of the ladder; the rungs are {names}")
    if names[0] in leave_out:
        raise ConfigError(f"{names[0]!r} is the baseline every rung is measured against: it cannot be left out")
    for name in options:
        if (rung := option_rung(name)) is None:
            raise ConfigError(
                f"--rung-value {name}=... is a technique with no rung of the ladder ({TECHNIQUE[name].no_rung}): the "
                "climb cannot switch it on; run it with `profile` or `export`, or in a panel"
            )
        if rung.name in leave_out:
            raise ConfigError(
                f"--rung-value {name}=... changes what the {rung.name!r} rung sets, and that rung is left out"
            )


def option_rung(technique: str) -> Rung | None:
    """The rung an option {technique: value} changes: its technique's last (precision=fp16: the 16-bit rung's)."""
    rungs = [r for r in _derived(TECHNIQUES)["LADDER"] if r.technique is not None and r.technique.name == technique]
    return rungs[-1] if rungs else None


def rung_up(cfg: TrainConfig, rung: Rung, caps, options: dict | None = None) -> TrainConfig | ConfigError:
    """`cfg` with `rung` switched on, or the ConfigError saying why the device cannot run it; `options` replace what
    a technique's last rung sets. caps=None: a device not on this machine (only the techniques' checks; bf16)."""
    last = rung.technique is not None and rung is option_rung(rung.technique.name)
    value = (options or {}).get(rung.technique.name) if last else None
    if caps is not None and value is None and rung.value == FAST_16BIT:
        value = caps.fast_16bit()[0] or "bf16"  # bf16 where neither runs fast: the ladder then measures that cost
    try:
        up = check(rung.apply(cfg, value))  # a combination no device can run (fused AdamW without AdamW)
        return up if caps is None else caps.require(up)
    except ConfigError as e:
        return e
