"""Mixture of experts: a top-k routed MLP that takes the place of a GPT block's dense MLP.

A router (one Linear, width -> E) scores every token for each of the E experts; the token goes to its top-k experts,
and the block's output is the experts' outputs weighted by the router's probabilities for them (the gates). Each
expert is the course's own dense MLP (model.MLP), so one expert costs what the dense MLP costs, and a token pays k of
them: parameters grow E-fold, compute per token k-fold.

Capacity: an expert takes at most C = ceil(capacity_factor * k * T / E) tokens out of the T it is offered in one
forward (its fair share times the factor), so that every expert's matmul has a fixed size. The assignments beyond C
are dropped: that token gets nothing from that expert (the block's residual connection still carries it forward).
Places are given first choices first (every token's first choice before any second choice, GShard), in token order.

Load-balancing loss (Switch Transformer, eq. 4): aux = E * sum_e f_e * P_e, with f_e the share of the assignments
that chose expert e and P_e the mean router probability of e; it is 1 when the router spreads tokens evenly and up
to E when it sends all to one. It reaches the gradient through `AddAuxLoss` (as Megatron-LM does): the MoE output
passes unchanged, and in backward the aux loss gets the gradient `aux_coef`, as if `aux_coef * aux` had been added
to the training loss, so the course's unchanged loop (course_lib.train) trains the router to balance.

Expert parallelism (course_lib.distributed.expert_parallel) subclasses MoE and replaces only `expert_outputs`.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ModelConfig
from ..model import GPT, MLP


@dataclass
class Load:
    """How full the experts were in one forward (plain numbers, no graph)."""

    chosen: torch.Tensor  # (E,) assignments each expert was offered, before the capacity cut
    kept: torch.Tensor  # (E,) assignments it took
    capacity: int

    @property
    def dropped_share(self) -> float:
        """The share of the k*T assignments that found their expert full."""
        return 1.0 - self.kept.sum().item() / self.chosen.sum().item()


@dataclass
class Routing:
    """Where one forward's T tokens went. tokens[e], gates[e]: the kept assignments of expert e, in priority order."""

    tokens: list[torch.Tensor]  # each (n_e,) token indices into the flattened (T, width) input
    gates: list[torch.Tensor]  # each (n_e,) router probabilities, differentiable
    chosen: torch.Tensor  # (E,) assignments each expert was offered, before the capacity cut
    capacity: int
    aux_loss: torch.Tensor  # the load-balancing loss of this forward

    def load(self) -> Load:
        return Load(self.chosen, torch.tensor([len(t) for t in self.tokens]), self.capacity)


class AddAuxLoss(torch.autograd.Function):
    """Identity on `out`; in backward gives `aux` the gradient `coef`, so that `coef * aux` counts in the loss."""

    @staticmethod
    def forward(ctx, out, aux, coef: float):
        ctx.coef, ctx.aux_dtype, ctx.aux_device = coef, aux.dtype, aux.device
        return out

    @staticmethod
    def backward(ctx, grad_out):
        return grad_out, torch.full((), ctx.coef, dtype=ctx.aux_dtype, device=ctx.aux_device), None


def capacity(n_tokens: int, n_experts: int, top_k: int, capacity_factor: float) -> int:
    """The most assignments one expert takes: its fair share k*T/E times the capacity factor, rounded up."""
    return math.ceil(capacity_factor * top_k * n_tokens / n_experts)


def route(logits: torch.Tensor, top_k: int, capacity_factor: float) -> Routing:
    """Top-k routing with a capacity per expert, from the router's logits (T, E)."""
    n_tokens, n_experts = logits.shape
    probs = F.softmax(logits.float(), dim=-1)
    gate, expert = probs.topk(top_k, dim=-1)  # (T, k): Switch's gates, the probabilities themselves (not renormalised)
    # Choice-major order: row j*T + t is token t's (j+1)-th choice, so first choices queue before second choices.
    expert, gate = expert.t().reshape(-1), gate.t().reshape(-1)
    onehot = F.one_hot(expert, n_experts)
    place = (onehot.cumsum(0) * onehot).sum(-1) - 1  # the assignment's place in its expert's queue: 0, 1, 2, ...
    cap = capacity(n_tokens, n_experts, top_k, capacity_factor)
    chosen = onehot.sum(0)
    aux = n_experts * ((chosen.float() / chosen.sum()) * probs.mean(0)).sum()  # f_e carries no gradient, P_e does
    tokens, gates = [], []
    for e in range(n_experts):
        rows = ((expert == e) & (place < cap)).nonzero().squeeze(1)
        tokens.append(rows % n_tokens)
        gates.append(gate[rows])
    return Routing(tokens, gates, chosen.cpu(), cap, aux)


class MoE(nn.Module):
    """A drop-in for model.MLP: (b, s, width) -> (b, s, width), the tokens routed to their top-k of E experts.

    router: Linear(width, E). experts: the experts this module computes, all E here (under expert parallelism a
    rank's share, experts[0] being global expert `first_expert`)."""

    def __init__(
        self,
        router: nn.Linear,
        experts,
        top_k: int = 2,
        capacity_factor: float = 1.25,
        aux_coef: float = 0.01,
        first_expert: int = 0,
    ):
        super().__init__()
        self.n_experts = router.out_features
        if not 1 <= top_k <= self.n_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and the {self.n_experts} experts")
        self.top_k, self.capacity_factor, self.aux_coef = top_k, capacity_factor, aux_coef
        self.router, self.experts, self.first_expert = router, nn.ModuleList(experts), first_expert
        self.last_load: Load | None = None  # the latest forward's expert load, for measurements

    def expert_outputs(self, flat: torch.Tensor, routing: Routing) -> list[torch.Tensor]:
        """Each expert's output for the tokens routed to it (all experts are here, in this process)."""
        return [expert(flat[idx]) for expert, idx in zip(self.experts, routing.tokens)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.size(-1))  # (T, width): routing is per token, the batch and sequence do not matter
        routing = route(self.router(flat), self.top_k, self.capacity_factor)
        self.last_load = routing.load()
        weighted = [
            y * gate.unsqueeze(1).to(y.dtype) for gate, y in zip(routing.gates, self.expert_outputs(flat, routing))
        ]
        # a token's k outputs add up, gate-weighted (index_put with accumulate: far faster than index_add on a CPU)
        out = torch.zeros_like(flat).index_put((torch.cat(routing.tokens),), torch.cat(weighted), accumulate=True)
        out = AddAuxLoss.apply(out, routing.aux_loss, self.aux_coef) if self.training and self.aux_coef else out
        return out.view_as(x)


def moe_blocks(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def moe_gpt(
    cfg: ModelConfig, n_experts: int, top_k: int = 2, capacity_factor: float = 1.25, aux_coef: float = 0.01
) -> GPT:
    """The course's GPT with every block's dense MLP replaced by an MoE layer of `n_experts` experts."""
    model = GPT(cfg)
    for block in model.blocks:
        layer = MoE(
            nn.Linear(cfg.n_embd, n_experts, bias=False),
            [MLP(cfg) for _ in range(n_experts)],
            top_k,
            capacity_factor,
            aux_coef,
        )
        layer.apply(GPT._init_weights)
        for expert in layer.experts:  # GPT-2's scaled init of residual projections, as GPT.__init__ gives the dense MLP
            nn.init.normal_(expert.c_proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))
        block.mlp = layer
    return model


@torch.no_grad()
def dropped_shares(model: nn.Module, idx: torch.Tensor, capacity_factors) -> dict[float, list[float]]:
    """For each capacity factor: the share of assignments dropped in each MoE layer, from one forward of `idx`."""
    model = copy.deepcopy(model).eval()  # the caller's model keeps its capacity factor
    shares = {}
    for cf in capacity_factors:
        for layer in moe_blocks(model):
            layer.capacity_factor = cf
        model(idx)
        shares[cf] = [layer.last_load.dropped_share for layer in moe_blocks(model)]
    return shares


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """Parameters in experts, in routers, and in the rest (attention, embeddings, LayerNorms)."""
    experts = sum(p.numel() for layer in moe_blocks(model) for p in layer.experts.parameters())
    routers = sum(p.numel() for layer in moe_blocks(model) for p in layer.router.parameters())
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return {"experts": experts, "routers": routers, "rest": total - experts - routers}
