"""FSDP2 with a mixed-precision policy and a choice of what is sharded (course_lib.distributed.fsdp and
techniques.shard_with_fsdp2), under gloo with 2 CPU processes: bf16 parameters while a block runs and fp32 master
shards, half the bytes in the gathered copy and in the all-gathers; LayerNorms kept replicated as plain tensors, their
gradients averaged over the ranks."""

from __future__ import annotations

import pytest
import torch

from course_lib.config import ConfigError
from course_lib.distributed import fsdp as F, launch as L

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="this torch build has no torch.distributed"
)


def test_the_policies():
    assert F.mixed_precision("fp32") is None  # the parameters' own dtype throughout
    bf16 = F.mixed_precision("bf16")
    assert bf16.param_dtype == torch.bfloat16 and bf16.reduce_dtype == torch.float32
    with pytest.raises(ConfigError, match="bf16"):
        F.mixed_precision("fp8")
    with pytest.raises(ConfigError, match="fp32, bf16"):  # refused before any process starts
        L.check_strategy_options("fsdp", {"precisions": ["fp16"]})


@pytest.fixture(scope="module")
def ranks():
    options = {"steps": 3, "precisions": ["fp32", "bf16"], "replicate_norms": True}
    result = L.launch("fsdp", 2, options=options, device="cpu", timeout_s=300)
    assert result.ok, result.why()
    return result.ranks


@pytest.mark.distributed
def test_bf16_parameters_while_a_block_runs_fp32_master_shards(ranks):
    for rank in ranks:
        fp32, bf16 = rank["fsdp"], rank["fsdp_bf16"]
        assert list(fp32["gathered_block_bytes"]) == ["float32"] and list(bf16["gathered_block_bytes"]) == ["bfloat16"]
        # the same shapes gathered, in 2 bytes instead of 4: exactly half
        assert 2 * bf16["gathered_block_bytes"]["bfloat16"] == fp32["gathered_block_bytes"]["float32"]
        assert fp32["master_dtypes"] == bf16["master_dtypes"] == ["float32"]
        # between steps the shards, their gradients and Adam's state are fp32 in both
        assert bf16["memory"] == fp32["memory"]
        gather = {k: v["collectives_last_step"]["all-gather"]["bytes"] for k, v in (("fp32", fp32), ("bf16", bf16))}
        assert 2 * gather["bf16"] == gather["fp32"]  # the all-gathers move bf16
        scatter = {k: v["collectives_last_step"]["reduce-scatter"]["bytes"] for k, v in (("a", fp32), ("b", bf16))}
        assert scatter["a"] == scatter["b"]  # reduce_dtype fp32: the gradients travel in fp32 in both
        assert bf16["result"]["losses"] == pytest.approx(fp32["result"]["losses"], rel=1e-3)
        assert bf16["result"]["losses"][-1] < bf16["result"]["losses"][0]


@pytest.mark.distributed
def test_replicated_norms_are_plain_tensors_averaged_over_the_ranks(ranks):
    checks = [rank["replicated_norms"] for rank in ranks]
    for c in checks:
        plain = [n for n, is_dtensor in c["dtensor"].items() if not is_dtensor]
        assert plain and all(".ln_" in n or n.startswith("ln_f.") for n in plain)
        assert all(is_dtensor for n, is_dtensor in c["dtensor"].items() if n not in plain)  # the rest is sharded
        assert c["replicated_dtypes"] == ["float32"]  # the policy casts only what FSDP2 manages
        assert set(c["gathered_block_bytes"]) == {"bfloat16", "float32"}  # a block runs bf16 weights, fp32 norms
        # the same steps as the model sharding everything, up to bf16's rounding of the norms in that one
        assert c["max_abs_change"] > 1e-4 and c["max_abs_diff_from_all_sharded"] < c["max_abs_change"] / 4, c
    # each rank saw its own slice of the batch: only averaged gradients leave the replicated norms equal on both
    assert checks[0]["replicated_checksum"] == checks[1]["replicated_checksum"]
