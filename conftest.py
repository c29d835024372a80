"""Test-wide settings, shared fixtures and markers.

COURSE_BUDGET=smoke makes every notebook and experiment small (read by course_lib.budget), and
COURSE_FILL_EXERCISES=1 fills the exercises' stubs with the references; notebook kernels started by nbval inherit the
environment, so they see both.

Markers, given here by where a test lives, so that `pytest -m "not notebook and not browser"` is a fast inner
loop: unit (the default), distributed (starts torchrun processes), notebook (an nbval cell), browser (a real
JupyterLab in Chromium), cuda (needs a GPU; skipped elsewhere with the reason).
"""

import dataclasses
import os
import signal

import pytest

os.environ.setdefault("COURSE_BUDGET", "smoke")
# The notebooks' exercises: a stub left as it is gets the reference filled in, so every checker runs in the tests
# (course_lib.exercises); a learner's kernel does not have it and sees "not solved yet".
os.environ.setdefault("COURSE_FILL_EXERCISES", "1")

# pytest-xdist runs the tests in several worker processes (`pytest -n 2`, the README's command). Each worker, and
# every notebook kernel and torchrun rank it starts (they inherit the environment), gets its share of the cores: two
# workers each running torch on every core would oversubscribe a 2-core machine, and OpenMP threads waiting on each
# other slow everything down.
if workers := os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    share = str(max(1, cores // int(workers)))
    os.environ.setdefault("OMP_NUM_THREADS", share)
    # torch.compile's C++ compiles too: with more than one thread it starts a pool of processes (each importing torch,
    # ~2 CPU-s) in every process that compiles, to compile in parallel on cores the other worker is using.
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", share)

MARKERS = {
    "unit": "fast tests of course_lib (the default)",
    "distributed": "starts torchrun processes (gloo on a CPU)",
    "notebook": "a notebook cell executed by nbval",
    "browser": "a real JupyterLab in headless Chromium",
    "cuda": "needs an NVIDIA GPU; skipped elsewhere with the reason",
}
DISTRIBUTED_FILES = {"test_distributed.py", "test_doctor.py"}
# pytest-xdist sends each of these groups whole to one worker; every other test goes alone to whichever worker is free.
# A notebook's cells run in order in one kernel. The browser test's cases share one JupyterLab and one Chromium. These
# files build a costly fixture once. The compile tests
# share a worker, so that torch.compile's start-up (importing dynamo, AOTAutograd and inductor) is paid once; the doctor
# and the exporter's compile case compile the same model with inductor: compiled once, then read from its cache.
# The files that check the strategies run in the session fixture `launched` share a worker, so that it launches once.
FILE_GROUPS = {
    "test_browser.py": "browser",
    "test_export.py": "compile",
    "test_compile.py": "compile",
    "test_doctor.py": "compile",
    "test_accumulated_gradients.py": "accumulation",
    "test_selective_checkpointing.py": "selective checkpointing",
    "test_ring_attention.py": "ring attention",  # its launches (2 and 4 processes) once, in one module fixture
    **dict.fromkeys(
        ("test_distributed.py", "test_zero_stages.py", "test_tensor_parallel.py", "test_moe.py"), "launched"
    ),
}
# The longest units are handed out first (on 2 cores with a cold compile cache: the browser cases ~2.5 min, the compile
# group ~2 min, then the notebooks, 8-70 s each), so that no worker starts a long one while the other runs out of work.
FIRST = ("browser", "compile", ".ipynb")


def worker_group(nodeid: str) -> str:
    """The unit of work pytest-xdist schedules for a test: its group, or the test alone."""
    path = nodeid.split("::")[0]
    if path.endswith(".ipynb"):
        return path
    return FILE_GROUPS.get(os.path.basename(path), nodeid)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """`pytest -n N` (xdist's default --dist load) or --dist loadgroup: schedule by the groups above. xdist's own
    loadgroup reads xdist_group marks from rewritten node ids, which pytest 9.2 no longer reads, and plain load would
    split a notebook's cells between workers. Other --dist modes are xdist's own."""
    if config.getvalue("dist") not in ("load", "loadgroup"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # keep the order pytest_collection_modifyitems gives (FIRST)

    class Grouped(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    return Grouped(config, log)


def pytest_configure(config):
    for name, what in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {what}")


def _start_rank(item) -> int:
    unit = worker_group(item.nodeid)
    return next((i for i, first in enumerate(FIRST) if unit.endswith(first)), len(FIRST))


def pytest_collection_modifyitems(config, items):
    import torch

    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker collects; the scheduler hands out units in this order
        items.sort(key=_start_rank)  # stable: a file's tests and a notebook's cells keep their order

    no_cuda = pytest.mark.skip(reason="needs CUDA (an NVIDIA GPU): none on this machine")
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_cuda)
        path = str(item.fspath)
        if path.endswith(".ipynb"):
            item.add_marker("notebook")
        elif path.endswith("test_browser.py"):
            item.add_marker("browser")
        elif os.path.basename(path) in DISTRIBUTED_FILES:
            item.add_marker("distributed")
        elif "cuda" not in item.keywords and "distributed" not in item.keywords:  # a test may mark itself distributed
            item.add_marker("unit")


@pytest.fixture(scope="session")
def splits():
    """The course's text, tokenized once for the whole run."""
    from course_lib import data

    return data.load_splits()


# The strategies the distributed tests check, with their options: run in series in one torchrun launch (see `launched`).
LAUNCHED = [
    ("ddp", {"steps": 3, "accum": 2}),
    ("fsdp", {"steps": 2}),
    ("pipeline", {"microbatches": [2, 4], "steps": 2, "n_layer": 4, "batch_size": 4}),
    ("zero_stages", {"steps": 3}),
    # sequence parallelism runs plain tensor parallelism too
    ("tensor_parallel", {"repeats": 1, "sequence_parallel": True}),
    ("expert_parallel", {"n_experts": 4, "top_k": 2, "capacity_factor": 0.75}),
    # each collective once on 1 MiB: what a rank writes to its sockets (gloo, Linux)
    ("selftest", {"measure_bytes": 2**20}),
]


@pytest.fixture(scope="session")
def launched(tmp_path_factory):
    """{strategy: LaunchResult} for LAUNCHED, 2 gloo processes: one launch (course_lib.distributed.series) whose
    processes start once, not once per strategy (a start costs ~5 CPU-s on 2 cores). A test calls raise_for_status()
    on its strategy's result, which shows the launch's stderr if that run failed."""
    from course_lib import config
    from course_lib.distributed import launch

    # the pipeline's: small enough that every step clips
    clipped = dataclasses.replace(config.tiny_preset("cpu"), clip_norm=0.05)
    return launch.launch_series(
        LAUNCHED,
        2,
        cfgs={"pipeline": clipped},
        device="cpu",
        timeout_s=600,
        out_dir=tmp_path_factory.mktemp("launched"),
    )


@pytest.fixture
def tiny():
    """tiny(**changes): the tiny preset on the CPU (a few milliseconds a step), with changes."""
    from course_lib import config

    def make(**changes):
        return dataclasses.replace(config.tiny_preset("cpu"), **changes)

    return make


@pytest.fixture
def pyflakes():
    """pyflakes(*paths): pyflakes' findings in those files ("" when clean). Skips, saying so, where pyflakes is not
    installed (it comes with the test extra; a GPU machine gets it as a carried wheel, see .ci/gpu)."""
    import importlib.util
    import subprocess
    import sys

    def check(*paths) -> str:
        if importlib.util.find_spec("pyflakes") is None:
            pytest.skip("pyflakes is missing: pip install -e '.[test]'")
        proc = subprocess.run(
            [sys.executable, "-m", "pyflakes", *map(str, paths)], capture_output=True, text=True, timeout=120
        )
        return "" if proc.returncode == 0 else (proc.stdout + proc.stderr or f"pyflakes exited {proc.returncode}")

    return check


@pytest.fixture
def tiny_model():
    """tiny_model(**model_changes): a seeded 2-block GPT of width 32 over a 64-token vocabulary."""
    import torch

    from course_lib import config
    from course_lib.model import GPT

    def make(**changes):
        torch.manual_seed(0)
        return GPT(
            config.ModelConfig(
                **{"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32, "vocab_size": 64, **changes}
            )
        )

    return make


@pytest.fixture
def as_from_a_terminal():
    """A child's preexec_fn for a test that stops it as a terminal would (Ctrl-C, a closed terminal, a scheduler's
    SIGTERM): a test run started in the background ignores SIGINT, one under nohup SIGHUP, and a child would inherit
    that, where a learner's command has each signal's default."""

    def default_signals():
        for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)

    return default_signals
