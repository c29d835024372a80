import pytest
import torch

from course_lib import measure
from course_lib.config import ModelConfig
from course_lib.model import GPT
from course_lib.techniques import loss_sum
from course_lib.timing import median_excluding


def test_flops_formula_agrees_with_the_flop_counter():
    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=64, block_size=128, vocab_size=512, attention="naive")
    m = GPT(cfg)
    idx = torch.randint(0, 512, (2, 128))
    counted = measure.counted_flops_per_token(m, idx, lambda logits: loss_sum(logits, idx))
    formula = measure.flops_per_token(m.num_params(non_embedding=True), cfg.n_layer, cfg.n_embd, 128)
    # The formula counts only matmuls: biases, norms and softmax are the small difference.
    assert counted == pytest.approx(formula, rel=0.03)


def test_ledger_follows_births_and_deaths_exactly():
    ledger = measure.MemoryLedger()
    with ledger:
        a = torch.empty(1000, dtype=torch.float32)  # 4000 bytes
        b = torch.empty(500, dtype=torch.float64)  # 4000 bytes
        assert ledger.live == 8000
        del a
        c = torch.empty(10, dtype=torch.uint8)
        assert ledger.live == 4010
        del b, c
    assert ledger.peak == 8000 and ledger.live == 0


def test_a_storage_freed_while_a_new_peak_is_copied_does_not_stop_the_step():
    """A storage's weakref callback can run while a new peak is being copied (a garbage collection, or autograd's GPU
    thread letting go of a tensor, as on an H200 in notebook 02): the copy must not iterate the live table."""
    ledger = measure.MemoryLedger()

    class FreesOneMidway(dict):
        def items(self):
            for i, item in enumerate(super().items()):
                if i == 1:
                    ledger._free(next(iter(self)))
                yield item

    with ledger:
        kept = [torch.empty(100) for _ in range(3)]
        ledger._info = FreesOneMidway(ledger._info)
        new_peak = torch.empty(1000)
    assert ledger.peak >= new_peak.nbytes and len(kept) == 3


def test_ledger_counts_a_view_once_and_registers_existing_tensors():
    p = torch.zeros(256)
    ledger = measure.MemoryLedger()
    ledger.register([p, p.view(16, 16)], "parameters")
    with ledger:
        x = torch.ones(256)  # one new storage; the view below shares it
        y = x.view(16, 16)
    rep = ledger.report()
    assert rep.by_category["parameters"] == 1024
    assert rep.peak_bytes == 2048 and y.numel() == 256


def test_saved_for_backward_counts_each_storage_once():
    w = torch.randn(64, 64, requires_grad=True)
    m = torch.nn.Module()
    m.lm_head = torch.nn.Identity()
    ledger = measure.MemoryLedger()
    with ledger.watch(m.lm_head), ledger.phase("forward"):
        x = torch.randn(8, 64)
        h = torch.tanh(x @ w)  # mm saves x (w only if x needed a gradient); tanh saves its output h
        h2 = h * h  # mul saves h twice: the same storage, counted once
        h2.sum().backward()
    assert ledger.saved_bytes == x.nbytes + h.nbytes


def test_tensor_bytes_counts_tied_weights_once():
    m = GPT(ModelConfig(n_layer=1, n_head=1, n_embd=8, block_size=4, vocab_size=10))
    assert measure.tensor_bytes(m.parameters()) == 4 * m.num_params()


def test_median_excludes_warmup():
    assert median_excluding([10.0, 1.0, 2.0, 3.0], {0}) == 2.0
    with pytest.raises(ValueError, match="no timed steps"):
        median_excluding([1.0], {0})


def test_cuda_report_subtracts_what_was_there_before_and_does_not_guess(monkeypatch):
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 5000)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 8000)
    rep = measure.cuda_memory_report(
        "cuda", {"parameters": 1000, "gradients": None, "optimizer state": 2000}, baseline=1500
    )
    assert rep.peak_bytes == 3500 and rep.reserved_bytes == 8000
    assert (
        rep.by_category["activations"] is None
        and rep.by_category["logits"] is None
        and rep.by_category["gradients"] is None
    )
    assert rep.by_category["other"] == 3500 - 1000 - 2000


def test_under_cuda_graphs_the_peak_is_what_was_reserved_pool_included(monkeypatch):
    """A CUDA-graph replay allocates nothing: its activations sit in the graphs' pool, which only the reserved peak
    sees (an H200 showed 1.33 GiB allocated against 28.4 GiB for the same loop without graphs)."""
    rep = measure.cuda_memory_report(
        "cuda", {"parameters": 1000}, peak=1200, baseline=100, reserved=9000, cuda_graphs=True, reserved_baseline=600
    )
    assert rep.peak_bytes == 9000 - 600 and rep.reserved_bytes == 9000 and rep.by_category["other"] == 8400 - 1000
    assert rep.method.startswith(measure.GRAPHS_METHOD) and "reserved" in rep.method
    plain = measure.cuda_memory_report("cuda", {"parameters": 1000}, peak=1200, baseline=100, reserved=9000)
    assert plain.peak_bytes == 1100 and not plain.method.startswith(measure.GRAPHS_METHOD)
    # an allocator that returned cached blocks mid-run holds less than before it: nothing subtracted, and said
    shrunk = measure.cuda_memory_report("cuda", {}, reserved=500, cuda_graphs=True, reserved_baseline=600)
    assert shrunk.peak_bytes == 500 and "nothing was subtracted" in shrunk.method


def test_a_reserved_peak_is_labelled_and_not_compared_with_a_live_one(tiny):
    """Tables and the panel say which peak a run's is; a reserved peak (CUDA graphs) against a live one is no ratio."""
    from course_lib.results import RunResult, table_rows

    def result(label, peak, graphs):
        memory = measure.cuda_memory_report("cuda", {}, peak=peak, reserved=peak, cuda_graphs=graphs).to_dict()
        return RunResult(label, "ok", tiny().to_dict(), {}, median_step_s=0.1, tokens_per_s=10.0, memory=memory)

    live, graphs, graphs2 = (
        result("default", 2 * 2**30, False),
        result("graphs", 3 * 2**30, True),
        result("g2", 6 * 2**30, True),
    )
    rows = {row["run"]: row for row in table_rows([live, graphs], baseline=live)}
    assert rows["default"]["peak GiB"] == "2.0000" and rows["graphs"]["peak GiB"].startswith("3.0000 (reserved")
    assert rows["graphs"]["memory vs base"] == ""
    assert table_rows([graphs2], baseline=graphs)[0]["memory vs base"] == "2.00x"
    # the memory plot says which bar is reserved memory
    from course_lib.plots import plot_memory

    texts = [t.get_text() for t in plot_memory([live, graphs]).axes[0].texts]
    assert texts.count("reserved") == 1


def test_a_tensor_made_in_backward_can_be_named_a_gradient_at_the_peak():
    ledger = measure.MemoryLedger()
    with ledger, ledger.phase("backward"):
        g = torch.empty(1000)  # born as a temporary of backward
        ledger.reclassify([g], "gradients")
    assert ledger.report().by_category["gradients"] == 4000 and ledger.report().by_category["other"] == 0


def test_ids_left_by_an_earlier_ledger_do_not_collide():
    first = measure.MemoryLedger()
    with first:
        old = torch.empty(1000)  # the first ledger marks its storage with an id
    second = measure.MemoryLedger()
    with second:
        new = torch.empty(250)  # the second ledger's first storage: its id must differ from old's
        second.register([old], "parameters")  # old is a different storage, counted on its own
    rep = second.report()
    assert second.live == 4000 + 1000 and rep.by_category["parameters"] == 4000 and rep.by_category["other"] == 1000
    assert new.numel() == 250


def test_a_view_of_a_storage_made_before_the_ledger_allocates_nothing():
    w = torch.randn(64, 32)  # made before, not registered (a parameter the caller forgot, a cached buffer)
    ledger = measure.MemoryLedger()
    with ledger:
        t = w.t()  # a view: the same storage
        col = w[:, 0]
        w.mul_(2.0)  # in place: no new storage either
    assert ledger.peak == 0 and t.shape == (32, 64) and col.numel() == 64


def test_resize_is_followed_both_ways():
    ledger = measure.MemoryLedger()
    with ledger:
        t = torch.empty(1000)
        t.resize_(3000)  # grows in place
        assert ledger.live == 12_000
        t.untyped_storage().resize_(0)  # what FSDP2 does to a parameter's unsharded storage between uses
        t.resize_(0)  # the next operation that touches the storage reads its size again
        assert ledger.live == 0
    assert ledger.peak == 12_000


def test_a_dtensor_is_counted_by_its_local_shard():
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault(
        "MASTER_PORT", str(__import__("course_lib.distributed.launch", fromlist=["free_port"]).free_port())
    )
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        ledger = measure.MemoryLedger()
        with ledger:
            d = distribute_tensor(torch.ones(256, 4), mesh, [Shard(0)])
            e = d * 2.0  # an op on a DTensor: its output's bytes are its local tensor's
        assert ledger.category_of(e) == "other" and ledger.live >= e.to_local().nbytes == 4096
    finally:
        dist.destroy_process_group()


def test_saved_for_backward_leaves_out_the_parameters():
    lin = torch.nn.Linear(64, 64)
    ledger = measure.MemoryLedger()
    ledger.register(list(lin.parameters()), "parameters")
    head = torch.nn.Identity()
    x = torch.randn(8, 64, requires_grad=True)
    with ledger.watch(head), ledger.phase("forward"):
        y = lin(x)  # addmm saves x and weight.t(): only x is an activation
    assert ledger.saved_bytes == x.nbytes and y.shape == (8, 64)


def test_a_tensor_made_from_python_data_is_counted():
    """torch.tensor(...) creates its storage outside dispatch and shows it to the ledger through aten.lift_fresh,
    an op that returns an alias of its input: it is a new allocation all the same (AdamW's step counters)."""
    ledger = measure.MemoryLedger()
    with ledger:
        a = torch.tensor(0.0)
        b = torch.tensor([1.0, 2.0, 3.0])
    assert ledger.peak == a.nbytes + b.nbytes == 16


def test_a_category_the_device_cannot_tell_apart_prints_as_not_measured():
    assert measure.mib_text(3 * 2**20) == "3.00 MiB" and measure.mib_text(2**19, 3) == "0.500 MiB"
    assert measure.mib_text(None) == "not measured"  # CUDA's activations and logits: inside "other"
    assert measure.mib_text(0) == "0.00 MiB"  # measured and empty is not "not measured"


@pytest.mark.cuda
def test_the_warm_up_allocates_the_workspaces_and_afterwards_matmuls_allocate_nothing_that_stays():
    """cuBLAS's and cuBLASLt's workspaces are allocated once by the warm-up, so that no run counts them."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:  # start without workspaces, whatever earlier tests in this process ran
        clear()
        measure._WARMED_GPUS.clear()
    before_warm_up = torch.cuda.memory_allocated()
    measure.warm_up_cuda_libraries("cuda")
    after_warm_up = torch.cuda.memory_allocated()
    if clear is not None:
        assert after_warm_up > before_warm_up  # it did allocate them
    # what a training step does: plain matmuls and linear layers with a bias, forward and backward, fp32 and bf16
    for autocast in (False, True):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            x = torch.randn(32, 256, device="cuda", requires_grad=True)
            w = torch.randn(256, 256, device="cuda", requires_grad=True)
            b = torch.randn(256, device="cuda", requires_grad=True)
            ((x @ w).sum() + torch.nn.functional.linear(x, w, b).sum()).float().backward()
        del x, w, b
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == after_warm_up


@pytest.mark.cuda
def test_the_doctors_oom_check_passes_on_its_own():
    """The check alone (the first CUDA work of a run_doctor call): a capped OOM, memory back, the next run fine."""
    from course_lib.doctor import run_doctor

    report = run_doctor("cuda", only=["out of memory"])
    assert [(c.name, c.status) for c in report.checks] == [("out of memory", "pass")], report.table()
