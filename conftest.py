"""Test-wide settings, shared fixtures and markers.

COURSE_BUDGET=smoke makes every notebook and experiment small (read by course_lib.budget); notebook kernels
started by nbval inherit the environment, so they see it too.

Markers, given here by where a test lives, so that `pytest -m "not notebook and not browser"` is a fast inner
loop: unit (the default), distributed (starts torchrun processes), notebook (an nbval cell), browser (a real
JupyterLab in Chromium), cuda (needs a GPU; skipped elsewhere with the reason).
"""
import dataclasses
import os

import pytest

os.environ.setdefault("COURSE_BUDGET", "smoke")

MARKERS = {
    "unit": "fast tests of course_lib (the default)",
    "distributed": "starts torchrun processes (gloo on a CPU)",
    "notebook": "a notebook cell executed by nbval",
    "browser": "a real JupyterLab in headless Chromium",
    "cuda": "needs an NVIDIA GPU; skipped elsewhere with the reason",
}
DISTRIBUTED_FILES = {"test_distributed.py", "test_doctor.py"}


def pytest_configure(config):
    for name, what in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {what}")


def pytest_collection_modifyitems(config, items):
    import torch

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


@pytest.fixture
def tiny():
    """tiny(**changes): the tiny preset on the CPU (a few milliseconds a step), with changes."""
    from course_lib import config

    def make(**changes):
        return dataclasses.replace(config.tiny_preset("cpu"), **changes)

    return make


@pytest.fixture
def tiny_model():
    """tiny_model(**model_changes): a seeded 2-block GPT of width 32 over a 64-token vocabulary."""
    import torch

    from course_lib import config
    from course_lib.model import GPT

    def make(**changes):
        torch.manual_seed(0)
        return GPT(config.ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=64, **changes))

    return make
