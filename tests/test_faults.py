"""Faults a learner meets: a damaged or missing file, a run stopped by Ctrl-C or SIGTERM, a full disk, a damaged or
unwritable cache, an unknown COURSE_BUDGET, odd characters in --set, paths that cannot be written, two climbs writing
one file, and an interrupted panel run. Each must end in a message that says what to change (on the command line: no
traceback, exit 2, or 130/143 for an interrupt), and never leave a result file that is not whole JSON.

A case runs as a learner types it (a subprocess) where the behaviour is the process's own (signals, the environment,
two processes at once); the rest call the same main() in this process."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from course_lib import cache, config as C, ladder as L
from course_lib.__main__ import main as cli
from course_lib.results import ResultsFileError, RunResult, load_results, provenance, save_results

COURSE = [sys.executable, "-m", "course_lib"]


def course(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*COURSE, *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


def said_once(err: str, says: str) -> None:
    """One `error:` line that says `says`, and no traceback."""
    assert err.startswith("error: ") and says in err and "Traceback" not in err, err


def whole_or_absent(folder: Path) -> None:
    """Every .json file in `folder` is whole JSON, and no temporary file is left beside them."""
    for f in folder.rglob("*"):
        assert ".partial" not in f.name, f"{f} left behind"
        if f.suffix == ".json" and f.is_file():
            json.loads(f.read_text())


def a_ladder_file(path: Path, labels=("naive fp32",)) -> Path:
    rows = [RunResult(label, "ok", C.tiny_preset("cpu").to_dict(), provenance("test")) for label in labels]
    return save_results(rows, path, preset="tiny")


# ---- a damaged, foreign or missing ladder file given to export and profile -------------------------------------------

DAMAGED = {
    "truncated": ('{"preset": "tiny", "results": [{"label": "naive fp32", "sta', "ends in the middle of its JSON"),
    "empty": ("", "it is empty"),
    "foreign": ('{"name": "a notebook", "cells": []}', "holds no list of results"),
    "foreign rows": ('{"results": [{"checks": 3}]}', "its result 1 is not a run's record"),
    "not text": (b"\x89PNG\r\n\x1a\n\xff\xfe", "it is not text"),
    "a folder": (None, "is a folder: give the file in it"),
    "missing": ("missing", "there is no file"),
}


@pytest.mark.parametrize("command", ["export", "profile"])
@pytest.mark.parametrize("case", list(DAMAGED))
def test_a_damaged_or_missing_ladder_file_is_named_for_what_it_is(case, command, tmp_path, capsys):
    content, says = DAMAGED[case]
    path = tmp_path / "ladder.json"
    if content is None:
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content != "missing":
        path.write_text(content)
    assert cli([command, "--ladder", str(path)]) == 2
    err = capsys.readouterr().err
    said_once(err, says)
    assert "not a ladder's results file" in err and "ladder --json PATH" in err  # and how to make one
    assert "step 1 of" not in err  # nothing was profiled


def test_a_ladder_file_cut_anywhere_is_named_cut_short(tmp_path):
    """Wherever a copy stops (inside a number such as `0.`, a word, a string, between two rows), the file is named
    cut short, not mistyped: the file's own numbers decide where a cut falls, so every cut is tried."""
    whole = a_ladder_file(tmp_path / "whole.json").read_text().rstrip()
    cut = tmp_path / "cut.json"
    for end in range(1, len(whole)):
        cut.write_text(whole[:end])
        with pytest.raises(ResultsFileError, match="ends in the middle of its JSON"):
            load_results(cut)


def test_a_truncated_ladder_file_from_a_real_process(tmp_path):
    """The same as a learner meets it: one line on stderr, exit 2, nothing on stdout."""
    path = a_ladder_file(tmp_path / "ladder.json")
    path.write_text(path.read_text()[: len(path.read_text()) // 2])
    proc = course("export", "--ladder", str(path))
    assert proc.returncode == 2 and proc.stdout == ""
    said_once(proc.stderr, "ends in the middle of its JSON")
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "change, says",
    [
        (lambda cfg: cfg.update(precision="fp8"), "precision='fp8' is not one of"),
        (lambda cfg: cfg.update(warp_drive=9), "TrainConfig has no field 'warp_drive'"),  # a newer course's file
        (lambda cfg: cfg.update(model="gpt"), "with model a dict too"),
    ],
    ids=["a value edited", "a field unknown", "a section not a dict"],
)
def test_a_ladder_file_whose_loop_was_edited_out_of_shape_is_named(change, says, tmp_path, capsys):
    path = a_ladder_file(tmp_path / "ladder.json", labels=("naive fp32", L.OPTIMISED))
    payload = json.loads(path.read_text())
    change(payload["results"][-1]["config"])
    path.write_text(json.dumps(payload))
    assert cli(["export", "--ladder", str(path)]) == 2
    err = capsys.readouterr().err
    said_once(err, says)
    assert err.startswith(f"error: --ladder {path}: ")


def test_load_results_raises_one_kind_of_error_for_any_damage(tmp_path):
    path = a_ladder_file(tmp_path / "l.json")
    assert [r.label for r in load_results(path)[0]] == ["naive fp32"]
    row = json.loads(path.read_text())
    row["results"][0]["val_losses"] = [1]  # a field of the wrong kind
    path.write_text(json.dumps(row))
    with pytest.raises(ResultsFileError, match="its result 1 is not a run's record"):
        load_results(path)


# ---- a climb stopped by Ctrl-C or SIGTERM: what finished is kept, in a whole file ------------------------------------


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_climb_stopped_by_a_signal_keeps_its_finished_rungs(sig, code, tmp_path, as_from_a_terminal):
    """The signal arrives once the first rung is written (a file of its own, then renamed: never half of one); the
    process ends with one line saying what was kept, the file holds whole JSON, and nothing is left beside it."""
    out = tmp_path / "ladder.json"
    proc = subprocess.Popen(
        [
            *COURSE,
            "ladder",
            "--preset",
            "tiny",
            "--device",
            "cpu",
            "--steps",
            "30",
            "--leave-out",
            "4",
            "--json",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=as_from_a_terminal,
    )
    try:
        deadline = time.monotonic() + 120
        while not out.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert out.exists(), "the first rung was never written"
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == code, stderr
    assert "Traceback" not in stderr and "interrupted: " in stderr and "saved in" in stderr, stderr
    results, meta = load_results(out)
    assert meta["preset"] == "tiny" and results[0].label == "naive fp32" and len(results) < 10
    assert "naive fp32" in stdout  # the table of what was measured
    whole_or_absent(tmp_path)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_command_stopped_by_sigterm_or_sighup_says_one_line(sig, tmp_path, as_from_a_terminal):
    """Any command, not only the ladder: a profile stopped mid-run (a scheduler's SIGTERM, a terminal closed) writes no
    trace and says so in one line; the exit code is 128 + the signal's number, as the shell reports a signal."""
    trace = tmp_path / "trace.json"
    proc = subprocess.Popen(
        [
            *COURSE,
            "profile",
            "--preset",
            "tiny",
            "--device",
            "cpu",
            "--steps",
            "200",
            "--trace",
            str(trace),
            "--no-floor",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=as_from_a_terminal,
    )
    try:
        err = ""
        while "step 2 of" not in err and proc.poll() is None:  # the profile has begun
            err += proc.stderr.readline()
        proc.send_signal(sig)
        _, rest = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig and "interrupted: profile stopped before it finished" in rest, rest
    assert "Traceback" not in err + rest and not trace.exists()
    whole_or_absent(tmp_path)


def test_the_signal_handlers_are_put_back_after_a_command(capsys):
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    assert cli(["config", "--preset", "tiny"]) == 0
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


# ---- a full disk ----------------------------------------------------------------------------------------------------


def full_disk(monkeypatch):
    """Every write of a file's text fails as on a full disk."""

    def no_space(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Path, "write_text", no_space)


def test_a_full_disk_under_export_is_said_and_leaves_the_earlier_script_whole(tmp_path, capsys, monkeypatch):
    out = tmp_path / "train.py"
    out.write_text("the learner's earlier script")
    full_disk(monkeypatch)
    assert cli(["export", "--preset", "tiny", "--out", str(out), "--force"]) == 2
    said_once(capsys.readouterr().err, "No space left on device")
    monkeypatch.undo()
    assert out.read_text() == "the learner's earlier script" and [p.name for p in tmp_path.iterdir()] == ["train.py"]


def test_a_full_disk_under_info_and_doctor_json(tmp_path, capsys, monkeypatch):
    full_disk(monkeypatch)
    assert cli(["info", "--json", str(tmp_path / "info.json")]) == 2
    said_once(capsys.readouterr().err, "No space left on device")
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_mid_climb_keeps_the_results_elsewhere(tmp_path, capsys, monkeypatch):
    """A save that fails keeps the results in memory; the climb goes on, and they land where they can be written."""
    from course_lib.results import ResultsFile

    kept = ResultsFile(tmp_path / "l.json", fallback_name="ladder")
    row = [RunResult("naive fp32", "ok", {}, provenance("test"))]
    full_disk(monkeypatch)
    kept.save(row)
    assert kept.error is not None and kept.error.errno == errno.ENOSPC and not (tmp_path / "l.json").exists()
    monkeypatch.undo()
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "temp"))
    (tmp_path / "temp").mkdir()
    where = kept.finish(complete=True)
    assert where.parent == tmp_path / "temp" and "No space left on device" in kept.note
    assert [r.label for r in load_results(where)[0]] == ["naive fp32"]
    whole_or_absent(tmp_path)


def test_a_full_disk_while_the_trace_is_written_leaves_no_half_trace(tmp_path, capsys, monkeypatch):
    import torch

    def half_then_full(self, path):
        Path(path).write_text('{"traceEvents": [')
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", half_then_full)
    trace = tmp_path / "trace.json"
    assert cli(["profile", "--preset", "tiny", "--steps", "1", "--rows", "1", "--no-floor", "--trace", str(trace)]) == 2
    err = capsys.readouterr().err.split("\nerror: ")[1]  # after the steps' progress lines
    assert err.startswith(f"No space left on device while profiling with --trace {trace}") and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_dev_full_is_refused_as_no_plain_file(capsys):
    for args in (["export", "--preset", "tiny", "--out"], ["info", "--json"], ["ladder", "--preset", "tiny", "--json"]):
        assert cli([*args, "/dev/full", "--force"]) == 2, args
        said_once(capsys.readouterr().err, "is not a plain file")


# ---- a damaged or unwritable cache folder -------------------------------------------------------------------------


def test_a_damaged_token_cache_is_encoded_again_and_rewritten(tmp_path, monkeypatch):
    from course_lib import data

    monkeypatch.setenv("COURSE_CACHE_DIR", str(tmp_path))
    data.token_stream.cache_clear()
    try:
        good = data.token_stream()
        (cached,) = tmp_path.glob("tokens-*.pt")
        cached.write_bytes(cached.read_bytes()[:100])  # cut short, as a disk that filled up would leave it
        data.token_stream.cache_clear()
        assert data.token_stream().equal(good)
        import torch

        assert torch.load(cached, weights_only=True).long().equal(good)  # written whole again
    finally:
        data.token_stream.cache_clear()


@pytest.mark.parametrize("where", ["a file", "/proc"], ids=["a file", "a read-only place"])
def test_an_unwritable_cache_folder_does_not_stop_a_run(where, tmp_path, monkeypatch, tiny):
    from course_lib import data
    from course_lib.train import run

    blocked = tmp_path / "cache"
    blocked.write_text("a file where the cache folder should be")
    monkeypatch.setenv("COURSE_CACHE_DIR", str(blocked if where == "a file" else "/proc/course_lib-cache"))
    data.token_stream.cache_clear()
    try:
        result = run(tiny(steps=3), "cache blocked")
    finally:
        data.token_stream.cache_clear()
    assert result.ok, result.reason
    assert blocked.read_text() == "a file where the cache folder should be"


def test_no_home_folder_puts_the_cache_in_the_temporary_folder(tmp_path, monkeypatch):
    def no_home():
        raise RuntimeError("Could not determine home directory.")

    for name in ("COURSE_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(Path, "home", no_home)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    assert cache.cache_dir() == tmp_path / "course_lib-cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "xdg" / "course_lib"


@pytest.mark.parametrize("strict", [True, False], ids=["a result", "a cache"])
def test_an_interrupt_in_the_middle_of_a_write_leaves_the_earlier_file_and_no_part(strict, tmp_path):
    path = tmp_path / "l.json"
    path.write_text("the earlier file")

    def interrupted(partial):
        partial.write_text('{"results": [')
        raise KeyboardInterrupt  # SIGTERM arrives while the file is written

    with pytest.raises(KeyboardInterrupt):
        cache.write_atomic(path, interrupted, strict=strict)
    assert path.read_text() == "the earlier file" and [p.name for p in tmp_path.iterdir()] == ["l.json"]


def test_write_atomic_skips_a_cache_it_cannot_write_and_raises_for_a_result(tmp_path):
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("x")
    cache.write_atomic(blocked / "peaks.json", lambda f: f.write_text("{}"))  # a cache: skipped, no error
    with pytest.raises(OSError):
        cache.write_atomic(blocked / "results.json", lambda f: f.write_text("{}"), strict=True)


# ---- an unknown COURSE_BUDGET ---------------------------------------------------------------------------------------


def test_an_unknown_budget_is_said_by_the_first_command_with_the_allowed_values():
    proc = course("info", env={"COURSE_BUDGET": "quick"})
    assert proc.returncode == 2 and proc.stdout == ""
    said_once(proc.stderr, "COURSE_BUDGET='quick' is not a budget")
    assert "full (" in proc.stderr and "smoke (" in proc.stderr and "unset it" in proc.stderr


# ---- odd characters in --set ----------------------------------------------------------------------------------------

ODD = [
    ("lr=1=2", "lr takes a finite number"),
    ("=3", "--set takes FIELD=VALUE"),
    ("lr=", "--set takes FIELD=VALUE"),
    ("a b=1", "is no setting's name"),
    ("l\nr=1", "is no setting's name"),
    ("lr=1\n2", "lr takes a finite number"),
    ('"lr=1', "is no setting's name"),
    ("präcision=bf16", "did you mean 'precision'"),
    ("batch_size=８x", "batch_size takes an integer"),
    ("max-steps=1", "is no setting's name"),
]


@pytest.mark.parametrize("item, says", ODD, ids=[repr(i) for i, _ in ODD])
def test_odd_characters_in_set_are_said_not_raised(item, says, capsys):
    assert cli(["config", "--preset", "tiny", "--set", item]) == 2
    said_once(capsys.readouterr().err, says)


@pytest.mark.parametrize("item", ["lr = 0.002", "lr='0.002'", "'lr'=0.002", 'lr="0.002"'])
def test_spaces_and_quotes_around_a_setting_are_taken(item, capsys):
    assert cli(["config", "--preset", "tiny", "--set", item]) == 0
    assert any(line.split()[:2] == ["lr", "0.002"] for line in capsys.readouterr().out.splitlines())


# ---- trace and output paths that cannot be written ------------------------------------------------------------------

UNWRITABLE = {
    "a folder": (lambda tmp: tmp, "is a folder: give a file name"),
    "under a file": (lambda tmp: tmp / "afile" / "x.json", "no file can be made"),
    "read-only place": (lambda tmp: Path("/proc/course.json"), "no file can be made"),
}
WRITERS = [
    ["profile", "--preset", "tiny", "--trace"],
    ["ladder", "--preset", "tiny", "--json"],
    ["export", "--preset", "tiny", "--out"],
    ["doctor", "--quick", "--json"],
    ["info", "--json"],
]


@pytest.mark.parametrize("case", list(UNWRITABLE))
@pytest.mark.parametrize("args", WRITERS, ids=[a[0] for a in WRITERS])
def test_an_output_path_that_cannot_be_written_is_refused_before_any_work(case, args, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    path, says = UNWRITABLE[case]
    assert cli([*args, str(path(tmp_path))]) == 2
    err = capsys.readouterr().err
    said_once(err, says)
    assert "step 1 of" not in err and "rung 1 of" not in err and "checking" not in err


def test_a_missing_folder_is_made_for_an_output(tmp_path, capsys):
    out = tmp_path / "new" / "deeper" / "train.py"
    assert cli(["export", "--preset", "tiny", "--out", str(out)]) == 0 and out.is_file()
    info = tmp_path / "another" / "info.json"
    assert cli(["info", "--json", str(info)]) == 0 and json.loads(info.read_text())["course_lib"]


# ---- two climbs writing one file at once ----------------------------------------------------------------------------


def test_two_writers_of_one_results_file_never_leave_it_half_written(tmp_path):
    """Each save is a file of its own renamed over the path: a reader at any moment sees one writer's whole file."""
    path = tmp_path / "l.json"
    rows = {who: [RunResult(f"{who} {i}", "ok", {"pad": "x" * 5000}, {}) for i in range(20)] for who in "ab"}
    stop, seen, bad = threading.Event(), set(), []

    def write(who):
        for n in range(1, 21):
            save_results(rows[who][:n], path, writer=who)

    def read():
        while not stop.is_set():
            try:
                payload = json.loads(path.read_text())
                seen.add(payload["writer"])
                assert all(r["label"].startswith(payload["writer"]) for r in payload["results"])
            except FileNotFoundError:
                pass
            except (ValueError, AssertionError) as e:
                bad.append(e)

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(who,)) for who in "ab"]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    reader.join()
    assert not bad, bad[:3]
    assert len(load_results(path)[0]) == 20
    whole_or_absent(tmp_path)


def test_two_climbs_at_once_into_one_file_leave_one_whole_climb(tmp_path):
    out = tmp_path / "ladder.json"
    cmd = [*COURSE, "ladder", "--preset", "tiny", "--steps", "3", "--rungs", "0", "--json", str(out), "--force"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outcomes = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outcomes]
    results, meta = load_results(out)
    assert meta["preset"] == "tiny" and results[0].label == "naive fp32" and L.OPTIMISED in [r.label for r in results]
    whole_or_absent(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ladder.json"]


# ---- a panel run interrupted (Kernel > Interrupt) -------------------------------------------------------------------


def test_an_interrupted_panel_run_is_a_row_and_the_panel_runs_again(tiny):
    from course_lib import widgets
    from course_lib.train import run

    calls = []

    def runner(cfg, label, callback):
        calls.append(label)
        if len(calls) == 1:
            raise KeyboardInterrupt  # the learner pressed Interrupt in the middle of the first run
        return run(cfg, label, callback=callback)

    panel = widgets.Panel(tiny(steps=3), runner=runner)
    with pytest.raises(KeyboardInterrupt):  # the cell stops, as an interrupt should
        panel.run()
    first = panel.results[-1]
    assert first.status == "interrupted" and "run it again" in first.reason
    assert "interrupted" in panel.status.value and panel.progress.description == "interrupted"
    again = panel.run()
    assert again.ok and [r.status for r in panel.results] == ["interrupted", "ok"]
