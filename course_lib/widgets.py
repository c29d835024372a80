"""The technique panel: one control per technique, a Run button, a progress bar, plots and a results table
that keeps every run of the session. It can be driven from code (`set`, `run`), which is how tests use it.

The panel holds no result that is not also in `panel.results` (a plain list), and it can save them to JSON.

A notebook fits the panel to its own lesson with three arguments, and nothing else:

- `runner(cfg, label, callback, **extras) -> RunResult` decides what Run does (default: course_lib.train.run);
  it calls `callback(step, result)` for the progress bar.
- `extras={name: widget}`: controls of the notebook's own that are not TrainConfig fields (any ipywidgets value
  widget: a Dropdown, an IntSlider...). Their values reach the runner as keyword arguments, `set` sets them, and
  a run's label names those that differ from their starting value.
- `plots=(...)`: one panel of the figure per entry, a name of course_lib.plots.PLOTS ("speed", "memory", "loss",
  "step_times", "grad_norm", "lr") or a callable `fn(results, ax)` that draws every run on the matplotlib Axes it
  is given (no pyplot: the figure is course_lib.plots.new_figure's).

What a runner measured for its own plots beyond a RunResult's fields goes in `RunResult.details` (JSON-able
numbers and lists), so that it is in `panel.results` and its saved file too: `result.with_details(**details)`.

The code: under the plots, a collapsed "Code" section shows what the current configuration changes in the exported
training script against naive fp32 (course_lib.export.diff_html against techniques.naive of the panel's base), redrawn
whenever a control changes while it is open; "Export this configuration" writes that script (export.script) next to
the notebook. A runner whose runs are not the config as it stands (the strategies of notebooks 07 and 08) says what its
runs train with an attribute `runner.export_config(cfg, **extras) -> TrainConfig` (or raises ConfigError: not
exportable).
"""

from __future__ import annotations

import dataclasses
import html
import inspect
import math
import re
import typing
from pathlib import Path
from typing import Callable, Sequence

import ipywidgets as W
from IPython.display import display

from . import config as C, export, techniques as T
from .capabilities import capabilities
from .measure import device_name
from .plots import PlotSpec, figure_png, plot_results
from .results import RunResult, html_table, provenance, save_results, table_rows

MODEL_FIELDS = tuple(t.name for t in T.TECHNIQUES if t.field.startswith("model."))
# Every technique of techniques.TECHNIQUES gets its control (compile's mode beside compile), then the run's sizes: a new
# technique appears on the default panel without an edit here.
_TECHNIQUE_CONTROLS = tuple(
    n for t in T.TECHNIQUES for n in ((t.name, "compile_mode") if t.name == "compile" else (t.name,))
)
ALL_CONTROLS = ("preset", *_TECHNIQUE_CONTROLS, "batch_size", "grad_accum_steps", "context", "steps")


def fewest_steps(cfg: C.TrainConfig) -> int:
    """The fewest steps a run of cfg can time: its warm-up, one timed step, and the memory ledger's on a CPU."""
    ledger = cfg.measure_memory and str(cfg.device).startswith("cpu")
    return cfg.timing_warmup + 1 + (1 if ledger else 0)


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


def _field_types() -> dict[str, object]:
    hints = typing.get_type_hints(C.TrainConfig)
    hints.update({f"model.{k}": v for k, v in typing.get_type_hints(C.ModelConfig).items()})
    return hints


def _current(cfg: C.TrainConfig, name: str):
    return getattr(cfg.model, name) if name in MODEL_FIELDS else getattr(cfg, name)


def _text(name: str, value) -> str:
    return FORMATS[name](value) if name in FORMATS else str(value)


class Panel:
    def __init__(
        self,
        base: C.TrainConfig | None = None,
        controls: Sequence[str] = ALL_CONTROLS,
        *,
        title: str = "Technique panel",
        runner: Callable[..., RunResult] | None = None,
        plots: Sequence[PlotSpec] = ("speed", "memory"),
        extras: dict[str, W.ValueWidget] | None = None,
        save_to: str | Path | None = None,
    ):
        """base: the starting config; controls: TrainConfig/ModelConfig field names, one control each; runner, extras
        and plots: the notebook's own Run, controls and plots (module docstring); save_to: a JSON file kept current."""
        self.base = base or C.cpu_preset()
        self.extras: dict[str, W.ValueWidget] = dict(extras or {})
        if self.extras and runner is None:
            raise ValueError(f"extra controls ({', '.join(self.extras)}) need a runner that reads them: pass runner=")
        if self.extras and runner is not None:
            params = inspect.signature(runner).parameters
            missing = [
                k for k in self.extras if k not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values())
            ]
            if missing:
                raise ValueError(
                    f"the runner takes no argument named {', '.join(missing)}: its extra controls reach it as keywords"
                )
        self.runner = runner or self._default_runner
        self.plot_names = tuple(plots)
        self.save_to, self.save_note = self._file_of_its_own(save_to) if save_to else (None, "")
        self.results: list[RunResult] = []
        self.last_figure = None
        self._types = _field_types()
        self.reasons = capabilities(self.base.device).unavailable()  # "field=value" -> why this device cannot
        self.controls: dict[str, W.Widget] = {}
        notes = []
        for name in controls:
            self.controls[name] = self._make_control(name, notes)
        for name, w in self.extras.items():
            if name in self.controls:
                raise ValueError(f"{name!r} is both a config control and an extra control")
            if hasattr(getattr(w, "style", None), "description_width"):
                w.style.description_width = "150px"
            w.layout.width = w.layout.width or "320px"
        self._extra_start = self.extra_values()
        self.run_button = W.Button(description="Run", button_style="primary", icon="play")
        self.clear_button = W.Button(description="Clear", icon="trash")
        self.progress = W.IntProgress(value=0, min=0, max=1, description="idle", layout=W.Layout(width="320px"))
        self.status = W.HTML(self.save_note)
        self.table = W.HTML(html_table([]))
        # The figure is PNG bytes in one persistent Image widget, replaced on every redraw: a figure displayed into an
        # Output widget from the Run button's callback came out blank or half drawn in JupyterLab
        # (tests/test_browser.py).
        self.plot_image = W.Image(
            format="png", layout=W.Layout(display="none", align_self="flex-start", max_width="100%", height="auto")
        )
        for w, css in (
            (self.run_button, "course-run"),
            (self.clear_button, "course-clear"),
            (self.table, "course-table"),
            (self.plot_image, "course-plots"),
        ):
            w.add_class(css)  # stable hooks for the browser test
        self.run_button.on_click(lambda _b: self._safe_run())
        self.clear_button.on_click(lambda _b: self.clear())
        self._code_section(runner)
        header = W.HTML(
            f"<b>{title}</b> &nbsp; <small>{device_name(self.base.device)}</small>"
            + "".join(f"<br><small>&#9888; {n}</small>" for n in notes)
        )
        grid = W.GridBox(
            list(self.controls.values()) + list(self.extras.values()),
            layout=W.Layout(grid_template_columns="repeat(3, 330px)"),
        )
        self.widget = W.VBox(
            [
                header,
                grid,
                W.HBox([self.run_button, self.clear_button, self.progress]),
                self.status,
                self.plot_image,
                self.table,
                self.code,
                W.HBox([self.export_button, self.export_status]),
            ]
        )

    # ---- the code: the configuration as a training script ---------------------------------------
    def _code_section(self, runner) -> None:
        """The collapsed diff against naive fp32, kept current while open, and the export button (module docstring)."""
        self.export_config = getattr(runner, "export_config", None)
        self.code_view = W.HTML()
        self.code = W.Accordion(
            children=[self.code_view],
            titles=("Code: this configuration's training script against naive fp32",),
            selected_index=None,
        )  # collapsed: the plots come first
        self.export_button = W.Button(
            description="Export this configuration",
            icon="download",
            layout=W.Layout(width="240px"),
            tooltip="write this configuration's standalone training script next to the notebook",
        )
        self.export_status = W.HTML()
        for w, css in (
            (self.code, "course-code"),
            (self.code_view, "course-diff"),
            (self.export_button, "course-export"),
            (self.export_status, "course-export-status"),
        ):
            w.add_class(css)
        # Formatting a diff takes a fraction of a second: redraw it on a change only while someone is looking at it.
        for w in [*self.controls.values(), *self.extras.values()]:
            w.observe(lambda _change: self._refresh_code_if_open(), names="value")
        self.code.observe(lambda _change: self._refresh_code_if_open(), names="selected_index")
        self.export_button.on_click(lambda _b: self.export_script())

    def export_target(self) -> C.TrainConfig:
        """The config the controls describe as a training script would run it (raises ConfigError when invalid)."""
        cfg = self.config()
        return self.export_config(cfg, **self.extra_values()) if self.export_config else cfg

    def code_diff(self) -> str:
        """What the current configuration changes in the exported script against naive fp32, as HTML (or why not)."""
        try:
            return export.diff_html(T.naive(self.base), self.export_target(), "naive fp32 -> this configuration")
        except (C.ConfigError, ValueError) as e:
            return (
                "<span style='color:#c44e52'>No script for this configuration: "
                f"{html.escape(str(e), quote=False)}</span>"
            )

    def _refresh_code_if_open(self) -> None:
        if self.code.selected_index == 0:
            self.code_view.value = self.code_diff()

    def export_script(self, directory: str | Path | None = None) -> Path | None:
        """Write the current configuration's script to train_<what changed>.py in `directory` (default: the working
        directory, the notebook's own folder in Jupyter) and say where; a config that cannot be exported says why."""
        try:
            cfg = self.export_target()
            text = export.script(cfg)
        except (C.ConfigError, ValueError) as e:
            self.export_status.value = (
                f"<span style='color:#c44e52'>Not exported: {html.escape(str(e), quote=False)}</span>"
            )
            return None
        what = re.sub(r"[^A-Za-z0-9]+", "_", self.label(cfg).partition(" ")[2]).strip("_")[:60]
        path = Path(directory or Path.cwd()) / f"train_{what or 'baseline'}.py"
        path.write_text(text, encoding="utf-8")
        run = "torchrun --nproc_per_node=2" if cfg.data_parallel != "none" else "python"
        self.export_status.value = (
            f"Wrote <code>{html.escape(str(path.resolve()))}</code> ({text.count(chr(10))} lines); "
            f"run it with <code>{run} {html.escape(path.name)}</code>"
        )
        return path

    # ---- building controls ----------------------------------------------------------------------
    def _make_control(self, name: str, notes: list[str]) -> W.Widget:
        style, layout = {"description_width": "150px"}, W.Layout(width="320px")
        desc = LABELS.get(name, name.replace("_", " "))
        if name == "preset":
            return W.Dropdown(
                options=list(C.PRESETS), value=self._matching_preset(), description="preset", style=style, layout=layout
            )
        if name == "device":
            import torch

            opts = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
            return W.Dropdown(
                options=opts, value=str(self.base.device), description="device", style=style, layout=layout
            )
        value = _current(self.base, name)
        hint = self._types.get(f"model.{name}" if name in MODEL_FIELDS else name)
        if name == "precision":
            options = [p for p in C.PRECISIONS if f"precision={p}" not in self.reasons]
            for p in C.PRECISIONS:
                if f"precision={p}" in self.reasons:
                    notes.append(f"{p} is not offered: {self.reasons[f'precision={p}']}")
            if self.base.device == "cpu" or str(self.base.device).startswith("cpu"):
                notes.append("tf32 runs on a CPU but changes nothing there (it is a CUDA tensor-core mode)")
            return W.Dropdown(
                options=options,
                value=value if value in options else "fp32",
                description=desc,
                style=style,
                layout=layout,
            )
        if name in CHOICES:
            opts = sorted(set(CHOICES[name]) | {value})
            return W.Dropdown(
                options=[(_text(name, v), v) for v in opts], value=value, description=desc, style=style, layout=layout
            )
        if typing.get_origin(hint) is typing.Literal:
            return W.Dropdown(
                options=list(typing.get_args(hint)), value=value, description=desc, style=style, layout=layout
            )
        if hint is bool:
            w = W.Checkbox(value=bool(value), description=desc, indent=False, layout=layout)
            why = self.reasons.get(f"{name}=True")
            if why:
                w.disabled, w.value = True, False
                w.description = f"{desc} (unavailable)"
                w.tooltip = why
                notes.append(f"{desc} is disabled: {why}")
            return w
        if name in SLIDERS:
            lo, hi, step = SLIDERS[name]
            lo, hi = (lo(self.base) if callable(lo) else lo), (hi(self.base) if callable(hi) else hi)
            return W.IntSlider(
                value=value,
                min=min(lo, value),
                max=max(hi, value),
                step=step,
                description=desc,
                style=style,
                layout=layout,
                continuous_update=False,
            )
        if name == "lr":
            return W.FloatLogSlider(
                value=value,
                base=10,
                min=-5,
                max=-1,
                step=0.1,
                description=desc,
                style=style,
                layout=layout,
                readout_format=".1e",
                continuous_update=False,
            )
        if name == "clip_norm":
            return W.FloatText(value=value or 0.0, description=desc, style=style, layout=layout)
        if hint is int or typing.get_origin(hint) is None and isinstance(value, int):
            return W.IntText(value=value, description=desc, style=style, layout=layout)
        if isinstance(value, float):
            return W.FloatText(value=value, description=desc, style=style, layout=layout)
        if isinstance(value, tuple):  # betas
            return W.Text(value=", ".join(map(str, value)), description=desc, style=style, layout=layout)
        raise ValueError(f"No control for {name!r}: it is not a TrainConfig/ModelConfig field the panel knows")

    def _matching_preset(self) -> str:
        """The preset whose network the base config trains (its techniques may differ: the loop a ladder kept)."""
        arch = lambda m: (m.n_layer, m.n_head, m.n_embd, m.vocab_size, m.block_size)  # noqa: E731
        for name, fn in C.PRESETS.items():
            if arch(fn(self.base.device).model) == arch(self.base.model):
                return name
        return "cpu"

    # ---- config from the controls ---------------------------------------------------------------
    def config(self) -> C.TrainConfig:
        """The TrainConfig the controls describe (raises ConfigError with a message when invalid)."""
        base = self.base
        values = {k: w.value for k, w in self.controls.items()}
        device = values.pop("device", base.device)
        if "preset" in values:
            chosen = values.pop("preset")
            if chosen != self._matching_preset():
                base = C.preset(chosen, device)
        if device != base.device:
            base = dataclasses.replace(base, device=device)
        model_changes = {k: values.pop(k) for k in MODEL_FIELDS if k in values}
        if "clip_norm" in values:
            values["clip_norm"] = values["clip_norm"] or None
        if "betas" in values and isinstance(values["betas"], str):
            values["betas"] = tuple(float(v) for v in values["betas"].split(","))
        if "context" in values:
            values["context"] = (
                min(values["context"], base.model.block_size) if "preset" in self.controls else values["context"]
            )
        cfg = dataclasses.replace(base, **values)
        cfg = cfg.with_model(**model_changes) if model_changes else cfg
        return capabilities(cfg.device).require(cfg)

    def extra_values(self) -> dict:
        """The values of the notebook's own controls (`extras`), as the runner receives them."""
        return {k: w.value for k, w in self.extras.items()}

    def set(self, **values) -> "Panel":
        """Set controls from code, e.g. panel.set(precision="bf16", compile=True); extra controls too."""
        for k, v in values.items():
            if k not in self.controls and k not in self.extras:
                raise KeyError(f"This panel has no {k!r} control; it has {', '.join([*self.controls, *self.extras])}")
            w = self.controls[k] if k in self.controls else self.extras[k]
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
            if options is not None and v not in [o[1] if isinstance(o, tuple) else o for o in options]:
                shown = [o[1] if isinstance(o, tuple) else o for o in options]
                raise C.ConfigError(
                    f"{k}={v!r} is not offered here: choose one of {', '.join(map(repr, shown))}"
                    f"{C.did_you_mean(v, shown)}"
                )
            w.value = ", ".join(map(str, v)) if isinstance(v, tuple) else v
        return self

    @staticmethod
    def _file_of_its_own(path) -> tuple[Path, str]:
        """(the file this panel keeps its runs in, what to tell the learner): `path`, checked now, or where a file is
        there already (an earlier session's runs), the first free `<name>-2.json`, `-3`... beside it, so that nothing
        already written is replaced."""
        from .results import check_writable

        path = check_writable(path)
        if not path.exists():
            return path, f"runs saved to {path}"
        n = 2
        while (free := path.with_name(f"{path.stem}-{n}{path.suffix}")).exists():
            n += 1
        return free, f"runs saved to {free} ({path} holds earlier runs: kept as it is)"

    def start_from(self, cfg: C.TrainConfig) -> "Panel":
        """Set every config control to `cfg`'s value (the loop a ladder kept, a rung's config) and make it the panel's
        starting config, which the runs' labels are named against (another network too: the preset control and the
        sliders' ranges follow it)."""
        self.base = cfg
        if "preset" in self.controls:
            self.controls["preset"].value = self._matching_preset()
        for name, w in self.controls.items():  # ranges that depend on the config (context up to the block size)
            if name in SLIDERS:
                lo, hi, _ = SLIDERS[name]
                value = _current(cfg, name)
                w.max = max(hi(cfg) if callable(hi) else hi, value)
                w.min = min(lo(cfg) if callable(lo) else lo, value)
        self.set(**{k: _current(cfg, k) for k in self.controls if k not in ("preset", "device")})
        return self

    def label(self, cfg: C.TrainConfig) -> str:
        """A short name for a run: what differs from the panel's starting config."""
        parts = []
        # another model or device: its runs are not comparable with the others, so say it first
        for k in ("preset", "device"):
            if k in self.controls and self.controls[k].value != (
                self._matching_preset() if k == "preset" else str(self.base.device)
            ):
                parts.append(f"{k}={self.controls[k].value}")
        for k in self.controls:
            if k in ("preset", "device"):
                continue
            new, old = _current(cfg, k), _current(self.base, k)
            if new != old:
                parts.append(k if new is True else f"no {k}" if new is False else f"{k}={_text(k, new)}")
        for k, new in self.extra_values().items():
            if new != self._extra_start[k]:
                parts.append(k if new is True else f"no {k}" if new is False else f"{k}={new}")
        return f"#{len(self.results) + 1} " + (", ".join(parts) if parts else "baseline")

    # ---- running --------------------------------------------------------------------------------
    def _default_runner(self, cfg: C.TrainConfig, label: str, callback) -> RunResult:
        from .train import run

        return run(cfg, label, callback=callback)

    def run(self, label: str | None = None) -> RunResult:
        """Run the experiment the controls describe; an invalid config becomes a 'skipped' row with the reason."""
        try:
            cfg = self.config()
        except (C.ConfigError, ValueError) as e:
            result = RunResult(
                label=label or f"#{len(self.results) + 1} invalid",
                status="skipped",
                config={},
                provenance=provenance(device_name(self.base.device)),
                reason=str(e),
            )
            self.status.value = f"<span style='color:#c44e52'>Not run: {e}</span>"
            return self._record(result)
        label = label or self.label(cfg)
        self.progress.max, self.progress.value, self.progress.description = cfg.steps, 0, "running"
        self.status.value = f"Running <b>{label}</b> ({cfg.steps} steps)..."

        def callback(step: int, _result: RunResult) -> None:
            self.progress.value = step + 1

        try:
            result = self.runner(cfg, label, callback, **self.extra_values())
        except Exception as e:  # noqa: BLE001 - a run that fails is a row that says why; the panel stays usable
            status = "skipped" if isinstance(e, C.ConfigError) else "error"
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            result = RunResult(
                label=label,
                status=status,
                config=cfg.to_dict(),
                provenance=provenance(device_name(cfg.device)),
                reason=f"{type(e).__name__}: {first}" if status == "error" else first,
            )
        self.progress.description = "done" if result.ok else result.status
        result = self._record(result)  # recorded first: nothing below can lose it
        peak = f", peak {result.peak_gib:.4f} GiB" if result.peak_gib is not None else ", memory not measured"
        speed = f"{result.tokens_per_s:,.0f} tokens/s" if result.tokens_per_s is not None else "done"
        self.status.value = (
            f"<b>{result.label}</b>: {speed}{peak}" + (f" ({result.reason})" if result.reason else "")
            if result.ok
            else f"<b>{result.label}</b>: {result.status.upper()} {result.reason}"
        )
        return result

    def _safe_run(self) -> None:
        """The button's handler: never lets an exception kill the panel; the error is shown instead."""
        try:
            self.run()
        except Exception as e:  # noqa: BLE001 - shown to the learner, the kernel lives on
            self.status.value = f"<span style='color:#c44e52'>Error: {type(e).__name__}: {e}</span>"

    def _record(self, result: RunResult) -> RunResult:
        self.results.append(result)
        if self.save_to:
            save_results(self.results, self.save_to)
        self.redraw()
        return result

    def clear(self) -> None:
        self.results.clear()
        self.redraw()
        self.status.value = "Cleared."

    def redraw(self) -> None:
        self.table.value = html_table(table_rows(self.results))
        if not self.results:
            self.last_figure = None
            self.plot_image.layout.display = "none"
            return
        fig = plot_results(self.results, self.plot_names)  # a Figure outside pyplot: nothing to close
        self.last_figure = fig
        self.plot_image.value = figure_png(fig)
        self.plot_image.layout.display = None

    def _ipython_display_(self):
        display(self.widget)


def show_environment(device: str) -> None:
    """The environment cell: device, torch version and what this device supports (course_lib.capabilities)."""
    import html

    rows = "".join(
        f"<tr><td>{html.escape(k)}</td><td style='text-align:left'>{html.escape(v)}</td></tr>"
        for k, v in capabilities(device).rows()
    )
    display(W.HTML(f"<table>{rows}</table>"))
