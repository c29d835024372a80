"""The `auto` preset: its choice is a pure function of a device description, tested here with made-up devices (their
memory is the data sheet's nominal size in GiB; torch reports a little less, checked below too)."""

import dataclasses
import json
from pathlib import Path

import pytest

from course_lib import config as C, presets as P
from course_lib.memory_formula import count_params, estimate

GiB = 1024**3
DEVICES = {  # name: nominal memory in GiB
    "Tesla T4": 16,
    "NVIDIA GeForce RTX 3060": 12,
    "NVIDIA GeForce RTX 4090": 24,
    "NVIDIA A100-SXM4-40GB": 40,
    "NVIDIA A100-SXM4-80GB": 80,
    "NVIDIA H100 80GB HBM3": 80,
    "NVIDIA H200": 141,
}
GPT2_SMALL = C.gpt2_small_preset("cpu").model


def gpu(name: str, gib: float | None = None) -> P.DeviceDescription:
    return P.DeviceDescription("cuda", name, int((gib or DEVICES[name]) * GiB))


def choice(name: str, gib: float | None = None) -> P.AutoChoice:
    return P.auto_choice(gpu(name, gib), "cuda")


def flops_per_step(cfg: C.TrainConfig) -> float:
    """6N + 12 L h s FLOPs per token (PaLM's count), times the tokens of a step."""
    m = cfg.model
    return cfg.tokens_per_step * (6 * count_params(m) + 12 * m.n_layer * m.n_embd * cfg.context)


@pytest.mark.parametrize("name", DEVICES)
def test_naive_fp32_fits_with_headroom_by_the_estimate(name):
    c = choice(name)
    cfg = c.config
    assert cfg.device == "cuda" and cfg.precision == "fp32" and cfg.model.attention == "naive"
    assert estimate(cfg).peak_gib <= DEVICES[name] * (1 - P.AUTO_HEADROOM)
    # the batch is the largest of its shape's that fits: the next one up would not
    bigger = [b for b in P.AUTO_BATCHES[_shape(cfg)] if b > cfg.batch_size]
    if bigger:
        assert estimate(C.replace(cfg, batch_size=min(bigger))).peak_gib > DEVICES[name] * (1 - P.AUTO_HEADROOM)


def _shape(cfg: C.TrainConfig) -> str:
    m = cfg.model
    return next(s for s, ch in P.AUTO_SHAPES.items() if all(getattr(m, k) == v for k, v in ch.items()))


@pytest.mark.parametrize("name", ["NVIDIA GeForce RTX 4090", "NVIDIA A100-SXM4-40GB", "NVIDIA H100 80GB HBM3"])
def test_gpt2_small_where_it_fits(name):
    cfg = choice(name).config
    assert cfg.model == GPT2_SMALL and cfg.context == 1024


@pytest.mark.parametrize("name", ["Tesla T4", "NVIDIA GeForce RTX 3060"])
def test_smaller_on_a_small_gpu(name):
    cfg = choice(name).config
    assert count_params(cfg.model) < count_params(GPT2_SMALL)
    assert cfg.model.n_layer * cfg.model.n_embd < GPT2_SMALL.n_layer * GPT2_SMALL.n_embd
    # GPT-2 small at the smallest batch auto accepts for it would not leave the headroom
    smallest = C.replace(C.gpt2_small_preset("cuda"), batch_size=min(P.AUTO_BATCHES["GPT-2 small"]))
    assert estimate(smallest).peak_gib > DEVICES[name] * (1 - P.AUTO_HEADROOM)


def test_the_h200_gets_the_shipped_shape_and_the_estimate_agrees_with_its_measured_peak():
    shipped = json.loads((Path(__file__).parents[1] / "data/reference/gpt2-small-nvidia-h200.json").read_text())
    naive = next(r for r in shipped["results"] if r["label"] == "naive fp32")
    measured = C.TrainConfig.from_dict(naive["config"])
    cfg = choice("NVIDIA H200").config
    assert (cfg.model, cfg.batch_size, cfg.context) == (measured.model, measured.batch_size, measured.context)
    predicted = estimate(cfg).peak_bytes
    assert abs(predicted - naive["memory"]["peak_bytes"]) <= 0.02 * naive["memory"]["peak_bytes"]


def test_monotone_in_memory():
    """More memory never gets less work per step, and every pick fits (checked from 1 to 160 GiB)."""
    last = 0.0
    for gib in range(1, 161):
        cfg = choice("NVIDIA H200", gib).config
        work = flops_per_step(cfg)
        assert work >= last, f"{gib} GiB chose less work per step than {gib - 1} GiB"
        last = work
        if cfg.model != C.cpu_preset("cuda").model:
            assert estimate(cfg).peak_gib <= gib * (1 - P.AUTO_HEADROOM)


@pytest.mark.parametrize("name", DEVICES)
def test_a_little_less_than_nominal_picks_the_same_or_the_next_smaller(name):
    """torch reports a GPU's memory after its own reserve (a T4 with ECC shows about 15 of 16): the pick holds or
    steps down, never up."""
    full, less = choice(name).config, choice(name, DEVICES[name] * 0.92).config
    assert flops_per_step(less) <= flops_per_step(full)


@pytest.mark.parametrize("name", DEVICES)
def test_the_reason_names_the_device_the_memory_and_the_choice(name):
    c = choice(name)
    assert "\n" not in c.reason
    assert name in c.reason and f"{DEVICES[name]:.1f} GiB" in c.reason
    assert f"batch {c.config.batch_size}" in c.reason


def test_a_cpu_keeps_the_cpu_preset():
    c = P.auto_choice(P.DeviceDescription("cpu", "cpu"), "cpu")
    assert c.config == C.cpu_preset("cpu") and "cpu" in c.reason
    assert P.preset("auto", "cpu") == C.cpu_preset("cpu")
    assert "cpu" in P.auto_reason("cpu")


def test_a_gpu_too_small_for_any_candidate_gets_the_cpu_model():
    c = choice("Tesla T4", 1)
    assert c.config.model == C.cpu_preset("cuda").model and c.config.device == "cuda"
    assert "1.0 GiB" in c.reason


def test_the_choice_is_a_pure_function_of_the_description():
    desc = gpu("NVIDIA GeForce RTX 4090")
    assert P.auto_choice(desc, "cuda") == P.auto_choice(dataclasses.replace(desc), "cuda")
