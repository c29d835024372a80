import json
import subprocess
import sys


def test_ladder_command_runs_rungs_and_writes_json(tmp_path):
    # compile (rung 4) left out: it is a minute of a 2-core CPU, and test_compile covers it
    out = tmp_path / "ladder.json"
    proc = subprocess.run([sys.executable, "-m", "course_lib", "ladder", "--preset", "tiny", "--steps", "3", "--rungs", "0,2,3,8,9",
                           "--leave-out", "4", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    for name in ("naive fp32", "+ bf16 autocast", "+ sdpa (flash)", "+ compile", "+ checkpointing", "+ chunked loss"):
        assert name in proc.stdout
    assert "speed-up" in proc.stdout and "peak GiB" in proc.stdout
    payload = json.loads(out.read_text())
    assert payload["preset"] == "tiny" and payload["torch"] and payload["device"]
    by = {r["label"]: r for r in payload["results"]}
    assert list(by) == ["naive fp32", "+ bf16 autocast", "+ sdpa (flash)", "+ compile", "+ checkpointing", "+ chunked loss"]
    assert by.pop("+ compile")["status"] == "skipped" and "--leave-out" in proc.stdout + json.dumps(payload)
    assert all(r["status"] == "ok" and r["config"]["steps"] == 3 and r["config"]["compile"] is False for r in by.values())
    assert "climbing without: + compile" in by["+ chunked loss"]["reason"]
    naive, lean = by["naive fp32"], by["+ chunked loss"]
    assert lean["memory"]["peak_bytes"] < naive["memory"]["peak_bytes"]


def test_bad_arguments_are_explained():
    proc = subprocess.run([sys.executable, "-m", "course_lib", "ladder", "--preset", "tiny", "--rungs", "99"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--rungs takes indices" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "course_lib", "ladder", "--preset", "tiny", "--leave-out", "compile"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--leave-out takes indices" in proc.stderr


def test_a_ladder_option_from_the_command_line(tmp_path):
    out = tmp_path / "l.json"
    proc = subprocess.run([sys.executable, "-m", "course_lib", "ladder", "--preset", "tiny", "--steps", "3", "--rungs", "8", "--leave-out", "4",
                           "--set", "activation_checkpointing=selective", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    skipped, r = json.loads(out.read_text())["results"]
    assert skipped["label"] == "+ compile" and skipped["status"] == "skipped"
    assert r["label"] == "+ checkpointing" and r["config"]["activation_checkpointing"] == "selective"
    bad = subprocess.run([sys.executable, "-m", "course_lib", "ladder", "--set", "checkpointing=full"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--set takes TECHNIQUE=VALUE" in bad.stderr
