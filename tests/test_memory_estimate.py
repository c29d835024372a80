"""memory_formula.estimate against the ledger, lever by lever.

The analytic estimate must model every lever the ledger measures. Its peak is compared with one measured step
(lessons.formula_beside_measured.account_step: the loop's own step body under the CPU ledger, in FakeTensorMode, so
nothing is allocated) for each lever alone from naive fp32, and for the combination of the issue (GPT-2 small at batch
32, context 1024, SDPA, full checkpointing, 8 loss chunks, set_to_none: the old estimate said 21.1 GiB, one step peaks
at 5.2 GiB).

Tolerance: TOL = 0.5 % of the measured peak, for the peak and for every category of it (parameters, gradients,
optimizer state, activations, logits, other). The model is term by term, so it is exact but for what it leaves
out on purpose: scalars (the loss, the GradScaler's), the final LayerNorm's gradients, a mask's few bytes; the
largest error of the cases below is about 0.02 %. The peak's moment is checked too: the ledger's peak must fall in
the phase of the estimate's (the loss in forward, or backward).

Shapes: the `cpu` preset (the course's CPU runs, where the logits hold the peak), the same with a 64-token vocabulary
(the blocks' backward holds the peak: checkpointing's recompute, attention's backward), and GPT-2 small at batch 32,
context 1024. fp16 cannot run under FakeTensorMode (its GradScaler reads the scale with .item()): it is measured for
real on the tiny preset.
"""

from dataclasses import replace

import pytest

from course_lib import memory_formula as F
from course_lib.config import cpu_preset, gpt2_small_preset
from course_lib.lessons.formula_beside_measured import account_step
from course_lib.measure import CATEGORIES, GiB

TOL = 0.005

SHAPES = {
    "cpu": cpu_preset("cpu"),
    "cpu-V64": cpu_preset("cpu").with_model(vocab_size=64),
    "gpt2-b32-s1024": replace(gpt2_small_preset("cpu"), batch_size=32, context=1024),
}

# Each lever, as a change from naive fp32 (the preset: naive attention, AdamW, gradients zeroed in place).
LEVERS = {
    "naive fp32": {},
    "tf32": {"precision": "tf32"},
    "bf16": {"precision": "bf16"},
    "sdpa": {"attention": "sdpa"},
    "full checkpointing": {"activation_checkpointing": "full"},
    "selective checkpointing": {"activation_checkpointing": "selective"},
    "8 loss chunks": {"loss_chunks": 8},
    "set_to_none": {"set_to_none": True},
    "accumulation x2": {"grad_accum_steps": 2},
    "sgd": {"optimizer": "sgd"},
    "sgd_momentum": {"optimizer": "sgd_momentum"},
    "vocab to x64": {"vocab_multiple": 64},
}
MODEL_FIELDS = {"attention", "vocab_multiple", "dropout"}

CASES = (
    [("cpu", name) for name in LEVERS]
    + [
        ("cpu-V64", name)
        for name in ("naive fp32", "bf16", "sdpa", "full checkpointing", "selective checkpointing", "set_to_none")
    ]
    + [("cpu-V64", "bf16 + selective checkpointing"), ("cpu-V64", "sdpa + full checkpointing")]
    # GPT-2 small: the levers whose terms grow with its shape (bf16 and full checkpointing are in the issue's
    # combinations)
    + [("gpt2-b32-s1024", name) for name in ("naive fp32", "selective checkpointing", "8 loss chunks")]
)


def config(shape: str, levers: str, **more):
    """The shape with the levers named in `levers` ("a + b") switched on."""
    cfg = SHAPES[shape]
    changes = {k: v for name in levers.split(" + ") for k, v in LEVERS[name].items()} | more
    model = {k: v for k, v in changes.items() if k in MODEL_FIELDS}
    return replace(cfg.with_model(**model), **{k: v for k, v in changes.items() if k not in MODEL_FIELDS})


def check(cfg, fake=True):
    """The estimate against one measured step: the peak and each category within TOL of the peak, at the same moment."""
    est, led = F.estimate(cfg), account_step(cfg, fake=fake)
    err = (est.peak_bytes - led.peak_bytes) / led.peak_bytes
    assert abs(err) <= TOL, (
        f"estimate {est.peak_gib:.4f} GiB ({est.when}) vs ledger {led.peak_bytes / GiB:.4f} GiB: {100 * err:+.2f} %"
    )
    for cat in CATEGORIES:
        assert abs(est.by_category[cat] - led.by_category[cat]) <= TOL * led.peak_bytes, (
            cat,
            est.by_category,
            led.by_category,
        )
    # the moment: the ledger's phase at its peak ("loss" is the forward from the output layer on)
    peak_phase = max(led.timeline, key=lambda pl: pl[1])[0]
    assert peak_phase == ("loss" if est.when.startswith("forward") else "backward"), (peak_phase, est.when)
    return est, led


@pytest.mark.parametrize("shape,lever", CASES, ids=[f"{s}-{lev}" for s, lev in CASES])
def test_each_lever_against_the_ledger(shape, lever):
    check(config(shape, lever))


def test_the_issue_chunked_loss_with_checkpointing():
    # The issue: SDPA + full checkpointing + 8 loss chunks (+ set_to_none, as on the ladder): the old estimate ignored
    # the chunks (21.1 GiB, three full b s V fp32 logits tensors). With the loss in slices, each slice's gradients made
    # in forward (techniques.HeadLossInSlices), one slice's logits are all that exist of them, and the step's peak
    # moves to the last block's backward, at about 4 GiB.
    cfg = config("gpt2-b32-s1024", "sdpa + full checkpointing + 8 loss chunks + set_to_none")
    est, led = check(cfg)
    assert 3.6 < led.peak_bytes / GiB < 4.8
    assert est.when == "last block's backward: MLP backward"
    # the loss's worst moment: the fp32 logits of one slice (4096 tokens x 50304), turned into their gradient in place
    chunk = 32 * 1024 // 8 * cfg.model.padded_vocab_size * 4
    slice_terms = F.peak_candidates(cfg)["forward: a loss slice"]
    assert slice_terms["the slice's logits, then softmax - onehot in place (c V fp32)"] == ("logits", chunk)
    vh = cfg.model.padded_vocab_size * cfg.model.n_embd * 4  # the slice's (V x h) share of the weight gradient
    assert sum(b for cat, b in slice_terms.values() if cat == "logits") < chunk + 2 * vh
    assert est.phases["forward: a loss slice"] < est.peak_bytes
    # and the same lever by lever: without the chunks the logits hold the peak again
    unchunked = F.estimate(replace(cfg, loss_chunks=1))
    assert unchunked.when == "start of backward" and unchunked.peak_bytes > 3.5 * est.peak_bytes


@pytest.mark.parametrize(
    "levers", ["sdpa + full checkpointing + 8 loss chunks + bf16", "sdpa + selective checkpointing + 8 loss chunks"]
)
def test_issue_combinations(levers):
    est, led = check(config("gpt2-b32-s1024", levers))
    assert est.when == "forward: a loss slice"


@pytest.mark.parametrize(
    "shape,levers,more,when",
    [
        ("cpu", "full checkpointing", {"loss_chunks": 16}, "last block's backward: attention backward"),
        ("cpu", "sdpa + full checkpointing", {"loss_chunks": 16}, "last block's backward: MLP backward"),
        ("cpu", "naive fp32", {"loss_chunks": 4, "batch_size": 1, "context": 8}, "end of backward"),
        ("gpt2-b32-s1024", "bf16 + sdpa + full checkpointing", {"batch_size": 1, "context": 512}, "forward: the loss"),
    ],
    ids=[
        "chunks: attention backward",
        "chunks: MLP backward",
        "tiny batch: the V x h gradients",
        "bf16 batch 1: autocast's weight cache in forward",
    ],
)
def test_every_moment_of_the_peak(shape, levers, more, when):
    # Chunks make the logits small, and the peak moves into the last block's backward (with its recompute under
    # checkpointing); with a tiny batch, to the end of backward, where the tied embedding's V x h gradients are summed
    # into .grad; with bf16 and a small
    # batch, into the forward, where autocast's cache holds a 16-bit copy of every block's weights until the forward
    # ends (checkpointing keeps none of them).
    est, _ = check(config(shape, levers, **more))
    assert est.when == when


def test_fp16_measured_for_real(tiny):
    # FakeTensorMode cannot run fp16's GradScaler (it reads the scale with .item()): the tiny preset, allocated for real
    check(tiny(precision="fp16", activation_checkpointing="selective", loss_chunks=4), fake=False)
    with pytest.raises(ValueError, match="fp16"):
        account_step(tiny(precision="fp16"), fake=True)
