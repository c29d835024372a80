"""Mixture of experts (course_lib.distributed.moe: top-k routing, capacity, load-balancing loss) and expert parallelism
under torchrun (2 gloo processes)."""

from __future__ import annotations

import copy

import pytest
import torch

from course_lib.distributed import moe
from course_lib.model import GPT


def test_capacity_cuts_the_queue_first_choices_first():
    # 4 tokens, 2 experts, top-2: every token offers itself to both; a first choice queues before any second choice.
    logits = torch.tensor([[2.0, 0.0], [2.0, 0.0], [0.0, 2.0], [2.0, 0.0]])
    r = moe.route(logits, top_k=2, capacity_factor=0.5)  # C = ceil(0.5 * 2 * 4 / 2) = 2
    assert r.capacity == 2 and r.chosen.tolist() == [4, 4]
    assert r.tokens[0].tolist() == [0, 1]  # tokens 0, 1, 3 chose expert 0 first: token 3 finds it full
    assert r.tokens[1].tolist() == [2, 0]  # token 2's first choice, then token 0's second choice
    assert r.load().dropped_share == pytest.approx(0.5)
    probs = torch.softmax(logits, -1)
    torch.testing.assert_close(r.gates[1], torch.stack([probs[2, 1], probs[0, 1]]))  # gates: the router's probabilities


def test_the_load_balancing_loss_is_1_when_even_and_e_when_collapsed():
    even = moe.route(torch.zeros(8, 4), top_k=1, capacity_factor=1.0)
    assert even.aux_loss.item() == pytest.approx(1.0)
    collapsed = moe.route(torch.tensor([[30.0, 0, 0, 0]]).repeat(8, 1), top_k=1, capacity_factor=1.0)
    assert collapsed.aux_loss.item() == pytest.approx(4.0, rel=1e-4)
    assert collapsed.load().dropped_share == pytest.approx(6 / 8)  # expert 0 takes its C = 2, the other 6 are dropped


def test_one_expert_with_top_1_is_the_dense_mlp(tiny_model):
    gpt = tiny_model()
    routed = copy.deepcopy(gpt)
    for block in routed.blocks:  # the dense MLP as the only expert: its gate is softmax of one logit, 1
        block.mlp = moe.MoE(torch.nn.Linear(32, 1, bias=False), [block.mlp], top_k=1, capacity_factor=1.0)
    idx = torch.randint(0, 64, (2, 32))
    torch.testing.assert_close(routed(idx), gpt(idx), rtol=0, atol=0)


def test_the_aux_loss_reaches_the_router_through_backward(tiny_model):
    cfg = tiny_model().config
    torch.manual_seed(0)
    with_aux = moe.moe_gpt(cfg, n_experts=4, top_k=2, aux_coef=0.5).blocks[0].mlp
    plain = copy.deepcopy(with_aux)
    plain.aux_coef = 0.0
    x = torch.randn(2, 16, 32)
    with_aux(x).square().sum().backward()
    # by hand: the same output loss plus 0.5 * the load-balancing loss of the same routing
    (
        plain(x).square().sum() + 0.5 * moe.route(plain.router(x.reshape(-1, 32)), 2, plain.capacity_factor).aux_loss
    ).backward()
    torch.testing.assert_close(with_aux.router.weight.grad, plain.router.weight.grad)
    assert with_aux.router.weight.grad.abs().sum() > 0


def test_moe_gpt_and_dropped_shares(tiny_model):
    cfg = tiny_model().config
    torch.manual_seed(0)
    model = moe.moe_gpt(cfg, n_experts=4, top_k=2, capacity_factor=1.0)
    counts = moe.parameter_counts(model)
    dense = GPT(cfg).num_params()
    mlp = sum(p.numel() for p in GPT(cfg).blocks[0].mlp.parameters())
    assert counts["experts"] == 4 * cfg.n_layer * mlp and counts["routers"] == cfg.n_layer * 32 * 4
    assert sum(counts.values()) == dense + 3 * cfg.n_layer * mlp + counts["routers"]
    idx = torch.randint(0, 64, (4, 32))
    shares = moe.dropped_shares(model, idx, [0.25, 0.5, 1.0, 2.0])  # 2.0 = E/k: every expert can take every token
    assert all(layer.capacity_factor == 1.0 for layer in moe.moe_blocks(model))  # the model itself is left as it was
    # more room, fewer drops: in the first layer, whose routing no capacity changes (later layers see what earlier ones
    # dropped)
    first = [shares[cf][0] for cf in (0.25, 0.5, 1.0, 2.0)]
    assert first == sorted(first, reverse=True)
    # at 0.25 at most a quarter is kept
    assert shares[2.0] == [0.0] * cfg.n_layer and all(s >= 0.75 for s in shares[0.25])


@pytest.mark.distributed
def test_expert_parallel_equals_one_process(launched):
    r = launched["expert_parallel"].raise_for_status()  # 4 experts, top 2, capacity factor 0.75
    for rank in r.ranks:
        loads = rank["expert_load"]
        # tokens were dropped: checked too
        assert sum(sum(ld["kept"]) for ld in loads) < sum(sum(ld["chosen"]) for ld in loads)
        # the same logits for this rank's tokens, the same gradients (experts: this rank's; the rest: summed over ranks)
        assert rank["max_abs_logit_diff"] <= 1e-5 * max(1.0, rank["max_abs_logit"])
        assert max(rank["max_abs_grad_diff"].values()) <= 1e-5 * max(1.0, rank["max_abs_grad"]), rank[
            "max_abs_grad_diff"
        ]
        assert rank["loss_sum_of_ranks"] == pytest.approx(rank["loss_single_process"], rel=1e-6)
        # two exchanges per MoE layer forward (tokens out and back), two more in backward, of the same sizes
        a2a = rank["all_to_all"]
        assert a2a["forward"]["calls"] == a2a["backward"]["calls"] == 2 * rank["n_layer"]
        assert a2a["forward"]["bytes_to_other_ranks"] == a2a["backward"]["bytes_to_other_ranks"] > 0
        # experts held: half of them; everything else replicated
        assert rank["expert_bytes_local"] * 2 == rank["expert_bytes_all"]
        assert (
            rank["parameter_bytes_expert_parallel"]
            == rank["parameter_bytes_replicated_model"] - rank["expert_bytes_all"] // 2
        )
    # every kept assignment's row goes out to its expert and comes back: 2 rows per assignment, over both ranks
    rows = sum(
        a2a_bytes
        for rank in r.ranks
        for a2a_bytes in (
            rank["all_to_all"]["forward"]["bytes_to_other_ranks"],
            rank["all_to_all"]["forward"]["bytes_kept_on_this_rank"],
        )
    )
    kept = sum(sum(ld["kept"]) for rank in r.ranks for ld in rank["expert_load"])
    assert rows == 2 * kept * r.ranks[0]["bytes_per_token_row"]
