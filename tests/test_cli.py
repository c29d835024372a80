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
    assert cli(["ladder", "--rung-value", "checkpointing=full"]) == 2
    assert "--rung-value takes TECHNIQUE=VALUE" in capsys.readouterr().err


def test_bad_ladder_input_is_refused_before_any_rung_runs(tmp_path, capsys):
    """Each ends in one line `error: ...` and exit 2, before the first rung (a run would print "rung 1 of")."""
    folder = tmp_path / "out"
    folder.mkdir()
    cases = [
        (["--leave-out", "0"], "baseline every rung is measured against"),
        (["--threads", "0"], "--threads takes a number of CPU threads from 1 to"),
        (["--threads", "-4"], "--threads takes a number of CPU threads from 1 to"),
        (["--rung-value", "activation_checkpointing=sometimes"], "activation_checkpointing='sometimes' is not one of"),
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
                "--rung-value",
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
    """`ladder --rung-value model.vocab_multiple=...` is the vocabulary rung's value, as `vocab_multiple=...` is: both
    are checked before the banner (0 is refused by the technique), and a field of no technique is refused by name."""
    from course_lib.__main__ import main as cli

    for name in ("vocab_multiple", "model.vocab_multiple"):
        assert cli(["ladder", "--preset", "tiny", "--rung-value", f"{name}=0"]) == 2
        assert "vocab_multiple" in capsys.readouterr().err
    assert cli(["ladder", "--preset", "tiny", "--rung-value", "model.n_layer=2"]) == 2
    assert "--rung-value takes TECHNIQUE=VALUE" in capsys.readouterr().err


# ---- the command line's own surface: version, usage, order, examples, the console script ----------------------------


def test_version_and_a_bare_call(capsys):
    import pytest

    import course_lib
    from course_lib.__main__ import build_parser

    with pytest.raises(SystemExit) as e:
        cli(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"course_lib {course_lib.__version__}"
    assert cli([]) == 0  # a bare call: the usage, not an error
    out = capsys.readouterr().out
    assert out.startswith("usage: ") and "COMMAND" in out and "Traceback" not in out
    # the commands in the order a learner works, the maintainers' last
    listed = [a for a in build_parser()._subparsers._group_actions[0].choices]
    assert listed == ["info", "doctor", "ladder", "profile", "export", "exercises", "config", "bpe"]
    assert out.index("  info ") < out.index("  doctor ") < out.index("  ladder ") < out.index("  bpe ")


def test_the_version_is_the_packages():
    import tomllib
    from pathlib import Path

    import course_lib

    project = tomllib.loads((Path(course_lib.__file__).parent.parent / "pyproject.toml").read_text())["project"]
    assert project["version"] == course_lib.__version__


def test_every_command_s_help_ends_with_examples_that_parse(capsys):
    import shlex

    import pytest

    from course_lib.__main__ import build_parser

    parser = build_parser()
    for name, command in parser._subparsers._group_actions[0].choices.items():
        with pytest.raises(SystemExit):
            cli([name, "--help"])
        text = capsys.readouterr().out
        assert "examples:\n" in text, name
        examples = [ln.strip() for ln in text.split("examples:\n")[1].split("\n\n")[0].splitlines()]
        assert examples and all(ex.startswith(f"python -m course_lib {name}") for ex in examples), (name, examples)
        for ex in examples:
            args = parser.parse_args(shlex.split(ex.split("   (")[0])[3:])  # an example's own note in parentheses
            assert args.command == name, ex


def test_the_console_script_runs():
    """`course-lib`, pyproject's [project.scripts], installed beside this Python (pip install -e . puts it there)."""
    from pathlib import Path

    script = Path(sys.executable).parent / "course-lib"
    assert script.is_file(), f"{script} is missing: `pip install -e .` installs it"
    proc = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("course_lib "), proc.stderr


def test_info_json_to_standard_output_and_to_a_file(tmp_path, capsys):
    assert cli(["info", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["course_lib"] and payload["python"] and payload["budget"] in ("full", "smoke")
    assert payload["rows"]["device"] == payload["capabilities"]["name"] and payload["rows"]["torch"]
    out = tmp_path / "info.json"
    assert cli(["info", "--json", str(out)]) == 0 and json.loads(out.read_text()) == payload
    assert cli(["info", "--json", str(out)]) == 2 and "exists: pass --force" in capsys.readouterr().err


def test_bpe_replaces_the_shipped_ranks_only_with_force(tmp_path, capsys, monkeypatch):
    """Without --out the shipped tokenizer in data/ is the file: refused before any training unless --force, as a file
    of --out is."""
    import pytest

    from course_lib import bpe, data

    monkeypatch.setattr(bpe, "train_bpe", lambda *a, **k: pytest.fail("trained before the refusal"))
    shipped = data.RANKS_FILE.resolve()
    before = shipped.read_bytes()
    assert cli(["bpe"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "pass --force" in err and "--out PATH" in err, err
    assert shipped.read_bytes() == before
    kept = tmp_path / "ranks.tiktoken"
    kept.write_text("mine")
    assert cli(["bpe", "--out", str(kept)]) == 2 and "exists: pass --force" in capsys.readouterr().err
    # with --force the training starts (here: a stand-in that writes a small table to the --out file)
    monkeypatch.setattr(bpe, "train_bpe", lambda *a, **k: {bytes([i]): i for i in range(256)})
    assert cli(["bpe", "--out", str(kept), "--force"]) == 0 and kept.read_text() != "mine"


def test_set_means_a_config_field_and_rung_value_a_rungs_value(capsys):
    """One name per meaning: --set changes the config everywhere; in the ladder a technique's value at its rung is
    --rung-value, and --set names a field of the preset it climbs from."""
    from course_lib.__main__ import climbed_from

    assert climbed_from(["batch_size=4", "model.n_layer=3"]) == {"batch_size": 4, "model.n_layer": 3}
    assert cli(["ladder", "--preset", "tiny", "--set", "precision=bf16"]) == 2
    assert "--rung-value precision=" in capsys.readouterr().err
    assert cli(["ladder", "--preset", "tiny", "--set", "batch_size=0"]) == 2  # checked before the banner
    err = capsys.readouterr().err
    assert "batch_size must be a positive int" in err and "Ladder on" not in err
    # at --rung, --set changes the rung's config: compile on at the sdpa rung, below compile's own
    assert cli(["config", "--preset", "tiny", "--rung", "+ sdpa", "--set", "compile=true"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.split()[:1] == ["compile"])
    assert line.split()[1] == "True", line
