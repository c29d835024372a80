"""`python -m course_lib doctor` runs every device-specific path of this device, for real."""

import json

import pytest
import torch

from course_lib import capabilities as K
from course_lib.doctor import FAIL, NA, PASS, SKIPPED, run_doctor


def fake_result(losses=(2.0, 1.5, 1.2), grad_norms=(0.9, 0.8, 0.7)):
    """What the doctor's checks read of a RunResult, for tests that stand in for the training runs."""
    from types import SimpleNamespace

    return SimpleNamespace(
        losses=list(losses), grad_norms=list(grad_norms), tokens_per_s=1000.0, step_times=[1.0] * len(losses)
    )


def test_doctor_runs_every_path_on_this_device(tmp_path):
    report = run_doctor("cpu", json_path=tmp_path / "doctor.json")
    by = {c.name: c for c in report.checks}
    assert not report.failed, report.table()
    caps = K.capabilities("cpu")
    for p in ("fp32", "bf16", "fp16"):
        assert by[f"train step {p}"].status == (PASS if caps.supports(p).ok else NA), by[f"train step {p}"]
    assert by["train step tf32"].status == NA  # TF32 does nothing on a CPU: not passed off as tested
    assert by["compile"].status == (PASS if caps.techniques["compile"].ok else NA)
    assert by["SDPA math"].status == PASS and by["SDPA flash"].status == (PASS if caps.sdpa["flash"].ok else NA)
    assert by["memory report"].status == PASS and by["all-reduce gloo"].status == PASS
    cuda_only = ("reserved vs allocated", "out of memory", "TF32", "memory snapshot")
    assert all(by[n].status == NA and by[n].detail == "CUDA only" for n in cuda_only)
    saved = json.loads((tmp_path / "doctor.json").read_text())
    assert [c["name"] for c in saved["checks"]] == [c.name for c in report.checks]
    assert saved["provenance"]["torch"] == torch.__version__ and "CPU instruction sets" in saved["capabilities"]


def test_a_failing_path_is_reported_as_a_failure_not_a_crash(monkeypatch):
    import course_lib.doctor as D

    def broken(caps):
        raise RuntimeError("the memory report is broken")

    monkeypatch.setattr(D, "check_memory_report", broken)
    report = run_doctor("cpu", only=["memory report"])
    assert [c.status for c in report.checks] == [FAIL] and "is broken" in report.checks[0].detail


def test_ctrl_c_keeps_the_checks_that_ran_and_writes_them(tmp_path, capsys, monkeypatch):
    import course_lib.doctor as D
    from course_lib.__main__ import main as cli

    def interrupted(caps):
        raise KeyboardInterrupt

    monkeypatch.setattr(D, "check_matmul_peak", interrupted)
    out = tmp_path / "d.json"
    assert cli(["doctor", "--quick", "--json", str(out)]) == 130
    report = json.loads(out.read_text())
    names = [c["name"] for c in report["checks"]]
    assert report["interrupted"] == "matmul peak" and "memory report" in names and "matmul peak" not in names
    printed = capsys.readouterr()
    assert "interrupted (Ctrl-C) at matmul peak" in printed.out and "Traceback" not in printed.err


def test_doctor_command_quick_says_what_it_left_out(tmp_path, capsys):
    # The command's own entry point, in this process (test_cli.py runs `python -m course_lib` as a learner types it).
    from course_lib.__main__ import main as cli

    out = tmp_path / "d.json"
    assert cli(["doctor", "--quick", "--json", str(out)]) == 0
    statuses = {c["name"]: c["status"] for c in json.loads(out.read_text())["checks"]}
    assert statuses["compile"] == SKIPPED and statuses["all-reduce gloo"] == SKIPPED
    assert statuses["train step fp32"] == PASS and "SKIPPED" in capsys.readouterr().out


def test_the_compile_check_compares_every_step_and_needs_a_compiled_graph(monkeypatch):
    """A compiled run whose forward agrees but whose later steps drift (a wrong compiled backward or optimizer step)
    fails, and so does one whose losses agree but whose gradient norms do not; so does a "compiled" run in which
    torch.compile captured no graph (eager compared with eager)."""
    import dataclasses

    from torch._dynamo.utils import counters

    import course_lib.doctor as D

    # the check runs even where compile cannot
    cpu = K.capabilities("cpu")
    caps = dataclasses.replace(cpu, techniques={**cpu.techniques, "compile": K.Support(True)})
    runs = {False: [2.0, 1.5, 1.2], True: [2.0, 1.5, 1.3]}
    norms = {False: [0.9, 0.8, 0.7], True: [0.9, 0.8, 0.7]}
    captures = {"graph": True}

    def fake_run(cfg):
        if cfg.compile and captures["graph"]:
            counters["stats"]["unique_graphs"] += 1
        return fake_result(runs[cfg.compile], norms[cfg.compile])

    monkeypatch.setattr(D, "_checked_run", fake_run)
    eager = lambda: fake_run(D.check_config("cpu"))  # noqa: E731 - the doctor's fp32 run, as run_doctor hands it over
    with pytest.raises(AssertionError, match="compiled losses .* differ from eager's"):
        D.check_compile(caps, eager)
    runs[True] = list(runs[False])
    assert "agrees with eager over 3 steps" in D.check_compile(caps, eager)
    norms[True] = [0.9, 0.8, 0.75]  # equal losses, but a gradient norm that differs: a wrong compiled backward
    with pytest.raises(AssertionError, match="compiled grad_norms .* differ from eager's"):
        D.check_compile(caps, eager)
    norms[True] = list(norms[False])
    captures["graph"] = False
    with pytest.raises(AssertionError, match="without torch.compile capturing a graph"):
        D.check_compile(caps, eager)


def test_the_fp32_reference_is_trained_once_and_its_failure_is_named(monkeypatch):
    """fp32's own check, the lower precisions' comparisons and compile's eager run share one fp32 run of the doctor's
    config. A failed fp32 run is not trained again, and every check that needs it says that the reference failed."""
    import dataclasses

    from torch._dynamo.utils import counters

    import course_lib.doctor as D

    yes = K.Support(True, "supported here (a stand-in for the test)")
    cpu = K.capabilities("cpu")
    caps = dataclasses.replace(
        cpu,
        techniques={**cpu.techniques, "compile": yes},
        precisions={"fp32": yes, "tf32": K.Support(False, "no TF32"), "bf16": yes, "fp16": yes},
    )
    trained, broken = [], {"fp32": False}

    def fake_run(cfg):
        trained.append("compiled" if cfg.compile else cfg.precision)
        if cfg.compile:
            counters["stats"]["unique_graphs"] += 1
        if broken["fp32"] and cfg.precision == "fp32" and not cfg.compile:
            raise AssertionError("non-finite loss or gradient norm: losses [nan]")
        return fake_result()

    monkeypatch.setattr(D, "_checked_run", fake_run)
    wanted = ("train step fp32", "train step bf16", "train step fp16", "compile")

    def run_checks() -> dict[str, str]:
        out = {}
        for name, check, _slow in D._checks(caps):
            if name in wanted:
                try:
                    out[name] = check()
                except AssertionError as e:
                    out[name] = f"FAIL {e}"
        return out

    details = run_checks()
    assert trained == ["fp32", "bf16", "fp16", "compiled"], trained  # the fp32 run once, first
    assert not any(d.startswith("FAIL") for d in details.values()), details
    trained.clear()
    broken["fp32"] = True
    details = run_checks()
    assert trained.count("fp32") == 1, trained
    for name in wanted:
        assert details[name].startswith("FAIL the fp32 reference run failed: AssertionError: non-finite loss"), (
            name,
            details[name],
        )
