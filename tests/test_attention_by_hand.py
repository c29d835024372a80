"""course_lib.lessons.attention_by_hand: naive, tiled and SDPA attention are the same function; the sweep measures
what it claims."""

import pytest
import torch

from course_lib.lessons import attention_by_hand as A

SHAPES = [(1, 1, 1, 8), (2, 3, 37, 16), (1, 2, 128, 32), (2, 2, 200, 64)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("blocks", [(64, 64), (16, 48), (32, 8)])
def test_naive_tiled_sdpa_agree(shape, blocks):
    q, k, v = A.random_qkv(*shape, seed=sum(shape))
    ref = A.sdpa_attention(q, k, v)
    assert A.max_abs_diff(A.naive_attention(q, k, v), ref) < 1e-5
    assert A.max_abs_diff(A.tiled_attention(q, k, v, *blocks), ref) < 1e-5


def test_tiled_non_causal_and_lse():
    q, k, v = A.random_qkv(2, 2, 50, 16, seed=3)
    out, lse = A.tiled_attention(q, k, v, 16, 16, causal=False, return_lse=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert A.max_abs_diff(out, ref) < 1e-5
    scores = q @ k.transpose(-2, -1) / 16**0.5
    assert A.max_abs_diff(lse, torch.logsumexp(scores, dim=-1)) < 1e-5


def test_tiled_gradients_match():
    q, k, v = A.random_qkv(1, 2, 40, 8, seed=5, requires_grad=True)
    A.tiled_attention(q, k, v, 16, 16).square().sum().backward()
    g_tiled = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    A.sdpa_attention(q, k, v).square().sum().backward()
    for a, t in zip(g_tiled, (q, k, v)):
        assert A.max_abs_diff(a, t.grad) < 1e-4


def test_windowed_is_a_different_function():
    q, k, v = A.random_qkv(1, 2, 128, 16, seed=1)
    ref = A.sdpa_attention(q, k, v)
    assert A.max_abs_diff(A.windowed_attention(q, k, v, window=32), ref) > 1e-2
    # a window as long as the sequence is full causal attention again
    assert A.max_abs_diff(A.windowed_attention(q, k, v, window=128), ref) < 1e-5


def test_sdpa_backend_names_a_kernel():
    q, k, v = A.random_qkv(1, 2, 64, 16)
    backend, op = A.sdpa_backend(q, k, v)
    assert op.startswith("aten.")
    if q.device.type == "cpu":
        assert backend.startswith("flash"), (backend, op)


def test_sdpa_backend_sees_math_fallback():
    q, k, v = A.random_qkv(1, 2, 64, 16)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        backend, op = A.sdpa_backend(q, k, v)
    assert backend.startswith("math"), (backend, op)


def test_context_sweep_memory_quadratic_vs_linear():
    pts = A.context_sweep([64, 256], impls=("naive", "sdpa"), batch=1, heads=2, head_dim=16, repeats=1)
    by = {(p.impl, p.context): p for p in pts}
    assert all(p.ms > 0 and p.peak_bytes > 0 for p in pts)
    # naive holds at least the b·a·s·s probabilities; 4x the context gives >= 8x its memory
    assert by["naive", 256].peak_bytes >= A.scores_bytes(1, 2, 256)
    assert by["naive", 256].peak_bytes / by["naive", 64].peak_bytes > 8
    # SDPA (flash) never materialises s x s: its memory grows about linearly and stays below one s x s matrix
    assert by["sdpa", 256].peak_bytes / by["sdpa", 64].peak_bytes < 6
    assert by["sdpa", 256].peak_bytes < A.scores_bytes(1, 2, 256)


def test_context_sweep_forward_only_tiled_is_linear():
    pts = A.context_sweep(
        [128, 512], impls=("naive", "tiled"), batch=1, heads=1, head_dim=16, backward=False, repeats=1
    )
    by = {(p.impl, p.context): p.peak_bytes for p in pts}
    assert by["naive", 512] >= A.scores_bytes(1, 1, 512)
    assert by["tiled", 512] < A.scores_bytes(1, 1, 512)


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: the GPU backends (flash / memory-efficient) only exist there"
)
def test_cuda_sdpa_backend_and_memory():
    q, k, v = A.random_qkv(2, 4, 1024, 64, device="cuda", dtype=torch.bfloat16)
    backend, _ = A.sdpa_backend(q, k, v)
    assert not backend.startswith("math")
    pts = A.context_sweep(
        [1024], impls=("naive", "sdpa"), batch=2, heads=4, device="cuda", dtype=torch.bfloat16, repeats=2
    )
    by = {p.impl: p.peak_bytes for p in pts}
    assert by["sdpa"] < by["naive"]


def test_the_sweep_goes_on_past_an_implementation_that_runs_out_of_memory(monkeypatch):
    """Naive attention out of memory (a CPU allocator's error here) at a context: that point and every longer one are
    'oom' for it, and the other implementation is measured at every context."""
    naive = A.IMPLS["naive"]

    def naive_that_runs_out(q, k, v):
        if q.shape[2] >= 128:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes.")
        return naive(q, k, v)

    monkeypatch.setitem(A.IMPLS, "naive", naive_that_runs_out)
    pts = A.context_sweep([64, 128, 256], impls=("naive", "sdpa"), batch=1, heads=2, head_dim=16, repeats=1)
    assert {(p.impl, p.context): p.status for p in pts} == {
        ("naive", 64): "ok",
        ("naive", 128): "oom",
        ("naive", 256): "oom",
        ("sdpa", 64): "ok",
        ("sdpa", 128): "ok",
        ("sdpa", 256): "ok",
    }


@pytest.mark.parametrize("shape", [(1, 1, 3, 8), (2, 3, 37, 16), (2, 2, 128, 32)])
@pytest.mark.parametrize("blocks", [1, 2, 4, 5])
def test_sdpa_in_query_blocks_is_causal_attention(shape, blocks):
    """The same function as SDPA causal, in value and in every gradient, whether or not the blocks divide s (and with
    more blocks than queries)."""
    q, k, v = A.random_qkv(*shape, seed=sum(shape) + blocks, requires_grad=True)
    grad = torch.randn_like(q)
    ref_out = A.sdpa_attention(q, k, v)
    ref = [ref_out, *torch.autograd.grad(ref_out, (q, k, v), grad)]
    out = A.sdpa_in_query_blocks(q, k, v, blocks)
    got = [out, *torch.autograd.grad(out, (q, k, v), grad)]
    for a, b in zip(got, ref):
        assert A.max_abs_diff(a, b) < 1e-5


@pytest.mark.parametrize("s, blocks", [(512, 1), (512, 2), (512, 4), (10, 3), (3, 5), (37, 4)])
def test_square_share_is_the_pairs_the_kernel_is_handed(s, blocks):
    """Counted pair by pair from the shapes sdpa_in_query_blocks hands SDPA (its queries times its keys), whether or
    not the blocks divide s; (blocks + 1) / (2 blocks) where they do."""
    from torch.utils._python_dispatch import TorchDispatchMode

    handed = []  # queries x keys of each attention kernel call, as the kernel receives them

    class Kernels(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "scaled_dot_product" in func.__name__:
                handed.append(args[0].size(-2) * args[1].size(-2))
            return func(*args, **(kwargs or {}))

    q, k, v = A.random_qkv(1, 1, s, 4)
    with Kernels():
        A.sdpa_in_query_blocks(q, k, v, blocks)
    assert len(handed) == len(A.query_blocks(s, blocks))
    assert A.square_share(s, blocks) == sum(handed) / (s * s)
    if s % blocks == 0:
        assert A.square_share(s, blocks) == (blocks + 1) / (2 * blocks)


def test_query_blocks_need_one_block_or_more():
    with pytest.raises(ValueError, match="1 block or more"):
        A.query_blocks(8, 0)
    assert A.query_blocks(3, 5) == [(0, 1), (1, 2), (2, 3)]  # empty blocks left out


def test_use_query_blocks_makes_the_models_sdpa_run_in_blocks(monkeypatch):
    """The model built after use_query_blocks attends in blocks (the patch the README's step timing used), with the
    same loss as plain SDPA."""
    from course_lib import config as C, model as M

    cfg = C.ModelConfig(vocab_size=64, n_layer=1, n_head=2, n_embd=16, block_size=32, attention="sdpa")
    idx = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    plain = M.GPT(cfg)(idx)
    monkeypatch.setitem(M.ATTENTION_IMPLS, "sdpa", M.ATTENTION_IMPLS["sdpa"])  # put back after the test
    A.use_query_blocks(4)
    calls = []
    real = A.sdpa_in_query_blocks
    monkeypatch.setattr(A, "sdpa_in_query_blocks", lambda *t, **kw: calls.append(1) or real(*t, **kw))
    torch.manual_seed(0)
    blocked = M.GPT(cfg)(idx)
    assert calls and A.max_abs_diff(blocked, plain) < 1e-5


def test_causal_skipping_times_the_three_ways_in_turns():
    r = A.causal_skipping(batch=1, heads=2, s=64, head_dim=16, blocks=4, repeats=3)
    assert list(r["ms"]) == ["whole square (not causal)", "causal", "causal, in 4 query blocks"]
    for lo, med, hi in r["ms"].values():
        assert 0 < lo <= med <= hi
    assert r["shape"] == dict(batch=1, heads=2, s=64, head_dim=16, blocks=4, dtype="float32")
    assert r["device"] and r["torch"] == torch.__version__


def test_context_sweep_runs_the_query_blocks():
    (point,) = A.context_sweep([64], impls=("sdpa_blocks",), batch=1, heads=2, head_dim=16, repeats=1)
    assert point.status == "ok" and point.ms > 0 and point.peak_bytes > 0


def test_fresh_processes_run_a_labels_before_in_its_own_processes():
    """What the README's timing of the loop with SDPA in query blocks ran: `before` changes only its label's
    processes; a `before` for a label with no config is refused before anything runs."""
    from course_lib import config as C
    from course_lib.lessons import fresh_processes as FP

    cfg = C.preset("tiny", "cpu").with_model(attention="sdpa")
    patch = "from course_lib.lessons.attention_by_hand import use_query_blocks; use_query_blocks(4)"
    check = "\nfrom course_lib import model; assert model.ATTENTION_IMPLS['sdpa'].__name__ == '{}'"
    runs = FP.time_in_fresh_processes(
        {"plain": cfg, "blocks": cfg},
        steps=1,
        warmup=1,
        before={"blocks": patch + check.format("attend"), "plain": check.format("sdpa_attention")},
    )
    assert [len(r.steps) for r in runs.values()] == [1, 1]
    with pytest.raises(ValueError, match="not among the configs' labels"):
        FP.time_in_fresh_processes({"plain": cfg}, steps=1, before={"blocks": patch})
