"""ZeRO's memory per device (Rajbhandari et al., 2020, section 5), as a calculator.

For a model of Ψ parameters trained with mixed-precision Adam on N data-parallel devices: 2Ψ bytes of 16-bit
parameters, 2Ψ of 16-bit gradients and KΨ of optimizer state (K = 12: fp32 master weights, momentum and
variance, 4 bytes each). Each stage shards one more of the three across the N devices:

    stage 0 (plain data parallel)   (2 + 2 + K) Ψ
    stage 1 (optimizer state)       2Ψ + 2Ψ + KΨ/N
    stage 2 (+ gradients)           2Ψ + (2 + K)Ψ/N
    stage 3 (+ parameters)          (2 + 2 + K)Ψ/N

The byte counts are parameters so the same formulas describe a pure fp32 run (4, 4 and K = 8).
"""

from __future__ import annotations

STAGES = (0, 1, 2, 3)
# the course's runs: fp32 weights and gradients, Adam's m and v
FP32_ADAMW = {"k": 8, "param_bytes": 4, "grad_bytes": 4}
STAGE_NAMES = {
    0: "baseline data parallel",
    1: "ZeRO-1: optimizer state sharded",
    2: "ZeRO-2: + gradients sharded",
    3: "ZeRO-3 / FSDP: + parameters sharded",
}


def zero_parts(
    psi: float, n: int, stage: int, k: float = 12, param_bytes: float = 2, grad_bytes: float = 2
) -> dict[str, float]:
    """Bytes per device of parameters, gradients and optimizer state."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage}")
    if n < 1:
        raise ValueError(f"n (devices) must be >= 1, got {n}")
    return {
        "parameters": param_bytes * psi / (n if stage >= 3 else 1),
        "gradients": grad_bytes * psi / (n if stage >= 2 else 1),
        "optimizer state": k * psi / (n if stage >= 1 else 1),
    }


def zero_bytes(psi: float, n: int, stage: int, k: float = 12, param_bytes: float = 2, grad_bytes: float = 2) -> float:
    """Model-state bytes per device (activations and buffers not included)."""
    return sum(zero_parts(psi, n, stage, k, param_bytes, grad_bytes).values())


def zero_gb(psi: float, n: int, stage: int, k: float = 12) -> float:
    """The paper's unit: GB = 10^9 bytes."""
    return zero_bytes(psi, n, stage, k) / 1e9


def zero_table(psi: float, n: int, k: float = 12) -> list[dict]:
    return [{"stage": s, "what is sharded": STAGE_NAMES[s], "GB per device": zero_gb(psi, n, s, k)} for s in STAGES]


def ring_all_reduce_bytes(payload_bytes: float, n: int) -> float:
    """Bytes each device sends (and receives) in a ring all-reduce of `payload_bytes`: a reduce-scatter and an
    all-gather, each (n-1)/n of the payload."""
    return 2 * (n - 1) / n * payload_bytes


def data_parallel_traffic(psi: float, n: int, stage: int, grad_bytes: float = 2, param_bytes: float = 2) -> float:
    """Bytes each device sends per optimizer step, in the ZeRO paper's accounting (section 7), ring algorithms. Stage 0:
    one all-reduce of the gradients, 2(N-1)/N of them. Stages 1-2: a reduce-scatter of the gradients (each rank receives
    the sum for its shard only) and an all-gather of the updated parameters, (N-1)/N each: the volume of one all-reduce.
    Stage 3 gathers the parameters twice (forward, and again in backward after they were freed) and reduce-scatters the
    gradients: 1.5x. An implementation may move more: the course's stage 1 (ZeroRedundancyOptimizer) keeps DDP's
    all-reduce and adds a broadcast of the updated parameters (zero_stages; measured in notebook 07)."""
    one_pass = (n - 1) / n * psi
    if stage < 3:
        return one_pass * grad_bytes + one_pass * (param_bytes if stage >= 1 else grad_bytes)
    return 2 * one_pass * param_bytes + one_pass * grad_bytes


def offload_optimizer_bytes(
    psi: float, n: int, stage: int = 2, k: float = 12, param_bytes: float = 2, grad_bytes: float = 2
) -> dict[str, float]:
    """ZeRO-Offload (optimizer state and the Adam update on the CPU), per device and optimizer step, as a formula:
    the device sends its gradients to the host and receives the updated parameters back; it no longer holds the
    optimizer state. With stage >= 2 a device moves only its shard (1/N); below, the whole model."""
    share = psi / (n if stage >= 2 else 1)
    return {
        "device to host (gradients)": grad_bytes * share,
        "host to device (parameters)": param_bytes * share,
        "saved on the device (optimizer state)": zero_parts(psi, n, stage, k, param_bytes, grad_bytes)[
            "optimizer state"
        ],
    }


# What one rank sends, as a share of the bytes the course's counter records for a collective (_common.CollectiveCounter:
# the full side of the exchange, B). Ring algorithms: an all-gather or a reduce-scatter moves (N-1)/N of B through
# every rank; an all-reduce is the two in a row, 2(N-1)/N. A broadcast delivers B to N-1 ranks, whatever its shape
# (chain, tree): (N-1)/N of B per rank on average over the ranks. A point-to-point send moves all of it.
def sent_share(kind: str, n: int) -> float:
    """The share of a collective's counted bytes that each rank sends (see above); a receive sends nothing."""
    shares = {
        "all-reduce": 2 * (n - 1) / n,
        "all-gather": (n - 1) / n,
        "reduce-scatter": (n - 1) / n,
        "broadcast": (n - 1) / n,
        "all-to-all": (n - 1) / n,
        "send": 1.0,
        "receive": 0.0,
    }
    if kind not in shares:
        raise ValueError(f"no sent share for {kind!r}: one of {', '.join(shares)}")
    return shares[kind]


def sent_by_kind(collectives: dict[str, dict], n: int, shares: dict[str, float] | None = None) -> dict[str, float]:
    """Bytes each rank sends, by kind, for the collectives the counter recorded ({kind: {"calls", "bytes",
    "by_group_size"}}): the counted bytes times the ring algorithms' share (all-to-all: an even spread over the ranks)
    for the size of the group each call ran on ("by_group_size": the pipeline's tied-embedding all-reduce runs on its 2
    end stages whatever the world's size; a record without it: every call on all n ranks). `shares` ({kind: share}),
    where given, replaces the ring's share for calls on all n ranks: e.g. the shares a backend was measured to send
    (notebook 07 measures this torch's gloo: its reduce-scatter sends what an all-reduce does)."""
    shares = shares or {}
    out = {}
    for kind, c in collectives.items():
        groups = {int(g): b for g, b in (c.get("by_group_size") or {n: c["bytes"]}).items()}
        out[kind] = sum(
            (shares[kind] if kind in shares and g == n else sent_share(kind, g)) * b for g, b in groups.items()
        )
    return out


def bytes_sent(collectives: dict[str, dict], n: int, shares: dict[str, float] | None = None) -> float:
    """Bytes each rank sends for the collectives the counter recorded, all kinds together (sent_by_kind)."""
    return sum(sent_by_kind(collectives, n, shares).values())
