"""The memory of a training step from its shapes, with no run (notebook 02's formula): the peak is the largest of the
moments that can hold it (`peak_candidates`), in measure.MemoryLedger's categories; tests hold it to the ledger."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from . import techniques as T
from .config import ConfigError, ModelConfig, TrainConfig
from .measure import CATEGORIES, GiB
from .techniques.activation_checkpointing import kept_per_layer, selective_activation_terms
from .techniques.chunked_loss import memory_terms as chunked_loss_terms
from .techniques.fused_attention import what_attention_keeps as _attention
from .techniques.mixed_precision import activation_format as _precision
from .techniques.optimizer import state_bytes as optimizer_state_bytes
from .techniques.set_to_none import gradients_before_backward

# ---- counting parameters -------------------------------------------------------------------------


def count_params(m: ModelConfig) -> int:
    """Parameters of the course's GPT (the tied embedding once): V h + block_size h + L (12 h^2 + 13 h) + 2 h, where a
    block is QKV 3h^2+3h, projection h^2+h, MLP 8h^2+5h and two LayerNorms 4h; without biases their terms go."""
    h, L = m.n_embd, m.n_layer
    per_block = 12 * h * h + (13 * h if m.bias else 2 * h)
    return m.padded_vocab_size * h + m.block_size * h + L * per_block + (2 * h if m.bias else h)


def count_param_tensors(m: ModelConfig) -> int:
    """Distinct parameter tensors (each gets one AdamW step counter)."""
    per_block = 12 if m.bias else 6  # 6 weights (2 LayerNorm, 4 Linear) and as many biases
    return 2 + m.n_layer * per_block + (2 if m.bias else 1)


def static_bytes(
    n_params: int, optimizer: str = "adamw", bytes_per_value: int = 4, n_param_tensors: int = 0
) -> dict[str, int]:
    """Parameters and gradients, n_params x bytes each, and the optimizer's state (step counters if n_param_tensors)."""
    return {
        "parameters": n_params * bytes_per_value,
        "gradients": n_params * bytes_per_value,
        "optimizer state": optimizer_state_bytes(optimizer, n_params, n_param_tensors, bytes_per_value),
    }


# ---- activations ---------------------------------------------------------------------------------


def layer_activation_terms(
    s: int, b: int, h: int, a: int, value_bytes=4, attention="naive", dropout=False, norm_bytes=None, mask_bytes=1
) -> dict[str, int]:
    """Bytes one block keeps for backward, term by term: the paper's sixteen sbh values (dropout masks only with dropout
    on), LayerNorm's fp32 mean and 1/std, and naive attention's softmax and mask or SDPA's logsumexp. norm_bytes: per
    LayerNorm input value (default value_bytes); mask_bytes: per dropout-mask value (_mask_bytes)."""
    B, sbh, as2b = value_bytes, s * b * h, a * s * s * b
    nb = B if norm_bytes is None else norm_bytes
    terms = {
        "LayerNorm inputs (2 x sbh)": 2 * sbh * nb,
        "LayerNorm mean and 1/std (fp32)": 2 * 2 * b * s * 4,
        "QKV matmul input (sbh)": sbh * B,
        "Q, K and V (3 x sbh)": 3 * sbh * B,
        "attention output = projection input (sbh)": sbh * B,
        "MLP first matmul input (sbh)": sbh * B,
        "GELU input (4 x sbh)": 4 * sbh * B,
        "MLP second matmul input (4 x sbh)": 4 * sbh * B,
    }
    if attention == "naive":
        terms["softmax output (a s^2 b)"] = as2b * B
        terms["causal mask (s x s bool)"] = s * s
    elif attention == "sdpa":
        terms["softmax logsumexp (b a s, fp32)"] = b * a * s * 4
    else:
        raise ValueError(f"attention={attention!r} is not 'naive' or 'sdpa'")
    if dropout:
        terms["dropout masks (2 x sbh)"] = 2 * sbh * mask_bytes
        if attention == "naive":
            terms["attention dropout mask (a s^2 b)"] = as2b * mask_bytes
            terms["attention dropout output (a s^2 b)"] = as2b * B
    return terms


def weight_copy_bytes(m: ModelConfig) -> int:
    """The 16-bit copies of one block's weights (12h^2) and biases (9h) that its matmuls keep under autocast."""
    h = m.n_embd
    return 2 * (12 * h * h + (9 * h if m.bias else 0))


def logits_terms(b: int, s: int, vocab: int) -> dict[str, int]:
    """The loss's three (tokens x vocab) tensors as backward starts: fp32 even under autocast, and not in the paper."""
    tv = b * s * vocab * 4
    return {
        "log-softmax output, saved (b s V fp32)": tv,
        "gradient of the log-softmax (b s V fp32)": tv,
        "gradient of the logits (b s V fp32)": tv,
    }


def _mask_bytes(cfg: TrainConfig) -> int:
    """Bytes per dropout-mask value: 1 on CUDA (a bool mask), the values' dtype on a CPU (PyTorch's CPU dropout)."""
    return _precision(cfg)[1] if torch.device(cfg.device).type == "cpu" else 1


# LayerNorm inputs and the residual stream (a block's input) stay fp32 under autocast: fp32 + 16-bit adds to fp32
R = 4


def _block_sizes(cfg: TrainConfig):
    """(s, b, h, a, X = sbh, S2 = a s^2 b, T = tokens, B = bytes per activation, autocast?, QKV weight copy bytes)."""
    m = cfg.model
    s, b, h, a = cfg.context, cfg.micro_batch_size, m.n_embd, m.n_head
    autocast, B = _precision(cfg)
    qkv_copy = (3 * h * h + (3 * h if m.bias else 0)) * 2 if autocast else 0
    return s, b, h, a, s * b * h, a * s * s * b, s * b, B, autocast, qkv_copy


def activation_bytes(cfg: TrainConfig) -> dict[str, int]:
    """Activations of one micro-batch: what a block saves ("per layer"), keeps through the forward ("kept per layer",
    less with checkpointing), and the total with what the model keeps outside its blocks."""
    m = cfg.model
    s, b, h, a, sbh, _, _, vb, autocast, _ = _block_sizes(cfg)
    mask = _mask_bytes(cfg) if m.dropout > 0 else 0
    attention, causal_mask = _attention(cfg)
    terms = layer_activation_terms(s, b, h, a, vb, attention, m.dropout > 0, norm_bytes=R, mask_bytes=mask)
    layer = sum(terms.values()) - (0 if causal_mask else terms.get("causal mask (s x s bool)", 0))
    layer += weight_copy_bytes(m) if autocast else 0
    # outside the blocks: position ids, the final LayerNorm's input and statistics, the embedding's dropout mask, and
    # the output layer's input, kept only in fp32 (autocast keeps a 16-bit copy, a logit term; the chunked loss none)
    outside = s * 8 + sbh * R + 2 * b * s * 4 + sbh * mask + (sbh * 4 if not autocast and cfg.loss_chunks == 1 else 0)
    kept = kept_per_layer(cfg.activation_checkpointing, layer, s, b, h, a, vb, attention, residual_bytes=R)
    return {"per layer": layer, "kept per layer": kept, "total": m.n_layer * kept + outside}


def block_backward_terms(cfg: TrainConfig) -> dict[str, dict[str, tuple[str, int]]]:
    """The last block's tensors and gradients in flight at the worst moments of its backward (it comes first, every
    other block still full), {moment: {term: (category, bytes)}}; with SDPA only the MLP's backward can be the peak."""
    points = {"MLP backward": _mlp_backward(cfg)}
    if _attention(cfg)[0] == "naive":
        points["attention backward"] = _attention_backward(cfg)
        if cfg.activation_checkpointing != "none":
            points["attention recompute"] = _attention_recompute(cfg)
    return points


def _mlp_backward(cfg: TrainConfig) -> dict[str, tuple[str, int]]:
    """The block's first backward matmul: its saved tensors (recomputed if checkpointed), output and GELU gradients."""
    s, b, h, a, X, S2, T, B, autocast, qkv_copy = _block_sizes(cfg)
    ck, attention = cfg.activation_checkpointing, _attention(cfg)[0]
    # what the block saves (its 16-bit weight copies included): "activations", or "other" where recomputed
    saved = activation_bytes(cfg)["per layer"]
    mlp: dict[str, tuple[str, int]] = {}
    if ck == "full":
        mlp["block input, kept"] = ("activations", X * R)
        mlp["the block's saved tensors, recomputed"] = ("other", saved - X * R)
    elif ck == "selective":
        # still cached: the block input, the MLP's first matmul output (GELU's saved input), with SDPA what it saves,
        # and the MLP's second matmul output (X * B), which the recompute, stopping before it, never takes
        kept = selective_activation_terms(s, b, h, a, B, attention, residual_bytes=R)
        cached_terms = ["block input (sbh)", "MLP first matmul output (4 x sbh)"]
        if attention == "sdpa":
            cached_terms += ["QKV matmul output (3 x sbh)", "attention output (sbh)", "softmax logsumexp (b a s, fp32)"]
        cached = sum(kept[t] for t in cached_terms)
        mlp["kept by selective checkpointing, still cached"] = ("activations", cached + X * B)
        mlp["the block's other saved tensors, recomputed"] = ("other", saved - cached)
    else:
        mlp["the block's saved tensors"] = ("activations", saved)
    mlp["gradient of the block output (sbh, fp32)"] = ("other", X * 4)
    if autocast:
        mlp["its 16-bit copy for the matmul's backward (sbh)"] = ("other", X * 2)
    mlp["gradient of the GELU output (4 sbh)"] = ("other", 4 * X * B)
    # a temporary added into .grad, or .grad itself where zero_grad(set_to_none=True) left none
    fresh_grads = not gradients_before_backward(cfg)
    mlp["weight gradient of the MLP's second matmul (4h^2)"] = ("gradients" if fresh_grads else "other", 4 * h * h * B)
    return mlp


def _attention_backward(cfg: TrainConfig) -> dict[str, tuple[str, int]]:
    """Naive attention's softmax backward: the MLP's tensors are gone, but three a s^2 b tensors are alive."""
    s, b, h, a, X, S2, T, B, autocast, qkv_copy = _block_sizes(cfg)
    m, ck, causal_mask = cfg.model, cfg.activation_checkpointing, _attention(cfg)[1]
    fresh_grads = not gradients_before_backward(cfg)
    left = {
        "LayerNorm input (sbh)": X * R,
        "LayerNorm mean and 1/std": T * 8,
        "QKV matmul input (sbh)": X * B,
        "Q and K (2 sbh)": 2 * X * B,
        "softmax output (a s^2 b)": S2 * B,
        "causal mask (s x s bool)": s * s if causal_mask else 0,
    }
    if m.dropout > 0:
        left["attention dropout mask and output (a s^2 b)"] = S2 * (_mask_bytes(cfg) + B)
    att: dict[str, tuple[str, int]] = {}
    if ck == "none":
        att["the block's saved tensors, what attention needs"] = ("activations", sum(left.values()) + qkv_copy)
    else:
        # kept: the block input, and with selective checkpointing the MLP's second matmul output, still cached
        att["block input, kept"] = ("activations", X * R + (X * B if ck == "selective" else 0))
        att["attention's saved tensors, recomputed"] = ("other", sum(left.values()) - X * R + qkv_copy)
    att["gradient of the attention block's output (sbh, fp32)"] = ("other", X * 4)
    att["gradient of V (sbh)"] = ("other", X * B)
    att["gradient of the softmax output (a s^2 b)"] = ("other", S2 * B)
    att["gradient of the scores (a s^2 b)"] = ("other", S2 * B)
    if fresh_grads:  # no .grad before: the gradients made so far stay, as .grad
        nb = 1 if m.bias else 0  # MLP and projection weights (9h^2) and biases (6h), two LayerNorms (2h each)
        made = 4 * (9 * h * h + 6 * h * nb + 2 * h * (1 + nb))
        att["gradients made so far (MLP, projection, LayerNorms)"] = ("gradients", made)
    return att


def _attention_recompute(cfg: TrainConfig) -> dict[str, tuple[str, int]]:
    """Naive attention recomputed (checkpointing) at softmax x V: the scores (a local variable) and probabilities."""
    s, b, h, a, X, S2, T, B, autocast, qkv_copy = _block_sizes(cfg)
    rec: dict[str, tuple[str, int]] = {}
    if cfg.activation_checkpointing == "selective":  # cached: the block input, matmul outputs not yet taken
        kept = selective_activation_terms(s, b, h, a, B, "naive", residual_bytes=R)
        taken = kept["QK^T matmul output (a s^2 b)"]  # the scores, which the recompute has taken
        rec["kept by selective checkpointing, still cached"] = ("activations", sum(kept.values()) - taken)
    else:
        rec["block input, kept"] = ("activations", X * R)
        rec["QKV matmul output, recomputed (3 sbh)"] = ("other", 3 * X * B)  # alive while q, k, v are local variables
    # LayerNorm's output, still attention's argument (a local variable), is fp32 under autocast: QKV takes a 16-bit copy
    rec["LayerNorm output and statistics, recomputed"] = ("other", X * (4 if autocast else B) + T * 8)
    if autocast:
        rec["16-bit copy of the LayerNorm output (sbh)"] = ("other", X * 2)
    rec["Q, K and V copies, recomputed (3 sbh)"] = ("other", 3 * X * B + qkv_copy)
    rec["scores and softmax output, recomputed (2 a s^2 b)"] = ("other", 2 * S2 * B)
    rec["causal mask and its negation (2 s x s bool)"] = ("other", 2 * s * s)
    rec["gradient of the block output (sbh, fp32)"] = ("other", X * 4)
    if autocast:  # cast for the MLP's second matmul before the recompute starts
        rec["its 16-bit copy for the matmul's backward (sbh)"] = ("other", X * 2)
    return rec


def loss_terms(cfg: TrainConfig) -> dict[str, dict[str, tuple[str, int]]]:
    """The loss's worst moments, {moment: {term: (category, bytes)}}: forward (a slice if chunked), backward's start."""
    m = cfg.model
    T, h, V, k = cfg.micro_batch_size * cfg.context, m.n_embd, m.padded_vocab_size, cfg.loss_chunks
    autocast = _precision(cfg)[0]
    fwd: dict[str, tuple[str, int]] = {}
    if autocast and cfg.activation_checkpointing != "none":  # alive until the forward ends, even under checkpointing
        fwd["autocast's cache of the blocks' 16-bit weights"] = ("activations", m.n_layer * weight_copy_bytes(m))
    if k > 1:
        slice_fwd, back = chunked_loss_terms(T, h, V, k, autocast)
        return {"forward: a loss slice": {**fwd, **slice_fwd}, "start of backward": back}
    copies = {}  # what the output layer's matmul keeps for backward under autocast: the 16-bit copies it multiplied
    if autocast:
        copies["16-bit copy of the output layer's input (T h)"] = ("logits", T * h * 2)
        copies["16-bit copy of the output layer's weight (V h)"] = ("logits", V * h * 2)
        fwd.update(copies)
        fwd["16-bit logits (T V)"] = ("logits", T * V * 2)
    fwd["logits in fp32 (T V)"] = ("logits", T * V * 4)  # the output layer's, or under autocast the loss's fp32 copy
    fwd["log-softmax output (T V fp32)"] = ("logits", T * V * 4)
    # the saved log-softmax is made in the loss, its gradients in backward
    (saved, saved_bytes), *grads = logits_terms(cfg.micro_batch_size, cfg.context, V).items()
    back = {**copies, saved: ("logits", saved_bytes), **{name: ("other", n) for name, n in grads}}
    return {"forward: the loss": fwd, "start of backward": back}


def peak_candidates(cfg: TrainConfig) -> dict[str, dict[str, tuple[str, int]]]:
    """Every moment of a steady-state step (with accumulation, its last micro-batch) that can hold its peak, each as
    {term: (ledger category, bytes)}: the loss, the last block's backward, the end of backward (AdamW's is smaller)."""
    m = cfg.model
    L, h, V = m.n_layer, m.n_embd, m.padded_vocab_size
    st = static_bytes(count_params(m), cfg.optimizer, 4, count_param_tensors(m))
    act = activation_bytes(cfg)
    grads_before = st["gradients"] if gradients_before_backward(cfg) else 0
    static = {
        "parameters": ("parameters", st["parameters"]),
        "optimizer state": ("optimizer state", st["optimizer state"]),
        "gradients": ("gradients", grads_before),
        # what a technique declares it holds through the step (techniques.Technique.memory), where it is on
        **{k: v for t in T.TECHNIQUES if t.memory and t.value(cfg) != t.off for k, v in t.memory(cfg).items()},
    }
    cands: dict[str, dict[str, tuple[str, int]]] = {}
    for moment, terms in loss_terms(cfg).items():
        cands[moment] = {**static, "activations, all the forward kept": ("activations", act["total"]), **terms}

    s, b = cfg.context, cfg.micro_batch_size
    still = s * 8 + (s * b * h * _mask_bytes(cfg) if m.dropout > 0 else 0)  # what the embedding's backward needs
    for moment, terms in block_backward_terms(cfg).items():
        cands[f"last block's backward: {moment}"] = {
            **static,
            f"the other {L - 1} blocks' kept activations": ("activations", (L - 1) * act["kept per layer"]),
            "position ids (and embedding dropout mask)": ("activations", still),
            "output layer's weight gradient, waiting for the embedding's (V h fp32)": ("other", V * h * 4),
            **terms,
        }

    cands["end of backward"] = {
        **static,
        "gradients": ("gradients", st["gradients"]),
        "tied embedding's gradients, summed into .grad": ("other", (2 if grads_before == 0 else 3) * V * h * 4),
    }
    return cands


# ---- the peak of a step, and "will it fit?" --------------------------------------------------------


@dataclass
class Estimate:
    """Predicted peak of a training step, by category, in bytes."""

    by_category: dict[str, int]
    peak_bytes: int
    when: str  # where in the step the peak falls
    phases: dict[str, int]  # the candidates for the peak
    terms: dict[str, int]  # the peak, term by term

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GiB

    def verdict(self, device_gib: float, margin: float = 0.1) -> str:
        """ "fits", "tight" (inside the margin kept for the CUDA context and fragmentation) or "does not fit"."""
        ask = "give the device's memory as a positive number of GiB, e.g. 80"
        if isinstance(device_gib, bool) or not isinstance(device_gib, (int, float)) or not 0 < device_gib < math.inf:
            raise ConfigError(f"device_gib={device_gib!r}: {ask}")
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            raise ConfigError(f"margin={margin!r}: give the share kept free as a number in [0, 1), e.g. 0.1")
        if self.peak_gib <= device_gib * (1 - margin):
            return "fits"
        return "tight" if self.peak_gib <= device_gib else "does not fit"


def estimate(cfg: TrainConfig) -> Estimate:
    """The steady-state peak of one optimizer step (the optimizer state exists): the largest of peak_candidates."""
    cands = peak_candidates(cfg)
    phases = {name: sum(nbytes for _, nbytes in terms.values()) for name, terms in cands.items()}
    when = max(phases, key=phases.get)
    by = dict.fromkeys(CATEGORIES, 0)
    for category, nbytes in cands[when].values():
        by[category] += nbytes
    terms = {name: nbytes for name, (_, nbytes) in cands[when].items()}
    return Estimate(by, phases[when], when, phases, terms)


def will_it_fit(cfg: TrainConfig, device_gib: float, margin: float = 0.1) -> tuple[Estimate, str]:
    """The predicted peak and its verdict on `device_gib` GiB, `margin` kept for the CUDA context and fragmentation."""
    est = estimate(cfg)
    return est, est.verdict(device_gib, margin)


def max_batch_that_fits(cfg: TrainConfig, device_gib: float, margin: float = 0.1, limit: int = 4096) -> int:
    """The largest batch_size (no accumulation) that fits, by bisection: 0 if none, a ConfigError if `limit` fits."""

    def fits(bs: int) -> bool:
        return will_it_fit(dataclasses.replace(cfg, batch_size=bs, grad_accum_steps=1), device_gib, margin)[1] == "fits"

    if not fits(1):
        return 0
    if fits(limit):
        more = "the search stops there; pass a larger limit to look further"
        raise ConfigError(f"every batch up to limit={limit} fits in {device_gib:g} GiB: {more}")
    lo, hi = 1, limit  # fits(lo), not fits(hi): the peak grows with the batch
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
