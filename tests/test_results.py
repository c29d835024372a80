import json

from course_lib import config as C
from course_lib.results import RunResult, load_results, provenance, save_results, table_rows, text_table


def fake(label, tps, peak, status="ok"):
    return RunResult(label=label, status=status, config=C.tiny_preset("cpu").to_dict(), provenance=provenance("CPU (test)"),
                     median_step_s=1.0, tokens_per_s=tps, memory={"peak_bytes": peak, "by_category": {"parameters": peak}, "method": "m"})


def test_json_round_trip_keeps_provenance(tmp_path):
    rs = [fake("a", 100.0, 2**30), fake("b", 300.0, 2**28)]
    path = save_results(rs, tmp_path / "r.json", preset="tiny")
    back, meta = load_results(path)
    assert meta["preset"] == "tiny" and back[0].provenance["device"] == "CPU (test)"
    assert json.dumps([r.to_dict() for r in back]) == json.dumps([r.to_dict() for r in rs])
    assert {"device", "torch", "date", "commit"} <= set(json.loads(path.read_text())["results"][0]["provenance"])


def test_table_reports_speed_up_memory_ratio_and_failures():
    rows = table_rows([fake("naive", 100.0, 2**30), fake("fast", 300.0, 2**28), RunResult("big", "oom", {}, {}, reason="out of memory")])
    assert rows[1]["speed-up"] == "3.00x" and rows[1]["memory vs base"] == "0.25x" and rows[1]["MFU"] == "n/a"
    assert rows[2]["status"] == "OOM" and rows[2]["note"] == "out of memory"
    assert "OOM" in text_table(rows)
