"""torch.compile through the one training loop: the compiled run computes the same losses as eager.
(A first compile on a 2-core CPU takes 10-30 s; this file compiles one tiny model once.)"""
import dataclasses

import pytest

from course_lib.capabilities import capabilities
from course_lib.config import tiny_preset
from course_lib.train import run

COMPILE = capabilities("cpu").compile


@pytest.mark.skipif(not COMPILE.ok, reason=COMPILE.note)
def test_compiled_and_eager_losses_equal():
    cfg = dataclasses.replace(tiny_preset("cpu"), steps=3, timing_warmup=1, measure_memory=False).with_model(attention="sdpa")
    eager = run(cfg, "eager")
    compiled = run(dataclasses.replace(cfg, compile=True), "compiled")
    assert eager.ok and compiled.ok, (eager.reason, compiled.reason)
    assert compiled.step_times[0] > compiled.median_step_s  # the first step traced and compiled
    for a, b in zip(eager.losses, compiled.losses):
        assert abs(a - b) <= 1e-4 * abs(a), (eager.losses, compiled.losses)
    assert eager.losses[-1] < eager.losses[0]
