import pytest
import torch

from course_lib import measure
from course_lib.config import ModelConfig
from course_lib.model import GPT
from course_lib.techniques import loss_sum


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
    with ledger.watch(m), ledger.phase("forward"):
        x = torch.randn(8, 64)
        h = torch.tanh(x @ w)  # mm saves x (w only if x needed a gradient); tanh saves its output h
        h2 = h * h  # mul saves h twice: the same storage, counted once
        h2.sum().backward()
    assert ledger.saved_bytes == x.nbytes + h.nbytes


def test_tensor_bytes_counts_tied_weights_once():
    m = GPT(ModelConfig(n_layer=1, n_head=1, n_embd=8, block_size=4, vocab_size=10))
    assert measure.tensor_bytes(m.parameters()) == 4 * m.num_params()


def test_median_excludes_warmup():
    assert measure.median_excluding([10.0, 1.0, 2.0, 3.0], {0}) == 2.0
    with pytest.raises(ValueError, match="no timed steps"):
        measure.median_excluding([1.0], {0})


def test_cuda_report_subtracts_what_was_there_before_and_does_not_guess(monkeypatch):
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 5000)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 8000)
    rep = measure.cuda_memory_report("cuda", {"parameters": 1000, "gradients": None, "optimizer state": 2000}, baseline=1500)
    assert rep.peak_bytes == 3500 and rep.reserved_bytes == 8000
    assert rep.by_category["activations"] is None and rep.by_category["logits"] is None and rep.by_category["gradients"] is None
    assert rep.by_category["other"] == 3500 - 1000 - 2000


def test_a_tensor_made_in_backward_can_be_named_a_gradient_at_the_peak():
    ledger = measure.MemoryLedger()
    with ledger, ledger.phase("backward"):
        g = torch.empty(1000)  # born as a temporary of backward
        ledger.reclassify([g], "gradients")
    assert ledger.report().by_category["gradients"] == 4000 and ledger.report().by_category["other"] == 0
