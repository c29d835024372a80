"""The panel's controls: one widget per config field it is given, and what they describe (a TrainConfig, a run's name).

A technique's control is made from its declaration in the registry (course_lib.techniques.TECHNIQUES): its label, its
choices (a checkbox for a bool, the Literal's values where it declares none) and its `help` as the control's tooltip.
What this device cannot run (capabilities' `unavailable()`, "field=value" -> why) is left out of a dropdown or
disables a checkbox, and each such reason goes in `notes`, which the panel shows under its title. The other fields'
controls are described by the tables below (SLIDERS, CHOICES, FORMATS, LABELS).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Callable, Sequence

import ipywidgets as W
import traitlets

from .. import config as C, presets, techniques as T
from ..capabilities import capabilities

# A setting shown right after a technique's control: compile's mode beside compile.
BESIDE = {"compile": ("compile_mode",)}


def technique_controls(techniques: Sequence[T.Technique] = T.TECHNIQUES) -> tuple[str, ...]:
    """One control per technique of the registry (and what goes beside it): a new technique appears on the default
    panel without an edit here."""
    return tuple(n for t in techniques for n in (t.name, *BESIDE.get(t.name, ())))


ALL_CONTROLS = ("preset", *technique_controls(), "batch_size", "grad_accum_steps", "context", "steps")
# The ModelConfig fields a control may set (their names are no TrainConfig field).
MODEL_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(C.ModelConfig)
    if f.name not in {g.name for g in dataclasses.fields(C.TrainConfig)}
)


def fewest_steps(cfg: C.TrainConfig) -> int:
    """The fewest steps a run of cfg can time: its warm-up, one timed step, and the memory ledger's on a CPU."""
    return cfg.fewest_steps()


# Ranges for numeric controls: (min, max, step); min and max may be functions of the base config.
SLIDERS: dict[str, tuple] = {
    "batch_size": (1, 128, 1),
    "grad_accum_steps": (1, 16, 1),
    "context": (16, lambda c: c.model.block_size, 16),
    "steps": (fewest_steps, 200, 1),
    "lr_warmup_steps": (0, 100, 1),
    "loss_scale_growth_interval": (1, 100, 1),
    "timing_warmup": (0, 10, 1),
    "eval_every": (0, 50, 1),
}
# A technique's label and choices come from its declaration (course_lib.techniques.TECHNIQUES); the other fields' here.
CHOICES: dict[str, tuple] = {t.name: t.choices for t in T.TECHNIQUES if t.choices}
CHOICES["loss_scale_init"] = tuple(2.0**e for e in range(0, 41))
# How a value is written in a dropdown and in a run's label (default: str).
FORMATS: dict[str, Callable[[object], str]] = {"loss_scale_init": lambda v: f"2^{math.log2(v):g}"}
LABELS = {
    "grad_accum_steps": "accumulation steps",
    "batch_size": "batch size",
    "compile_mode": "compile mode",
    "clip_norm": "clip threshold (0: off)",
    "clip_kind": "clipping",
    "lr_warmup_steps": "LR warm-up steps",
    "weight_decay": "weight decay",
    "decay_2d_only": "decay only >=2-D",
    "loss_scale_init": "loss scale start",
    "loss_scale_growth_interval": "scale growth interval",
    "data_parallel": "data parallel",
    **{t.name: t.label for t in T.TECHNIQUES},
}
_STYLE = {"description_width": "150px"}


def _layout() -> W.Layout:
    return W.Layout(width="320px")


def _field_types() -> dict[str, object]:
    hints = typing.get_type_hints(C.TrainConfig)
    hints.update({k: v for k, v in typing.get_type_hints(C.ModelConfig).items() if k in MODEL_FIELDS})
    return hints


def current(cfg: C.TrainConfig, name: str):
    """The value of field `name` in cfg (a ModelConfig field read from cfg.model)."""
    return C.get_setting(cfg, name)


def text(name: str, value) -> str:
    """How a value is written in a dropdown and in a run's label."""
    return FORMATS[name](value) if name in FORMATS else str(value)


def _change(name: str, new, shown) -> str:
    """A change in a run's label: the name for a switch turned on, "no name" for one turned off, else name=value."""
    return name if new is True else f"no {name}" if new is False else f"{name}={shown}"


def _offered(options: list) -> list:
    return [o[1] if isinstance(o, tuple) else o for o in options]


class Controls:
    """The widgets for `names` (TrainConfig/ModelConfig fields, "preset", "device") and a notebook's own `extras`
    ({name: any ipywidgets value widget}), made for the config `base` on its device; `techniques` is the registry whose
    declarations label the technique controls."""

    def __init__(
        self,
        base: C.TrainConfig,
        names: Sequence[str] = ALL_CONTROLS,
        *,
        extras: dict[str, W.ValueWidget] | None = None,
        techniques: Sequence[T.Technique] = T.TECHNIQUES,
    ):
        self.base = base
        self.techniques = {t.name: t for t in techniques}
        self.reasons = capabilities(base.device).unavailable()  # "field=value" -> why this device cannot
        self.notes: list[str] = []  # what this device does not offer, and why
        self._types = _field_types()
        self.widgets: dict[str, W.Widget] = {name: self._make(name) for name in names}
        self.extras: dict[str, W.ValueWidget] = dict(extras or {})
        for name, w in self.extras.items():
            if name in self.widgets:
                raise ValueError(f"{name!r} is both a config control and an extra control")
            if hasattr(getattr(w, "style", None), "description_width"):
                w.style.description_width = "150px"
            w.layout.width = w.layout.width or "320px"
        self._extra_start = self.extra_values()

    # ---- making the widgets -------------------------------------------------------------------------------------
    def _make(self, name: str) -> W.Widget:
        if name == "preset":
            return W.Dropdown(
                options=list(presets.PRESET_NAMES),
                value=self.matching_preset(),
                description="preset",
                style=_STYLE,
                layout=_layout(),
            )
        if name == "device":
            import torch

            opts = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
            return W.Dropdown(
                options=opts, value=str(self.base.device), description="device", style=_STYLE, layout=_layout()
            )
        if name not in self._types:
            raise ValueError(f"No control for {name!r}: it is not a TrainConfig/ModelConfig field the panel knows")
        technique = self.techniques.get(name)
        label = technique.label if technique else LABELS.get(name, name.replace("_", " "))
        w = self._widget(name, label, technique)
        if technique is not None and not w.disabled:  # a disabled one's tooltip says why instead
            w.tooltip = technique.help
        return w

    def _widget(self, name: str, label: str, technique: T.Technique | None) -> W.Widget:
        value, hint = current(self.base, name), self._types[name]
        choices = technique.choices if technique else CHOICES.get(name, ())
        if choices:  # declared: in order, with the base's value among them
            return self._dropdown(name, label, value, sorted({*choices, value}), technique)
        if typing.get_origin(hint) is typing.Literal:
            return self._dropdown(name, label, value, typing.get_args(hint), technique)
        if hint is bool:
            w = W.Checkbox(value=bool(value), description=label, indent=False, layout=_layout())
            why = self.reasons.get(f"{name}=True")
            if why:
                w.disabled, w.value = True, False
                w.description, w.tooltip = f"{label} (unavailable)", why
                self.notes.append(f"{label} is disabled: {why}")
            return w
        if name in SLIDERS:
            lo, hi = self._range(name, self.base)
            return W.IntSlider(
                value=value,
                min=min(lo, value),
                max=max(hi, value),
                step=SLIDERS[name][2],
                description=label,
                style=_STYLE,
                layout=_layout(),
                continuous_update=False,
            )
        kw = dict(description=label, style=_STYLE, layout=_layout())
        if name == "lr":
            return W.FloatLogSlider(
                value=value, base=10, min=-5, max=-1, step=0.1, readout_format=".1e", continuous_update=False, **kw
            )
        if name == "clip_norm":
            return W.FloatText(value=value or 0.0, **kw)
        if hint is int or typing.get_origin(hint) is None and isinstance(value, int):
            return W.IntText(value=value, **kw)
        if isinstance(value, float):
            return W.FloatText(value=value, **kw)
        if isinstance(value, tuple):  # betas
            return W.Text(value=", ".join(map(str, value)), **kw)
        raise ValueError(f"No control for {name!r}: it is not a TrainConfig/ModelConfig field the panel knows")

    def _dropdown(self, name: str, label: str, value, choices, technique: T.Technique | None) -> W.Dropdown:
        """The choices this device can run (those it cannot are noted with the reason), the current value among them
        (or the technique's off value where the device cannot run the current one)."""
        options = [v for v in choices if f"{name}={v}" not in self.reasons]
        for v in choices:
            if f"{name}={v}" in self.reasons:
                self.notes.append(f"{v} is not offered: {self.reasons[f'{name}={v}']}")
        if name == "precision" and "tf32" in options and str(self.base.device).startswith("cpu"):
            self.notes.append("tf32 runs on a CPU but changes nothing there (it is a CUDA tensor-core mode)")
        if value not in options:
            value = technique.off if technique is not None and technique.off in options else options[0]
        return W.Dropdown(
            options=[(text(name, v), v) for v in options],
            value=value,
            description=label,
            style=_STYLE,
            layout=_layout(),
        )

    @staticmethod
    def _range(name: str, cfg: C.TrainConfig) -> tuple:
        lo, hi, _ = SLIDERS[name]
        return (lo(cfg) if callable(lo) else lo), (hi(cfg) if callable(hi) else hi)

    def matching_preset(self) -> str:
        """The preset whose network the base config trains (its techniques may differ: the loop a ladder kept)."""

        def arch(m):
            return (m.n_layer, m.n_head, m.n_embd, m.vocab_size, m.block_size)

        for name in (*C.PRESETS, "auto"):  # a named preset before auto
            if arch(presets.preset(name, self.base.device).model) == arch(self.base.model):
                return name
        return "cpu"

    # ---- what the controls describe ------------------------------------------------------------------------------
    def config(self) -> C.TrainConfig:
        """The TrainConfig the controls describe (raises ConfigError with a message when invalid)."""
        base = self.base
        values = {k: w.value for k, w in self.widgets.items()}
        device = values.pop("device", base.device)
        if "preset" in values:
            chosen = values.pop("preset")
            if chosen != self.matching_preset():
                base = presets.preset(chosen, device)
        if device != base.device:
            base = dataclasses.replace(base, device=device)
        model_changes = {k: values.pop(k) for k in MODEL_FIELDS if k in values}
        if "clip_norm" in values:
            values["clip_norm"] = values["clip_norm"] or None
        if "betas" in values and isinstance(values["betas"], str):
            values["betas"] = tuple(float(v) for v in values["betas"].split(","))
        if "context" in values and "preset" in self.widgets:
            values["context"] = min(values["context"], base.model.block_size)
        cfg = dataclasses.replace(base, **values)
        cfg = cfg.with_model(**model_changes) if model_changes else cfg
        return capabilities(cfg.device).require(cfg)

    def extra_values(self) -> dict:
        """The values of the notebook's own controls (`extras`), as the runner receives them."""
        return {k: w.value for k, w in self.extras.items()}

    def set(self, **values) -> None:
        """Set controls from code; a value a control does not offer raises ConfigError (a slider would clamp it)."""
        for k, v in values.items():
            if k not in self.widgets and k not in self.extras:
                raise KeyError(f"This panel has no {k!r} control; it has {', '.join([*self.widgets, *self.extras])}")
            w = self.widgets[k] if k in self.widgets else self.extras[k]
            if getattr(w, "disabled", False) and v:
                raise C.ConfigError(f"{k} is unavailable on this device: {self.reasons.get(f'{k}=True', 'disabled')}")
            lo, hi = getattr(w, "min", None), getattr(w, "max", None)
            if isinstance(w, W.FloatLogSlider):  # its min and max are exponents of its base
                lo, hi = w.base**w.min, w.base**w.max
            if isinstance(v, (int, float)) and not isinstance(v, bool) and lo is not None and not lo <= v <= hi:
                raise C.ConfigError(
                    f"{k}={v} is outside this control's range {lo}..{hi} (a slider would clamp it): "
                    "choose a value in the range"
                )
            options = getattr(w, "options", None)
            if options is not None and v not in _offered(options):
                shown = _offered(options)
                raise C.ConfigError(
                    f"{k}={v!r} is not offered here: choose one of {', '.join(map(repr, shown))}"
                    f"{C.did_you_mean(v, shown)}"
                )
            try:
                w.value = ", ".join(map(str, v)) if isinstance(v, tuple) else v
            except traitlets.TraitError:  # a value of the wrong kind (compile="yes" for a checkbox)
                kind = type(w.value).__name__
                raise C.ConfigError(f"{k}={v!r}: this control takes a {kind}, e.g. {k}={w.value!r}") from None

    def start_from(self, cfg: C.TrainConfig) -> None:
        """Every config control set to `cfg`'s value, and `cfg` the base that runs are named against (another network
        too: the preset control and the sliders' ranges follow it)."""
        self.base = cfg
        if "preset" in self.widgets:
            self.widgets["preset"].value = self.matching_preset()
        for name, w in self.widgets.items():  # ranges that depend on the config (context up to the block size)
            if name in SLIDERS:
                lo, hi = self._range(name, cfg)
                value = current(cfg, name)
                w.max, w.min = max(hi, value), min(lo, value)
        self.set(**{k: current(cfg, k) for k in self.widgets if k not in ("preset", "device")})

    def describe(self, cfg: C.TrainConfig) -> str:
        """What differs in cfg and the extras from the base and the extras' first values ("baseline": nothing)."""
        parts = []
        # another model or device: its runs are not comparable with the others, so say it first
        for k, start in (("preset", self.matching_preset), ("device", lambda: str(self.base.device))):
            if k in self.widgets and self.widgets[k].value != start():
                parts.append(f"{k}={self.widgets[k].value}")
        for k in [k for k in self.widgets if k not in ("preset", "device")]:
            new = current(cfg, k)
            if new != current(self.base, k):
                parts.append(_change(k, new, text(k, new)))
        for k, new in self.extra_values().items():
            if new != self._extra_start[k]:
                parts.append(_change(k, new, new))
        return ", ".join(parts) if parts else "baseline"
