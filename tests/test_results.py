import json

from course_lib import config as C
from course_lib.results import RunResult, load_results, provenance, save_results, table_rows, text_table


def fake(label, tps, peak, status="ok"):
    return RunResult(
        label=label,
        status=status,
        config=C.tiny_preset("cpu").to_dict(),
        provenance=provenance("CPU (test)"),
        median_step_s=1.0,
        tokens_per_s=tps,
        memory={"peak_bytes": peak, "by_category": {"parameters": peak}, "method": "m"},
    )


def test_json_round_trip_keeps_provenance(tmp_path):
    rs = [fake("a", 100.0, 2**30), fake("b", 300.0, 2**28)]
    path = save_results(rs, tmp_path / "r.json", preset="tiny")
    back, meta = load_results(path)
    assert meta["preset"] == "tiny" and back[0].provenance["device"] == "CPU (test)"
    assert json.dumps([r.to_dict() for r in back]) == json.dumps([r.to_dict() for r in rs])
    assert {"device", "torch", "date", "commit"} <= set(json.loads(path.read_text())["results"][0]["provenance"])


def test_table_reports_speed_up_memory_ratio_and_failures():
    rows = table_rows(
        [
            fake("naive", 100.0, 2**30),
            fake("fast", 300.0, 2**28),
            RunResult("big", "oom", {}, {}, reason="out of memory"),
        ]
    )
    assert rows[1]["speed-up"] == "3.00x" and rows[1]["memory vs base"] == "0.25x" and rows[1]["MFU"] == "n/a"
    assert rows[2]["status"] == "OOM" and rows[2]["note"] == "out of memory"
    assert "OOM" in text_table(rows)


def test_a_run_stopped_before_its_memory_step_has_no_memory_ratio():
    """The ladder gives up on a far slower rung before its memory-ledger step: its row says nothing about memory."""
    stopped = fake("stopped", 10.0, 0)
    stopped.memory, stopped.stopped_early = None, "stopped after 3 timed steps"
    row = table_rows([fake("naive", 100.0, 2**30), stopped])[1]
    assert row["speed-up"] == "0.10x" and row["memory vs base"] == "" and row["peak GiB"] == "n/a"


def test_a_failed_write_leaves_the_earlier_file_whole(tmp_path, monkeypatch):
    """Results are written in one step: a write that fails half-way (a full disk) raises and keeps the old file."""
    import pathlib

    import pytest

    path = save_results([fake("a", 100.0, 2**30)], tmp_path / "r.json")
    before = path.read_text()

    def half_then_full(self, text, *a, **k):
        with open(self, "w") as f:
            f.write(text[: len(text) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pathlib.Path, "write_text", half_then_full)
    with pytest.raises(OSError, match="No space left"):
        save_results([fake("a", 100.0, 2**30), fake("b", 1.0, 1)], path)
    monkeypatch.undo()
    assert path.read_text() == before and list(tmp_path.iterdir()) == [path]  # no partial file left beside it


def test_a_rate_keeps_its_digits_below_100_gflops():
    from course_lib.results import gflops_text

    assert gflops_text(4.12e8) == "0.412 GFLOP/s"  # a tiny matmul's rate, not "0 GFLOP/s"
    assert gflops_text(87.4e9) == "87.4 GFLOP/s" and gflops_text(1_534.6e9) == "1,535 GFLOP/s"


def test_course_commit_names_the_code_where_the_copy_has_another_git(monkeypatch):
    monkeypatch.setenv("COURSE_COMMIT", "abc1234")
    assert provenance("CPU (test)")["commit"] == "abc1234"
    monkeypatch.delenv("COURSE_COMMIT")
    assert provenance("CPU (test)")["commit"] != "abc1234"
