"""Bad input, from every door: the command line, the Python API, the panels and the launches. Each case must end in a
clear message (on the command line: one `error:` line and exit 2, no traceback, nothing run), or in a labelled skipped,
diverged or failed row; and nothing already written is damaged. The cases are a learner's typos and a workshop's
accidents; each one's message is checked to say what to change."""

import dataclasses
import json
import math
import os
import tempfile
from pathlib import Path

import pytest
import torch

from course_lib import config as C, memory_formula as M, widgets
from course_lib.__main__ import main as cli
from course_lib.distributed import launch as L
from course_lib.train import train

NO_CUDA = not torch.cuda.is_available()

# ---- the command line: exit 2, one `error:` line naming the fix, before any work ------------------------------------

CLI = [
    (["ladder", "--preset", "tiny", "--leave-out", "0"], "baseline every rung is measured against"),
    (["ladder", "--preset", "tiny", "--threads", "0"], "--threads takes a number of CPU threads from 1 to"),
    (["ladder", "--preset", "tiny", "--threads", "-4"], "--threads takes a number of CPU threads from 1 to"),
    (["ladder", "--preset", "tiny", "--threads", "100000"], "--threads takes a number of CPU threads from 1 to"),
    (["ladder", "--preset", "tiny", "--rungs", "0,0"], "a rung is named twice"),
    (["ladder", "--preset", "tiny", "--leave-out", "4", "--rung-value", "compile=true"], "and that rung is left out"),
    (
        ["ladder", "--preset", "tiny", "--leave-out", "2", "--rung-value", "precision=fp16"],
        "'+ 16-bit autocast' rung sets",
    ),
    (["ladder", "--preset", "tiny", "--rungs", "0,1", "--rung-value", "compile=true"], "and that rung is left out"),
    (["ladder", "--preset", "tiny", "--rung-value", "compile=false"], "the rung would change nothing"),
    (["ladder", "--preset", "tiny", "--rung-value", "precision=fp32"], "the rung would change nothing"),
    (
        ["ladder", "--preset", "tiny", "--rung-value", "activation_checkpointing=sometimes"],
        "is not one of 'none', 'selective', 'full'",
    ),
    (["ladder", "--preset", "tiny", "--rung-value", "checkpointing=full"], "--rung-value takes TECHNIQUE=VALUE"),
    (
        ["ladder", "--preset", "tiny", "--rung-value", "vocab_multiple=8", "--rung-value", "model.vocab_multiple=64"],
        "vocab_multiple is set twice",
    ),
    (["config", "--preset", "tiny", "--rung", "9", "--set", "loss_chunks=0"], "loss_chunks must be a positive int"),
    (["export", "--preset", "tiny", "--set", "model.vocab_multiple=0"], "--set model.vocab_multiple=...:"),
    (["ladder", "--preset", "tiny", "--rungs", "99"], "--rungs takes indices 0..9"),
    (["ladder", "--preset", "tiny", "--leave-out", "compile"], "--leave-out takes indices"),
    (["ladder", "--preset", "tiny", "--device", "tpu"], "is not a torch device"),
    (["info", "--device", "tpu"], "is not a torch device"),
    (["export", "--preset", "tiny", "--set", "compile=sometimes"], "compile takes true or false"),
    (["export", "--preset", "tiny", "--set", "model.bias=perhaps"], "bias takes true or false"),
    (["export", "--preset", "tiny", "--set", "seed=abc"], "seed takes an integer"),
    (["export", "--preset", "tiny", "--set", "lr=fast"], "lr takes a finite number"),
    (["export", "--preset", "tiny", "--set", "lr=inf"], "lr takes a finite number"),
    (["export", "--preset", "tiny", "--set", "betas=5"], "betas takes 2 numbers"),
    (["export", "--preset", "tiny", "--set", "betas=2,0.9"], "betas must each be in [0, 1)"),
    (["export", "--preset", "tiny", "--set", "eps=-1"], "eps must be > 0"),
    (["export", "--preset", "tiny", "--set", "momentum=-3"], "momentum must be in [0, 1)"),
    (["export", "--preset", "tiny", "--set", "lrr=1"], "did you mean 'lr'"),
    (["export", "--preset", "tiny", "--set", "precision=bf61"], "did you mean 'bf16'"),
    (["export", "--preset", "tiny", "--set", "model.n_layer=0"], "n_layer must be a positive int"),
    (["export", "--preset", "tiny", "--set", "steps=1"], "raise steps"),
    (["export", "--preset", "tiny", "--set", "model.vocab_size=10"], "smaller than the tokenizer's 4097 tokens"),
    (["export", "--preset", "tiny", "--rung", "+ warp drive"], "is not a rung of the ladder"),
    (["export", "--preset", "tiny", "--rung", "compile"], "(did you mean '+ compile'?)"),
    (["export", "--ladder", "/nonexistent/ladder.json"], "not a ladder's results file"),
    (["profile", "--preset", "tiny", "--set", "steps=0"], "steps must be a positive int"),
    # a negative index is not counted from the end, an empty list is not every rung, a rung is not asked for twice
    (["ladder", "--preset", "tiny", "--rungs", "-1"], "--rungs takes indices 0..9"),
    (["ladder", "--preset", "tiny", "--rungs", ""], "--rungs takes indices 0..9"),
    (["ladder", "--preset", "tiny", "--leave-out", "-2"], "--leave-out takes indices 0..9"),
    (["ladder", "--preset", "tiny", "--rungs", "0,2", "--leave-out", "2"], "is in --rungs and in --leave-out"),
    (["ladder", "--preset", "tiny", "--rung-value", "loss_chunks=0"], "loss_chunks must be a positive int"),
    # every value checked before what each rung would change, in either order
    (
        ["ladder", "--preset", "tiny", "--rung-value", "compile=false", "--rung-value", "loss_chunks=0"],
        "loss_chunks must be",
    ),
    (
        ["ladder", "--preset", "tiny", "--rung-value", "loss_chunks=0", "--rung-value", "compile=false"],
        "loss_chunks must be",
    ),
    (["export", "--preset", "tiny", "--set", "n_head=2", "--set", "model.n_head=4"], "n_head is set twice"),
    (["export", "--preset", "tiny", "--rung", "12"], "--rung takes an index 0..9, got"),
    (["export", "--preset", "tiny", "--rung", "-1"], "is not a rung of the ladder"),
    (["profile", "--preset", "tiny", "--rows", "0"], "--rows takes the number of operators"),
    # a device torch knows but the course has no path for
    (["info", "--device", "xpu"], "the course runs on cpu, cuda, mps only"),
    (["ladder", "--preset", "tiny", "--device", "hpu"], "the course runs on cpu, cuda, mps only"),
    (["export", "--preset", "tiny", "--device", "xpu"], "the course runs on cpu, cuda, mps only"),
    # an empty path (an unset shell variable) is not "no file"
    (["ladder", "--preset", "tiny", "--json", ""], "an empty path"),
    (["doctor", "--quick", "--json", ""], "an empty path"),
    (["profile", "--preset", "tiny", "--trace", ""], "an empty path"),
    (["export", "--preset", "tiny", "--out", ""], "an empty path"),
    (["bpe", "--out", ""], "an empty path"),
    (["export", "--ladder", ""], "an empty path"),
    (["exercises", "--guide", "/nonexistent/guide.md"], "is not a file"),
]
if NO_CUDA:
    CLI += [
        (["ladder", "--preset", "tiny", "--device", "cuda"], "CUDA is not available here"),
        (["profile", "--preset", "tiny", "--device", "cuda"], "CUDA is not available here"),
    ]


@pytest.mark.parametrize("args, says", CLI, ids=[" ".join(a) for a, _ in CLI])
def test_the_command_line_refuses_with_one_line(args, says, capsys):
    assert cli(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err, err
    assert "Traceback" not in err and "Ladder on" not in err and "rung 1 of" not in err and "step 1 of" not in err


def test_a_folder_or_an_unwritable_path_is_refused_before_the_run(tmp_path, capsys):
    folder = tmp_path / "out"
    folder.mkdir()
    for args in (
        ["ladder", "--json", str(folder)],
        ["export", "--out", str(folder)],
        ["profile", "--trace", str(folder)],
        ["doctor", "--quick", "--json", str(folder)],
    ):
        assert cli([*args, "--preset", "tiny"] if args[0] != "doctor" else args) == 2, args
        err = capsys.readouterr().err
        assert "is a folder: give a file name" in err and "step 1 of" not in err and "checking" not in err, (args, err)
    afile = tmp_path / "afile"  # a path under a regular file cannot be written, by root either
    afile.write_text("x")
    # and /proc takes no new file, though os.access says root may write it
    for path in (afile / "l.json", "/proc/course-results.json"):
        for args in (["ladder", "--preset", "tiny", "--json"], ["export", "--preset", "tiny", "--out"]):
            assert cli([*args, str(path)]) == 2
            err = capsys.readouterr().err
            assert "cannot write" in err and "no file can be made" in err and "rung 1 of" not in err, err
            assert ".partial" not in err  # the message names the learner's path, not a temporary file's


def test_an_existing_file_is_kept_unless_forced(tmp_path, capsys):
    out = tmp_path / "train.py"
    out.write_text("mine")
    assert cli(["export", "--preset", "tiny", "--out", str(out)]) == 2
    assert "exists: pass --force" in capsys.readouterr().err and out.read_text() == "mine"
    assert cli(["ladder", "--preset", "tiny", "--json", str(out)]) == 2 and out.read_text() == "mine"
    assert cli(["profile", "--preset", "tiny", "--trace", str(out)]) == 2 and out.read_text() == "mine"


@pytest.mark.parametrize(
    "settings",
    [
        ["context=128", "model.block_size=128"],
        ["grad_accum_steps=3", "batch_size=6"],
        ["model.n_head=3", "model.n_embd=48"],
    ],
)
def test_settings_that_hold_together_are_taken_in_any_order(settings, capsys):
    for order in (settings, settings[::-1]):
        assert cli(["config", "--preset", "tiny", *(x for s in order for x in ("--set", s))]) == 0, order
        out = capsys.readouterr().out
        assert all(s.split("=")[1] in out for s in settings), out
    assert cli(["config", "--preset", "tiny", "--set", "context=128"]) == 2  # alone it still does not hold
    assert "--set model.block_size=N" in capsys.readouterr().err


def test_a_device_a_link_or_a_dash_is_refused_even_when_forced(tmp_path, capsys):
    """A file is written beside its path and moved over it: --force would replace /dev/null (as root) or a link with a
    plain file. '-' is standard output to export, and no file name to the others."""
    target = tmp_path / "target.txt"
    target.write_text("mine")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for path in (link, fifo, "/dev/null"):
        for args in (["ladder", "--preset", "tiny", "--json"], ["export", "--preset", "tiny", "--out"]):
            assert cli([*args, str(path), "--force"]) == 2, (args, path)
            assert "is not a plain file" in capsys.readouterr().err
    assert link.is_symlink() and target.read_text() == "mine" and Path("/dev/null").is_char_device()
    assert cli(["ladder", "--preset", "tiny", "--json", "-"]) == 2
    assert "'-' is not a file name here" in capsys.readouterr().err and not Path("-").exists()


def test_ctrl_c_during_a_ladder_keeps_the_rungs_measured(tmp_path, capsys, monkeypatch):
    """The climb saves after every rung; an interrupt ends cleanly with exit 130, says what was saved and how to go
    on."""
    from course_lib import ladder as ladder_mod
    from course_lib.results import load_results

    def interrupted(base, on_result=None, **_):
        return _one_rung_then(base, on_result, lambda done: (_ for _ in ()).throw(KeyboardInterrupt))

    monkeypatch.setattr(ladder_mod, "run_ladder", interrupted)
    out = tmp_path / "l.json"
    assert cli(["ladder", "--preset", "tiny", "--json", str(out)]) == 130
    err = capsys.readouterr().err
    assert "interrupted: 1 rung(s) measured, saved in" in err and "Traceback" not in err
    assert "run the same command with --force" in err  # the file it saved in now exists
    results, meta = load_results(out)
    assert [r.label for r in results] == ["naive fp32"] and meta["preset"] == "tiny"


def _one_rung_then(base, on_result, after):
    from course_lib.results import RunResult, provenance

    done = [
        RunResult(
            "naive fp32",
            "ok",
            base.to_dict(),
            provenance("test"),
            tokens_per_s=1.0,
            median_step_s=1.0,
            ladder={"kept": True, "why": "the baseline"},
        )
    ]
    on_result(done)
    return after(done)


def test_ctrl_c_in_any_command_is_one_line_and_exit_130(capsys, monkeypatch):
    import course_lib.__main__ as entry

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(entry, "cmd_doctor", interrupted)
    assert cli(["doctor", "--quick"]) == 130
    err = capsys.readouterr().err
    assert "interrupted: doctor stopped before it finished" in err and "Traceback" not in err


@pytest.mark.parametrize("unbuffered", ["1", ""])
def test_output_piped_to_a_reader_that_stops_early_is_no_traceback(unbuffered):
    """`| head`: the reader goes before the output is all written. `true` reads nothing and is gone long before the
    command's first line (torch takes a second to import), so every write meets a closed pipe."""
    import subprocess
    import sys

    piped = subprocess.run(
        ["bash", "-c", f"{sys.executable} -m course_lib config --preset tiny | true; echo $" + "{PIPESTATUS[0]}"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": unbuffered},
    )
    assert piped.stdout.strip() == "141" and piped.stderr == "", piped.stderr


def test_an_interrupted_forced_climb_leaves_the_earlier_file_whole(tmp_path, capsys, monkeypatch):
    """--force replaces an earlier climb only with a finished one: interrupted, the rungs measured are beside it."""
    from course_lib import ladder as ladder_mod
    from course_lib.results import load_results

    def interrupted(base, on_result=None, **_):
        return _one_rung_then(base, on_result, lambda done: (_ for _ in ()).throw(KeyboardInterrupt))

    monkeypatch.setattr(ladder_mod, "run_ladder", interrupted)
    out = tmp_path / "full.json"
    out.write_text("an earlier, complete climb")
    assert cli(["ladder", "--preset", "tiny", "--json", str(out), "--force"]) == 130
    err = capsys.readouterr().err
    beside = tmp_path / "full.in-progress.json"
    assert f"saved in {beside}; {out} is as it was" in err and out.read_text() == "an earlier, complete climb"
    assert [r.label for r in load_results(beside)[0]] == ["naive fp32"]

    # finished, the climb replaces the earlier file, and nothing is left beside it
    finished = lambda base, on_result=None, **_: _one_rung_then(base, on_result, list)  # noqa: E731
    monkeypatch.setattr(ladder_mod, "run_ladder", finished)
    assert cli(["ladder", "--preset", "tiny", "--json", str(out), "--force"]) in (0, 1)
    assert [r.label for r in load_results(out)[0]] == ["naive fp32"] and not beside.exists()
    assert f"wrote {out}" in capsys.readouterr().err


def test_a_write_that_fails_mid_climb_does_not_stop_it_and_the_results_land_elsewhere(tmp_path, capsys, monkeypatch):
    """The folder of --json replaced by a file while the climb runs: said once, the climb goes on, and at the end its
    results are written to the temporary folder, named."""
    from course_lib import ladder as ladder_mod
    from course_lib.results import load_results

    folder = tmp_path / "mid"
    out = folder / "l.json"
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def folder_gone(base, on_result=None, **_):
        def after(done):
            out.unlink()
            folder.rmdir()
            folder.write_text("now a file")
            on_result(done)  # the next rung's save fails
            return done

        return _one_rung_then(base, on_result, after)

    monkeypatch.setattr(ladder_mod, "run_ladder", folder_gone)
    cli(["ladder", "--preset", "tiny", "--json", str(out)])
    err = capsys.readouterr().err
    assert "warning: could not write" in err and "climbing on" in err and "Traceback" not in err
    fallback = next(tmp_path.glob("ladder-*.json"))
    assert f"the results are in {fallback}" in err and f"wrote {fallback}" in err
    assert [r.label for r in load_results(fallback)[0]] == ["naive fp32"]


def test_a_finished_climb_that_can_be_written_nowhere_still_shows_its_table(tmp_path, capsys, monkeypatch):
    """The folder of --json gone mid-climb and the temporary folder unwritable too: no traceback after the rungs were
    measured; the line says where it tried, and the table is printed."""
    from course_lib import ladder as ladder_mod

    folder = tmp_path / "mid"
    out = folder / "l.json"
    (tmp_path / "no-temp").write_text("a file, not a folder")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-temp"))

    def folder_gone(base, on_result=None, **_):
        def after(done):
            out.unlink()
            folder.rmdir()
            folder.write_text("now a file")
            on_result(done)
            return done

        return _one_rung_then(base, on_result, after)

    monkeypatch.setattr(ladder_mod, "run_ladder", folder_gone)
    cli(["ladder", "--preset", "tiny", "--json", str(out)])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and f"could not write {out}" in captured.err
    assert "no-temp" in captured.err and "the table below has them" in captured.err
    assert "naive fp32" in captured.out  # the table


# ---- the Python API: a ConfigError that says what to change -------------------------------------------------------

API = [
    (lambda: C.TrainConfig(lr=math.inf), "lr takes a finite number"),
    (lambda: C.TrainConfig(eps=math.nan), "eps takes a finite number"),
    (lambda: C.TrainConfig(betas=(2, -1)), "betas must each be in [0, 1)"),
    (lambda: C.TrainConfig(compile="no"), "compile takes True or False"),
    (lambda: C.TrainConfig(steps=True), "steps takes an integer"),
    (lambda: C.TrainConfig(batch_size=2.0), "batch_size takes an integer"),
    (lambda: C.TrainConfig(steps=__import__("numpy").int64(5)), "a numpy.int64: convert it with int()"),
    (lambda: C.tiny_preset("cpu").with_model(n_heads=3), "did you mean 'n_head'"),
    (lambda: C.TrainConfig(clip_norm=-1), "clip_norm must be positive or None"),
    (lambda: C.TrainConfig(device="tpu"), "is not a torch device"),
    (lambda: C.ModelConfig(n_layer=True), "n_layer takes an integer"),
    (lambda: C.ModelConfig(dropout=1.5), "dropout must be in [0, 1)"),
    (lambda: C.ModelConfig(attention="flashy"), "is not one of 'naive', 'sdpa', 'flash'"),
    (lambda: C.TrainConfig.from_dict({**C.tiny_preset("cpu").to_dict(), "stepz": 3}), "did you mean 'steps'"),
    (
        lambda: C.TrainConfig.from_dict({**C.tiny_preset("cpu").to_dict(), "model": {"n_layers": 2}}),
        "did you mean 'n_layer'",
    ),
    (lambda: C.TrainConfig.from_dict([1, 2]), "a TrainConfig is a dict of its fields"),
    (lambda: C.preset("cpu-large"), "Unknown preset"),
    (lambda: C.parse_setting("warmup", "3"), "is not a setting"),
    (lambda: C.with_settings(C.tiny_preset("cpu"), {"n_head": 2, "model.n_head": 2}), "set the same field"),
    (lambda: M.max_batch_that_fits(C.tiny_preset("cpu"), 1e6), "every batch up to limit=4096 fits"),
    (lambda: M.max_batch_that_fits(C.tiny_preset("cpu"), "8GB"), "a positive number of GiB, e.g. 80"),
    (lambda: M.will_it_fit(C.tiny_preset("cpu"), -1), "a positive number of GiB"),
    (lambda: M.will_it_fit(C.tiny_preset("cpu"), math.nan), "a positive number of GiB"),
    (lambda: M.will_it_fit(C.tiny_preset("cpu"), 80, margin=1.5), "margin=1.5: give the share kept free"),
    (lambda: train(C.tiny_preset("cpu"), batches=lambda step: []), "returned no micro-batches"),
    (lambda: train(dataclasses.replace(C.tiny_preset("cpu"), steps=2)), "raise steps"),
    (lambda: train(C.tiny_preset("cpu").with_model(vocab_size=10)), "smaller than the tokenizer"),
]


@pytest.mark.parametrize("make, says", API, ids=[s for _, s in API])
def test_the_api_says_what_to_change(make, says):
    with pytest.raises(C.ConfigError, match=None) as e:
        make()
    assert says in str(e.value), str(e.value)


def test_a_run_that_diverges_stops_and_says_so(tiny):
    r = train(tiny(lr=1e6, steps=6))
    assert r.status == "diverged" and not r.ok
    assert "diverged: the loss became nan at step" in r.reason and "lower lr" in r.reason
    assert len(r.losses) < 6 and not math.isfinite(r.losses[-1])  # stopped at the first non-finite loss
    assert r.tokens_per_s is None and r.memory is None  # no speed or memory is claimed for it


# ---- the panels: a row that says why, never a crash or a silent change ----------------------------------------------


def test_panel_inputs(tiny):
    base = tiny()
    p = widgets.Panel(base, controls=("preset", "attention", "batch_size", "grad_accum_steps", "steps"))
    # the slider cannot go below a run
    assert p.controls["steps"].min == widgets.fewest_steps(base) == base.timing_warmup + 2
    with pytest.raises(C.ConfigError, match="outside this control's range"):
        p.set(steps=1)  # a slider would clamp it silently
    with pytest.raises(C.ConfigError, match="outside this control's range"):
        p.set(batch_size=10_000)
    with pytest.raises(C.ConfigError, match="did you mean 'sdpa'"):
        p.set(attention="sdpaa")
    with pytest.raises(KeyError, match="no 'lr' control"):
        p.set(lr=1.0)
    p.set(batch_size=3, grad_accum_steps=2)
    bad = p.run()
    assert bad.status == "skipped" and "does not divide" in bad.reason and p.results[-1] is bad
    p.set(batch_size=4, grad_accum_steps=1)
    assert p.run().ok
    p.set(preset="cpu")  # another network: its label says so (the table gives no ratio across networks: the test below)
    assert p.label(p.config()).startswith(f"#{len(p.results) + 1} preset=cpu")
    lr_panel = widgets.Panel(base, controls=("lr",))  # a log slider: its range is 1e-5..1e-1, not its exponents
    assert lr_panel.set(lr=3e-4).config().lr == pytest.approx(3e-4, rel=0.3)
    with pytest.raises(C.ConfigError, match="outside this control's range"):
        lr_panel.set(lr=1.0)
    with pytest.raises(C.ConfigError, match="compile='yes': this control takes a bool, e.g. compile=False"):
        widgets.Panel(base, controls=("compile",)).set(compile="yes")  # not traitlets' own error


def test_start_from_another_network_follows_it(tiny):
    p = widgets.Panel(tiny(), controls=("preset", "precision", "batch_size", "context"))
    cpu = C.cpu_preset("cpu")
    p.start_from(cpu)
    assert p.controls["preset"].value == "cpu" and p.config() == cpu and p.label(p.config()) == "#1 baseline"


def test_a_panel_run_that_raises_is_a_row_and_the_panel_lives_on(tiny):
    def runner(cfg, label, callback):
        raise RuntimeError("the runner fell over")

    p = widgets.Panel(tiny(measure_memory=False), controls=("steps",), runner=runner)
    r = p.run()
    assert r.status == "error" and "RuntimeError: the runner fell over" in r.reason and p.results == [r]
    assert p.progress.description == "error"


def test_a_comparison_across_networks_is_labelled_not_computed(tiny):
    from course_lib.results import RunResult, provenance, table_rows

    small, cpu = tiny(), C.cpu_preset("cpu")
    a = RunResult(
        "tiny",
        "ok",
        small.to_dict(),
        provenance("t"),
        tokens_per_s=100.0,
        median_step_s=1.0,
        memory={"peak_bytes": 100},
    )
    b = RunResult(
        "cpu", "ok", cpu.to_dict(), provenance("t"), tokens_per_s=30.0, median_step_s=1.0, memory={"peak_bytes": 600}
    )
    row = table_rows([a, b])[1]
    assert row["speed-up"] == row["memory vs base"] == "other model"


# ---- the launches: refused before a process starts -------------------------------------------------------------------

LAUNCH = [
    (dict(strategy="ddp", nproc=0), "a launch needs a whole number of processes >= 1"),
    (dict(strategy="ddp", nproc=2, options={"stepz": 3}), "did you mean 'steps'"),
    (dict(strategy="ddp", nproc=2, options={"steps": "three"}), 'steps="three": takes an integer'),
    (dict(strategy="tensor_parallel", nproc=2, options={"sequence_parallel": 1}), "takes true or false"),
    (
        dict(strategy="series", nproc=2, options={"runs": [{"strategy": "fsdp", "options": {"step": 1}}]}),
        "fsdp has no option 'step'",
    ),
    (dict(strategy="dpp", nproc=2), "unknown strategy 'dpp'"),
]


@pytest.mark.parametrize("kw, says", LAUNCH, ids=[s for _, s in LAUNCH])
def test_a_launch_refuses_before_starting(kw, says, tmp_path):
    with pytest.raises(ValueError) as e:
        L.launch(kw.pop("strategy"), kw.pop("nproc"), out_dir=tmp_path / "never", **kw)
    assert says in str(e.value), str(e.value)
    assert not (tmp_path / "never").exists()  # nothing was started or written


@pytest.mark.distributed
def test_a_rank_error_is_shown_by_its_message(tmp_path):
    """tensor parallelism over 3 ranks with 2 heads: each rank's ValueError, as its message, not a source line."""
    r = L.launch("tensor_parallel", 3, out_dir=tmp_path, show_errors=False, timeout_s=120)
    assert not r.ok
    errors = r.why().split("--- errors raised in the ranks ---")[1].split("--- stderr")[0]
    assert "ValueError: n_head=2 must be divisible by the 3 tensor-parallel ranks" in errors and "raise " not in errors


def test_a_damaged_cache_entry_is_dropped_and_measured_again(tmp_path, monkeypatch, capsys):
    from course_lib import capabilities as K

    monkeypatch.setenv("COURSE_CACHE_DIR", str(tmp_path))
    for damaged, says in (
        ("null", "holds no table of peaks"),
        ("[1, 2]", "holds no table of peaks"),
        (json.dumps({"a key": None, "another": "fast", "good": 0.5}), "2 unreadable entries"),
    ):
        (tmp_path / "matmul_peaks.json").write_text(damaged)
        kept = K._read_cache()
        assert says in capsys.readouterr().err
        assert kept == ({"good": 0.5} if "good" in damaged else {})


# ---- results files: what a failed climb writes, and what a wrong file says ------------------------------------------


def test_a_climb_whose_baseline_fails_replaces_the_file_with_its_failure_and_exits_1(tmp_path, capsys, monkeypatch):
    """Naive fp32 out of memory: nothing to climb from. The --json file (replaced with --force) holds this climb's
    failure, not an earlier climb's loop that `export` would then write without a word; the exit status says so."""
    from course_lib import ladder as ladder_mod
    from course_lib.results import RunResult, load_results, provenance, save_results

    def out_of_memory(cfg, label, *args, **kwargs):
        result = RunResult(label, "oom", cfg.to_dict(), provenance("test"), reason="out of memory: made up")
        return result, None, []

    monkeypatch.setattr(ladder_mod, "_measure", out_of_memory)
    out = tmp_path / "l.json"
    earlier = RunResult("= optimised here", "ok", C.tiny_preset("cpu").to_dict(), provenance("test"))
    save_results([earlier], out, preset="tiny")
    assert cli(["ladder", "--preset", "tiny", "--json", str(out), "--force"]) == 1
    captured = capsys.readouterr()
    assert "the baseline, did not finish (oom: out of memory: made up)" in captured.out and "smaller" in captured.out
    assert "the baseline's failure is recorded there" in captured.err and "Traceback" not in captured.err
    results, _ = load_results(out)
    assert results[0].status == "oom" and all(r.status == "skipped" for r in results[1:])
    assert cli(["export", "--ladder", str(out)]) == 2
    assert "naive fp32, the baseline, did not finish (oom" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["null", "1", '"x"', "{}", "[]", '{"results": null}', '{"results": [1]}'])
def test_a_json_file_that_is_no_ladder_is_named_as_such(tmp_path, capsys, text):
    bad = tmp_path / "l.json"
    bad.write_text(text)
    for command in ("export", "profile", "config"):
        assert cli([command, "--ladder", str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "not a ladder's results file" in err and "Traceback" not in err, err


def test_ladder_and_preset_together_are_refused(tmp_path, capsys):
    from course_lib.results import save_results

    out = tmp_path / "l.json"
    save_results([], out)
    assert cli(["export", "--ladder", str(out), "--preset", "gpt2-small"]) == 2
    assert "--ladder and --preset both name a model" in capsys.readouterr().err


def test_bpe_checks_its_out_path_before_training(tmp_path, capsys, monkeypatch):
    from course_lib import bpe

    monkeypatch.setattr(bpe, "train_bpe", lambda *a, **k: pytest.fail("trained before the path was checked"))
    kept = tmp_path / "ranks.tiktoken"
    kept.write_text("mine")
    folder = tmp_path / "d"
    folder.mkdir()
    for out, says in ((kept, "exists: pass --force"), (folder, "is a folder"), ("/proc/r.tiktoken", "cannot write")):
        assert cli(["bpe", "--out", str(out)]) == 2
        assert says in capsys.readouterr().err
    assert kept.read_text() == "mine"


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_a_written_file_gets_the_usual_permissions(tmp_path, umask, mode):
    """A file write_atomic makes gets the permissions any new file gets here (the umask's), not a temporary file's
    0600; a file it replaces keeps its own, a read-only one included, which is written first and made read-only
    after (the write itself must not meet the target's read-only mode: root would not notice, anyone else would)."""
    import os
    import stat

    from course_lib.cache import write_atomic

    def write(text):
        def fill(partial):
            assert partial.stat().st_mode & stat.S_IWUSR, oct(partial.stat().st_mode)  # writable while written
            partial.write_text(text)

        return fill

    old = os.umask(umask)
    try:
        new = tmp_path / "train.py"
        write_atomic(new, write("x"), strict=True)
        assert new.stat().st_mode & 0o777 == mode
        new.chmod(0o444)
        write_atomic(new, write("y"), strict=True)
        assert new.stat().st_mode & 0o777 == 0o444 and new.read_text() == "y"
        assert [p.name for p in tmp_path.iterdir()] == ["train.py"]  # no temporary file left behind
    finally:
        os.umask(old)


def test_exercises_takes_one_of_verify_status_and_guide(capsys):
    with pytest.raises(SystemExit) as e:
        cli(["exercises", "--status", "--verify"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
