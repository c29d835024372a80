"""Configs as frozen dataclasses, checked at construction, and the named presets (each technique's field is explained
in its module of course_lib.techniques). `ModelConfig` says what the network is; `TrainConfig` how it is trained."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import difflib
import functools
import math
import numbers
import types
import typing
from dataclasses import dataclass, field, replace
from typing import Literal

import torch

Precision = Literal["fp32", "tf32", "bf16", "fp16"]
Attention = Literal["naive", "sdpa", "flash"]  # flash: the course's own, in PyTorch (course_lib.flash_attention)
Optimizer = Literal["adamw", "sgd", "sgd_momentum", "adagrad", "rmsprop"]
Schedule = Literal["constant", "cosine", "wsd", "inverse_sqrt", "exponential"]
CompileMode = Literal["default", "reduce-overhead", "max-autotune"]
Checkpointing = Literal["none", "selective", "full"]
ClipKind = Literal["global", "per_tensor"]

PRECISIONS = typing.get_args(Precision)
# The dtype each precision stores values in (TF32 is a matmul mode of fp32 values): the one map from name to dtype.
PRECISION_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CLIP_KINDS = typing.get_args(ClipKind)
_UNION = (typing.Union, types.UnionType)


class ConfigError(ValueError):
    """An invalid configuration; the message says what to change."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def did_you_mean(name, names) -> str:
    """ " (did you mean 'x'?)" for the closest of `names`, or ""."""
    close = difflib.get_close_matches(str(name), [str(n) for n in names], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


# The annotations are the declaration: __post_init__ checks each value against its field's type (a bool is not an int,
# a float is finite, a Literal one of its values) and parse_setting reads a value from text by the same type.
@functools.cache
def _field_types(cls) -> dict[str, object]:
    return typing.get_type_hints(cls)


def _check_fields(names, cls) -> None:
    """A ConfigError naming the closest field where one of `names` (a dict's keys) is no field of dataclass `cls`."""
    fields = _field_types(cls)
    if unknown := [k for k in names if k not in fields]:
        hint = did_you_mean(unknown[0], fields)
        raise ConfigError(f"{cls.__name__} has no field {unknown[0]!r}{hint}; its fields: {', '.join(fields)}")


def _conforms(value, hint) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in (int, float) and isinstance(value, bool):  # an int to Python, not to a config
        return False
    if hint is float:
        return isinstance(value, (int, float)) and math.isfinite(value)
    if hint is type(None):
        return value is None
    if origin is Literal:
        return isinstance(value, str) and value in args
    if origin in _UNION:
        return any(_conforms(value, a) for a in args)
    if origin is tuple:
        return isinstance(value, tuple) and len(value) == len(args) and all(map(_conforms, value, args))
    return isinstance(value, hint)


def _describe(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin in _UNION:
        return " or ".join("None (off)" if a is type(None) else _describe(a) for a in args)
    if origin is tuple:
        return f"{len(args)} numbers, e.g. (0.9, 0.95)"
    return {bool: "True or False", int: "an integer", float: "a finite number"}.get(hint, hint.__name__)


def _check_types(obj) -> None:
    for name, hint in _field_types(type(obj)).items():
        value = getattr(obj, name)
        if _conforms(value, hint):
            continue
        if typing.get_origin(hint) is Literal:
            raise ConfigError(f"{name}={value!r} is not {_describe(hint)}{did_you_mean(value, typing.get_args(hint))}")
        kind = type(value)  # a number of another library's type (numpy.int64 from an array) is not a Python number
        foreign = isinstance(value, numbers.Number) and kind.__module__ != "builtins"
        convert = f" (this one is a {kind.__module__}.{kind.__name__}: convert it with int() or float())"
        raise ConfigError(f"{name}={value!r}: {name} takes {_describe(hint)}{convert if foreign else ''}")


_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def parse_value(name: str, hint, text: str):
    """The value of a field of type `hint` written as text, or a ConfigError that says what the field takes."""
    t = text.strip()
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    bad = ConfigError(f"{name}={text!r}: {name} takes {_describe(hint)}")
    if origin in _UNION:
        if type(None) in args and t.lower() in ("none", "off", "null"):
            return None
        for a in (a for a in args if a is not type(None)):
            with contextlib.suppress(ConfigError):
                return parse_value(name, a, t)
        raise bad
    if hint is bool:
        _check(t.lower() in _TRUE + _FALSE, f"{name}={text!r}: {name} takes true or false (also on/off, yes/no, 1/0)")
        return t.lower() in _TRUE
    if origin is Literal:
        _check(t in args, f"{name}={text!r} is not one of {', '.join(map(repr, args))}{did_you_mean(t, args)}")
        return t
    try:
        if origin is tuple:
            value = ast.literal_eval(t if t.startswith("(") else f"({t},)")
            value = tuple(value) if isinstance(value, (tuple, list)) else None
        else:
            value = hint(t)  # int or float (str: the text itself)
    except (ValueError, SyntaxError):
        raise bad from None
    _check(_conforms(value, hint), str(bad))
    return value


def _owner(name: str) -> tuple[str, str, object]:
    """("train" or "model", the field's own name, its type) for a setting name (get_setting's)."""
    train, model = _field_types(TrainConfig), _field_types(ModelConfig)
    if name in train and name != "model":
        return "train", name, train[name]
    if (bare := name.removeprefix("model.")) in model:
        return "model", bare, model[bare]
    known = [*(k for k in train if k != "model"), *model, *(f"model.{k}" for k in model)]
    use = "use a TrainConfig field or a ModelConfig field (model.<field>, or its name)"
    raise ConfigError(f"{name!r} is not a setting: {use}{did_you_mean(name, known)}")


def get_setting(cfg: TrainConfig, name: str):
    """A setting's value: a TrainConfig field, or a ModelConfig one as "model.<field>" or bare (TrainConfig's first)."""
    where, field_name, _ = _owner(name)
    return getattr(cfg if where == "train" else cfg.model, field_name)


def with_setting(cfg: TrainConfig, name: str, value) -> TrainConfig:
    """cfg with one setting (get_setting's names) changed."""
    return with_settings(cfg, {name: value})


def with_settings(cfg: TrainConfig, settings: dict) -> TrainConfig:
    """cfg with every one of `settings` {name: value} changed in one step: only the whole new config is checked, so
    settings that hold only together are taken in any order (context=128 before model.block_size=128)."""
    changes, named = {"train": {}, "model": {}}, {}
    for name, value in settings.items():
        where, field_name, _ = _owner(name)
        if (where, field_name) in named:  # n_head and model.n_head: which one was meant?
            raise ConfigError(f"{named[where, field_name]} and {name} set the same field: give one of them")
        named[where, field_name] = name
        changes[where][field_name] = value
    if changes["model"]:
        changes["train"]["model"] = replace(cfg.model, **changes["model"])
    return replace(cfg, **changes["train"]) if changes["train"] else cfg


def parse_setting(name: str, text: str):
    """A setting's value from text (the command line's --set FIELD=VALUE), by its declared type."""
    return parse_value(name, _owner(name)[2], text)


def _must(obj, name: str, ok: bool, be: str) -> None:
    """A ConfigError "`name` must `be`, got its value" unless `ok`."""
    _check(ok, f"{name} must {be}, got {getattr(obj, name)!r}")


def _check_positive(obj, *names: str) -> None:
    for name in names:
        _must(obj, name, getattr(obj, name) >= 1, "be a positive int")


@dataclass(frozen=True)
class ModelConfig:
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    block_size: int = 512  # the longest context the position embedding covers
    vocab_size: int = 4097  # the course's Shakespeare BPE (4095 ranks + <|endoftext|> + <|pad|>)
    vocab_multiple: int = 1  # pad the embedding to a multiple of this (64 makes GPU kernels happier)
    attention: Attention = "naive"
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self):
        _check_types(self)
        _check_positive(self, "n_layer", "n_head", "n_embd", "block_size", "vocab_size", "vocab_multiple")
        whole = "change one so that n_embd/n_head is a whole head size"
        _check(self.n_embd % self.n_head == 0, f"n_head={self.n_head} must divide n_embd={self.n_embd}: {whole}")
        _must(self, "dropout", 0.0 <= self.dropout < 1.0, "be in [0, 1)")
        no_dropout = "attention='flash' (the course's flash attention) has no dropout: set dropout=0 or use 'sdpa'"
        _check(self.attention != "flash" or self.dropout == 0, no_dropout)

    @property
    def padded_vocab_size(self) -> int:
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple  # rounded up

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


DEVICE_TYPES = ("cpu", "cuda", "mps")  # where the course's loop, timing and memory statistics have a path


def check_device(device) -> str:
    """`device` as torch names it ('cuda:0'); a ConfigError for an unknown name or a type the course has no path for."""
    use = "use 'cpu', or 'cuda' on a machine with an NVIDIA GPU"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device={device!r} is not a torch device: {use}") from None
    only = f"the course runs on {', '.join(DEVICE_TYPES)} only"
    _check(dev.type in DEVICE_TYPES, f"device={device!r}: {only}, not on {dev.type!r}; {use}")
    return str(dev)


# TrainConfig's fields by section, in the class's order; a name is unique across them (replace() and --set use it).
SECTIONS: dict[str, tuple[str, ...]] = {
    section: tuple(names.split())
    for section, names in {
        "model": "model",
        "run": "device steps timing_warmup seed eval_every eval_batches measure_memory",
        "batch": "batch_size grad_accum_steps context",
        "precision": "precision loss_scale_init loss_scale_growth_interval",
        "speed and memory": "keep_freed_memory compile compile_mode fused_adamw activation_checkpointing loss_chunks "
        "set_to_none",
        "optimisation": "optimizer lr betas eps momentum weight_decay decay_2d_only schedule lr_warmup_steps "
        "min_lr_ratio clip_norm clip_kind",
        "parallelism": "data_parallel",
    }.items()
}


@dataclass(frozen=True)
class TrainConfig:
    """How a model is trained, by SECTIONS. Whether *this machine* can run it is asked by capabilities.require(cfg) when
    a run starts, not here: a config saved on a GPU must load on a laptop."""

    # -- model: the network's shape (ModelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    # -- run: where, how long, what is measured
    device: str = "cpu"
    steps: int = 10
    timing_warmup: int = 2  # steps left out of the timing (the first one also compiles)
    seed: int = 0
    eval_every: int = 0  # validation loss every this many steps (0: never)
    eval_batches: int = 4
    measure_memory: bool = True  # on a CPU, the last step runs under the memory ledger (and is not timed)
    # -- batch: batch_size sequences of `context` tokens per optimizer step, in grad_accum_steps micro-batches
    batch_size: int = 32
    grad_accum_steps: int = 1
    context: int = 512
    # -- precision (techniques.mixed_precision): fp16's loss scale, doubled after each growth interval of clean steps
    precision: Precision = "fp32"
    loss_scale_init: float = 65536.0
    loss_scale_growth_interval: int = 2000
    # -- speed and memory: the other techniques (each in techniques.<field>), each off in the naive loop
    keep_freed_memory: bool = False  # a CPU step reuses freed memory (glibc)
    compile: bool = False  # techniques.torch_compile
    compile_mode: CompileMode = "default"
    fused_adamw: bool = False
    activation_checkpointing: Checkpointing = "none"  # what each mode keeps: techniques.activation_checkpointing
    loss_chunks: int = 1  # techniques.chunked_loss: >1, the output layer and loss in this many token slices
    set_to_none: bool = False  # zero_grad(set_to_none=True) frees gradients between steps
    # -- optimisation (notebook 05): optimizer, weight decay, schedule, clipping
    optimizer: Optimizer = "adamw"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    momentum: float = 0.9  # for sgd_momentum
    weight_decay: float = 0.0
    decay_2d_only: bool = True  # weight decay only on >=2-D parameters (matmuls, embeddings)
    schedule: Schedule = "constant"
    lr_warmup_steps: int = 0
    min_lr_ratio: float = 0.1  # cosine, wsd and exponential decay to this fraction of lr
    clip_norm: float | None = None  # clipping threshold; None is off
    clip_kind: ClipKind = "global"  # "global": one factor from the joint norm (GPT-3); "per_tensor": each by its own
    # -- parallelism (notebook 07, techniques.data_parallel) in a torchrun group: DDP, FSDP2, or DDP by hand in buckets
    data_parallel: Literal["none", "ddp", "fsdp", "bucketed"] = "none"

    def __post_init__(self):
        if isinstance(self.betas, list):  # read from JSON
            object.__setattr__(self, "betas", tuple(self.betas))
        if isinstance(self.activation_checkpointing, bool):  # configs saved before "selective" existed
            object.__setattr__(self, "activation_checkpointing", "full" if self.activation_checkpointing else "none")
        _check_types(self)
        _check_positive(self, "batch_size", "grad_accum_steps", "context", "steps", "loss_chunks")
        _check_positive(self, "eval_batches", "loss_scale_growth_interval")
        _must(self, "timing_warmup", self.timing_warmup >= 0, "be an int >= 0")
        n, k = self.batch_size, self.grad_accum_steps
        fix = f"make batch_size a multiple of grad_accum_steps (e.g. batch_size={n // k * k or k})"
        _check(n % k == 0, f"batch_size={n} does not divide into grad_accum_steps={k} equal micro-batches: {fix}")
        longer = f"context={self.context} is longer than the model's block_size={self.model.block_size}"
        fix = "shorten the context or raise the model's block_size (model.block_size; `--set model.block_size=N`)"
        _check(self.context <= self.model.block_size, f"{longer}: {fix}")
        no_warmup = "schedule='inverse_sqrt' peaks at the end of the warmup: set lr_warmup_steps >= 1"
        _check(self.schedule != "inverse_sqrt" or self.lr_warmup_steps >= 1, no_warmup)
        _must(self, "eval_every", self.eval_every >= 0, "be >= 0")
        _must(self, "lr", self.lr > 0, "be positive")
        _must(self, "clip_norm", self.clip_norm is None or self.clip_norm > 0, "be positive or None (off)")
        _must(self, "lr_warmup_steps", self.lr_warmup_steps >= 0, "be >= 0")
        _must(self, "min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "be in [0, 1]")
        _must(self, "weight_decay", self.weight_decay >= 0, "be >= 0")
        _must(self, "eps", self.eps > 0, "be > 0 (it keeps Adam's division finite)")
        _must(self, "betas", all(0 <= b < 1 for b in self.betas), "each be in [0, 1) (decay rates of moving averages)")
        _must(self, "momentum", 0 <= self.momentum < 1, "be in [0, 1)")
        _must(self, "loss_scale_init", self.loss_scale_init > 0, "be > 0")
        check_device(self.device)

    @property
    def micro_batch_size(self) -> int:
        return self.batch_size // self.grad_accum_steps

    @property
    def tokens_per_step(self) -> int:
        """Tokens per optimizer step (on one process), padding included."""
        return self.batch_size * self.context

    @property
    def ledger_step(self) -> int | None:
        """The step a CPU run takes under the memory ledger (the last, untimed), or None (a GPU reads timed steps')."""
        return self.steps - 1 if self.measure_memory and torch.device(self.device).type == "cpu" else None

    @property
    def untimed_steps(self) -> set[int]:
        """The steps left out of the timing: the warm-up steps (the first also compiles) and the memory-ledger step."""
        return set(range(min(self.timing_warmup, self.steps))) | ({self.ledger_step} - {None})

    def fewest_steps(self, timed: int = 1, ledger: bool | None = None) -> int:
        """Steps to time `timed` after the warm-up, plus the ledger step where `ledger` (default: where it has one)."""
        return self.timing_warmup + timed + (self.ledger_step is not None if ledger is None else ledger)

    def check_steps_to_time(self, ledger: bool | None = None) -> None:
        """A ConfigError that says what to raise where the run would leave no step to time."""
        if self.steps < (need := self.fewest_steps(1, ledger)):
            ledger_text = " and the memory-ledger step" if need > self.timing_warmup + 1 else ""
            after = f"after {self.timing_warmup} warm-up step(s){ledger_text}"
            raise ConfigError(f"steps={self.steps} leaves no step to time {after}: raise steps to at least {need}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        """The config a dict describes (to_dict's, a JSON file); a key that is no field names the closest field."""
        what = "a TrainConfig is a dict of its fields (TrainConfig.to_dict()), with model a dict too"
        _check(isinstance(d, dict) and isinstance(d.get("model", {}), dict), f"{what}; got {type(d).__name__}")
        _check_fields(d, cls)
        _check_fields(d.get("model", {}), ModelConfig)
        return cls(**{**d, "model": ModelConfig(**d.get("model", {}))})

    def with_model(self, **changes) -> TrainConfig:
        """This config with the model's fields in `changes` changed; a name that is no field is a ConfigError."""
        _check_fields(changes, ModelConfig)
        return replace(self, model=replace(self.model, **changes))

    def by_section(self) -> dict[str, dict[str, object]]:
        """{section: {field: value}} in SECTIONS' order; the model's fields as "model.<field>"."""
        model = {f"model.{f.name}": getattr(self.model, f.name) for f in dataclasses.fields(self.model)}
        return {name: model if name == "model" else {f: getattr(self, f) for f in fs} for name, fs in SECTIONS.items()}


def reference_preset(device: str | None = None) -> TrainConfig:
    """The course's reference model: 4 blocks, context 512, width 256, 4 heads, batch 32."""
    model = ModelConfig(n_layer=4, n_head=4, n_embd=256, block_size=512)
    return TrainConfig(model, device or default_device(), batch_size=32, context=512, steps=20, timing_warmup=3)


def cpu_preset(device: str | None = None) -> TrainConfig:
    """For a laptop CPU, shaped like the reference (context 512, 5as/h = 40): attention and logits weigh as on a GPU."""
    model = ModelConfig(n_layer=2, n_head=2, n_embd=128, block_size=512)
    return TrainConfig(model, device or "cpu", batch_size=8, context=512, steps=8, timing_warmup=2)


def tiny_preset(device: str | None = None) -> TrainConfig:
    """For tests: a few milliseconds a step."""
    model = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=64)
    return TrainConfig(model, device or "cpu", batch_size=4, context=64, steps=4, timing_warmup=1)


def gpt2_small_preset(device: str | None = None) -> TrainConfig:
    """GPT-2 small, 124M parameters: 12 blocks, width 768, 12 heads, context 1024, GPT-2's vocab of 50257."""
    model = ModelConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50257)
    return TrainConfig(model, device or default_device(), batch_size=16, context=1024, steps=20, timing_warmup=3)


PRESETS = {"tiny": tiny_preset, "cpu": cpu_preset, "reference": reference_preset, "gpt2-small": gpt2_small_preset}


def preset(name: str, device: str | None = None) -> TrainConfig:
    # auto, sized to a device, lives a layer up (presets.preset), which asks here for every other name
    _check(name in PRESETS, f"Unknown preset {name!r}: choose one of auto, {', '.join(PRESETS)}")
    return PRESETS[name](device)
