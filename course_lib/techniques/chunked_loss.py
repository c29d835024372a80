"""The chunked loss (`HeadLossInSlices`), `LossModule` (the model and its loss as one module, what compile traces), and
the chunked loss's memory term (`memory_terms`)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ConfigError
from ..data import IGNORE_INDEX
from .declaration import MEMORY, Technique
from .model_parts import ModelParts


def loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over the positions that count (padding is IGNORE_INDEX), in fp32 at least: on a
    GPU, F.cross_entropy would keep the log-softmax of 16-bit logits in 16 bits; fp64 logits stay as they are."""
    # (tokens, vocab); `flat` keeps 16-bit logits alive until the loss is made, as the memory model counts them
    flat = logits.reshape(-1, logits.size(-1))
    upcast = flat.float() if flat.element_size() < 4 else flat
    return F.cross_entropy(upcast, targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")


class HeadLossInSlices(torch.autograd.Function):
    """The output layer and the summed cross-entropy of `hidden` (T, d) one slice at a time, each slice's gradients
    made in forward: one slice of the (T, V) logits exists at a time, nothing is recomputed. Backward only scales
    the two kept gradients by the loss's gradient (1/targets, loss scale)."""

    @staticmethod
    def forward(
        ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, head: nn.Module, chunks: int
    ) -> torch.Tensor:
        # this function makes the gradients itself: its slices are plain tensors (no autograd history)
        hidden = hidden.detach()
        grad_hidden = torch.empty_like(hidden)  # (T, d), filled slice by slice
        grad_weight = torch.zeros_like(weight)  # (V, d), the slices' shares summed
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for h, t, gh in zip(hidden.chunk(chunks), targets.chunk(chunks), grad_hidden.chunk(chunks)):
            logits = head(h)  # (c, V), 16-bit under autocast
            # the loss in fp32: a copy of 16-bit logits, or the fp32 logits themselves, used up in place
            p = logits.float()
            valid = t != IGNORE_INDEX  # (c,)
            t0 = t.clamp(min=0)[:, None]  # (c, 1): padding's index made a valid one; its row is zeroed below
            picked = p.gather(1, t0).squeeze(1)  # the target's logit (c,)
            m = p.amax(dim=-1, keepdim=True)  # (c, 1): exp never overflows
            p.sub_(m).exp_()
            s = p.sum(dim=-1, keepdim=True)
            total = total + ((m.squeeze(1) + s.log().squeeze(1) - picked) * valid).sum()  # log-sum-exp - target logit
            # softmax - onehot, 0 on padding: a padding row is divided by infinity, so one pass divides and masks
            p.div_(s.masked_fill(~valid[:, None], float("inf"))).scatter_add_(1, t0, -valid[:, None].to(p.dtype))
            g = p.to(logits.dtype)  # d loss / d logits (c, V), in the matmul's dtype
            gh.copy_(g @ weight)  # (c, d)
            grad_weight += (g.t() @ h).float()  # (V, d)
            del logits, p, g  # this slice's (c, V) tensors go before the next slice makes its own
        ctx.save_for_backward(grad_hidden, grad_weight)
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_total, grad_weight * grad_total, None, None, None


class LossModule(nn.Module):
    """Model and loss as one module, (inputs, targets) -> summed loss: compiling it fuses the cross-entropy too. With
    loss_chunks > 1 it runs HeadLossInSlices, on the model's body and head (ModelParts), a Linear without bias."""

    def __init__(self, model: nn.Module, loss_chunks: int, parts: ModelParts):
        super().__init__()
        self.model, self.loss_chunks = model, loss_chunks
        self._body, self.head = parts.body, parts.head
        bias_free_head = isinstance(self.head, nn.Linear) and self.head.bias is None
        if loss_chunks > 1 and (self._body is None or not bias_free_head):
            raise ConfigError(
                "loss_chunks > 1 needs the model's body and an output layer nn.Linear(..., bias=False): pass "
                "ModelParts(body=..., head=...) or set loss_chunks=1"
            )

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.loss_chunks == 1:
            return loss_sum(self.model(idx), targets)
        hidden = self._body(idx)
        hidden = hidden.reshape(-1, hidden.size(-1))  # (tokens, width)
        return HeadLossInSlices.apply(hidden, self.head.weight, targets.reshape(-1), self.head, self.loss_chunks)


def memory_terms(tokens: int, h: int, vocab: int, chunks: int, autocast: bool) -> tuple[dict, dict]:
    """({term: (ledger category, bytes)} at the worst moment of a forward slice, the same at the start of backward)
    for `tokens` tokens of width `h`, a (padded) vocabulary `vocab` and `chunks` slices."""
    T, V = tokens, vocab
    c = -(-T // chunks)  # tokens per slice: torch.chunk makes ceil(T / k)-token slices (the last one shorter)
    kept = {
        "input gradient, made in forward and kept (T h fp32)": ("activations", T * h * 4),
        "weight gradient, made in forward and kept (V h fp32)": ("activations", V * h * 4),
    }
    fwd = {
        "the output layer's input, the final LayerNorm's output (T h fp32)": ("activations", T * h * 4),
        **kept,
        "the slice's per-token numbers (target, mask, target logit, max, sum)": ("logits", c * (8 + 1 + 4 + 4 + 4)),
    }
    if autocast:
        fwd["16-bit copy of the output layer's weight (V h), autocast's cache"] = ("logits", V * h * 2)
        fwd["the slice's 16-bit logits (c V)"] = ("logits", c * V * 2)
        fwd["the slice's softmax - onehot, fp32 and 16-bit (c V)"] = ("logits", c * V * (4 + 2))
        fwd["the slice's weight-gradient share, 16-bit and fp32 (V h)"] = ("logits", V * h * (2 + 4))
    else:  # the fp32 logits become softmax - onehot in place
        fwd["the slice's logits, then softmax - onehot in place (c V fp32)"] = ("logits", c * V * 4)
        fwd["the slice's weight-gradient share (V h fp32)"] = ("logits", V * h * 4)
    back = {**kept, "the two gradients times the loss's gradient (T h + V h fp32)": ("other", (T + V) * h * 4)}
    return fwd, back


TECHNIQUE = Technique(
    "loss_chunks",
    "loss chunks",
    1,
    help="the output layer and the loss in slices of the tokens, gradients made in forward: one slice of logits at "
    "a time",
    rungs=(
        (
            "+ chunked loss",
            8,
            "output layer and loss in 8 token slices, gradients made in forward: "
            "one slice of logits at a time, nothing recomputed",
        ),
    ),
    choices=(1, 2, 4, 8, 16),
    aims=(MEMORY,),
)
