"""The Triton flash attention (course_lib.lessons.flash_attention_triton): its output and dQ, dK, dV equal SDPA's and
the PyTorch by-hand version's. On a CPU the kernels run in Triton's interpreter (small sizes); on a GPU they compile.
Skipped, saying so, where triton is not installed (the optional extra: pip install -e ".[kernels]")."""

import importlib.util
import inspect
import re

import pytest
import torch
import torch.nn.functional as F

if importlib.util.find_spec("triton") is None:
    pytest.skip(
        'triton is not installed: the kernels are the optional extra, pip install -e ".[kernels]"',
        allow_module_level=True,
    )

from course_lib import flash_attention as FA  # noqa: E402
from course_lib.lessons import flash_attention_triton as FT  # noqa: E402

# The test that runs this file (test_flash_attention_triton.py) starts it in a process of its own, with
# TRITON_INTERPRET=1 where there is no GPU: no other test's notebook kernel or torchrun rank inherits it.
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


# fp32 on a CPU: the same products as SDPA's, summed in another order. On a GPU the kernels' fp32 dots are asked for
# full fp32 ("ieee"), but SDPA's CUDA kernels sum in other orders and tiles again.
ATOL, RTOL = (1e-4, 1e-4) if ON_GPU else (2e-5, 1e-4)


def _qkv(s, d=32, dtype=torch.float32, b=1, h=3, seed=0, s_k=None):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(b, h, s, d), (b, h, s_k or s, d), (b, h, s_k or s, d)]
    return [torch.randn(shape, generator=gen).to(DEVICE, dtype).requires_grad_() for shape in shapes]


def _forward_backward(fn, q, k, v, grad):
    out = fn(q, k, v)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), grad))


def test_on_a_cpu_the_kernels_are_interpreted_and_on_a_gpu_compiled():
    assert FT.interpreted() is not ON_GPU


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize(
    "s, block_q, block_k, d",
    [(128, 64, 64, 32), (100, 32, 16, 16), (70, 16, 64, 32)],
    ids=["s128-blocks64x64-d32", "s100-blocks32x16-d16", "s70-blocks16x64-d32"],
)
def test_fp32_output_and_gradients_equal_sdpas_and_the_pytorch_versions(causal, s, block_q, block_k, d):
    """s not a multiple of the blocks (100, 70): the last block's rows and keys are masked."""
    q, k, v = _qkv(s, d)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ours = _forward_backward(lambda *t: FT.flash_attention_triton(*t, causal, block_q, block_k), q, k, v, grad)
    sdpa = _forward_backward(lambda *t: F.scaled_dot_product_attention(*t, is_causal=causal), q, k, v, grad)
    by_hand = _forward_backward(lambda *t: FA.flash_attention(*t, causal, block_q, block_k), q, k, v, grad)
    for ref_name, ref in (("SDPA", sdpa), ("by hand", by_hand)):
        for name, a, b in zip(("output", "dQ", "dK", "dV"), ours, ref):
            assert torch.allclose(a, b, atol=ATOL, rtol=RTOL), (ref_name, name, float((a - b).abs().max()))


def test_more_keys_than_queries_without_a_mask():
    q, k, v = _qkv(40, s_k=90)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ours = _forward_backward(lambda *t: FT.flash_attention_triton(*t, False, 16, 32), q, k, v, grad)
    sdpa = _forward_backward(lambda *t: F.scaled_dot_product_attention(*t), q, k, v, grad)
    for name, a, b in zip(("output", "dQ", "dK", "dV"), ours, sdpa):
        assert torch.allclose(a, b, atol=ATOL, rtol=RTOL), (name, float((a - b).abs().max()))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_16_bit_inputs_are_as_close_to_the_fp32_answer_as_sdpa_in_16_bits(dtype):
    """The 16-bit path (P and dS cast to the inputs' format before their products, fp32 accumulators): the error
    against the fp32 answer is at most SDPA's own in that format (plus 1e-3; in bf16 twice SDPA's), and under 2e-2, for
    the output and every gradient. Twice in bf16: its 8-bit mantissa rounds the blocks' sums in another order than
    SDPA's kernel (on an H200, torch 2.11, bf16's dQ was off by 0.016 where SDPA's was off by 0.0098)."""
    if dtype == torch.bfloat16 and FT.interpreted():
        pytest.skip("Triton's interpreter keeps bf16 as raw uint16 bits, and its tl.dot multiplies them as integers")
    q32, k32, v32 = _qkv(96, d=32)
    grad32 = torch.randn(q32.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    truth = _forward_backward(lambda *t: F.scaled_dot_product_attention(*t, is_causal=True), q32, k32, v32, grad32)
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q32, k32, v32))
    grad = grad32.to(dtype)
    slack = 2 if dtype == torch.bfloat16 else 1
    ours = _forward_backward(lambda *t: FT.flash_attention_triton(*t, True, 32, 32), q, k, v, grad)
    sdpa = _forward_backward(lambda *t: F.scaled_dot_product_attention(*t, is_causal=True), q, k, v, grad)
    for name, t, a, b in zip(("output", "dQ", "dK", "dV"), truth, ours, sdpa):
        assert a.dtype == dtype
        err, sdpa_err = float((a.float() - t).abs().max()), float((b.float() - t).abs().max())
        assert err <= slack * sdpa_err + 1e-3 and err < 2e-2, (name, err, sdpa_err)


def test_it_keeps_no_s_by_s_tensor_for_backward():
    s, kept = 96, []
    q, k, v = _qkv(s)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(tuple(t.shape)) or t, lambda t: t):
        FT.flash_attention_triton(q, k, v, True, 32, 32)
    assert kept and not [shape for shape in kept if shape[-2:] == (s, s)], kept


def test_the_products_it_states_are_the_tl_dots_each_kernel_makes():
    """PRODUCTS (the module docstring's count: 2 forward, 4 + 3 backward) against the kernels' source."""
    dots = {
        name: len(re.findall(r"\btl\.dot\(", inspect.getsource(kernel.fn)))
        for name, kernel in (
            ("forward", FT._forward_kernel),
            ("backward, dK/dV kernel", FT._backward_dk_dv),
            ("backward, dQ kernel", FT._backward_dq),
        )
    }
    assert dots == FT.PRODUCTS


@pytest.mark.parametrize(
    "change, match",
    [
        ({"d": 24}, "head_dim must be a power of two"),
        ({"block_q": 8}, "block_q must be a power of two"),
        ({"causal": True, "s_k": 48}, "as many queries as keys"),
    ],
    ids=["head-dim-24", "block-8", "causal-unequal-lengths"],
)
def test_it_refuses_what_the_kernels_cannot_do(change, match):
    q, k, v = _qkv(32, d=change.get("d", 32), s_k=change.get("s_k"))
    with pytest.raises(ValueError, match=match):
        FT.flash_attention_triton(q, k, v, change.get("causal", False), change.get("block_q", 16), 16)


def test_the_benchmark_needs_a_gpu_and_says_so(capsys):
    if ON_GPU:
        pytest.skip("a GPU is here: test_the_benchmark_on_a_gpu runs it")
    assert FT.main(["--json", "unused.json", "--device", "cpu"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="CUDA"):
        FT.benchmark(device="cpu")


def test_the_benchmark_plot_has_a_panel_per_head_size_and_a_line_per_implementation():
    points = [
        {"impl": impl, "s": s, "head_dim": d, "tflops": tf}
        for d in (64, 128)
        for impl, tf in (("triton (ours)", 1.0), ("sdpa flash", 2.0))
        for s in (512, 1024)
    ]
    result = {
        "points": points,
        "dtype": "bfloat16",
        "causal": True,
        "tokens_per_batch": 16384,
        "triton": "3.x",
        "provenance": {"device": "a made-up GPU", "torch": torch.__version__, "date": "2026-01-01T00:00:00"},
    }
    fig = FT.plot_benchmark(result)
    assert [len(ax.get_lines()) for ax in fig.axes] == [2, 2]
    assert [ax.get_title() for ax in fig.axes] == ["head dim 64", "head dim 128"]


@pytest.mark.cuda
def test_the_benchmark_on_a_gpu(tmp_path):
    """The GPU stage's command at two small sizes: its JSON (provenance, every point timed) and its plot; the kernels
    agree with SDPA's flash kernel in bf16 (largest difference within 2% of the largest value)."""
    path = tmp_path / "flash.json"
    assert FT.main(["--json", str(path), "--lengths", "256", "512", "--head-dims", "64"]) == 0
    import json

    result = json.loads(path.read_text())
    assert {"device", "torch", "date", "commit"} <= set(result["provenance"])
    assert len(result["points"]) == 4 and all(p["ms"] > 0 for p in result["points"])
    for p in result["points"]:
        if p["impl"] == "triton (ours)":
            assert max(p["max_rel_diff_from_sdpa"].values()) < 2e-2, p
    assert path.with_suffix(".png").stat().st_size > 0
