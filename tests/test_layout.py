"""What adding a technique must not require (an edit in a second place a reader can forget), and the global state
the package keeps, explicit and tested."""

import ast
import dataclasses
from pathlib import Path

import torch

import course_lib
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


# ---- the step a learner reads, and functions a reader can hold in view -----------------------------------------------

MAX_LINES = 60


def _functions():
    """(file:function, its node) for every function of the package, nested ones and methods included."""
    root = Path(course_lib.__file__).parent
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{path.relative_to(root.parent).as_posix()}:{node.name}", node


def _lines(node) -> int:
    return node.end_lineno - node.lineno + 1


def test_no_function_is_longer_than_a_screen():
    long = {}
    for name, node in _functions():
        if _lines(node) > MAX_LINES:
            long[name] = max(long.get(name, 0), _lines(node))
    assert not long, f"over {MAX_LINES} lines: {long}"


def _calls(node) -> set[str]:
    """The names a function calls: f(...) as "f", x.f(...) as "f"."""
    return {
        c.func.id if isinstance(c.func, ast.Name) else c.func.attr
        for c in ast.walk(node)
        if isinstance(c, ast.Call) and isinstance(c.func, (ast.Name, ast.Attribute))
    }


def test_the_step_is_one_short_function_three_calls_from_a_notebooks_run():
    """train.train_step is the function that calls backward(), in at most MAX_LINES lines; a notebook's train.run calls
    Trainer.fit, which calls train_step: run -> fit -> train_step -> backward, all in train.py."""
    functions = dict(_functions())
    backward = [
        n for n, node in functions.items() if n.startswith("course_lib/train.py:") and "backward" in _calls(node)
    ]
    assert backward == ["course_lib/train.py:train_step"]
    assert _lines(functions["course_lib/train.py:train_step"]) <= MAX_LINES
    assert "fit" in _calls(functions["course_lib/train.py:run"])
    assert "train_step" in _calls(functions["course_lib/train.py:fit"])


def test_the_step_calls_no_function_stored_on_the_setup():
    """What the step calls is code a reader's editor can jump to: the only callables Setup holds are the loss (the
    model, maybe compiled) and the autocast context; a pipeline and a hand-written DDP are objects whose methods it
    calls."""
    from course_lib.techniques.assemble import Setup

    callables = {f.name for f in dataclasses.fields(Setup) if "Callable" in str(f.type)}
    assert callables <= {"loss_fn", "autocast"}, callables
