"""The exercises' checkers are honest: each reference passes, each recorded mistake is caught with its own hint, a
stub says "not solved yet", and a learner's exception is explained, not thrown."""

import ast
import dataclasses
import linecache
import math
import secrets
from pathlib import Path

import pytest
import torch

from course_lib import __main__ as cli, config, exercises as X
from course_lib.exercises import core, status as exercise_status


@pytest.mark.parametrize("row", X.verify(), ids=lambda r: f"{r['exercise']}-{r['answer']}")
def test_the_reference_passes_and_every_recorded_mistake_is_caught_with_its_hint(row):
    assert row["ok"], row["said"]


def test_every_exercise_records_at_least_two_typical_mistakes_with_different_hints():
    for ex in X.EXERCISES.values():
        assert len(ex.mistakes) >= 2 and len({m.hint for m in ex.mistakes}) == len(ex.mistakes), ex.name


def test_a_stub_is_not_solved_and_the_notebook_goes_on_with_the_reference(monkeypatch):
    monkeypatch.setenv(core.FILL_ENV, "0")

    def merge_tiles(o1, lse1, o2, lse2):
        """Your code."""
        raise NotImplementedError

    verdict = X.check("merge_tiles", merge_tiles)
    assert not verdict.solved and "not solved yet" in verdict.message
    assert X.attempt("merge_tiles", merge_tiles) is X.EXERCISES["merge_tiles"].reference
    monkeypatch.setenv(core.FILL_ENV, "1")  # the tests' switch: the stub gets the reference, every check runs
    assert X.check("merge_tiles", merge_tiles).solved


def test_a_learners_error_is_explained_in_a_sentence_not_a_traceback(monkeypatch):
    monkeypatch.setenv(core.FILL_ENV, "0")

    def step_time(times, warmup):
        return sorted(times)[warmup:][len(times)]  # an index out of range

    verdict = X.check("step_time", step_time)
    assert not verdict.solved and "raised IndexError" in verdict.message and "Traceback" not in verdict.message


def test_a_wrong_shape_is_named_and_the_reference_shown_only_when_asked(monkeypatch):
    monkeypatch.setenv(core.FILL_ENV, "0")

    def merge_tiles(o1, lse1, o2, lse2):
        return o1  # forgot the lse

    verdict = X.check("merge_tiles", merge_tiles)
    assert "should be tuple of 2" in verdict.message and "def merge_tiles" not in verdict.message
    assert "def merge_tiles" in X.check("merge_tiles", merge_tiles, show_reference=True).message


def test_a_correct_answer_written_differently_is_accepted(monkeypatch):
    monkeypatch.setenv(core.FILL_ENV, "0")

    def merge_tiles(o1, lse1, o2, lse2):
        m = torch.maximum(lse1, lse2)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        e1, e2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
        return (e1[:, None] * o1 + e2[:, None] * o2) / (e1 + e2)[:, None], m + torch.log(e1 + e2)

    assert X.check("merge_tiles", merge_tiles).solved


def test_the_cli_verifies_every_checker(capsys):
    assert cli.main(["exercises", "--verify"]) == 0
    out = capsys.readouterr().out
    assert f"{len(X.verify())} of {len(X.verify())} as they must be" in out
    assert cli.main(["exercises"]) == 0 and "merge_tiles" in capsys.readouterr().out


# ---- the notebooks' exercise cells, run as a learner meets them ---------------------------------------------------

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("0*.ipynb"))


def exercise_cells(notebook: Path) -> list[tuple[str, str, str]]:
    """(exercise name, the variable attempt's result is bound to, the cell's source) for each cell tagged "exercise"."""
    cells = []
    for tags, source in exercise_status.code_cells(notebook):  # read as `exercises --status` reads a notebook
        if exercise_status.TAG not in tags:
            continue
        calls = [
            (node.targets[0].id, node.value.args[0].value)
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and ast.unparse(node.value.func) == "exercises.attempt"
        ]
        assert len(calls) == 1, f"{notebook.name}: an exercise cell calls exercises.attempt once: {source[:80]!r}"
        cells.append((calls[0][1], calls[0][0], source))
    return cells


def run_exercise_cell(source: str, monkeypatch) -> tuple[dict, list]:
    """The cell's source executed on its own with the notebook's import of the exercises, as a kernel runs it (its
    source registered in linecache, so that inspect.getsource sees the stub as IPython's cells are seen)."""
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda *objs, **kw: shown.extend(objs))
    filename = f"<exercise cell {secrets.token_hex(4)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace = {"exercises": X}
    exec(compile(source, filename, "exec"), namespace)
    return namespace, shown


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem[:2])
def test_each_notebooks_stubs_as_written_say_not_solved_and_hand_back_the_reference(notebook, monkeypatch):
    """The learner's first run: the switch off, each stub as the notebook ships it. Each says "not solved yet" and the
    notebook goes on with the reference (the whole notebook's run under nbval uses the switch: conftest)."""
    for name, target, source in exercise_cells(notebook):
        monkeypatch.setenv(core.FILL_ENV, "0")
        namespace, shown = run_exercise_cell(source, monkeypatch)
        assert len(shown) == 1 and "not solved yet" in str(shown[0]), (notebook.name, name, shown)
        assert "goes on with the course's reference" in str(shown[0])
        assert namespace[target] is X.EXERCISES[name].reference, (notebook.name, name)
        monkeypatch.setenv(core.FILL_ENV, "1")  # the tests' switch: the same stub is the reference, and says so
        namespace, shown = run_exercise_cell(source, monkeypatch)
        assert shown[0].solved and "filled" in str(shown[0]) and namespace[target] is X.EXERCISES[name].reference


def test_the_exercises_sit_in_their_notebooks_two_or_three_each():
    by_notebook = {nb.stem[:2]: [name for name, _, _ in exercise_cells(nb)] for nb in NOTEBOOKS}
    for number, names in by_notebook.items():
        assert all(X.EXERCISES[n].notebook == number for n in names), (number, names)
    in_notebooks = {n for names in by_notebook.values() for n in names}
    assert set(X.EXERCISES) == in_notebooks, set(X.EXERCISES) ^ in_notebooks  # each exercise has its cell
    per_notebook = {f"{i:02d}": sum(ex.notebook == f"{i:02d}" for ex in X.EXERCISES.values()) for i in range(1, 10)}
    assert len(X.EXERCISES) >= 16 and all(2 <= n <= 3 for n in per_notebook.values()), per_notebook


# ---- verify is honest: a checker that accepts a wrong answer fails it --------------------------------------------


def test_verify_fails_when_a_checker_cannot_tell_a_mistake_from_the_reference(monkeypatch, capsys):
    ex = X.EXERCISES["step_time"]
    # one case with no outlier, no warm-up and an odd count: the mean, the warm-up kept and the unsorted middle all
    # equal the median there
    blind = dataclasses.replace(ex, cases=lambda: [core.Case("three equal steps", ([0.2, 0.2, 0.2], 0))])
    monkeypatch.setitem(X.EXERCISES, "step_time", blind)
    rows = [r for r in X.verify() if r["exercise"] == "step_time"]
    assert rows[0]["answer"] == "reference" and rows[0]["ok"]
    assert rows[1:] and all(not r["ok"] and r["said"].startswith("not caught") for r in rows[1:]), rows
    assert cli.main(["exercises", "--verify"]) == 1
    assert "not caught" in capsys.readouterr().out


def test_a_mistake_caught_only_with_another_mistakes_hint_fails_verify(monkeypatch):
    ex = X.EXERCISES["bucket_plan"]
    # the second recorded mistake made to answer as the first does: the checker names the first's hint, not its own
    twin = dataclasses.replace(ex.mistakes[1], fn=ex.mistakes[0].fn)
    monkeypatch.setitem(X.EXERCISES, "bucket_plan", dataclasses.replace(ex, mistakes=(ex.mistakes[0], twin)))
    row = next(r for r in X.verify() if r["exercise"] == "bucket_plan" and r["answer"] == twin.name)
    assert not row["ok"] and row["said"].startswith("caught without its own hint"), row


# ---- the checker's comparisons --------------------------------------------------------------------------------------


def test_an_int_answer_must_be_an_int_and_a_refused_case_must_be_refused(monkeypatch):
    monkeypatch.setenv(core.FILL_ENV, "0")

    def micro_steps(target_tokens, micro_batch, context, processes=1):
        return target_tokens / (micro_batch * context * processes)

    verdict = X.check("micro_steps", micro_steps)
    assert "should be an int, yours is the float 32.0" in verdict.message and verdict.mistake == "true division"

    def micro_steps(target_tokens, micro_batch, context, processes=1):
        return target_tokens // (micro_batch * context * processes)

    verdict = X.check("micro_steps", micro_steps)
    assert "the reference refuses this case (ValueError" in verdict.message and verdict.mistake == "rounded down"


def test_a_nested_answer_is_compared_by_its_nesting_not_only_its_leaves(monkeypatch):
    monkeypatch.setenv(core.FILL_ENV, "0")
    ref = X.EXERCISES["bucket_plan"].reference

    def bucket_plan(sizes, bucket_bytes):  # the same indices in the same order, one bucket each
        return [[i] for bucket in ref(sizes, bucket_bytes) for i in bucket]

    verdict = X.check("bucket_plan", bucket_plan)
    assert not verdict.solved and "buckets" in verdict.message


def test_a_learner_that_changes_its_inputs_in_place_does_not_change_the_reference_s_case(monkeypatch):
    monkeypatch.setenv(core.FILL_ENV, "0")
    ring = X.EXERCISES["ring_all_reduce"].reference

    def ring_all_reduce(chunks):
        out = ring(chunks)
        for rank in chunks:  # scribbles over its inputs after answering
            for c in rank:
                c.zero_()
        return out

    assert X.check("ring_all_reduce", ring_all_reduce).solved


# ---- the references agree with the course's own code and with the formulas --------------------------------------


def test_the_bucket_plan_is_bucketed_ddps(monkeypatch):
    from course_lib.distributed import ddp_by_hand
    from course_lib.model import GPT

    monkeypatch.setattr(ddp_by_hand.dist, "get_world_size", lambda: 1)
    monkeypatch.setattr(ddp_by_hand.dist, "broadcast", lambda tensor, src: None)
    model = GPT(config.tiny_preset("cpu").model)
    params = [p for p in model.parameters() if p.requires_grad]
    sizes = [p.numel() * p.element_size() for p in params]
    for bucket_bytes in (1, 64 * 1024, 256 * 1024, 10**9):
        ddp = ddp_by_hand.BucketedDDP(model, bucket_bytes)
        index = {id(p): i for i, p in enumerate(params)}
        assert [[index[id(p)] for p in b] for b in ddp.buckets] == X.EXERCISES["bucket_plan"].reference(
            sizes, bucket_bytes
        ), bucket_bytes


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_the_ring_all_reduce_leaves_every_rank_the_sum(n):
    gen = torch.Generator().manual_seed(n)
    chunks = [[torch.randn(3, generator=gen) for _ in range(n)] for _ in range(n)]
    out = X.EXERCISES["ring_all_reduce"].reference(chunks)
    for c in range(n):
        total = sum(chunks[r][c] for r in range(n))
        assert all(torch.allclose(out[r][c], total, atol=1e-6) for r in range(n))


def test_the_tensor_parallel_partials_and_c_projs_bias_are_the_courses_mlp():
    from course_lib.model import MLP

    torch.manual_seed(0)
    mlp = MLP(config.tiny_preset("cpu").model)
    x = torch.randn(5, mlp.c_fc.in_features)
    for n in (1, 2, 4, 8):
        partials = X.EXERCISES["mlp_partials"].reference(x, mlp.c_fc.weight.T, mlp.c_fc.bias, mlp.c_proj.weight.T, n)
        assert len(partials) == n
        torch.testing.assert_close(sum(partials) + mlp.c_proj.bias, mlp(x))


@pytest.mark.parametrize(("p", "m"), [(2, 2), (4, 4), (4, 8), (3, 7)])
def test_the_gpipe_times_leave_the_bubble_of_the_formula(p, m):
    from course_lib.distributed.pipeline import bubble_fraction

    f, b = X.EXERCISES["gpipe_start_times"].reference(p, m)
    span = float(b.max()) + 2.0  # the last backward's end (a backward costs two forwards)
    assert abs(1 - 3 * m / span - bubble_fraction(p, m)) < 1e-12  # each stage busy for m forwards and m backwards
    gpipe_bubble = (p - 1) / (m + p - 1)
    assert X.EXERCISES["gpipe_bubble"].reference(p, m) == pytest.approx(gpipe_bubble, abs=1e-12)


def test_the_scaler_step_replays_torchs_grad_scaler():
    ex = X.EXERCISES["scaler_step"]
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    scale, tracker = 2.0**10, 0
    for g in (1.0, float("inf"), 1.0, 1.0, 1.0, float("nan"), 1.0, 1.0):
        assert scaler.get_scale() == scale
        opt.zero_grad()
        scaler.scale((p * g).sum()).backward()  # p.grad = g x the scale, as backward of the scaled loss makes it
        grads, found, scale, tracker = ex.reference([p.grad.clone()], scale, tracker, 2)
        scaler.unscale_(opt)
        assert found == (not math.isfinite(g))
        if not found:
            torch.testing.assert_close(grads[0], p.grad)
        scaler.step(opt)
        scaler.update()


def test_a_learners_adamw_step_trains_the_model_as_torch_does_and_a_wrong_one_does_not():
    from course_lib.exercises import adamw
    from course_lib.lessons import optimizers_by_hand as O

    def against_torch(step):
        return O.max_difference_after_steps(
            lambda g: adamw.optimizer_from(step)(g, lr=3e-3, betas=(0.9, 0.95)),
            lambda g: torch.optim.AdamW(g, lr=3e-3, betas=(0.9, 0.95), foreach=False),
            config.tiny_preset("cpu").model,
            steps=2,
            weight_decay=0.1,
        )

    assert against_torch(adamw.adamw_step) < 1e-10
    assert against_torch(X.EXERCISES["adamw_step"].mistakes[0].fn) > 1e-4


def test_a_shortcut_the_exercise_is_there_to_avoid_is_named_not_passed(monkeypatch):
    """torch.softmax for the online softmax, a bf16 conversion for rounding to bf16: the right numbers, refused, and the
    verdict says what the exercise asks instead. The references themselves may use them."""
    monkeypatch.setenv(core.FILL_ENV, "0")
    softmax = X.check("online_softmax", lambda x, block: torch.softmax(x, -1))
    assert not softmax.solved and "in blocks" in softmax.message and softmax.mistake == "shortcut"
    bf16 = X.check("round_to_bf16", lambda x: x.to(torch.bfloat16).float())
    assert not bf16.solved and "on the bits" in bf16.message
    assert X.check("online_softmax", X.EXERCISES["online_softmax"].reference).solved
