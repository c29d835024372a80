"""`python -m course_lib ladder`: one run end to end as a learner types it (a subprocess); the rest call the same
main() in this process, which saves a Python and torch start-up per command."""

import json
import re
import subprocess
import sys

from course_lib import config as C, export, ladder as L, techniques as T
from course_lib.__main__ import main as cli


def test_ladder_command_runs_rungs_and_writes_json(tmp_path):
    # compile (rung 4) left out: it is a minute of a 2-core CPU, and the doctor's compile check covers it (test_doctor)
    out = tmp_path / "ladder.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "course_lib",
            "ladder",
            "--preset",
            "tiny",
            "--steps",
            "5",
            "--rungs",
            "0,2,3,8,9",
            "--leave-out",
            "4",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    names = [r.name for r in T.LADDER]
    for name in names + [L.OPTIMISED]:
        assert name in proc.stdout
    assert "vs best so far" in proc.stdout and "peak GiB" in proc.stdout and "ms/step min-med-max" in proc.stdout
    # the 5 rungs asked for and the last row, and one more for each second look; no rung left out is announced
    counted = re.findall(r"rung (\d+) of (\d+)", proc.stderr)
    assert counted[0] == ("1", "6") and "rung 1 of 6: naive fp32" in proc.stderr and "left)" in proc.stderr
    assert counted[-1][0] == counted[-1][1] and int(counted[-1][1]) >= 6 and "+ compile (" not in proc.stderr
    assert "the optimised loop is" in proc.stdout and "kept:" in proc.stdout
    payload = json.loads(out.read_text())
    assert payload["preset"] == "tiny" and payload["torch"] and payload["device"] and payload["fixed"] is False
    by = {r["label"]: r for r in payload["results"]}
    assert [label for label in by if not label.endswith(L.AGAIN)] == names + list(L.FINAL_ROWS)
    assert tuple(by)[-2:] == L.FINAL_ROWS
    assert by["+ compile"]["status"] == "skipped" and "--leave-out" in by["+ compile"]["reason"]
    assert by["+ tf32"]["status"] == "skipped" and "not among the rungs asked for" in by["+ tf32"]["reason"]
    ran = [by[n] for n in ("naive fp32", "+ 16-bit autocast", "+ sdpa", "+ checkpointing", "+ chunked loss")]
    assert all(r["status"] == "ok" and r["config"]["steps"] == 5 and r["config"]["compile"] is False for r in ran)
    for r in ran[1:]:  # each measured in pairs against the best loop so far, with its verdict
        assert len(r["ladder"]["pairs"]) == 3 and r["ladder"]["why"].startswith(("kept", "not kept")), r["ladder"]
    top = by[L.OPTIMISED]
    # the kept rungs in the order they ran: the ladder's, then any second looks ("<rung>, again")
    kept = [label for label, r in list(by.items())[1:-2] if r["ladder"]["kept"]]
    assert by[L.LEANEST]["ladder"]["kept_rungs"] == kept and top["status"] == "ok"
    assert set(top["ladder"]["kept_rungs"]) <= set(kept)  # less the memory rungs that cost time
    # The optimised loop is what export writes from this file.
    script = tmp_path / "train.py"
    assert cli(["export", "--ladder", str(out), "--out", str(script)]) == 0
    assert script.read_text() == export.script(C.TrainConfig.from_dict(top["config"]))
    lean = tmp_path / "lean.py"  # and the leanest loop, when asked for
    assert cli(["export", "--ladder", str(out), "--loop", "leanest", "--out", str(lean)]) == 0
    assert lean.read_text() == export.script(C.TrainConfig.from_dict(by[L.LEANEST]["config"]))
    # An existing file is not replaced without --force, and the refusal comes before any work.
    again = subprocess.run(
        [sys.executable, "-m", "course_lib", "ladder", "--preset", "tiny", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 2 and "exists: pass --force" in again.stderr and "rung 1" not in again.stderr


def test_bad_arguments_are_explained(capsys):
    assert cli(["ladder", "--preset", "tiny", "--rungs", "99"]) == 2
    assert "--rungs takes indices" in capsys.readouterr().err
    assert cli(["ladder", "--preset", "tiny", "--leave-out", "compile"]) == 2
    assert "--leave-out takes indices" in capsys.readouterr().err
    assert cli(["ladder", "--set", "checkpointing=full"]) == 2
    assert "--set takes TECHNIQUE=VALUE" in capsys.readouterr().err


def test_bad_ladder_input_is_refused_before_any_rung_runs(tmp_path, capsys):
    """Each ends in one line `error: ...` and exit 2, before the first rung (a run would print "rung 1 of")."""
    folder = tmp_path / "out"
    folder.mkdir()
    cases = [
        (["--leave-out", "0"], "baseline every rung is measured against"),
        (["--threads", "0"], "--threads takes a number of CPU threads from 1 to"),
        (["--threads", "-4"], "--threads takes a number of CPU threads from 1 to"),
        (["--set", "activation_checkpointing=sometimes"], "activation_checkpointing='sometimes' is not one of"),
        (["--json", str(folder)], "is a folder: give a file name"),
        (["--device", "tpu"], "device"),
        (["--device", "cuda"] if not __import__("torch").cuda.is_available() else ["--rungs", "x"], ""),
    ]
    for args, says in cases:
        assert cli(["ladder", "--preset", "tiny", *args]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("error: ") and says in err and "rung 1 of" not in err and "Traceback" not in err, (
            args,
            err,
        )


def test_a_ladder_option_from_the_command_line(tmp_path):
    out = tmp_path / "l.json"
    assert (
        cli(
            [
                "ladder",
                "--preset",
                "tiny",
                "--steps",
                "4",
                "--rungs",
                "9",
                "--leave-out",
                "4",
                "--set",
                "activation_checkpointing=selective",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    by = {r["label"]: r for r in json.loads(out.read_text())["results"]}
    assert by["+ compile"]["status"] == "skipped"
    assert by["+ checkpointing"]["config"]["activation_checkpointing"] == "selective"


def test_the_ladder_takes_a_technique_by_its_config_field_too(capsys):
    """`ladder --set model.vocab_multiple=...` is the vocabulary rung's value, as `vocab_multiple=...` is: both are
    checked before the banner (0 is refused by the technique), and a field of no technique is refused by name."""
    from course_lib.__main__ import main as cli

    for name in ("vocab_multiple", "model.vocab_multiple"):
        assert cli(["ladder", "--preset", "tiny", "--set", f"{name}=0"]) == 2
        assert "vocab_multiple" in capsys.readouterr().err
    assert cli(["ladder", "--preset", "tiny", "--set", "model.n_layer=2"]) == 2
    assert "--set takes TECHNIQUE=VALUE" in capsys.readouterr().err
