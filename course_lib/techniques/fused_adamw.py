"""Fused AdamW: one kernel updates every parameter tensor, in place of the for-loop implementation (foreach=False)
that the naive loop uses. The optimizer module makes it (course_lib.techniques.optimizer.optimizer_for); its piece of
the exported script is a keyword of the optimizer's line.
"""

from __future__ import annotations

from ..codegen import Code
from ..config import TrainConfig
from .declaration import Technique


def export(cfg: TrainConfig) -> Code:
    """Which AdamW implementation: a keyword of the optimizer's line (written by the "optimizer" snippet)."""
    if cfg.fused_adamw:
        return Code(
            fills=(
                ("<adamw_impl>", "fused=True"),
                (
                    "<adamw_why>",
                    "# AdamW, fused: one kernel updates every parameter tensor "
                    "(no Python loop over tensors, no temporaries).",
                ),
            )
        )
    return Code(
        fills=(
            ("<adamw_impl>", "foreach=False"),
            ("<adamw_why>", "# AdamW, the for-loop implementation (foreach=False): one parameter tensor at a time."),
        )
    )


TECHNIQUE = Technique(
    "fused_adamw",
    "fused AdamW",
    False,
    help="one fused kernel updates every parameter tensor, instead of a Python loop over them",
    export=export,
    rungs=(("+ fused AdamW", True, "one fused optimizer kernel for every tensor"),),
    memory_note="not in the estimate: AdamW's temporaries are smaller than the terms of the peak",
)
