"""Vocabulary padding: the embedding and the output layer get a multiple of `vocab_multiple` rows (64 makes GPU
kernels happier); the extra rows are never a target. The model builds it (course_lib.config.ModelConfig's
padded_vocab_size); the memory estimate's V is that padded size.
"""

from __future__ import annotations

from .declaration import Technique

TECHNIQUE = Technique(
    "model.vocab_multiple",
    "pad vocab to x",
    1,
    help="pad the embedding and the output layer to a multiple of this many rows",
    rungs=(("+ vocab to x64", 64, "embedding padded to a multiple of 64"),),
    choices=(1, 8, 64, 128),
    memory_note="the estimate's vocabulary V is ModelConfig.padded_vocab_size",
)
