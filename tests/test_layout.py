"""What adding a technique must not require (an edit in a second place a reader can forget), and the global state
the package keeps, explicit and tested (issue 32)."""

import torch

from course_lib import config as C, export

# A technique's control and its snippet come from its declaration (tests/test_panel_parts.py builds the controls of a
# made-up registry; tests/test_technique_registry.py holds every module's snippet to its own module).


# ---- the three pieces of global state, explicit and tested ---------------------------------------------------------


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


def test_a_compiled_run_starts_with_a_fresh_compiler_and_an_eager_cpu_one_leaves_it_alone(tiny, monkeypatch):
    """Trainer resets dynamo before a compiled run (an earlier model's guards and dynamo's cache limit would otherwise
    decide what this run compiles, and its first step would not honestly include compiling), and before any CUDA run (it
    frees an earlier run's CUDA graphs, whose pool would count in this run's memory); an eager CPU run does not touch
    the compiler's state, on a machine with a GPU too."""
    from course_lib.train import Trainer

    resets = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1))
    Trainer(tiny(steps=2, timing_warmup=1, measure_memory=False))
    assert resets == []
    Trainer(tiny(steps=2, timing_warmup=1, measure_memory=False, compile=True))
    assert resets == [1]
    if torch.cuda.is_available():
        Trainer(tiny(device="cuda", steps=2, timing_warmup=1, measure_memory=False))
        assert resets == [1, 1]
