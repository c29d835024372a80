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
FP32_ADAMW = {"k": 8, "param_bytes": 4, "grad_bytes": 4}  # the course's runs: fp32 weights and gradients, Adam's m and v
STAGE_NAMES = {0: "baseline data parallel", 1: "ZeRO-1: optimizer state sharded", 2: "ZeRO-2: + gradients sharded",
               3: "ZeRO-3 / FSDP: + parameters sharded"}


def zero_parts(psi: float, n: int, stage: int, k: float = 12, param_bytes: float = 2, grad_bytes: float = 2) -> dict[str, float]:
    """Bytes per device of parameters, gradients and optimizer state."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage}")
    if n < 1:
        raise ValueError(f"n (devices) must be >= 1, got {n}")
    return {"parameters": param_bytes * psi / (n if stage >= 3 else 1),
            "gradients": grad_bytes * psi / (n if stage >= 2 else 1),
            "optimizer state": k * psi / (n if stage >= 1 else 1)}


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
    """Bytes each device sends per optimizer step. Stages 0-2: one all-reduce of the gradients (stage 1-2 as a
    reduce-scatter plus an all-gather of updated parameters: the same volume). Stage 3 gathers the parameters
    twice (forward, and again in backward after they were freed) and reduce-scatters the gradients: 1.5x."""
    one_pass = (n - 1) / n * psi
    if stage < 3:
        return one_pass * grad_bytes + one_pass * (param_bytes if stage >= 1 else grad_bytes)
    return 2 * one_pass * param_bytes + one_pass * grad_bytes


def offload_optimizer_bytes(psi: float, n: int, stage: int = 2, k: float = 12, param_bytes: float = 2,
                            grad_bytes: float = 2) -> dict[str, float]:
    """ZeRO-Offload (optimizer state and the Adam update on the CPU), per device and optimizer step, as a formula:
    the device sends its gradients to the host and receives the updated parameters back; it no longer holds the
    optimizer state. With stage >= 2 a device moves only its shard (1/N); below, the whole model."""
    share = psi / (n if stage >= 2 else 1)
    return {"device to host (gradients)": grad_bytes * share, "host to device (parameters)": param_bytes * share,
            "saved on the device (optimizer state)": zero_parts(psi, n, stage, k, param_bytes, grad_bytes)["optimizer state"]}
