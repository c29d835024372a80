"""torch.compile: compiled gradients equal eager ones with activation checkpointing and the chunked loss.

Two compile checks divide the work. That the one training loop, compiled by inductor (the compiler the course uses),
computes eager's losses and gradient norms step after step is the doctor's compile check
(course_lib.doctor.check_compile), which test_doctor.py requires to pass wherever compile can run; notebook 04
compiles the ladder's bf16 + SDPA rung with inductor too. What checkpointing adds to a compiled graph (the
recomputation, the selective policy, the loss in chunks) lives in the graph that dynamo captures and AOTAutograd
splits into forward and backward, before any code is generated. This file checks that part with torch's debugging
backend "aot_eager_decomp_partition": dynamo, AOTAutograd, inductor's decompositions and its min-cut partitioner,
then the graphs run eagerly (about 5 s, where inductor's C++ code for this graph costs ~45 CPU-s on a 2-core CPU)."""
import pytest
import torch

from course_lib import techniques
from course_lib.capabilities import capabilities

COMPILE = capabilities("cpu").compile


@pytest.mark.skipif(not COMPILE.ok, reason=COMPILE.note)
def test_compiled_gradients_equal_eager_with_full_and_selective_checkpointing_and_chunked_loss(tiny_model):
    """Two blocks, the first under full checkpointing and the second under selective, and the loss in chunks (each
    under checkpoint): one captured graph, with no graph break, holds every recomputation the course offers, and its
    loss and every gradient equal eager's."""
    from torch._dynamo.utils import counters

    from course_lib import config as C

    x, y = torch.randint(0, 64, (2, 32)), torch.randint(0, 64, (2, 32))
    grads, losses = {}, {}
    for compiled in (False, True):
        m = tiny_model(attention="sdpa", n_layer=2)
        for i, mode in enumerate(("full", "selective")):
            m.blocks[i] = techniques.CheckpointedBlock(m.blocks[i], mode)  # what activation_checkpointing=mode does to every block
        setup = techniques.build(C.TrainConfig(model=m.config, context=32, loss_chunks=4), m)
        # What the course compiles (techniques.build with compile=True: the loss module), with the debugging backend.
        loss_fn = torch.compile(setup.loss_module, backend="aot_eager_decomp_partition") if compiled else setup.loss_fn
        torch._dynamo.reset()
        counters.clear()
        losses[compiled] = loss_fn(x, y)
        losses[compiled].backward()
        grads[compiled] = {name: p.grad.clone() for name, p in m.named_parameters()}
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], (dict(counters["stats"]), dict(counters["graph_break"]))
    torch.testing.assert_close(losses[False], losses[True], rtol=1e-4, atol=1e-4)
    assert any(".block." in name for name in grads[True])  # the gradients of the checkpointed blocks are compared
    for name, eager in grads[False].items():
        torch.testing.assert_close(grads[True][name], eager, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
