"""torch.compile: compiled gradients equal eager ones with activation checkpointing and the chunked loss.

That the one training loop, compiled, computes eager's losses step after step is the doctor's compile check
(course_lib.doctor.check_compile), which test_doctor.py requires to pass wherever compile can run. (A first compile
on a 2-core CPU takes 10-30 s; conftest sends this file, the doctor's tests and the exporter's to one pytest-xdist
worker, so that start-up is paid once.)"""
import pytest
import torch

from course_lib import techniques
from course_lib.capabilities import capabilities

COMPILE = capabilities("cpu").compile


@pytest.mark.skipif(not COMPILE.ok, reason=COMPILE.note)
def test_compiled_gradients_equal_eager_with_full_and_selective_checkpointing_and_chunked_loss(tiny_model):
    """Two blocks, the first under full checkpointing and the second under selective, and the loss in chunks (each
    under checkpoint): one compiled graph holds every recomputation the course offers (one compile, ~30 s on a 2-core
    CPU with a cold cache, where a graph per mode costs ~50 s)."""
    from course_lib import config as C

    x, y = torch.randint(0, 64, (2, 32)), torch.randint(0, 64, (2, 32))
    grads, losses = {}, {}
    for compiled in (False, True):
        m = tiny_model(attention="sdpa", n_layer=2)
        for i, mode in enumerate(("full", "selective")):
            m.blocks[i] = techniques.CheckpointedBlock(m.blocks[i], mode)  # what activation_checkpointing=mode does to every block
        cfg = C.TrainConfig(model=m.config, context=32, compile=compiled, loss_chunks=4)
        setup = techniques.build(cfg, m)
        losses[compiled] = setup.loss_fn(x, y)
        losses[compiled].backward()
        grads[compiled] = {name: p.grad.clone() for name, p in m.named_parameters()}
    torch.testing.assert_close(losses[False], losses[True], rtol=1e-4, atol=1e-4)
    assert any(".block." in name for name in grads[True])  # the gradients of the checkpointed blocks are compared
    for name, eager in grads[False].items():
        torch.testing.assert_close(grads[True][name], eager, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
