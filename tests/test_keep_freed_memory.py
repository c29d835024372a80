"""Keeping freed memory (course_lib.cpu_allocator, techniques.keep_freed_memory): what it claims, checked where it can
hold. The allocator's setting is the process's, so each check that switches it runs in a process of its own."""

import dataclasses
import json
import subprocess
import sys

import pytest

from course_lib import capabilities as K, cpu_allocator, export, techniques as T
from course_lib.config import TrainConfig, with_setting

GLIBC = not cpu_allocator.unavailable()

# Frees and allocates a 64 MiB tensor (past glibc's largest mmap threshold, 32 MiB, as naive attention's and the logits'
# tensors are) five times in each setting, counting the page faults of each round; then the loop's own switch.
ROUNDS = """
import json, torch
from course_lib import config as C, cpu_allocator as A
from course_lib.train import Trainer

def rounds():
    out = []
    for _ in range(6):
        before = A.page_faults()
        torch.empty(16 * 2**20).fill_(1.0)  # 64 MiB, touched, then freed
        out.append(A.page_faults() - before)
    return out

default = rounds()
A.keep_freed(True)
kept = rounds()
A.keep_freed(False)
handed_back = rounds()
states = []
for keep in (True, False):
    t = Trainer(C.with_setting(C.preset("tiny", "cpu"), "keep_freed_memory", keep))
    t.step()
    states.append(A.keeping())
print(json.dumps({"default": default, "kept": kept, "handed_back": handed_back, "states": states}))
"""


@pytest.mark.skipif(not GLIBC, reason=f"no glibc here: {cpu_allocator.unavailable()}")
def test_a_freed_block_is_reused_without_page_faults_only_while_freed_memory_is_kept():
    proc = subprocess.run([sys.executable, "-c", ROUNDS], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    # glibc's default: the block is a mapping of its own, unmapped at free; every round maps its pages again (16384
    # faults with 4 KiB pages, 32 with transparent huge pages of 2 MiB)
    assert min(got["default"]) >= 16, got
    # kept: the first rounds grow the heap (what else is allocated between them splits the freed block); then reused
    assert max(got["kept"][3:]) <= 8 and max(got["kept"][3:]) * 4 < min(got["default"]), got
    # handed back (glibc's largest thresholds, what its own rule reaches, and the kept heap returned): every round
    # faults again
    assert min(got["handed_back"]) >= 16, got
    # the loop sets the process's allocator at the start of each step, as its config says
    assert got["states"] == [True, False], got


def test_a_gpu_and_a_c_library_without_the_switch_say_why_it_cannot_run(monkeypatch):
    monkeypatch.setitem(cpu_allocator._state, "keep", None)  # as in a process that never switched it
    cpu = K.capabilities("cpu")
    gpu = dataclasses.replace(cpu, type="cuda")
    assert "caching allocator already keeps freed GPU memory" in gpu.unavailable()["keep_freed_memory=True"]
    assert cpu_allocator.unavailable("cuda") == gpu.unavailable()["keep_freed_memory=True"]
    monkeypatch.setattr(cpu_allocator, "_libc", lambda: None)
    why = cpu_allocator.unavailable()
    assert "glibc" in why and "jemalloc" in why and cpu.unavailable()["keep_freed_memory=True"] == why
    cpu_allocator.keep_freed(True)  # a no-op there, not an error
    assert not cpu_allocator.keeping()


def test_the_exported_script_keeps_freed_memory_on_a_cpu_with_glibc_only():
    cpu = with_setting(TrainConfig(), "keep_freed_memory", True)
    text = export.script(cpu)
    assert f"mallopt({cpu_allocator.M_MMAP_MAX}, 0)" in text and "CS_GNU_LIBC_VERSION" in text
    assert "mallopt" not in export.script(dataclasses.replace(cpu, device="cuda"))  # nothing to do on a GPU


def test_the_rung_comes_first_is_a_speed_rung_and_switches_the_process():
    rung = T.LADDER[1]
    assert rung.name == "+ keep freed memory" and rung.aims == (T.SPEED,) and rung.technique.process_wide
    naive = T.naive(TrainConfig())
    assert T.process_wide_differs(naive, rung.apply(naive)) and not T.process_wide_differs(naive, naive)
