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
# tensors are) six times in each setting, recording for each round the page faults, the bytes glibc held in mappings of
# their own while the tensor lived (mallinfo2's hblkhd) and the free bytes its heap kept after the free (fordblks); then
# the loop's own switch.
ROUNDS = """
import ctypes, json, torch
from course_lib import config as C, cpu_allocator as A
from course_lib.train import Trainer

FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")

class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in FIELDS]

class Mallinfo(ctypes.Structure):  # glibc before 2.33: ints, enough for these sizes
    _fields_ = [(name, ctypes.c_int) for name in FIELDS]

libc = ctypes.CDLL("libc.so.6")
if not hasattr(libc, "mallinfo2"):
    libc.mallinfo2 = libc.mallinfo
    Mallinfo2 = Mallinfo
libc.mallinfo2.restype = Mallinfo2

def rounds():
    out = []
    for _ in range(6):
        before = A.page_faults()
        t = torch.empty(16 * 2**20).fill_(1.0)  # 64 MiB, touched, then freed
        mapped = libc.mallinfo2().hblkhd
        del t
        out.append([A.page_faults() - before, mapped, libc.mallinfo2().fordblks])
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
def test_a_freed_block_stays_in_the_heap_for_reuse_only_while_freed_memory_is_kept():
    proc = subprocess.run([sys.executable, "-c", ROUNDS], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    block = 64 * 2**20
    faults, mapped, _ = (list(column) for column in zip(*got["default"]))
    # glibc's default: the block is a mapping of its own, unmapped at free, so every round the kernel maps its pages
    # again (16384 faults with 4 KiB pages, 32 with transparent huge pages of 2 MiB)
    assert min(mapped) >= block and min(faults) >= 16, got
    # kept: the block comes from the heap, and after the free the heap keeps it. Whether the next round reuses it
    # without page faults is not asserted: that depends on what else the heap holds around it (a freed chunk hemmed in
    # by a small one can be just too small for the next request with its alignment) and on a kernel that reclaims idle
    # memory by itself (DAMON runs on the Zen 3 VM). Run alone there, most rounds reused it; in one run beside another
    # test worker no round did, cause not established (2026-11-27). Notebook 02 measures whole steps in fresh
    # processes, where the kept heap has settled.
    _, mapped, kept_free = (list(column) for column in zip(*got["kept"]))
    assert max(mapped) < block and min(kept_free) >= block, got
    # handed back: what the heap kept goes back to the kernel at the switch, so the next round maps it again (later
    # rounds may reuse the heap's free blocks: glibc's own rule, which never put them there, cannot be had back)
    assert got["handed_back"][0][0] >= 16, got
    # the loop sets the process's allocator at the start of each step, as its config says
    assert got["states"] == [True, False], got


def test_a_gpu_and_a_c_library_without_the_switch_say_why_it_cannot_run(monkeypatch):
    monkeypatch.setitem(cpu_allocator._state, "keep", None)  # as in a process that never switched it
    probe = T.TECHNIQUE["keep_freed_memory"].probe  # what capabilities asks of a device, through the registry
    gpu = probe("cuda")
    assert not gpu.ok and "caching allocator already keeps freed GPU memory" in gpu.note
    assert cpu_allocator.unavailable("cuda") == gpu.note
    assert ("keep_freed_memory=True" in K.capabilities("cpu").unavailable()) == (not probe("cpu").ok)
    monkeypatch.setattr(cpu_allocator, "_libc", lambda: None)
    why = cpu_allocator.unavailable()
    assert "glibc" in why and "jemalloc" in why and probe("cpu").note == why and not probe("cpu").ok
    cpu_allocator.keep_freed(True)  # a no-op there, not an error
    assert not cpu_allocator.keeping()


def test_the_exported_script_keeps_freed_memory_on_a_cpu_with_glibc_only():
    cpu = with_setting(TrainConfig(), "keep_freed_memory", True)
    text = export.script(cpu)
    assert "libc.mallopt(M_MMAP_MAX, 0)" in text and "CS_GNU_LIBC_VERSION" in text
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
