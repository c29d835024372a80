"""What adding a technique must not require (an edit in a second place a reader can forget), and the global state
the package keeps, explicit and tested (issue 32)."""

import torch

from course_lib import config as C, export, techniques as T, widgets


def test_every_technique_has_a_control_on_the_default_panel():
    assert {t.name for t in T.TECHNIQUES} <= set(widgets.ALL_CONTROLS)


def test_every_technique_has_an_export_snippet():
    assert {t.field for t in T.TECHNIQUES} <= set(export.SNIPPETS) | set(export.NOT_EXPORTED)


# ---- the two pieces of global state, explicit and tested ---------------------------------------------------------


def test_a_run_seeds_itself_whatever_the_global_rng_held_before(tiny):
    """Trainer seeds torch's global RNG with cfg.seed (the model's initialisation draws from it): what ran before, a
    notebook cell or another run, cannot change a run's numbers."""
    from course_lib.train import run

    cfg = tiny(steps=2, timing_warmup=1, measure_memory=False)
    torch.manual_seed(123)
    first = run(cfg, "a").losses
    torch.manual_seed(999)
    torch.rand(1000)  # the global RNG moved on
    assert run(cfg, "b").losses == first


def test_the_exported_script_is_cached_by_its_frozen_config():
    """export.script is a pure function of a frozen TrainConfig, so it is cached (the panel and the ladder's diffs ask
    again); a config that differs gets its own script."""
    assert C.TrainConfig.__dataclass_params__.frozen
    cfg = C.tiny_preset("cpu")
    assert export.script(cfg) is export.script(cfg)
    assert export.script(cfg.with_model(attention="sdpa")) != export.script(cfg)
    assert export.script.cache_info().maxsize is not None  # bounded: a long session does not grow it without end
