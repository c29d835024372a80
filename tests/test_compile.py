"""torch.compile with activation checkpointing and the chunked loss: one captured graph that keeps checkpointing's
saving and computes eager's loss and gradients.

Two compile checks divide the work. That the one training loop, compiled by inductor (the compiler the course uses),
computes eager's losses and gradient norms step after step is the doctor's compile check
(course_lib.doctor.check_compile), which test_doctor.py requires to pass wherever compile can run; notebook 04
compiles the ladder's bf16 + SDPA rung with inductor too. What checkpointing changes in a compiled step (which
tensors the forward keeps for backward and which the backward recomputes) is decided before any code is generated:
dynamo captures the graph, AOTAutograd splits it into forward and backward, and inductor's min-cut partitioner
chooses what to save under the checkpoint's tags. This file checks that part with torch's debugging backend
"aot_eager_decomp_partition", which runs all of that (with inductor's decompositions) and then the graphs eagerly:
~5 s here, where inductor's C++ for this graph cost ~45 CPU-seconds of a 2-core CPU (36 kernels). Inductor's
kernels for a checkpointed graph are not compiled by the test suite."""

import dataclasses

import pytest
import torch

from course_lib import techniques
from course_lib.techniques.activation_checkpointing import CHECKPOINTED_BLOCKS


def saved_for_backward_bytes(
    model: torch.nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """loss_fn(x, y), and the bytes of the storages its forward kept for backward, the parameters left out (each
    storage once; a compiled graph's saved tensors pass through the same hook as eager ones). The course's
    measure.MemoryLedger counts the same bytes, but it is a TorchDispatchMode, and under an active dispatch mode
    torch.compile captures no graph: the "compiled" call would run eagerly."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            kept[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(x, y)
    return loss, sum(kept.values())


@pytest.mark.skipif(
    not torch._dynamo.is_dynamo_supported(), reason="torch.compile (dynamo) is not supported on this Python"
)
def test_compiled_checkpointing_keeps_its_saving_and_eagers_gradients(tiny_model):
    """Two blocks, the first under full checkpointing and the second under selective, and the loss in chunks (each
    under checkpoint), compiled: one captured graph with no graph break; it keeps less than 60% of the bytes that the
    same model without checkpointing keeps for backward (here ~39%; a compile that ignored the checkpoints would keep
    ~97%); and its loss and every gradient equal eager's."""
    from torch._dynamo.utils import counters

    from course_lib import config as C

    x, y = torch.randint(0, 64, (2, 32)), torch.randint(0, 64, (2, 32))
    grads, losses, kept = {}, {}, {}
    for run in ("eager, no checkpointing", "eager", "compiled"):
        m = tiny_model(attention="sdpa", n_layer=2)
        if run != "eager, no checkpointing":
            for i, mode in enumerate(("full", "selective")):
                # what activation_checkpointing=mode does to every block
                m.blocks[i] = CHECKPOINTED_BLOCKS[mode](m.blocks[i])
        setup = techniques.build(C.TrainConfig(model=m.config, context=32, loss_chunks=4), m)
        # What the course compiles (techniques.build with compile=True: the loss module), with the debugging backend.
        loss_fn = (
            torch.compile(setup.loss_module, backend="aot_eager_decomp_partition")
            if run == "compiled"
            else setup.loss_fn
        )
        torch._dynamo.reset()
        counters.clear()
        losses[run], kept[run] = saved_for_backward_bytes(m, loss_fn, x, y)
        losses[run].backward()
        grads[run] = {name: p.grad.clone() for name, p in m.named_parameters()}
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert kept["compiled"] < 0.6 * kept["eager, no checkpointing"], kept
    torch.testing.assert_close(losses["eager"], losses["compiled"], rtol=1e-4, atol=1e-4)
    assert any(".block." in name for name in grads["compiled"])  # the gradients of the checkpointed blocks are compared
    for name, eager in grads["eager"].items():
        torch.testing.assert_close(
            grads["compiled"][name], eager, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.skipif(
    not torch._dynamo.is_dynamo_supported(), reason="torch.compile (dynamo) is not supported on this Python"
)
def test_compile_on_a_cpu_writes_tanh_through_exp_and_keeps_gelu_within_its_stated_error():
    """What compile adds on a CPU (techniques.torch_compile.CPU_INDUCTOR_OPTIONS) reaches Inductor: the C++ it generates
    for GPT-2's tanh GELU calls exp and no tanh (with the exact tanh it calls .tanh()); and that GELU stays within
    1e-6 of float64's over [-10, 10] (measured 5.2e-7, against 4.3e-7 with the exact tanh). The mode's own settings
    are kept beside it, and a GPU is given the mode alone."""
    from torch._inductor.utils import run_and_get_code

    from course_lib import config as C
    from course_lib.techniques import torch_compile

    cfg = C.with_setting(C.tiny_preset("cpu"), "compile", True)
    arguments = torch_compile.compile_arguments(cfg)
    assert arguments == {"options": torch_compile.CPU_INDUCTOR_OPTIONS}
    autotuned = torch_compile.compile_arguments(C.with_setting(cfg, "compile_mode", "max-autotune"))
    assert autotuned["options"]["max_autotune"] and autotuned["options"]["cpp.use_decompose_tanh"]
    assert torch_compile.compile_arguments(C.TrainConfig(device="cuda", compile=True)) == {"mode": None}

    x = torch.linspace(-10, 10, 200_001)
    exact = torch.nn.functional.gelu(x.double(), approximate="tanh")
    for through_exp in (True, False):
        torch._dynamo.reset()
        options = {**arguments["options"], torch_compile.TANH_THROUGH_EXP: through_exp}
        gelu = torch.compile(lambda v: torch.nn.functional.gelu(v, approximate="tanh"), options=options)
        y, sources = run_and_get_code(gelu, x)
        kernel = "\n".join(sources)
        assert (".tanh()" not in kernel) == through_exp and (".exp()" in kernel) == through_exp, kernel[-3000:]
        assert (y.double() - exact).abs().max().item() < 1e-6
    torch._dynamo.reset()


@pytest.mark.parametrize("set_to_none", [False, True])
@pytest.mark.parametrize("mode", ["default", "reduce-overhead", "max-autotune"])
def test_the_cuda_graph_modes_mark_each_optimizer_step_and_keep_grads_out_of_the_graphs(
    mode, set_to_none, monkeypatch, tiny
):
    """A mode that replays CUDA graphs overwrites the outputs of the step before once a new step is marked: the loop
    marks each optimizer step once, before its first micro-batch (a mark between micro-batches would overwrite the
    gradients the first left in .grad), and where gradients live across steps (set_to_none=False) they exist before
    the first forward, so that backward adds into them rather than installing a graph's output as .grad. The default
    mode needs neither. (torch.compile itself is replaced by a function that logs each forward: what is checked is the
    loop's calls, not the compiler.)"""
    from course_lib.techniques import torch_compile
    from course_lib.train import Trainer

    events = []
    params = []

    def counting_forwards(fn, **arguments):
        def forward(*args):
            events.append(("forward", all(p.grad is not None for p in params)))
            return fn(*args)

        return forward

    monkeypatch.setattr(torch_compile.torch, "compile", counting_forwards)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: events.append(("mark", None)))
    cfg = tiny(
        compile=True,
        compile_mode=mode,
        steps=3,
        grad_accum_steps=2,
        batch_size=2,
        measure_memory=False,
        set_to_none=set_to_none,
    )
    trainer = Trainer(cfg)
    params.extend(trainer.setup.model.parameters())
    assert trainer.fit().ok
    graphed = mode != "default"  # written out: read from CUDA_GRAPH_MODES, the test could not fail
    first = ("forward", graphed and not set_to_none)  # the step's first micro-batch: .grad made beforehand, or not
    second = ("forward", True)  # the first micro-batch's backward made them
    mark = [("mark", None)] if graphed else []
    later = ("forward", not set_to_none)  # a later step's first micro-batch: .grad zeroed in place, or freed
    assert events == mark + [first, second] + (mark + [later, second]) * 2  # 3 steps of 2 micro-batches


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU (none here)")
@pytest.mark.parametrize("set_to_none, grad_accum_steps", [(False, 1), (False, 2), (True, 2)])
def test_reduce_overhead_trains_as_the_default_mode_does_on_cuda(set_to_none, grad_accum_steps, tiny):
    """On a GPU, CUDA graphs replay into the memory of their last outputs. Whether the loop keeps .grad from step to
    step (the naive zero_grad, which failed on an H200 before begin_cuda_graph_step) or frees it, and with
    micro-batches, the reduce-overhead loop runs and gives the default mode's losses."""
    from torch._dynamo.utils import counters

    from course_lib.train import train

    runs = {}
    for mode in ("default", "reduce-overhead"):
        torch._dynamo.reset()
        counters.clear()
        cfg = tiny(
            device="cuda",
            compile=True,
            compile_mode=mode,
            steps=5,
            set_to_none=set_to_none,
            grad_accum_steps=grad_accum_steps,
            batch_size=4,
            measure_memory=False,
        )
        runs[mode] = train(cfg, mode)
    assert runs["reduce-overhead"].ok, runs["reduce-overhead"].reason
    # the graphs were replayed: inductor counts each graph it leaves out of CUDA graphs (then both runs were the same)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert runs["reduce-overhead"].losses == pytest.approx(runs["default"].losses, rel=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU (none here)")
def test_reduce_overhead_peak_counts_the_graphs_memory_pool(tiny):
    """A replay allocates nothing, so the allocated peak of a reduce-overhead step missed the activations in the
    graphs' pool (an H200, GPT-2 small at batch 64: 1.33 GiB against 28.4 GiB without graphs). Its peak is the reserved
    one, pool included, and said to be that. How it compares with the default mode's allocated peak depends on the
    program: for GPT-2 small at batch 64, 28.8 GiB reserved against 28.4 GiB allocated (data/reference/checks/
    gpt2-small-mfu-nvidia-h200.json), for this tiny model 0.051 against 0.109 GiB (the graphs reuse their pool's
    memory), both on an H200. What must be in the pool is one micro-batch's logits, an output of the forward graph: the
    peak holds at least that, which a replay's allocated peak (the tensors outside the pool) does not."""
    from torch._dynamo.utils import counters

    from course_lib.train import train

    runs = {}
    cfg = tiny(device="cuda", compile=True, steps=5, batch_size=32)
    for mode in ("default", "reduce-overhead"):
        counters.clear()
        runs[mode] = train(dataclasses.replace(cfg, compile_mode=mode), mode)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])  # the graphs did replay
    graphs, plain = runs["reduce-overhead"], runs["default"]
    assert graphs.peak_is_reserved and not plain.peak_is_reserved
    assert cfg.precision == "fp32" and cfg.loss_chunks == 1  # the logits whole, 4 bytes each
    logits_gib = cfg.batch_size // cfg.grad_accum_steps * cfg.context * cfg.model.vocab_size * 4 / 2**30
    assert logits_gib <= graphs.peak_gib <= 3 * plain.peak_gib, (graphs.peak_gib, logits_gib, plain.peak_gib)
