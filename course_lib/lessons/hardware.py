"""What the hardware does, for the lessons: the number formats of each NVIDIA GPU generation as course_lib.capabilities
judges them (notebook 03), and the matmul shapes of a model whose speed notebook 01 measures."""

from __future__ import annotations

from ..capabilities import Support, fast_16bit, gpu_precisions
from ..config import TrainConfig

# NVIDIA's GPU generations by compute capability (data sheets, not measured here).
GPU_GENERATIONS = {
    (6, 0): "Pascal (P100)",
    (6, 1): "Pascal (GTX 10)",
    (7, 0): "Volta (V100)",
    (7, 5): "Turing (T4, RTX 20)",
    (8, 0): "Ampere (A100)",
    (8, 6): "Ampere (RTX 30, A10)",
    (8, 9): "Ada (L4, L40, RTX 40)",
    (9, 0): "Hopper (H100, H200)",
}


def _word(s: Support) -> str:
    return "tensor cores" if s.ok and s.native else "runs, no tensor cores" if s.ok else "refused"


def gpu_generation_rows() -> list[dict[str, str]]:
    """What capabilities.gpu_precisions answers for each generation (the environment cell on such a GPU says the same):
    data-sheet facts by compute capability, nothing measured."""
    rows = []
    for (major, minor), gen in GPU_GENERATIONS.items():
        p = gpu_precisions(major, minor)
        fast = fast_16bit(p, gen)[0]  # techniques.rung_up: else bf16, which such a GPU refuses: the rung is skipped
        rows.append(
            {
                "compute capability": f"{major}.{minor}",
                "generation": gen,
                **{f: _word(p[f]) for f in ("fp16", "bf16", "tf32")},
                "the ladder's 16-bit rung": fast or "skipped (no 16-bit tensor cores)",
            }
        )
    return rows


def model_matmul_shapes(cfg: TrainConfig) -> dict[str, tuple[int, int, int]]:
    """The largest matmuls of one micro-batch's forward: (tokens x width) @ (width x 4·width) in the MLP and
    (tokens x width) @ (width x vocab) in the output layer."""
    tokens, width = cfg.micro_batch_size * cfg.context, cfg.model.n_embd
    return {
        "MLP up-projection": (tokens, width, 4 * width),
        "output layer": (tokens, width, cfg.model.padded_vocab_size),
    }
