"""Claims of notebooks 04 and 09 that are bookkeeping rather than a lesson, moved out of their "Check yourself"
cells."""

import torch

from course_lib import config as C
from course_lib.lessons import micro_benchmarks
from course_lib.model import GPT


def test_the_padded_gpt2_head_has_50304_rows_47_never_predicted():
    gpt2 = C.ModelConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50257, vocab_multiple=64)
    with torch.device("meta"):
        rows = GPT(gpt2).lm_head.weight.shape[0]
    assert rows == gpt2.padded_vocab_size == 50304 and rows - gpt2.vocab_size == 47


def test_foreach_and_fused_adamw_make_far_fewer_operator_calls_than_the_for_loop(tiny):
    params = [p.detach() for p in GPT(tiny().model).parameters()]
    calls = micro_benchmarks.adamw_operator_calls(params)
    assert calls["for-loop"] >= 4 * len(params)  # moments, decay and update: several calls per tensor
    assert len(params) > calls["foreach"] >= calls["fused"] >= 1, calls
