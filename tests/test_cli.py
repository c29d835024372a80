"""`python -m course_lib ladder`: one run end to end as a learner types it (a subprocess); the rest call the same
main() in this process, which saves a Python and torch start-up per command."""
import json
import subprocess
import sys

from course_lib.__main__ import main as cli


def test_ladder_command_runs_rungs_and_writes_json(tmp_path):
    # compile (rung 4) left out: it is a minute of a 2-core CPU, and the doctor's compile check covers it (test_doctor)
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


def test_bad_arguments_are_explained(capsys):
    assert cli(["ladder", "--preset", "tiny", "--rungs", "99"]) == 2
    assert "--rungs takes indices" in capsys.readouterr().err
    assert cli(["ladder", "--preset", "tiny", "--leave-out", "compile"]) == 2
    assert "--leave-out takes indices" in capsys.readouterr().err
    assert cli(["ladder", "--set", "checkpointing=full"]) == 2
    assert "--set takes TECHNIQUE=VALUE" in capsys.readouterr().err


def test_a_ladder_option_from_the_command_line(tmp_path):
    out = tmp_path / "l.json"
    assert cli(["ladder", "--preset", "tiny", "--steps", "3", "--rungs", "8", "--leave-out", "4",
                "--set", "activation_checkpointing=selective", "--json", str(out)]) == 0
    skipped, r = json.loads(out.read_text())["results"]
    assert skipped["label"] == "+ compile" and skipped["status"] == "skipped"
    assert r["label"] == "+ checkpointing" and r["config"]["activation_checkpointing"] == "selective"
