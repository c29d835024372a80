"""course_lib.export: the standalone script of a config trains exactly like the course's loop.

Each case exports a script, runs it (a subprocess), and trains the same config with course_lib.train.train on the same
seed and batches; the per-step losses must be equal bit for bit, except where the arithmetic may differ (torch.compile
may fuse and reorder fp32 sums: a stated tolerance, against the course's eager loop). To stay fast, the single-process
scripts run one after another in one subprocess (each imported and its main() called, as `python train.py` would; the
corpus is tokenized once, by the first script's own code), and DDP and FSDP2 run each script as torchrun runs it, then
the course's loop, in one launch of 2 gloo processes. Every config here has measure_memory=False: the course's
memory-ledger step is a measurement the script does not have (and it runs a compiled step eagerly).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from course_lib import codegen, config as C, data, export, ladder, techniques as T, train
from course_lib.__main__ import main as cli
from course_lib.capabilities import capabilities
from course_lib.doctor import check_config

BASE = check_config("cpu")  # the doctor's run: the compile case reads the kernels the doctor's compile check compiled
COMPILE_RTOL = 1e-5  # compiled kernels may sum in another order: |loss_script - loss_course| <= 1e-5 * |loss_course|


def everything_on(cfg: C.TrainConfig) -> C.TrainConfig:
    """The ladder's top rung without asking the device (every rung's value, in order)."""
    cfg = T.naive(cfg)
    for rung in T.LADDER:
        cfg = rung.apply(cfg)
    return cfg


# name -> (config, the batches are the test's padded ones, tolerance or None for bit for bit)
CASES = {
    "naive fp32": (BASE, False, None),
    "tf32 (no effect on a CPU)": (dataclasses.replace(BASE, precision="tf32"), False, None),
    "bf16 autocast": (dataclasses.replace(BASE, precision="bf16"), False, None),
    "fp16 + GradScaler + clipping": (dataclasses.replace(BASE, precision="fp16", clip_norm=0.5), False, None),
    "sdpa": (BASE.with_model(attention="sdpa"), False, None),
    "the course's flash attention": (BASE.with_model(attention="flash"), False, None),
    "vocab x64": (BASE.with_model(vocab_multiple=64), False, None),
    "fused AdamW": (dataclasses.replace(BASE, fused_adamw=True), False, None),
    "set_to_none": (dataclasses.replace(BASE, set_to_none=True), False, None),
    "checkpointing full": (dataclasses.replace(BASE, activation_checkpointing="full"), False, None),
    "checkpointing selective": (dataclasses.replace(BASE, activation_checkpointing="selective"), False, None),
    "chunked loss": (dataclasses.replace(BASE, loss_chunks=8), False, None),
    "everything on but compile": (dataclasses.replace(everything_on(BASE), compile=False), False, None),
    "accumulation with uneven padding": (dataclasses.replace(BASE, grad_accum_steps=2), True, None),
    "AdamW decay 2-D, global clip, cosine, validation": (
        dataclasses.replace(BASE, weight_decay=0.1, clip_norm=0.5, schedule="cosine", lr_warmup_steps=1, eval_every=2),
        False,
        None,
    ),
    "SGD momentum, per-tensor clip, wsd": (
        dataclasses.replace(
            BASE,
            optimizer="sgd_momentum",
            lr=0.05,
            clip_norm=0.5,
            clip_kind="per_tensor",
            schedule="wsd",
            weight_decay=0.01,
            decay_2d_only=False,
        ),
        False,
        None,
    ),
    "RMSprop, exponential decay": (
        dataclasses.replace(BASE, optimizer="rmsprop", schedule="exponential", lr_warmup_steps=1),
        False,
        None,
    ),
    "AdaGrad, L2 decay on every tensor": (
        dataclasses.replace(BASE, optimizer="adagrad", lr=1e-2, weight_decay=0.01, decay_2d_only=False),
        False,
        None,
    ),
    "compile": (dataclasses.replace(BASE, compile=True), False, COMPILE_RTOL),  # the one compile case, last
}

DRIVER = textwrap.dedent("""
    import importlib.util, json, sys
    import torch

    # the corpus, tokenized by the first script's own token_stream and handed to the others (it is the same code)
    stream = []
    for case in json.load(open(sys.argv[1])):
        spec = importlib.util.spec_from_file_location("exported_train", case["script"])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        own = module.token_stream
        module.token_stream = lambda enc, own=own: stream[0] if stream else stream.append(own(enc)) or stream[0]
        # the test's batches in place of the script's own (make_batches is where a learner puts theirs)
        if case["batches"]:
            steps = torch.load(case["batches"])
            module.make_batches = lambda *args, steps=steps: (lambda step: steps[step])
        sys.argv = [case["script"], "--losses", case["losses"]]
        module.main()  # what `python train.py --losses ...` runs
""")


def padded_batches(stream: torch.Tensor, cfg: C.TrainConfig, pad: int) -> list:
    """Each step's two micro-batches of two sequences padded to the context, unevenly: the first micro-batch almost
    full, the second mostly padding (a mean of micro-batch means would weight its few tokens up)."""
    gen = torch.Generator().manual_seed(7)
    lengths = ((cfg.context + 1, 50), (20, 9))  # tokens per sequence, for micro-batches 0 and 1
    steps = []
    for _ in range(cfg.steps):
        micro = []
        for lens in lengths:
            starts = torch.randint(0, len(stream) - 2 * cfg.context, (len(lens),), generator=gen).tolist()
            micro.append(data.pad_sequences([stream[s : s + n] for s, n in zip(starts, lens)], cfg.context, pad))
        steps.append(micro)
    return steps


# The template itself, uncut (only its settings set: it imports course_lib), runs these cases too: exactly as their cut
# scripts do, so the cut changes nothing a run does.
UNCUT = ("naive fp32", "fp16 + GradScaler + clipping", "everything on but compile", "accumulation with uneven padding")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, splits):
    """Every case's script run once (one subprocess): name -> (script losses, the padded batches or None); the uncut
    template's runs under "<name> (uncut)"."""
    tmp = tmp_path_factory.mktemp("export")
    cases, batches = [], {}
    jobs = [(name, *case, True) for name, case in CASES.items()]
    jobs += [(f"{name} (uncut)", *CASES[name], False) for name in UNCUT]
    for i, (name, cfg, padded, _, cut) in enumerate(jobs):
        script = tmp / f"train_{i}.py"
        script.write_text(export.script(cfg, cut=cut))
        case = {"script": str(script), "losses": str(tmp / f"losses_{i}.json"), "batches": None}
        if padded:
            batches[name] = batches.get(name.removesuffix(" (uncut)")) or padded_batches(
                splits.train, cfg, splits.pad_id
            )
            case["batches"] = str(tmp / f"batches_{i}.pt")
            torch.save(batches[name], case["batches"])
        cases.append(case)
    (tmp / "cases.json").write_text(json.dumps(cases))
    (tmp / "driver.py").write_text(DRIVER)
    proc = subprocess.run(
        [sys.executable, str(tmp / "driver.py"), str(tmp / "cases.json")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {
        job[0]: (json.loads(Path(c["losses"]).read_text()), batches.get(job[0])) for job, c in zip(jobs, cases)
    }, proc.stdout


@pytest.mark.parametrize("name", list(CASES))
def test_the_script_trains_like_the_course_loop(name, runs, splits):
    cfg, padded, rtol = CASES[name]
    script_losses, batches = runs[0][name]
    # The compiled script is held to the course's eager loop: the course's compiled loop equals its eager one (the
    # doctor's compile check, test_doctor.py), and a second compile of the same model here would only cost time.
    course = train.train(
        dataclasses.replace(cfg, compile=False), splits=splits, batches=(lambda step: batches[step]) if padded else None
    )
    assert len(script_losses) == cfg.steps
    if rtol is None:
        assert script_losses == course.losses, f"{name}: not bit for bit: {script_losses} against {course.losses}"
    else:
        for a, b in zip(script_losses, course.losses):
            assert abs(a - b) <= rtol * abs(b), f"{name}: {script_losses} against {course.losses} (rtol {rtol})"
        if script_losses != course.losses:
            print(f"{name}: within rtol {rtol}, not bit for bit: {script_losses} against {course.losses}")


@pytest.mark.parametrize("name", UNCUT)
def test_the_template_uncut_trains_as_its_cut_script(name, runs):
    assert runs[0][f"{name} (uncut)"][0] == runs[0][name][0]


def test_the_script_prints_its_timing(runs):
    out = runs[1]
    assert "parameters;" in out and "tokens/s" in out and "median step" in out
    assert "validation loss" in out  # the case with eval_every


def test_padding_is_uneven_across_micro_batches(runs):
    (_, batches) = runs[0]["accumulation with uneven padding"]
    counts = [[data.count_targets(y) for _, y in step] for step in batches]
    assert all(a > 2 * b for a, b in counts), counts


DP_DRIVER = textwrap.dedent('''
    """Under torchrun, for each case: the exported script (as `torchrun train.py` runs it), then the course's loop on
    the same shards."""
    import json, os, runpy, sys
    import torch, torch.distributed as dist
    from course_lib import config as C, data, train

    out = sys.argv[1]
    splits = data.load_splits()
    for i, (script, cfg_file, port) in enumerate(json.load(open(os.path.join(out, "cases.json")))):
        sys.argv = [script, "--losses", os.path.join(out, f"script_{i}.json")]
        # torchrun's store was the first script's; a later one joins the store its rank 0 starts on a free port
        if i > 0:
            os.environ.update(TORCHELASTIC_USE_AGENT_STORE="False", MASTER_PORT=str(port))
        runpy.run_path(script, run_name="__main__")  # it joins the process group and leaves it
        cfg = C.TrainConfig.from_dict(json.load(open(cfg_file)))
        # A second group in the same processes: a file store (torchrun's store was the script's).
        dist.init_process_group("gloo", init_method="file://" + os.path.join(out, f"store_{i}"),
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        rank, world, mb = dist.get_rank(), dist.get_world_size(), cfg.micro_batch_size
        # the script's batches: one global batch per micro-batch, sliced by rank
        gen = torch.Generator().manual_seed(cfg.seed)
        steps = [[tuple(t[rank * mb:(rank + 1) * mb]
                        for t in data.random_windows(splits.train, world * mb, cfg.context, gen))
                  for _ in range(cfg.grad_accum_steps)] for _ in range(cfg.steps)]
        result = train.train(cfg, batches=lambda step: steps[step], splits=splits)
        with open(os.path.join(out, f"course_{i}_rank{rank}.json"), "w") as f:
            json.dump(result.losses, f)
        dist.destroy_process_group()
''')
# Data parallel on 2 gloo processes with gradient accumulation (the sync switched off on the first micro-batch: DDP's
# no_sync, FSDP2's set_requires_gradient_sync): rank 0's losses, bit for bit. Both cases in one torchrun launch (its
# start-up paid once); the second script's process group gets a store of its own (joining torchrun's store a second
# time from the same processes can hang).
DP_CASES = {
    "ddp": dataclasses.replace(BASE, data_parallel="ddp", grad_accum_steps=2),
    "fsdp": dataclasses.replace(BASE, data_parallel="fsdp", grad_accum_steps=2),
    "bucketed": dataclasses.replace(BASE, data_parallel="bucketed"),  # DDP by hand (it all-reduces every backward)
}


@pytest.fixture(scope="module")
def dp_runs(tmp_path_factory) -> dict:
    """Every DP case's script and the course's loop under one torchrun launch: name -> (script losses, course losses,
    stdout of that script)."""
    from course_lib.distributed.launch import free_port

    tmp = tmp_path_factory.mktemp("dp")
    cases = []
    for i, cfg in enumerate(DP_CASES.values()):
        (tmp / f"train_{i}.py").write_text(export.script(cfg))
        (tmp / f"cfg_{i}.json").write_text(json.dumps(cfg.to_dict()))
        cases.append([str(tmp / f"train_{i}.py"), str(tmp / f"cfg_{i}.json"), free_port()])
    (tmp / "cases.json").write_text(json.dumps(cases))
    (tmp / "driver.py").write_text(DP_DRIVER)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(tmp / "driver.py"),
        str(tmp),
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:  # torchrun and its workers are one process group: none is left behind, even after a timeout
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, stderr[-4000:]
    printed = stdout.split("step 1/3")  # each script's rank 0 prints its steps, the first one "step 1/3"
    assert len(printed) == len(DP_CASES) + 1, f"expected one 'step 1/3' per script (only rank 0 prints):\n{stdout}"
    return {
        name: (
            json.loads((tmp / f"script_{i}.json").read_text()),
            json.loads((tmp / f"course_{i}_rank0.json").read_text()),
            "step 1/3" + printed[i + 1],
        )
        for i, name in enumerate(DP_CASES)
    }


def test_ddp_script_trains_like_the_course_loop(dp_runs):
    script_losses, course, stdout = dp_runs["ddp"]
    assert script_losses == course, f"DDP: {script_losses} against {course}"
    assert "tokens/s" in stdout


def test_the_hand_written_ddp_script_trains_like_the_course_loop(dp_runs):
    """data_parallel="bucketed": the loop's own BucketedDDP, rendered into the script (its hooks all-reduce buckets of
    gradients while backward runs, finish() waits for the rest): the same losses as the course's loop, bit for bit."""
    script_losses, course, stdout = dp_runs["bucketed"]
    assert script_losses == course, f"DDP by hand: {script_losses} against {course}"
    assert "tokens/s" in stdout


def test_fsdp_script_trains_like_the_course_loop(dp_runs):
    """FSDP2 (fully_shard on each block, then the root): the same losses as the course's loop, bit for bit."""
    script_losses, course, stdout = dp_runs["fsdp"]
    assert script_losses == course, f"FSDP2: {script_losses} against {course}"
    assert "tokens/s" in stdout


# ---- what the script holds -------------------------------------------------------------------------------------


def test_every_config_field_is_a_setting_of_the_template():
    """Each field is one setting of the template (its name in capitals), or is said not to be exported; a field the
    template lacks is an error that says what to add."""
    names = [f.name for f in dataclasses.fields(C.ModelConfig)]
    names += [f.name for f in dataclasses.fields(C.TrainConfig) if f.name != "model"]
    assert sorted(export.settings(BASE)) == sorted(n.upper() for n in names if n not in export.NOT_EXPORTED)
    uncut = export.script(BASE, cut=False)
    assert all(f"\n{name} = {codegen.literal(v)}" in uncut for name, v in export.settings(BASE).items())
    with pytest.raises(RuntimeError, match="the template has no setting"):
        codegen.set_constants("A = 1\n", {"A": 2, "B": 3})


def test_the_cut_drops_every_branch_the_settings_decide():
    """What the cut does, on a small source: if/elif/else, `and`/`or` with a setting in them, `a if S else b`, a
    setting that decides nothing left as written, and the settings, imports and functions nothing reads any more
    dropped."""
    src = textwrap.dedent("""
        import os
        import sys
        A = 2
        B = "x"
        DOUBLE = A * 2


        def f(n):
            if A > 1:
                n += 1  # kept
            if B == "y":
                n = 0
            elif B == "x":
                n *= DOUBLE
            else:
                n = -1
            if A == 2 and n > 3:
                n -= 1
            if A == 3 or n > 3:
                n -= 1
            return n if B == "x" else os.sep


        RESULT = [f(n) for n in range(6)]
    """)
    known = codegen.known_constants(src, {"A": 2, "B": "x"})
    assert known["DOUBLE"] == 4
    out = codegen.drop_unused(codegen.fold(src, known), known)
    assert "n += 1  # kept" in out and "n *= DOUBLE" in out and "n = -1" not in out and "n = 0" not in out
    assert out.count("if n > 3:") == 2 and "return n\n" in out
    assert "import os" not in out and "import sys" not in out and "B = " not in out and "A = 2" in out  # DOUBLE reads A
    namespace = {}
    exec(out, namespace)
    exec(src, reference := {})
    assert namespace["RESULT"] == reference["RESULT"] and "def f(n):" in out


# What each technique's rung puts into the script; none of these is in the naive script.
MARKERS = {
    "precision": {"tf32": 'fp32_precision = "tf32"', T.FAST_16BIT: "torch.autocast"},
    "model.attention": "scaled_dot_product_attention",
    "compile": "torch.compile(",
    "model.vocab_multiple": "VOCAB_MULTIPLE = 64",
    "fused_adamw": "fused=True",
    "set_to_none": "set_to_none=True",
    "activation_checkpointing": "CheckpointedBlock(",
    "loss_chunks": "LOSS_CHUNKS",
    "keep_freed_memory": "mallopt(",
}
OFF_WORDS = (
    "mallopt",
    "autocast",
    "torch.compile",
    "Checkpointed",
    "fused=True",
    "GradScaler",
    "scaler",
    "require_backward_grad_sync",
    "scaled_dot_product",
    "flash",
    "LOSS_CHUNKS",
    "HeadLossInSlices",
    "scheduler",
    "clip",
    "torch.distributed",
    "fp32_precision",
    "set_to_none=True",
    "evaluate",
    "param_groups",
    "dist.",
    "rank ==",
    "cuda",
)


def test_the_naive_script_holds_no_technique():
    text = export.script(T.naive(BASE))
    assert [w for w in OFF_WORDS if w in text] == []


@pytest.mark.parametrize("rung", [r for r in T.LADDER if r.technique], ids=lambda r: r.name)
def test_each_rung_adds_its_technique(rung):
    t = rung.technique
    marker = MARKERS[t.field][rung.value] if isinstance(MARKERS[t.field], dict) else MARKERS[t.field]
    naive, on = T.naive(BASE), rung.apply(T.naive(BASE))
    assert marker not in export.script(naive) and marker in export.script(on)
    changed = export.diff(naive, on)
    assert marker in changed and changed.startswith("--- a/train.py\n+++ b/train.py\n")


def test_accumulation_is_a_number_of_micro_batches_and_ddp_syncs_on_the_last():
    """As in nanoGPT, the step always loops over its micro-batches: accumulation changes their number (and, under DDP,
    switches the gradient sync off on all but the last)."""
    one, two = export.script(BASE), export.script(dataclasses.replace(BASE, grad_accum_steps=2))
    code = [text.split('"""', 2)[2].splitlines() for text in (one, two)]  # after the docstring
    changed = [(a, b) for a, b in zip(*code) if a != b]
    assert len(code[0]) == len(code[1]) and [a.split("#")[0] for a, _ in changed] == ["GRAD_ACCUM_STEPS = 1  "]
    assert "GRAD_ACCUM_STEPS = 2" in two and "step_loss += loss.detach()" in one
    ddp = export.script(dataclasses.replace(BASE, grad_accum_steps=2, data_parallel="ddp"))
    assert "ddp_model.require_backward_grad_sync = i == GRAD_ACCUM_STEPS - 1" in ddp and "init_process_group" in ddp
    assert "require_backward_grad_sync" not in export.script(dataclasses.replace(BASE, data_parallel="ddp"))


def test_exported_scripts_pass_pyflakes(tmp_path, pyflakes):
    top = everything_on(BASE)
    cfgs = [cfg for cfg, _, _ in CASES.values()] + [
        top,
        dataclasses.replace(top, activation_checkpointing="selective", compile_mode="max-autotune"),
        dataclasses.replace(top, compile_mode="reduce-overhead", grad_accum_steps=2, set_to_none=False),
        dataclasses.replace(
            BASE, data_parallel="ddp", grad_accum_steps=2, eval_every=1, precision="fp16", clip_norm=1.0
        ),
        dataclasses.replace(
            top,
            device="cuda",
            data_parallel="ddp",
            loss_chunks=1,
            grad_accum_steps=2,
            schedule="inverse_sqrt",
            lr_warmup_steps=2,
            optimizer="sgd",
            fused_adamw=False,
            weight_decay=0.1,
        ),
        dataclasses.replace(
            BASE, schedule="constant", lr_warmup_steps=2, optimizer="sgd", clip_norm=1.0, clip_kind="per_tensor"
        ),
    ]
    paths = []
    for i, cfg in enumerate(cfgs):
        paths.append(tmp_path / f"train_{i}.py")
        paths[-1].write_text(export.script(cfg))
    assert pyflakes(*paths) == ""


def test_what_cannot_be_exported_is_explained():
    with pytest.raises(C.ConfigError, match="loss_chunks=1"):
        export.script(dataclasses.replace(BASE, data_parallel="fsdp", loss_chunks=8))
    with pytest.raises(C.ConfigError, match="loss_chunks=1"):
        export.script(dataclasses.replace(BASE, data_parallel="ddp", loss_chunks=8))
    with pytest.raises(C.ConfigError, match="raise steps"):
        export.script(dataclasses.replace(BASE, steps=1))


# ---- the command line ------------------------------------------------------------------------------------------


def test_export_command_writes_a_rung(tmp_path, capsys, tiny):
    out = tmp_path / "train.py"
    assert (
        cli(
            [
                "export",
                "--preset",
                "tiny",
                "--device",
                "cpu",
                "--steps",
                "3",
                "--rung",
                "+ 16-bit autocast",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    expected = ladder.rung_config(tiny(steps=3), "+ 16-bit autocast")
    # the 16-bit format this CPU runs fast, or bf16 where it runs none fast (what the ladder then measures)
    assert expected.precision == (capabilities("cpu").fast_16bit()[0] or "bf16") and out.read_text() == export.script(
        expected
    )
    assert "wrote" in capsys.readouterr().err
    before = out.read_text()
    again = [
        "export",
        "--preset",
        "tiny",
        "--device",
        "cpu",
        "--rung",
        "+ checkpointing",
        "--set",
        "activation_checkpointing=selective",
        "--set",
        "grad_accum_steps=2",
        "--out",
        str(out),
    ]
    # not replaced unasked
    assert cli(again) == 2 and "exists: pass --force" in capsys.readouterr().err and out.read_text() == before
    assert cli(again + ["--force"]) == 0
    text = out.read_text()
    assert (
        "create_selective_checkpoint_contexts" in text and "GRAD_ACCUM_STEPS = 2" in text and "torch.compile(" in text
    )
    assert (
        cli(
            [
                "export",
                "--preset",
                "tiny",
                "--device",
                "cpu",
                "--set",
                "data_parallel=ddp",
                "--set",
                "model.n_layer=3",
                "--out",
                str(out),
                "--force",
            ]
        )
        == 0
    )
    assert "DistributedDataParallel(model)" in out.read_text() and "N_LAYER = 3" in out.read_text()


@pytest.mark.parametrize(
    "args, says",
    [
        (["--set", "checkpointing=full"], "did you mean 'activation_checkpointing'"),
        (["--set", "precision"], "--set takes FIELD=VALUE"),
        (["--set", "precision=fp8"], "precision='fp8' is not one of"),
        (["--rung", "+ warp drive"], "is not a rung of the ladder"),
    ],
)
def test_export_command_explains_bad_arguments(args, says, capsys):
    assert cli(["export", "--preset", "tiny", "--device", "cpu", *args]) == 2
    assert says in capsys.readouterr().err


def test_the_script_finds_the_ranks_file_as_course_lib_data_does(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(export.script(BASE))
    spec = importlib.util.spec_from_file_location("exported_train", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.course_ranks_file().resolve() == data.RANKS_FILE.resolve()
    assert module.tokenizer(module.course_ranks_file()).n_vocab == data.get_tokenizer().n_vocab


@pytest.mark.unit
def test_diff_html_shows_exactly_the_lines_a_technique_adds(tiny):
    import html as html_mod

    naive = T.naive(tiny())
    bf16 = dataclasses.replace(naive, precision="bf16")
    text = export.diff(naive, bf16)
    added = [line for line in text.splitlines() if line.startswith("+") and not line.startswith("+++")]
    removed = [line for line in text.splitlines() if line.startswith("-") and not line.startswith("---")]
    page = export.diff_html(naive, bf16, "bf16")
    assert f"{len(added)} lines added, {len(removed)} removed" in page
    assert all(html_mod.escape(line) in page for line in added + removed)
    assert "torch.autocast" in page
    assert "the two scripts are the same" in export.diff_html(naive, naive)


def test_the_fsdp_script_shards_every_block_then_the_root(tmp_path, pyflakes):
    """FSDP2 as techniques.apply_data_parallel applies it, before the optimizer (which then holds the shards); on a GPU
    one process per GPU with NCCL; with accumulation, the reduce-scatter only on the last micro-batch."""
    cfg = dataclasses.replace(
        everything_on(BASE),
        device="cuda",
        data_parallel="fsdp",
        loss_chunks=1,
        grad_accum_steps=2,
        eval_every=1,
        precision="fp16",
        clip_norm=1.0,
    )
    text = export.script(cfg)
    make_model, main = text[text.index("def make_model(") :], text[text.index("def main()") :]
    assert make_model.index("fully_shard(block, mesh=mesh)") < make_model.index("fully_shard(model, mesh=mesh)")
    assert main.index("model = make_model(") < main.index("optimizer = make_optimizer(model)")
    assert "torch.optim.AdamW(" in text
    assert (
        "init_device_mesh(DEVICE_TYPE, (world,))" in text
        and 'DEVICE = "cuda"' in text
        and 'backend="nccl"' in text
        and "torchrun --nproc_per_node" in text
    )
    assert (
        "model.set_requires_gradient_sync(i == GRAD_ACCUM_STEPS - 1)" in text and "DistributedDataParallel" not in text
    )
    assert "fully_shard" not in export.script(dataclasses.replace(cfg, grad_accum_steps=1, data_parallel="ddp"))
    (tmp_path / "train.py").write_text(text)
    assert pyflakes(tmp_path / "train.py") == ""


@pytest.mark.unit
def test_technique_diff_shows_a_technique_on_against_off():
    on = dataclasses.replace(BASE, clip_norm=0.5)
    shown = export.technique_diff(BASE, activation_checkpointing="selective").data
    assert "create_selective_checkpoint_contexts" in shown and "activation_checkpointing='selective'" in shown
    assert export.technique_diff(on, without={"clip_norm": None}).data == export.diff_html(
        BASE, on, "without clip_norm=None"
    )
    assert "VOCAB_MULTIPLE = 64" in export.technique_diff(BASE, **{"model.vocab_multiple": 64}).data
    with pytest.raises(ValueError, match="needs the settings"):
        export.technique_diff(BASE)


def test_a_rung_of_a_gpu_config_written_on_a_machine_without_that_gpu(tiny):
    """rung_config on a device this machine lacks applies the rungs unchecked, and a rung that no device can run on
    that config (fused AdamW under SGD) is a ConfigError, not a crash of the rungs below it."""
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA: here the GPU's capabilities would be asked")
    base = tiny(device="cuda", optimizer="sgd")
    assert ladder.rung_config(base, "+ tf32").precision == "tf32"
    with pytest.raises(C.ConfigError, match="cannot run on this device"):
        ladder.rung_config(base, "+ fused AdamW")


@pytest.mark.parametrize("name", ["vocab_multiple", "model.vocab_multiple"])
def test_a_set_techniques_field_is_what_its_rung_sets_not_overwritten_by_it(name, capsys):
    """`profile --rung 7 --set model.vocab_multiple=1` (on an H200) profiled the padded vocabulary: the field's name
    changed the preset, and the vocabulary rung, below rung 7, set 64 over it. By its name or its field, a technique's
    --set is what its rung sets."""
    assert cli(["config", "--preset", "tiny", "--rung", "7", "--set", f"{name}=1"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "model.vocab_multiple" in x)
    assert line.split()[1] == "1", line
    assert cli(["config", "--preset", "tiny", "--rung", "7"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "model.vocab_multiple" in x)
    assert line.split()[1] == "64", line
