"""The one loop as an object: a model of your own, what it built, evaluation, and OOM handling."""

import dataclasses
import math

import pytest
import torch
import torch.nn as nn

from course_lib import techniques
from course_lib.train import Trainer, evaluate, run, train


class TwoLayerNet(nn.Module):
    """Not a GPT: features in, class logits out."""

    def __init__(self, d_in=16, width=32, classes=5):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d_in, width), nn.GELU())
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.body(x))


def test_a_model_of_your_own_trains_in_the_one_loop(tiny):
    gen = torch.Generator().manual_seed(0)
    teacher = torch.randn(16, 5, generator=gen)
    data = [torch.randn(32, 16, generator=gen) for _ in range(20)]
    batches = lambda step: [(data[step], (data[step] @ teacher).argmax(-1))]  # noqa: E731
    cfg = tiny(steps=20, timing_warmup=1, lr=1e-2)
    torch.manual_seed(0)
    model = TwoLayerNet()
    trainer = Trainer(cfg, model, batches=batches, parts=techniques.ModelParts(head=model.head))
    assert trainer.setup.model is model  # what it built is there before fit(): a hook could be added now
    r = trainer.fit("mine")
    assert r.ok and r.tokens_per_step == 32  # one "token" per sample: counted from the targets
    # FLOPs counted by FlopCounterMode: per sample 2*(16*32 + 32*5) forward, twice that backward, minus the first
    # layer's input gradient (the data needs none): 6*(512+160) - 2*512
    assert r.flops_per_token == 6 * (16 * 32 + 32 * 5) - 2 * 16 * 32
    assert sum(r.losses[-3:]) / 3 < r.losses[0]
    by = r.memory["by_category"]
    assert by["parameters"] == 4 * sum(p.numel() for p in model.parameters())
    assert by["logits"] > 0  # the ledger followed the head it was given


def test_evaluate_is_repeatable_and_eval_every_logs_it(tiny, splits):
    r = train(tiny(steps=4, eval_every=2, eval_batches=2, measure_memory=False), "eval", splits=splits)
    assert [s for s, _ in r.val_losses] == [1, 3]
    assert all(math.isfinite(v) for _, v in r.val_losses)
    trainer = Trainer(tiny(), splits=splits)
    first = evaluate(trainer.setup.model, splits.val, trainer.cfg, 2)
    assert first == evaluate(trainer.setup.model, splits.val, trainer.cfg, 2)  # the same windows every call
    assert first == pytest.approx(math.log(4097), abs=0.3)  # an untrained model is about uniform


def test_after_an_oom_the_failed_runs_tensors_are_freed_before_run_returns(tiny, monkeypatch):
    """What the failed step held (on a GPU: its activations) must be gone when run() returns, not at some later
    garbage collection: the OOM demonstration and the doctor read the memory still allocated right after."""
    import gc
    import weakref

    held = []

    def step(*_a, **_k):
        activations = torch.ones(1024)  # what a step holds when it runs out of memory
        held.append(weakref.ref(activations))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")

    monkeypatch.setattr("course_lib.train.train_step", step)
    gc.disable()  # only reference counting may free it: nothing is left for a later collection to find
    try:
        r = run(tiny(steps=3, measure_memory=False), "oom")
        alive = held[0]() is not None
    finally:
        gc.enable()
    assert r.status == "oom" and not alive


def test_an_oom_wrapped_by_another_error_is_still_reported_as_oom(tiny, monkeypatch):
    """torch.compile re-raises a failure inside its own exception; the OOM is found in the chain."""

    def step(*_a, **_k):
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")
        except torch.OutOfMemoryError as e:
            raise RuntimeError("backend compiler failed") from e

    monkeypatch.setattr("course_lib.train.train_step", step)
    r = run(tiny(steps=3, measure_memory=False), "oom")
    assert r.status == "oom" and "Tried to allocate 80.00 GiB" in r.reason
    monkeypatch.undo()
    assert run(tiny(steps=3, measure_memory=False), "after").ok  # and the next run works


def test_selective_checkpointing_keeps_more_than_full_and_less_than_none(tiny):
    """Measured by the ledger: activations held at the peak, none > selective > full."""
    held = {}
    for mode in ("none", "selective", "full"):
        r = train(dataclasses.replace(tiny(steps=2, timing_warmup=0), activation_checkpointing=mode), mode)
        held[mode] = r.memory["by_category"]["activations"]  # what checkpoint keeps is invisible to saved_tensors_hooks
    assert held["none"] > held["selective"] > held["full"], held
