import re
import shlex
from pathlib import Path

import pytest

from course_lib import presets, reference
from course_lib.ladder import optimised
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
    assert seen["preset"] in presets.PRESET_NAMES and seen["json"].endswith(".json")
    assert Path(seen["json"]).parent.parts[-2:] == reference.REFERENCE_DIR.parts[-2:]


def test_batch_sweeps_are_read_from_the_checks_folder_with_their_provenance(tmp_path, tiny):
    """Notebook 06 shows a GPU's throughput by micro-batch from the sweep `.ci/gpu mfu` writes (PRESET-mfu-GPU.json
    in data/reference/checks/); other files there (logs, the doctor's report) are not read as results."""
    assert reference.batch_sweeps(tmp_path / "none") == []
    runs = [
        RunResult(f"batch {b}", "ok", tiny(batch_size=b).to_dict(), {"device": "NVIDIA H200", "torch": "2.11"})
        for b in (16, 64)
    ]
    save_results(runs, tmp_path / "gpt2-small-mfu-nvidia-h200.json", device="NVIDIA H200", preset="gpt2-small")
    (tmp_path / "doctor-nvidia-h200.json").write_text("{}")
    [(path, results, meta)] = reference.batch_sweeps(tmp_path)
    assert path.name == "gpt2-small-mfu-nvidia-h200.json" and meta["device"] == "NVIDIA H200"
    assert [r.config["batch_size"] for r in results] == [16, 64]


def test_the_shipped_batch_sweep_names_its_gpu_torch_and_date():
    """Notebook 06 and the README quote the H200 sweep: it is shipped, and every run in every sweep says where and
    when it ran; a run that finished has its times and MFU (a sweep may also hold a run that ran out of memory)."""
    sweeps = reference.batch_sweeps()
    assert any(path.name == "gpt2-small-mfu-nvidia-h200.json" for path, _, _ in sweeps), [p.name for p, _, _ in sweeps]
    for path, results, meta in sweeps:
        assert meta["device"] and results, path
        for r in results:
            assert r.provenance["device"] == meta["device"] and r.provenance["torch"] and r.provenance["date"], path
            assert not r.ok or (r.median_step_s and r.mfu), (path, r.label)


def test_the_other_kind_of_cpu_is_a_climb_measured_on_it_not_one_held_to_its_kernels(tmp_path, monkeypatch, tiny):
    """Notebook 09 shows a learner the other kind of CPU (with bf16 instructions, or AVX2 only): a climb measured on
    such a CPU as it is. A climb whose kernels were held to AVX2 on a CPU with AMX shows AVX2's kernels, not an AVX2
    CPU, and is neither kind."""
    monkeypatch.setattr(reference, "MEASURED_DIR", tmp_path)
    r = RunResult("naive fp32", "ok", tiny().to_dict(), {"device": "CPU"})
    for name, cpu in (
        ("zen3", "AVX2"),
        ("amx", "AVX2, AVX512, AVX512-BF16, AMX-BF16"),
        ("held", "AVX2, AVX512, AVX512-BF16, AMX-BF16; ONEDNN_MAX_CPU_ISA=AVX2; ATEN_CPU_CAPABILITY=avx2"),
        ("held-avx512", "AVX2, AVX512; MKL_ENABLE_INSTRUCTIONS=AVX2"),  # no BF16 in its text, still held
        ("held-aten", "AVX2, AVX512, AVX512-BF16; ATEN_CPU_CAPABILITY=avx2"),
        ("unnamed", ""),  # a CPU whose instruction sets were not recorded is neither kind
    ):
        save_results([r], tmp_path / f"{name}.json", preset="cpu", cpu=cpu)
    assert [p.name for p, *_ in reference.measured_cpu_climbs(bf16_instructions=False)] == ["zen3.json"]
    assert [p.name for p, *_ in reference.measured_cpu_climbs(bf16_instructions=True)] == ["amx.json"]
    assert reference.measured_cpu_climbs(bf16_instructions=True, preset="reference") == []


def test_the_course_ships_a_climb_of_each_kind_of_cpu_with_what_notebook_09_prints():
    """Notebook 09 prints, for each climb of the other kind, its 16-bit rung's verdict and its optimised loop: a file
    without them would be skipped without a word."""
    without = reference.measured_cpu_climbs(bf16_instructions=False)
    assert sorted(p.name for p, *_ in without) == [
        "2026-11-26_cpu-2core-epyc-zen3-avx2_ladder-cpu.json",
        "2026-11-26_cpu-2core-epyc-zen3-avx2_ladder-cpu_second-climb.json",
    ]
    for bf16, climbs in ((False, without), (True, reference.measured_cpu_climbs(bf16_instructions=True))):
        assert climbs, bf16
        for path, results, meta in climbs:
            assert meta["device"] and meta["torch"] and meta["date"], path
            sixteen = next(r for r in results if r.label == "+ 16-bit autocast")
            assert sixteen.ok and sixteen.ladder["why"], path
            assert sixteen.ladder["kept"] is bf16, path  # software bf16 never kept; with the instructions it was
            assert optimised(results).ladder["factor"] > 1, path


@pytest.mark.parametrize("fast, kind", [(None, "with"), ("fp16", "with"), ("bf16", "without")])
def test_notebooks_03_and_09_show_the_other_kind_of_cpu_labelled_as_not_measured_here(fast, kind):
    lines = reference.other_cpu_lines(fast)
    assert lines and all(line.startswith(f"A CPU {kind} bf16 instructions, for comparison") for line in lines)
    assert all("not measured here" in line and "optimised loop" in line for line in lines)
    climbs = reference.measured_cpu_climbs(bf16_instructions=kind == "with")
    dates = {meta["date"][:10] for *_, meta in climbs}
    assert all(any(d in line for d in dates) for line in lines)  # each line dated by its climb
    assert not any(" here:" in line for line in lines)  # a shipped verdict's "bf16 here" spoke of that CPU
    if kind == "without":
        assert len(lines) == len(climbs) >= 2 and all("[AVX2]" in line and "(bf16) not kept" in line for line in lines)
        assert all("bf16 there: no bf16 instructions" in line for line in lines)
    else:  # the shipped AMX and AVX512-BF16 climbs: their 16-bit rung, in bf16, kept
        assert len(lines) == len(climbs) >= 2 and all("(bf16) kept" in line for line in lines)
        assert "xeon-amx" in lines[0] and "AMX-BF16" in lines[0] and "epyc-zen5-avx512bf16" in lines[1]
