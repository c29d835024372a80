"""torch.compile: through the one training loop the compiled run computes the same losses as eager, and compiled
gradients equal eager ones with activation checkpointing and the chunked loss. (A first compile on a 2-core CPU takes
10-30 s; conftest sends this file's tests to one pytest-xdist worker, so that start-up is paid once.)"""
import dataclasses

import pytest
import torch

from course_lib import techniques
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


@pytest.mark.skipif(not COMPILE.ok, reason=COMPILE.note)
@pytest.mark.parametrize("checkpointing", ["full", "selective"])
def test_compiled_gradients_equal_eager_with_checkpointing_and_chunked_loss(tiny_model, checkpointing):
    from course_lib import config as C

    x, y = torch.randint(0, 64, (2, 32)), torch.randint(0, 64, (2, 32))
    grads, losses = {}, {}
    for compiled in (False, True):
        m = tiny_model(attention="sdpa", n_layer=1)  # one block: compile time is what this test costs
        cfg = C.TrainConfig(model=m.config, context=32, compile=compiled, activation_checkpointing=checkpointing, loss_chunks=4)
        setup = techniques.build(cfg, m)
        losses[compiled] = setup.loss_fn(x, y)
        losses[compiled].backward()
        grads[compiled] = [p.grad.clone() for p in m.parameters()]
    torch.testing.assert_close(losses[False], losses[True], rtol=1e-4, atol=1e-4)
    for a, b in zip(grads[False], grads[True]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
