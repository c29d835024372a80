"""A GPT in the style of nanoGPT, the network only: techniques (autocast, compile, the loss) wrap it from outside."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import ModelConfig
from .flash_attention import flash_attention


def naive_attention(q, k, v, dropout_p: float = 0.0, training: bool = False) -> torch.Tensor:
    """Causal attention written out: materialises the (batch, heads, s, s) scores and probabilities."""
    s = q.size(-2)
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))  # reassigned: the unmasked scores are freed now
    probs = F.softmax(scores, dim=-1)
    return F.dropout(probs, p=dropout_p, training=training) @ v


def sdpa_attention(q, k, v, dropout_p: float = 0.0, training: bool = False) -> torch.Tensor:
    """The same through scaled_dot_product_attention: a fused kernel, which may never store the s x s matrix."""
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p if training else 0.0, is_causal=True)


def flash_by_hand_attention(q, k, v, dropout_p: float = 0.0, training: bool = False) -> torch.Tensor:
    """The same through the course's flash attention in PyTorch (no s x s matrix either, slower; no dropout)."""
    return flash_attention(q, k, v, causal=True)


ATTENTION_IMPLS = {"naive": naive_attention, "sdpa": sdpa_attention, "flash": flash_by_hand_attention}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # q, k, v in one matmul
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.attend = ATTENTION_IMPLS[cfg.attention]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Widths come from c_attn's output, not x: under tensor parallelism it yields only this rank's heads.
        b, s, _ = x.shape
        q, k, v = self.c_attn(x).chunk(3, dim=2)  # each (b, s, d)
        q, k, v = (t.view(b, s, self.n_head, -1).transpose(1, 2) for t in (q, k, v))  # (b, n_head, s, d / n_head)
        y = self.attend(q, k, v, self.dropout, self.training)
        y = y.transpose(1, 2).contiguous().view(b, s, -1)  # heads side by side again: (b, s, d)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.padded_vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.padded_vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied input and output embeddings
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by 1/sqrt(2 * n_layer)
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameters, the tied weight once; non_embedding leaves out the position table, which does no matmul."""
        return sum(p.numel() for p in self.parameters()) - (self.wpe.weight.numel() if non_embedding else 0)

    # The forward in three pieces, embed -> blocks -> head, so a pipeline stage can run a slice with the model's code.

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (batch, s) to the residual stream entering the first block (batch, s, n_embd)."""
        s = idx.size(1)
        if s > self.config.block_size:
            raise ValueError(f"sequence length {s} exceeds block_size {self.config.block_size}")
        pos = torch.arange(s, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))  # (b, s, d) + (s, d) broadcast over the batch

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The residual stream leaving the last block (batch, s, n_embd) to logits (batch, s, padded_vocab)."""
        return self.lm_head(self.ln_f(x))

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        """The final normalised hidden states (batch, s, n_embd): the chunked loss applies lm_head a chunk at a time."""
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (batch, s) to logits (batch, s, padded_vocab)."""
        return self.lm_head(self.hidden(idx))

    @torch.no_grad()
    def generate(self, idx, max_new_tokens: int, temperature=1.0, top_k: int | None = None, generator=None):
        """Sample continuations; padded vocabulary rows are never sampled."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.config.block_size :])[:, -1, : self.config.vocab_size] / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx
