"""Fused AdamW: one kernel updates every parameter tensor, in place of the for-loop implementation (foreach=False)
that the naive loop uses. The optimizer module makes it (course_lib.techniques.optimizer.optimizer_for); its piece of
the exported script is a keyword of the optimizer's line.
"""

from __future__ import annotations

from .declaration import Technique

TECHNIQUE = Technique(
    "fused_adamw",
    "fused AdamW",
    False,
    help="one fused kernel updates every parameter tensor, instead of a Python loop over them",
    rungs=(("+ fused AdamW", True, "one fused optimizer kernel for every tensor"),),
    memory_note="not in the estimate: AdamW's temporaries are smaller than the terms of the peak",
)
