import pytest
import torch

from course_lib.config import ModelConfig
from course_lib.model import GPT, naive_attention, sdpa_attention


@pytest.mark.parametrize("b,h,s,d", [(2, 2, 16, 8), (1, 4, 33, 16), (3, 1, 64, 32)])
def test_naive_and_sdpa_attention_are_the_same_function(b, h, s, d):
    g = torch.Generator().manual_seed(s)
    q, k, v = (torch.randn(b, h, s, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out_n = naive_attention(q, k, v)
    grads_n = torch.autograd.grad(out_n.sum(), (q, k, v))
    out_s = sdpa_attention(q, k, v)
    grads_s = torch.autograd.grad(out_s.sum(), (q, k, v))
    torch.testing.assert_close(out_n, out_s)
    for a, c in zip(grads_n, grads_s):
        torch.testing.assert_close(a, c)


def test_attention_is_causal():
    q = k = v = torch.randn(1, 1, 8, 4)
    out = naive_attention(q, k, v)
    v2 = v.clone()
    v2[..., -1, :] += 100.0  # changing the last position must not change earlier outputs
    assert torch.allclose(naive_attention(q, k, v2)[..., :-1, :], out[..., :-1, :])


def test_both_attention_models_compute_the_same_logits():
    torch.manual_seed(0)
    a = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=100, attention="naive"))
    b = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=100, attention="sdpa"))
    b.load_state_dict(a.state_dict())
    idx = torch.randint(0, 100, (2, 32))
    torch.testing.assert_close(a(idx), b(idx), atol=1e-5, rtol=1e-5)


def test_embeddings_are_tied_and_vocab_padded():
    m = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=100, vocab_multiple=64))
    assert m.lm_head.weight is m.wte.weight
    assert m.wte.weight.shape == (128, 16)
    out = m.generate(torch.zeros(1, 1, dtype=torch.long), 20, generator=torch.Generator().manual_seed(0))
    assert out.max() < 100  # padded rows are never sampled


def test_gpt2_small_has_124m_parameters():
    with torch.device("meta"):
        m = GPT(ModelConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50257))
    assert m.num_params() == 124_439_808  # GPT-2 small, tied embeddings, counted once


def test_too_long_sequence_is_refused():
    m = GPT(ModelConfig(n_layer=1, n_head=1, n_embd=8, block_size=4, vocab_size=10))
    with pytest.raises(ValueError, match="exceeds block_size"):
        m(torch.zeros(1, 5, dtype=torch.long))


def test_forward_is_embed_blocks_head_and_the_parameter_names_are_nanogpts():
    torch.manual_seed(0)
    m = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=50, dropout=0.1)).eval()
    idx = torch.randint(0, 50, (2, 8))
    x = m.embed(idx)
    for block in m.blocks:
        x = block(x)
    torch.testing.assert_close(m.head(x), m(idx), rtol=0, atol=0)
    torch.testing.assert_close(m.lm_head(m.hidden(idx)), m(idx), rtol=0, atol=0)
    block_keys = {
        "ln_1.weight",
        "ln_1.bias",
        "attn.c_attn.weight",
        "attn.c_attn.bias",
        "attn.c_proj.weight",
        "attn.c_proj.bias",
        "ln_2.weight",
        "ln_2.bias",
        "mlp.c_fc.weight",
        "mlp.c_fc.bias",
        "mlp.c_proj.weight",
        "mlp.c_proj.bias",
    }
    assert set(m.state_dict()) == (
        {"wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias", "lm_head.weight"}
        | {f"blocks.{i}.{k}" for i in range(2) for k in block_keys}
    )
