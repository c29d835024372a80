"""The Triton flash attention kernels (course_lib.lessons.flash_attention_triton), tested in a process of their own.

Triton decides between compiling and interpreting when triton.language is first imported, reading TRITON_INTERPRET.
In a test worker that ran torch.compile earlier, inductor has already imported triton without it, and the kernels would
then try to compile (there is no GPU) and fail. So on a CPU the kernel cases (tests/triton_kernel_cases.py, not
collected on their own) run in a fresh Python with TRITON_INTERPRET=1 from the start; on a GPU they compile there."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CASES = Path(__file__).with_name("triton_kernel_cases.py")


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason='triton is not installed: pip install -e ".[kernels]"'
)
def test_the_triton_kernels_equal_sdpa_and_the_by_hand_version_in_a_process_of_their_own():
    env = dict(os.environ)
    if not torch.cuda.is_available():
        from course_lib.lessons.flash_attention_triton import interpreter_too_old

        if too_old := interpreter_too_old():
            pytest.skip(too_old)
        env["TRITON_INTERPRET"] = "1"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:randomly",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            str(CASES),
        ],
        cwd=CASES.parent.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    tail = (run.stdout + run.stderr)[-6000:]
    assert run.returncode == 0, tail
    assert " passed" in run.stdout and " failed" not in run.stdout, tail
