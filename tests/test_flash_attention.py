"""The hand-written flash attention (course_lib.lessons.attention_by_hand.flash_attention): equal to SDPA forward and
backward, keeping no (s x s) tensor, its memory growing in proportion to s, its backward recomputing one Q K^T."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from course_lib.lessons import attention_by_hand as FA


def _textbook(q, k, v, causal=True):
    """Attention as autograd sees it written out: it keeps the (s x s) probabilities (the reference for counting)."""
    scores = (q @ k.transpose(-2, -1)) / q.size(-1) ** 0.5
    if causal:
        s = q.size(-2)
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _qkv(s, d=32, dtype=torch.float32, b=2, h=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, s, d, generator=gen).to(dtype).requires_grad_() for _ in range(3)]


def _forward_backward(fn, q, k, v, grad):
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), grad))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("s, block_q, block_k", [(128, 64, 64), (100, 32, 48), (70, 16, 64)])
def test_fp32_output_and_gradients_equal_sdpas(causal, s, block_q, block_k):
    q, k, v = _qkv(s)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    ours = _forward_backward(lambda *t: FA.flash_attention(*t, causal, block_q, block_k), q, k, v, grad)
    ref = _forward_backward(lambda *t: F.scaled_dot_product_attention(*t, is_causal=causal), q, k, v, grad)
    for name, a, b in zip(("output", "dQ", "dK", "dV"), ours, ref):
        assert torch.allclose(a, b, atol=2e-5, rtol=1e-4), (name, float((a - b).abs().max()))


def test_bf16_is_as_close_to_the_fp32_answer_as_sdpa_in_bf16():
    """The stated tolerance: in bf16 the hand-written version's error against the fp32 answer is at most SDPA's own
    bf16 error (plus 1e-3), and under 2e-2 absolute, for the output and every gradient."""
    q32, k32, v32 = _qkv(96, d=64)
    grad32 = torch.randn(q32.shape, generator=torch.Generator().manual_seed(2))
    truth = _forward_backward(lambda *t: F.scaled_dot_product_attention(*t, is_causal=True), q32, k32, v32, grad32)
    q, k, v = (t.detach().bfloat16().requires_grad_() for t in (q32, k32, v32))
    grad = grad32.bfloat16()
    ours = _forward_backward(lambda *t: FA.flash_attention(*t, True, 32, 32), q, k, v, grad)
    sdpa = _forward_backward(lambda *t: F.scaled_dot_product_attention(*t, is_causal=True), q, k, v, grad)
    for name, t, a, b in zip(("output", "dQ", "dK", "dV"), truth, ours, sdpa):
        assert a.dtype == torch.bfloat16
        err, sdpa_err = float((a.float() - t).abs().max()), float((b.float() - t).abs().max())
        assert err <= sdpa_err + 1e-3 and err < 2e-2, (name, err, sdpa_err)


def test_it_keeps_no_s_by_s_tensor_for_backward_where_naive_attention_keeps_the_probabilities():
    s = 96
    kept: dict[str, list[tuple[int, ...]]] = {"flash": [], "naive": []}
    fns = {"flash": lambda *t: FA.flash_attention(*t, True, 32, 32), "naive": _textbook}
    for name, fn in fns.items():
        q, k, v = _qkv(s)
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t, n=name: kept[n].append(tuple(t.shape)) or t, lambda t: t
        ):
            fn(q, k, v)
    assert not [shape for shape in kept["flash"] if shape[-2:] == (s, s)], kept["flash"]
    assert [shape for shape in kept["naive"] if shape[-2:] == (s, s)]  # the check can see an (s x s) tensor


def test_its_memory_grows_in_proportion_to_s_and_naives_with_s_squared():
    """CPU memory ledger, fp32 forward and backward: doubling s adds twice as much to flash's peak as the previous
    doubling did (linear in s), and multiplies naive's by nearly 4."""
    rows = FA.peak_bytes_by_length([256, 512, 1024], batch=1, heads=2, head_dim=32, block=64)
    flash = [r["flash"] for r in rows]
    naive = [r["naive"] for r in rows]
    assert flash[2] - flash[1] == pytest.approx(2 * (flash[1] - flash[0]), rel=0.1), flash
    assert naive[2] / naive[1] > 3.5 and naive[2] > 3 * flash[2], (naive, flash)


def test_the_backward_recomputes_one_product_a_seventh_of_its_matmul_flops():
    """Non-causal, s a multiple of the tiles: flash's matmul FLOPs are 7/6 of naive attention's (one more Q K^T)."""
    q, k, v = _qkv(128)

    def flops(fn):
        with FlopCounterMode(display=False) as counter:
            fn(q, k, v).sum().backward()
        return counter.get_total_flops()

    flash = flops(lambda *t: FA.flash_attention(*t, False, 32, 32))
    naive = flops(lambda *t: _textbook(*t, causal=False))
    assert flash / naive == pytest.approx(7 / 6, rel=1e-9)
    assert FA.recompute_share() == pytest.approx(1 / 7)


def test_a_causal_mask_needs_as_many_queries_as_keys():
    q, k, v = _qkv(32)
    with pytest.raises(ValueError, match="as many queries as keys"):
        FA.flash_attention(q[..., :16, :], k, v)
