import re
import shlex
from pathlib import Path

from course_lib import config as C, reference
from course_lib.results import RunResult, save_results


def test_shipped_results_are_read_with_their_provenance(tmp_path, monkeypatch, tiny):
    monkeypatch.setattr(reference, "REFERENCE_DIR", tmp_path)
    assert reference.load_reference() == []
    r = RunResult(
        "naive fp32",
        "ok",
        tiny().to_dict(),
        {"device": "NVIDIA H100 80GB HBM3", "torch": "2.13.0"},
        tokens_per_s=1e6,
    )
    save_results(
        [r],
        tmp_path / "h100.json",
        preset="reference",
        device="NVIDIA H100 80GB HBM3",
        torch="2.13.0",
        date="2026-11-21",
    )
    save_results([r], tmp_path / "other.json", preset="gpt2-small")
    found = reference.load_reference("reference")
    assert len(found) == 1
    path, results, meta = found[0]
    assert path.name == "h100.json" and meta["device"] == "NVIDIA H100 80GB HBM3" and results[0].tokens_per_s == 1e6
    assert len(reference.load_reference()) == 2


def test_missing_results_name_a_command_that_writes_where_they_are_read(monkeypatch):
    # The message tells a learner with a GPU how to produce the missing results: the command it quotes must be one
    # the CLI accepts, for a preset that exists, writing a JSON file into the folder load_reference reads.
    from course_lib import __main__ as cli

    quoted = re.search(r"`(python -m course_lib [^`]+)`", reference.describe_missing())
    assert quoted, reference.describe_missing()
    argv = shlex.split(quoted.group(1).replace("<device>", "H100"))[3:]
    seen = {}
    monkeypatch.setattr(cli, "cmd_ladder", lambda args: seen.update(vars(args)) or 0)  # parse, do not train
    assert cli.main(argv) == 0 and seen["command"] == "ladder"
    assert seen["preset"] in C.PRESETS and seen["json"].endswith(".json")
    assert Path(seen["json"]).parent.parts[-2:] == reference.REFERENCE_DIR.parts[-2:]
