import json
import subprocess
import sys


def test_ladder_command_runs_rungs_and_writes_json(tmp_path):
    out = tmp_path / "ladder.json"
    proc = subprocess.run([sys.executable, "-m", "course_lib", "ladder", "--preset", "tiny", "--steps", "3", "--rungs", "0,2,3,8,9",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    for name in ("naive fp32", "+ bf16 autocast", "+ sdpa (flash)", "+ checkpointing", "+ chunked loss"):
        assert name in proc.stdout
    assert "speed-up" in proc.stdout and "peak GiB" in proc.stdout
    payload = json.loads(out.read_text())
    assert payload["preset"] == "tiny" and payload["torch"] and payload["device"]
    assert [r["label"] for r in payload["results"]] == ["naive fp32", "+ bf16 autocast", "+ sdpa (flash)", "+ checkpointing", "+ chunked loss"]
    assert all(r["status"] == "ok" and r["config"]["steps"] == 3 for r in payload["results"])
    naive, lean = payload["results"][0], payload["results"][-1]
    assert lean["memory"]["peak_bytes"] < naive["memory"]["peak_bytes"]


def test_bad_arguments_are_explained():
    proc = subprocess.run([sys.executable, "-m", "course_lib", "ladder", "--preset", "tiny", "--rungs", "99"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--rungs takes indices" in proc.stderr


def test_a_ladder_option_from_the_command_line(tmp_path):
    out = tmp_path / "l.json"
    proc = subprocess.run([sys.executable, "-m", "course_lib", "ladder", "--preset", "tiny", "--steps", "3", "--rungs", "8",
                           "--set", "activation_checkpointing=selective", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (r,) = json.loads(out.read_text())["results"]
    assert r["label"] == "+ checkpointing" and r["config"]["activation_checkpointing"] == "selective"
    bad = subprocess.run([sys.executable, "-m", "course_lib", "ladder", "--set", "checkpointing=full"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--set takes TECHNIQUE=VALUE" in bad.stderr
