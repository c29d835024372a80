"""Keeping freed memory (course_lib.cpu_allocator, techniques.keep_freed_memory): what it claims, checked where it can
hold. The allocator's setting is the process's, so each check that switches it runs in a process of its own."""

import dataclasses
import json
import subprocess
import sys

import pytest

from course_lib import capabilities as K, config as C, cpu_allocator, export, techniques as T
from course_lib.config import TrainConfig, with_setting
from course_lib.lessons import fresh_processes

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
    # kept: the first round grows the heap; most rounds after it reuse the block. Not every one: what else is allocated
    # in between can split the freed block, and a kernel that reclaims idle memory by itself (DAMON, on the Zen 3 VM,
    # more so under load) can take its pages back between rounds
    reused = [f for f in got["kept"][1:] if f <= 8]
    assert len(reused) >= len(got["kept"][1:]) / 2, got
    # handed back: what the heap kept goes back to the kernel at the switch, so the next round maps it again (later
    # rounds may reuse the heap's free blocks: glibc's own rule, which never put them there, cannot be had back)
    assert got["handed_back"][0] >= 16, got
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


def test_it_has_no_rung_and_a_climb_refuses_it_with_a_reason():
    t = T.TECHNIQUE["keep_freed_memory"]
    assert t.rungs == () and all(r.technique is not t for r in T.LADDER)
    assert not T.naive(with_setting(TrainConfig(), "keep_freed_memory", True)).keep_freed_memory  # naive turns it off
    with pytest.raises(C.ConfigError, match="no rung of the ladder"):
        T.check_ladder_arguments({"keep_freed_memory": True}, None)


@pytest.mark.skipif(not GLIBC, reason=f"no glibc here: {cpu_allocator.unavailable()}")
def test_fresh_processes_time_each_setting_as_a_program_of_its_own(monkeypatch):
    """The naive cpu preset, whose 64 MiB logits glibc maps afresh each step by its own rule: in a process that keeps
    freed memory its settled steps map at most half as many pages (where pages are 4 KiB: with 2 MiB huge pages both
    are few), each process as a program of its own gets it (nothing kept from the tests' own process)."""
    cfg = dataclasses.replace(T.naive(C.preset("cpu", "cpu")), steps=100, measure_memory=False)
    runs = fresh_processes.time_in_fresh_processes(
        {"handed back": cfg, "kept": with_setting(cfg, "keep_freed_memory", True)}, steps=2, warmup=2, rounds=1
    )
    assert [len(r.steps) for r in runs.values()] == [2, 2]
    kept, handed_back = runs["kept"].median_faults, runs["handed back"].median_faults
    assert kept <= handed_back / 2 if handed_back >= 1000 else kept <= max(handed_back, 64), (kept, handed_back)
    monkeypatch.setattr(fresh_processes, "_RUN", "raise SystemExit('no such loop')")
    with pytest.raises(RuntimeError, match="'broken': its process failed: no such loop"):
        fresh_processes.time_in_fresh_processes({"broken": cfg}, steps=1)


def test_a_run_after_freed_memory_was_kept_says_it_is_not_timed_as_glibc_runs_it(tiny, monkeypatch):
    """Once this process has kept freed memory, glibc's own rule cannot be had back: a later run that does not keep it
    says so in its note (a panel's table shows it; its reason, which a ladder rung fills with what it changed, is left
    alone), and a run that keeps it, or one in a process that never did, says nothing."""
    from course_lib import results as results_mod
    from course_lib.train import train

    monkeypatch.setattr(cpu_allocator, "keep_freed", lambda keep: None)  # the test process's allocator left alone
    monkeypatch.setitem(cpu_allocator._state, "keep", None)
    assert train(tiny(steps=2, timing_warmup=1, measure_memory=False), "fresh").note == ""
    monkeypatch.setitem(cpu_allocator._state, "keep", True)
    kept = train(tiny(steps=2, timing_warmup=1, measure_memory=False, keep_freed_memory=True), "kept")
    assert kept.note == "" and "allocator" not in kept.details
    after = train(tiny(steps=2, timing_warmup=1, measure_memory=False), "after")
    if cpu_allocator.unavailable("cpu"):  # not glibc: nothing was kept, nothing to say
        assert after.note == ""
    else:
        assert "glibc's own rule" in after.note and after.details["allocator"] == after.note and after.reason == ""
        assert results_mod.table_rows([after])[0]["note"] == after.note
