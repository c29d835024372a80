"""What the techniques need to know about a model, given explicitly: no technique assumes an attribute name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from ..model import GPT


@dataclass
class ModelParts:
    blocks: nn.ModuleList | None = None  # the repeated layers: checkpointing wraps each one, FSDP2 shards each one
    body: Callable[[torch.Tensor], torch.Tensor] | None = None  # inputs -> final hidden states (the chunked loss)
    head: nn.Module | None = None  # hidden states -> logits (the chunked loss; the memory ledger's "logits" start here)

    @classmethod
    def of(cls, model: nn.Module) -> "ModelParts":
        """The course's GPT names its parts; any other model has none unless the caller says."""
        if isinstance(model, GPT):
            return cls(blocks=model.blocks, body=model.hidden, head=model.lm_head)
        return cls()
