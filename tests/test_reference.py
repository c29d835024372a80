from course_lib import config as C
from course_lib import reference
from course_lib.results import RunResult, save_results


def test_shipped_results_are_read_with_their_provenance(tmp_path, monkeypatch):
    monkeypatch.setattr(reference, "REFERENCE_DIR", tmp_path)
    assert reference.load_reference() == []
    r = RunResult("naive fp32", "ok", C.tiny_preset("cpu").to_dict(), {"device": "NVIDIA H100 80GB HBM3", "torch": "2.13.0"}, tokens_per_s=1e6)
    save_results([r], tmp_path / "h100.json", preset="reference", device="NVIDIA H100 80GB HBM3", torch="2.13.0", date="2026-11-21")
    save_results([r], tmp_path / "other.json", preset="gpt2-small")
    found = reference.load_reference("reference")
    assert len(found) == 1
    path, results, meta = found[0]
    assert path.name == "h100.json" and meta["device"] == "NVIDIA H100 80GB HBM3" and results[0].tokens_per_s == 1e6
    assert len(reference.load_reference()) == 2


def test_missing_results_are_said_plainly():
    assert "None are invented" in reference.describe_missing()
