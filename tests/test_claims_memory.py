"""The claims of notebooks 01 and 02 that are bookkeeping or arithmetic, not measurements a learner should watch: what
was asserted in their "Check yourself" cells and could not fail there (a function against itself, a constant restated)
is checked here, with what the notebooks' panels put beside each run (the formula beside the measurement).

Checked elsewhere, and so not again here: tokens/s recomputed from the raw step times, the first loss near ln V and the
ledger's 4N / 4N / 8N (tests/test_train.py); padding adds nothing to the loss (tests/test_data.py); GPT-3's 3,640
PF-days, a PF-day's 8.64e19 FLOPs, 4,430,769 s on an A100 at its fp32 peak and the budget table
(tests/test_training_compute.py); the quoted 1.4 GB, 16 bytes per parameter with AdamW and the 69 GB
(tests/test_memory_estimate_formulas.py)."""

import dataclasses
import inspect
import json
import math
import re
import time
from pathlib import Path

import pytest

from course_lib import (
    capabilities,
    config as C,
    export,
    memory_formula as F,
    plots,
    techniques as T,
    train,
)
from course_lib.lessons import memory_plots, training_compute as CB
from course_lib.lessons.formula_beside_measured import (
    account_step,
    beside_measured,
    plot_formula_beside_measured,
    plot_memory_vs_estimate,
    plot_time_vs_flops,
    run_beside_estimate,
)
from course_lib.lessons.memory_calculator import calculator_config
from course_lib.measure import CATEGORIES

ROOT = Path(__file__).resolve().parent.parent


# ---- selective checkpointing: what Korthikanti et al. propose, and what the course's `selective` does ----


def test_the_exported_script_and_the_config_say_whose_selective_checkpointing_it_is(tiny):
    """Korthikanti et al. (2022) recompute the attention core (QK^T, softmax, dropout, the product with V) and keep the
    rest; the course's `selective` keeps the matmul outputs and recomputes the element-wise work. The old text said the
    course's policy was the paper's ("as Korthikanti et al. propose")."""
    script = export.script(tiny(activation_checkpointing="selective"))
    # the runtime class's docstring, rendered into the script
    comment = script[
        script.index("class SelectiveCheckpointedBlock") : script.index(
            'def checkpoint_options(self) -> dict:\n        return {"context_fn"'
        )
    ]
    field_help = T.activation_checkpointing.__doc__  # the technique's home, which the config's field points to
    assert "techniques.activation_checkpointing" in inspect.getsource(C.TrainConfig)
    for text in (comment, field_help):
        assert "as Korthikanti et al. propose" not in text and "work (Korthikanti et al.)" not in text
        assert "recompute the attention core" in text and "QK^T, softmax" in text, text
        assert "element-wise work" in text and "keep" in text, text
    # nowhere in the course is the keep-the-matmuls policy attributed to the paper again
    sources = [
        *(ROOT / "course_lib").rglob("*.py"),
        *(ROOT / "notebooks").glob("*.ipynb"),
        ROOT / "README.md",
        ROOT / "CONTRIBUTING.md",
    ]
    for path in sources:
        text = path.read_text(encoding="utf-8")
        assert "as Korthikanti et al. propose" not in text and "element-wise work (Korthikanti et al.)" not in text, (
            path
        )


@pytest.mark.parametrize(
    "shape",
    [
        dict(preset="gpt2-small", batch_size=32, context=1024),  # a s = 12288 > 5h = 3840
        dict(preset="cpu", batch_size=8, context=512),  # 1024 > 640
        dict(preset="cpu", batch_size=4, context=128),  # 256 < 640
        dict(preset="tiny", batch_size=4, context=64),
    ],
)  # 128 < 160
def test_the_papers_selection_keeps_less_than_the_courses_exactly_when_as_exceeds_5h(shape):
    """Per block (fp32, naive attention) the paper's selection drops the a s^2 b values and keeps what SDPA keeps (16
    sbh and a log-sum-exp per query); the course's drops 5 sbh and keeps the scores. Notebook 02 measures one shape."""
    cfg = calculator_config(**shape)
    m = cfg.model
    course = F.activation_bytes(dataclasses.replace(cfg, activation_checkpointing="selective"))["kept per layer"]
    paper = F.activation_bytes(cfg.with_model(attention="sdpa"))["kept per layer"]
    assert (paper < course) == (m.n_head * cfg.context > 5 * m.n_embd), (paper, course)


# ---- notebook 02: when the logits outweigh the activations ----


@pytest.mark.parametrize(
    "shape, logits_win",
    [
        (dict(preset="gpt2-small", batch_size=32, context=1024), False),
        (dict(preset="reference", batch_size=32, context=512), False),
        (dict(preset="cpu", batch_size=8, context=512), True),
        (dict(preset="tiny", batch_size=4, context=64), True),
    ],
)
def test_the_logits_outweigh_the_activations_where_3v_exceeds_l_16h_plus_as(shape, logits_win):
    """The old text said the logits were the largest item; that holds for small models only. The condition the notebook
    states, 3V > L(16h + as) per token (fp32, naive attention), agrees with the memory model's full count."""
    cfg = calculator_config(**shape)
    m = cfg.model
    loss_tensors = sum(F.logits_terms(cfg.micro_batch_size, cfg.context, m.padded_vocab_size).values())
    assert (loss_tensors > F.activation_bytes(cfg)["total"]) == logits_win
    assert (3 * m.padded_vocab_size > m.n_layer * (16 * m.n_embd + m.n_head * cfg.context)) == logits_win


# ---- notebook 01: a PF-day, in tokens ----


def _notebook_cell(name: str, cell_id: str) -> str:
    cells = json.loads((ROOT / "notebooks" / name).read_text(encoding="utf-8"))["cells"]
    return "".join(next(c for c in cells if c["id"] == cell_id)["source"])


def test_a_pf_day_buys_a_1b_model_about_14b_tokens():
    """Notebook 01 (cell 9d2b4c61 and the summary) writes that a PF-day buys a 1B model about 14B tokens, about 0.7 of
    Chinchilla's compute-optimal count; its code cell prints CB.tokens_for. Both are checked here against the facts
    stated independently: a PF-day is 10^15 FLOP/s for 86,400 s, training costs 6 FLOPs per parameter per token, and
    Chinchilla's rule is 20 tokens per parameter."""
    tokens = CB.tokens_for(CB.PF_DAY_FLOPS, 1e9)
    assert math.isclose(tokens, 1e15 * 86_400 / (6 * 1e9)) and math.isclose(tokens, 1.44e10)
    assert math.isclose(CB.tokens_for(6e20, 1e10), 1e10)  # a second point: 6 x 1e10 params x 1e10 tokens
    share = tokens / CB.chinchilla_tokens(1e9)
    assert math.isclose(CB.chinchilla_tokens(1e9), 20 * 1e9) and math.isclose(share, 0.72)
    code = _notebook_cell("01_naive_loop.ipynb", "7c1e5f0a")
    assert "CB.tokens_for(CB.PF_DAY_FLOPS, 1e9)" in code  # the notebook prints the function checked here
    # the numbers written in the notebook's prose are the function's, rounded as written
    for cell_id in ("9d2b4c61", "62824514"):
        text = " ".join(_notebook_cell("01_naive_loop.ipynb", cell_id).split())
        written = re.findall(r"about (\d+)B tokens", text)
        assert written and all(int(w) == round(tokens / 1e9) for w in written), (cell_id, written)
    said_share = re.findall(
        r"about (0\.\d+) of what Chinchilla", " ".join(_notebook_cell("01_naive_loop.ipynb", "9d2b4c61").split())
    )
    assert said_share and float(said_share[0]) == round(share, 1), said_share


# ---- the panels' runner: the formula beside the measurement ----


def test_the_panels_runner_trains_the_loop_and_puts_the_formula_beside_the_ledger(splits, tiny):
    """lessons.formula_beside_measured.run_beside_estimate is train.run (the same losses) with the estimate's
    prediction in its details and its note; the step clock fits inside the wall clock."""
    cfg = tiny(steps=4, timing_warmup=1)
    t0 = time.perf_counter()
    r = run_beside_estimate(cfg, "panel", splits=splits)
    wall = time.perf_counter() - t0
    assert r.ok and r.losses == train.run(cfg, "plain", splits=splits).losses
    assert sum(r.step_times) <= wall
    est = r.details["estimate"]
    assert set(est["by_category"]) == set(CATEGORIES) and est["peak_bytes"] == sum(est["by_category"].values())
    # the formula against the ledger, category by category (tests/test_memory_estimate.py: every lever)
    for c in CATEGORIES:
        assert abs(est["by_category"][c] - r.memory["by_category"][c]) <= 0.01 * r.memory["peak_bytes"], c
    assert r.reason.startswith("peak: formula ") and "measured" in r.reason and est["when"] in r.reason
    rows = beside_measured(F.estimate(cfg), r.memory)
    assert [row[""] for row in rows] == [*CATEGORIES, f"peak ({est['when']})"]
    assert rows[-1]["formula MiB"] == f"{est['peak_bytes'] / 2**20:.2f}"


def test_the_panels_plots_draw_formula_beside_measurement(splits, tiny):
    cfg = tiny(steps=3, timing_warmup=1)
    runs = [
        run_beside_estimate(cfg, "a", splits=splits),
        run_beside_estimate(cfg.with_model(attention="sdpa"), "b", splits=splits),
    ]
    fig = plots.plot_results(runs, (plot_memory_vs_estimate, plot_time_vs_flops))
    mem_ax, time_ax = fig.axes[:2]
    assert "formula (hatched) beside measured" in mem_ax.get_title() and "MiB" in mem_ax.get_ylabel()
    assert [t.get_text() for t in mem_ax.get_xticklabels()] == [
        "a (formula)",
        "a (measured)",
        "b (formula)",
        "b (measured)",
    ]
    # the stacked bars: each pair's totals are the formula's and the ledger's peaks
    totals = {}
    for p in mem_ax.patches:
        x = round(p.get_x() + p.get_width() / 2)
        totals[x] = totals.get(x, 0) + p.get_height()
    assert math.isclose(totals[0] * 2**20, runs[0].details["estimate"]["peak_bytes"], rel_tol=1e-9)
    assert math.isclose(totals[1] * 2**20, runs[0].memory["peak_bytes"], rel_tol=1e-9)
    # time, on a log scale: the hatched bar is a step's FLOPs, counted by hand (tokens x (6N + 12Lhs)), over the
    # device's peak (the step time drops out); the solid bar is the measured median step
    assert time_ax.get_yscale() == "log" and "ms" in time_ax.get_ylabel()
    heights = [p.get_height() for p in time_ax.patches]
    m = cfg.model
    n_non_embedding = runs[0].n_params - m.block_size * m.n_embd  # less the position table, which does no matmul
    step_flops = cfg.batch_size * cfg.context * (6 * n_non_embedding + 12 * m.n_layer * m.n_embd * cfg.context)
    peak, _ = capabilities.capabilities(cfg.device).peak_tflops(cfg.precision)
    assert math.isclose(heights[0], step_flops / (peak * 1e12) * 1e3, rel_tol=1e-6), (heights[0], step_flops, peak)
    assert math.isclose(heights[1], runs[0].median_step_s * 1e3)


def test_the_notebooks_other_figures_draw(tiny):
    est = F.estimate(calculator_config())
    fig = memory_plots.plot_will_it_fit(est, 80, "GPT-2 small")
    assert "GiB" in fig.axes[0].get_xlabel() and len(fig.axes[0].patches) == len(CATEGORIES)
    report = account_step(tiny(steps=1), fake=True)
    fig = memory_plots.plot_step_timelines({"one": report, "two": report}, "title")
    assert len(fig.axes) == 2 and "MiB" in fig.axes[0].get_ylabel() and fig.axes[0].get_title().startswith("one: peak")
    static = {"sgd": ({"parameters": 4, "gradients": 4}, {"parameters": 4, "gradients": 4})}
    ax = plot_formula_beside_measured(static).axes[0]
    assert len(ax.get_legend().get_texts()) == 2  # only the categories that hold bytes


def test_the_calculator_config_grows_the_position_table():
    cfg = calculator_config("cpu", batch_size=2, context=2048, attention="sdpa", precision="bf16")
    assert (cfg.batch_size, cfg.context, cfg.model.block_size, cfg.model.attention, cfg.precision) == (
        2,
        2048,
        2048,
        "sdpa",
        "bf16",
    )
    assert calculator_config() == dataclasses.replace(C.gpt2_small_preset("cpu"), batch_size=32, context=1024)


def test_backward_is_timed_on_its_own_and_never_negative(tiny, monkeypatch):
    """training_compute.forward_backward_seconds timed backward as (forward + backward) less forward, two medians, which
    came out negative on a busy machine (notebook 02 printed it). Here the forward is slow while forward alone is timed
    (0.6 s) and faster afterwards (0.4 s), as on a machine whose load drops, and the backward sleeps 0.05 s: the
    difference of medians would give about 0.45 - 0.6 < 0; a backward timed on its own gives at least its 0.05 s, and
    without the forward in it, less than 0.4 s (the margin is for a busy machine)."""
    import torch

    FWD_FIRST, FWD_LATER, BWD = 0.6, 0.4, 0.05
    backwards = []

    class SleepInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, loss):
            return loss.clone()

        @staticmethod
        def backward(ctx, grad):
            time.sleep(BWD)
            backwards.append(1)
            return grad

    class SlowTrainer(train.Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            loss_fn = self.setup.loss_fn

            def slow_loss(x, y):
                time.sleep(FWD_LATER if backwards else FWD_FIRST)
                return SleepInBackward.apply(loss_fn(x, y))

            self.setup.loss_fn = slow_loss

    monkeypatch.setattr(train, "Trainer", SlowTrainer)
    seconds = CB.forward_backward_seconds(tiny(), repeats=1)
    assert backwards, "the backward that sleeps never ran"
    assert seconds["forward"] >= FWD_FIRST
    assert BWD <= seconds["backward"] < FWD_LATER, seconds
