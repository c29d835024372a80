"""Vocabulary padding: the embedding and output layer get a multiple of `vocab_multiple` rows (64 suits GPU kernels);
the extra rows are never a target. The model builds it (ModelConfig.padded_vocab_size)."""

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
