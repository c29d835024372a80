"""Tensor parallelism, and sequence parallelism with it (course_lib.distributed.tensor_parallel), 2 gloo processes: the
same logits, loss and gradients as the unsharded model, the collectives each uses, the parameter and activation bytes
they save. One run (with sequence_parallel, which also runs plain tensor parallelism) serves every test here: conftest's
`launched`, the strategies the tests check run in series in one torchrun launch."""

from __future__ import annotations

import pytest
import torch

from course_lib.distributed import tensor_parallel as TP

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not torch.distributed.is_available(), reason="this torch build has no torch.distributed"),
]


def test_a_shards_expected_gradient_follows_its_placement():
    from torch.distributed.tensor import Replicate, Shard

    class Placed:  # stands for a DTensor parameter: only its placements are read
        def __init__(self, placement):
            self.placements = (placement,)

    g = torch.arange(24.0).view(6, 4)
    assert TP._expected_grad("blocks.0.mlp.c_fc.weight", g, Placed(Shard(0)), 2, 1).equal(g[3:])
    assert TP._expected_grad("blocks.0.mlp.c_proj.weight", g, Placed(Shard(1)), 2, 0).equal(g[:, :2])
    assert TP._expected_grad("ln_f.weight", g, Placed(Replicate()), 2, 1) is g
    # c_attn's rows were reordered [q; k; v] -> [q0; k0; v0; q1; k1; v1] so that rank 1 holds q1, k1, v1
    assert TP._expected_grad("blocks.0.attn.c_attn.weight", g, Placed(Shard(0)), 2, 1).equal(g[[1, 3, 5]])


def test_tensor_parallel_equals_the_unsharded_model(launched):
    for rank in launched["tensor_parallel"].raise_for_status().ranks:
        assert rank["max_abs_logit_diff"] < 1e-5 and rank["max_abs_grad_diff"] < 1e-6
        n = rank["n_layer"]
        assert rank["forward_collectives"].get("all_reduce") == 2 * n  # one after attention, one after the MLP
        assert rank["backward_collectives"].get("all_reduce", 0) >= 2 * n
        assert rank["parameter_bytes_sharded_local"] + rank["parameter_bytes_replicated"] < rank["parameter_bytes_full"]


def test_sequence_parallel_equals_the_unsharded_model_and_saves_activations(launched):
    for rank in launched["tensor_parallel"].raise_for_status().ranks:
        sp, n = rank["sequence_parallel"], rank["n_layer"]
        assert sp["max_abs_logit_diff"] <= 1e-5 * max(1.0, rank["max_abs_logit"])
        assert sp["loss_tp"] == pytest.approx(sp["loss_full"], rel=1e-6)
        # every parameter's gradient, the replicated LayerNorms' included (summed over the ranks' positions)
        assert sp["max_abs_grad_diff"] <= 1e-5 * max(1.0, sp["max_abs_grad"]), max(
            sp["grad_diffs"], key=sp["grad_diffs"].get
        )
        assert any(k.endswith("ln_1.weight") for k in sp["grad_diffs"])
        # each all-reduce became a reduce-scatter + an all-gather; one more all-gather hands the output layer the
        # sequence
        fwd = sp["forward_collectives"]
        assert (
            "all_reduce" not in fwd
            and fwd["reduce_scatter_tensor"] == 2 * n
            and fwd["all_gather_into_tensor"] == 2 * n + 1
        )
        # activations: tensor parallelism shrinks the matmuls' region, sequence parallelism the LayerNorm/dropout region
        # too
        mem = sp["memory"]
        assert (
            mem["tp_sp"]["saved_for_backward_bytes"]
            < mem["tp"]["saved_for_backward_bytes"]
            < mem["full"]["saved_for_backward_bytes"]
        )
        acts = [mem[v]["by_category"]["activations"] for v in ("tp_sp", "tp", "full")]
        assert acts == sorted(acts) and acts[0] < acts[1]
