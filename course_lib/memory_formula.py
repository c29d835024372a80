"""The analytic memory model of a training step: the formulas, with no run of the loop (course_lib.train builds on
them to refuse, on a CPU, a step that cannot fit; course_lib.memory_estimate sets them beside measurements).

Where the bytes of one training step go, by category (the same categories as measure.MemoryLedger):

- static: parameters, gradients and optimizer state, num_params x bytes x count;
- activations: what autograd keeps from the forward pass for the backward pass. Korthikanti et al.,
  "Reducing Activation Recomputation in Large Transformer Models" (2022), count sbh(34 + 5as/h) bytes per
  transformer layer with 16-bit values and 1-byte dropout masks; `layer_activation_terms` itemises what
  this course's own GPT block saves, term by term, so the two can be set side by side;
- logits: the (tokens x vocab) output layer and cross-entropy, which the paper's formula leaves out and which
  dominate small models;
- and the peak of a step, estimated from these: the largest of the moments that can hold it (`peak_candidates`:
  the loss in forward and in backward, the last block's backward, the end of backward), each term by term, for every
  lever the ledger measures (precision, attention, checkpointing none/selective/full, loss chunks, set_to_none,
  accumulation, optimizer, vocabulary padding); tests/test_memory_estimate.py holds it to the ledger, lever by
  lever. With a verdict for a device ("will it fit?").
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from . import techniques as T
from .config import PRECISION_DTYPES, ConfigError, ModelConfig, TrainConfig
from .measure import CATEGORIES, GiB
from .techniques.activation_checkpointing import kept_per_layer, selective_activation_terms
from .techniques.chunked_loss import memory_terms as chunked_loss_terms
from .techniques.fused_attention import what_attention_keeps as _attention
from .techniques.mixed_precision import activation_format as _precision
from .techniques.optimizer import state_bytes as optimizer_state_bytes
from .techniques.set_to_none import gradients_before_backward

# Bytes per value of each precision (tf32 is stored as fp32; it only changes how matmuls multiply).
BYTES = {p: dtype.itemsize for p, dtype in PRECISION_DTYPES.items()}  # bytes per value
GB = 10**9  # decimal gigabyte, as papers and blog posts often quote


# ---- counting parameters -------------------------------------------------------------------------


def count_params(m: ModelConfig) -> int:
    """Parameters of the course's GPT from its shape (the tied embedding once).

    V h (token table, also the output layer) + block_size h (positions)
    + L (12 h^2 + 13 h) (per block: QKV 3h^2+3h, projection h^2+h, MLP 8h^2+5h, two LayerNorms 4h)
    + 2 h (final LayerNorm); without biases, the biases' terms go.
    """
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
    """Bytes of parameters, gradients and optimizer state: num_params x bytes x count.

    count is 1 for parameters, 1 for gradients, and the optimizer's state is its own term
    (techniques.optimizer.state_bytes: AdamW's two moments, and its per-tensor step counters when n_param_tensors
    is given).
    """
    return {
        "parameters": n_params * bytes_per_value,
        "gradients": n_params * bytes_per_value,
        "optimizer state": optimizer_state_bytes(optimizer, n_params, n_param_tensors, bytes_per_value),
    }


# ---- activations ---------------------------------------------------------------------------------


def korthikanti_terms(s: int, b: int, h: int, a: int) -> dict[str, int]:
    """Bytes per transformer layer, term by term, as Korthikanti et al. count them: 16-bit values (2 bytes),
    1-byte dropout masks, no sequence or tensor parallelism. They sum to sbh(34 + 5as/h)."""
    sbh, as2b = s * b * h, a * s * s * b
    return {
        "LayerNorm inputs (2 x 2sbh)": 4 * sbh,
        "QKV matmul input (2sbh)": 2 * sbh,
        "Q and K for QK^T (4sbh)": 4 * sbh,
        "softmax output (2as^2b)": 2 * as2b,
        "attention dropout mask (as^2b)": as2b,
        "attention dropout output (2as^2b)": 2 * as2b,
        "V (2sbh)": 2 * sbh,
        "output projection input (2sbh)": 2 * sbh,
        "attention residual dropout mask (sbh)": sbh,
        "MLP first matmul input (2sbh)": 2 * sbh,
        "GELU input (8sbh)": 8 * sbh,
        "MLP second matmul input (8sbh)": 8 * sbh,
        "MLP dropout mask (sbh)": sbh,
    }


def korthikanti_bytes(s: int, b: int, h: int, a: int, bits: int = 16, flash: bool = False) -> int:
    """sbh(34 + 5as/h) bytes per layer at 16 bits; twice that, 2sbh(34 + 5as/h), at 32 bits.
    flash=True: an attention kernel that never stores the s x s matrices drops the 5as/h term."""
    if bits not in (16, 32):
        raise ValueError("bits must be 16 or 32")
    sbh = s * b * h
    total = 34 * sbh + (0 if flash else 5 * a * s * s * b)  # = sbh(34 + 5as/h), in integers
    return total * (bits // 16)


def layer_activation_terms(
    s: int,
    b: int,
    h: int,
    a: int,
    value_bytes: int = 4,
    attention: str = "naive",
    dropout: bool = False,
    norm_bytes: int | None = None,
    mask_bytes: int = 1,
) -> dict[str, int]:
    """Bytes one block of the course's GPT (course_lib.model.Block) keeps for backward, term by term.

    Sixteen sbh-sized values, as in the paper: two LayerNorm inputs, the QKV input, Q, K and V, the attention
    output, the MLP input, GELU's input and the second matmul's input (4h wide each). Differences from the paper:
    no dropout masks when dropout is 0 (PyTorch saves a 1-byte bool mask when it is on); LayerNorm also keeps a
    mean and 1/std per token (fp32); naive attention keeps the softmax output (a s^2 b values) and its s x s bool
    causal mask; SDPA keeps neither, only a logsumexp per query (b a s fp32). norm_bytes: bytes of the LayerNorm
    inputs (fp32 under autocast; defaults to value_bytes). mask_bytes: bytes per dropout-mask value: 1 on CUDA
    (a bool mask, as in the paper), but PyTorch's CPU dropout keeps its mask in the values' dtype (use value_bytes).
    """
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
    """Under autocast a matmul multiplies 16-bit copies of its fp32 weight and bias, and keeps them for backward:
    one block's four Linear layers have 12h^2 weights and 9h biases, 2 bytes each. (The fp32 weights themselves are
    the parameters.)"""
    h = m.n_embd
    return 2 * (12 * h * h + (9 * h if m.bias else 0))


def outside_activation_terms(
    s: int,
    b: int,
    h: int,
    value_bytes: int = 4,
    dropout: bool = False,
    mask_bytes: int = 1,
    output_input_bytes: int | None = None,
) -> dict[str, int]:
    """What the model keeps outside its blocks: position ids, the final LayerNorm's input and statistics, and the
    output layer's input. (The token ids are the batch itself: they exist before the forward pass.)
    output_input_bytes: bytes per value of the output layer's input (default value_bytes); 0 where the output layer
    keeps a copy of its own instead (under autocast: a 16-bit copy made inside it, counted with the logits)."""
    sbh = s * b * h
    out_bytes = value_bytes if output_input_bytes is None else output_input_bytes
    terms = {
        "position ids (int64)": s * 8,
        "final LayerNorm input (sbh)": sbh * value_bytes,
        "final LayerNorm mean and 1/std": 2 * b * s * 4,
    }
    if out_bytes:
        terms["output layer input (sbh)"] = sbh * out_bytes
    if dropout:
        terms["embedding dropout mask (sbh)"] = sbh * mask_bytes
    return terms


def logits_terms(b: int, s: int, vocab: int) -> dict[str, int]:
    """The output layer and the loss (F.cross_entropy = log_softmax + nll_loss), which the paper leaves out.
    Cross-entropy runs in fp32 (also under autocast). At the start of backward three (tokens x vocab) fp32 tensors
    are alive: the saved log-softmax, the gradient arriving at it, and the gradient of the logits.
    (With the chunked loss the tokens are one chunk's: see loss_terms.)"""
    tv = b * s * vocab * 4
    return {
        "log-softmax output, saved (b s V fp32)": tv,
        "gradient of the log-softmax (b s V fp32)": tv,
        "gradient of the logits (b s V fp32)": tv,
    }


def _mask_bytes(cfg: TrainConfig) -> int:
    """Bytes per dropout-mask value: 1 on CUDA (a bool mask), the values' dtype on a CPU (PyTorch's CPU dropout)."""
    return _precision(cfg)[1] if torch.device(cfg.device).type == "cpu" else 1


def activation_bytes(cfg: TrainConfig) -> dict[str, int]:
    """Activations of the whole model for one micro-batch: what one block saves for backward ("per layer"), what it
    keeps through the forward pass ("kept per layer": all of it without checkpointing, its input with full
    checkpointing, its input and matmul outputs with selective), all layers, outside the layers, total; and
    "recompute": what one block's backward recomputes (0 without checkpointing)."""
    m = cfg.model
    s, b, h, a = cfg.context, cfg.micro_batch_size, m.n_embd, m.n_head
    autocast, vb = _precision(cfg)
    mask = _mask_bytes(cfg)
    attention, causal_mask = _attention(cfg)
    # LayerNorm runs in fp32 under autocast, and the residual stream stays fp32 (fp32 + 16-bit adds to fp32)
    terms = layer_activation_terms(
        s, b, h, a, vb, attention, m.dropout > 0, norm_bytes=4 if autocast else None, mask_bytes=mask
    )
    layer = sum(terms.values()) - (0 if causal_mask else terms.get("causal mask (s x s bool)", 0))
    if autocast:  # the 16-bit copies of the block's weights, which its matmuls keep
        layer += weight_copy_bytes(m)
    # The output layer's input: the final LayerNorm's output (fp32), kept by the output layer's matmul. Under autocast
    # that keeps only its 16-bit copy (a logit term); the chunked loss keeps none (it makes its gradients in forward).
    out_input = 4 if (not autocast and cfg.loss_chunks == 1) else 0
    outside = sum(
        outside_activation_terms(
            s, b, h, 4 if autocast else vb, m.dropout > 0, mask_bytes=mask, output_input_bytes=out_input
        ).values()
    )
    # the block's input, the residual stream, is fp32 under autocast too
    kept, recompute = kept_per_layer(cfg.activation_checkpointing, layer, s, b, h, a, vb, attention, residual_bytes=4)
    return {
        "per layer": layer,
        "kept per layer": kept,
        "layers": m.n_layer * kept,
        "outside layers": outside,
        "total": m.n_layer * kept + outside,
        "recompute": recompute,
    }


def _block_sizes(cfg: TrainConfig):
    """A block's sizes for its backward's terms: (s, b, h, a; X an sbh tensor's, S2 an a s^2 b tensor's values, T the
    tokens; B bytes per activation value, whether under autocast; the bytes of the QKV matmul's 16-bit weight copy)."""
    m = cfg.model
    s, b, h, a = cfg.context, cfg.micro_batch_size, m.n_embd, m.n_head
    autocast, B = _precision(cfg)
    qkv_copy = (3 * h * h + (3 * h if m.bias else 0)) * 2 if autocast else 0
    return s, b, h, a, s * b * h, a * s * s * b, s * b, B, autocast, qkv_copy


# the residual stream (block input) and LayerNorm inputs: fp32 under autocast too
R = 4


def block_backward_terms(cfg: TrainConfig) -> dict[str, dict[str, tuple[str, int]]]:
    """What the last block holds at the worst moments of its backward, term by term, as {moment: {term: (ledger
    category, bytes)}}: the last block's own tensors and the gradients in flight. (The other blocks, the static memory
    and the tied embedding's gradient are added by peak_candidates.) The last block is the worst: its backward comes
    first, while every other block still holds what it kept.

    - "MLP backward": the first matmul of the block's backward. All the block's saved tensors are alive (recomputed
      first under checkpointing), with the gradient of the block's output and the gradient of the GELU output (4 sbh).
    - "attention backward" (naive attention): softmax's backward. The MLP's tensors are gone, but three a s^2 b
      tensors are alive: the saved probabilities, their gradient and the gradient of the scores. (SDPA's backward
      holds 4 sbh of gradients where the MLP's backward has already freed 10: never the worst.)
    - "attention recompute" (naive attention, checkpointing): the recompute of the forward holds both the scores and
      the probabilities (the scores are still a local variable of naive_attention when softmax x V runs).
    """
    points = {"MLP backward": _mlp_backward(cfg)}
    if _attention(cfg)[0] != "naive":
        return points
    points["attention backward"] = _attention_backward(cfg)
    if cfg.activation_checkpointing != "none":
        points["attention recompute"] = _attention_recompute(cfg)
    return points


def _mlp_backward(cfg: TrainConfig) -> dict[str, tuple[str, int]]:
    """block_backward_terms' "MLP backward"."""
    s, b, h, a, X, S2, T, B, autocast, qkv_copy = _block_sizes(cfg)
    ck, attention = cfg.activation_checkpointing, _attention(cfg)[0]
    # Everything the block saves for backward (its weights' 16-bit copies included). Without checkpointing these are the
    # forward's ("activations" for the ledger); with it they are recomputed in backward ("other"), but for what the
    # block kept through the forward ("activations").
    saved = activation_bytes(cfg)["per layer"]
    mlp: dict[str, tuple[str, int]] = {}
    if ck == "full":
        mlp["block input, kept"] = ("activations", X * R)
        mlp["the block's saved tensors, recomputed"] = ("other", saved - X * R)
    elif ck == "selective":
        # still cached from the forward: the block input, the MLP's first matmul output (= GELU's saved input) and, with
        # SDPA, the QKV output and attention output (= what SDPA saves); the recompute stops before the MLP's second
        # matmul runs, so its cached output is never taken and stays too
        kept = selective_activation_terms(s, b, h, a, B, attention, residual_bytes=R)
        sdpa_kept = ("QKV matmul output (3 x sbh)", "attention output (sbh)", "softmax logsumexp (b a s, fp32)")
        cached = sum(
            kept[t]
            for t in ("block input (sbh)", "MLP first matmul output (4 x sbh)", *sdpa_kept)
            if t in kept and (attention == "sdpa" or t not in sdpa_kept)
        )
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
    """block_backward_terms' "attention backward" (naive attention)."""
    s, b, h, a, X, S2, T, B, autocast, qkv_copy = _block_sizes(cfg)
    m, ck, causal_mask = cfg.model, cfg.activation_checkpointing, _attention(cfg)[1]
    fresh_grads = not gradients_before_backward(cfg)
    # naive attention: what is left of the block at softmax's backward
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
        # the MLP's and the projection's weights (9h^2) and biases (6h), two LayerNorms (2h each)
        nb = 1 if m.bias else 0
        att["gradients made so far (MLP, projection, LayerNorms)"] = (
            "gradients",
            4 * (9 * h * h + 6 * h * nb + 2 * h * (1 + nb)),
        )
    return att


def _attention_recompute(cfg: TrainConfig) -> dict[str, tuple[str, int]]:
    """block_backward_terms' "attention recompute" (naive attention, checkpointing)."""
    s, b, h, a, X, S2, T, B, autocast, qkv_copy = _block_sizes(cfg)
    ck, attention = cfg.activation_checkpointing, _attention(cfg)[0]
    # checkpointing, naive attention: the recompute at softmax x V
    rec: dict[str, tuple[str, int]] = {}
    if ck == "selective":  # cached: the block input and every matmul output not yet taken by the recompute
        kept = selective_activation_terms(s, b, h, a, B, attention, residual_bytes=R)
        rec["kept by selective checkpointing, still cached"] = (
            "activations",
            sum(kept.values()) - kept["QK^T matmul output (a s^2 b)"],  # the scores, which the recompute has taken
        )
    else:
        rec["block input, kept"] = ("activations", X * R)
        rec["QKV matmul output, recomputed (3 sbh)"] = ("other", 3 * X * B)  # alive while q, k, v are local variables
    # LayerNorm's output is still the attention's argument (a local variable); under autocast it is fp32 and the QKV
    # matmul keeps a 16-bit copy
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
    """The output layer and the loss at their worst moments, as {moment: {term: (category, bytes)}}.

    loss_chunks=1. In forward, the loss: the logits and the saved log-softmax; under autocast also the 16-bit logits
    (their fp32 copy is what the loss reads), the output layer's 16-bit copies of its input and weight, and autocast's
    cache of the blocks' 16-bit weights, which lives until the forward ends even where checkpointing keeps none of them.
    In backward, "start of backward", the log-softmax backward: three (tokens x V) fp32 tensors (logits_terms), and
    under autocast the output layer's 16-bit copies of its input and weight.

    loss_chunks=k (techniques.HeadLossInSlices): in forward, slices of c = ceil(tokens / k) tokens one at a time, each
    slice's gradients made at once. From the first slice on, the whole input gradient (tokens x h) and weight gradient
    (V x h) exist, kept for backward (made in the forward pass: "activations" to the ledger), beside the output layer's
    input, the final LayerNorm's output (tokens x h fp32, not kept after the forward). The worst moment of a slice is
    its share of the weight gradient: the slice's logits (in fp32 turned into softmax - onehot in place; under autocast
    the 16-bit logits, an fp32 copy turned into softmax - onehot, and that in 16 bits) and the (V x h) product being
    added. In backward, "start of backward": the two kept gradients and the two
    scaled by the loss's gradient.
    """
    m = cfg.model
    T, h, V, k = cfg.micro_batch_size * cfg.context, m.n_embd, m.padded_vocab_size, cfg.loss_chunks
    autocast, B = _precision(cfg)

    fwd: dict[str, tuple[str, int]] = {}
    # without checkpointing the blocks keep these copies: activations
    if autocast and cfg.activation_checkpointing != "none":
        fwd["autocast's cache of the blocks' 16-bit weights"] = ("activations", m.n_layer * weight_copy_bytes(m))
    if k == 1:
        if autocast:
            fwd["16-bit copy of the output layer's input (T h)"] = ("logits", T * h * 2)
            fwd["16-bit copy of the output layer's weight (V h)"] = ("logits", V * h * 2)
            fwd["16-bit logits (T V)"] = ("logits", T * V * 2)
        # the output layer's, or under autocast the loss's fp32 copy
        fwd["logits in fp32 (T V)"] = ("logits", T * V * 4)
        fwd["log-softmax output (T V fp32)"] = ("logits", T * V * 4)
        terms: dict[str, tuple[str, int]] = {}
        if autocast:  # the output layer's matmul keeps the 16-bit copies it multiplied
            terms["16-bit copy of the output layer's input (b s h)"] = ("logits", T * h * 2)
            terms["16-bit copy of the output layer's weight (V h)"] = ("logits", V * h * 2)
        lt = logits_terms(cfg.micro_batch_size, cfg.context, V)
        for i, (name, nbytes) in enumerate(lt.items()):
            # the saved output is made in the loss, its gradients in backward
            terms[name] = ("logits" if i == 0 else "other", nbytes)
        return {"forward: the loss": fwd, "start of backward": terms}

    slice_fwd, back = chunked_loss_terms(T, h, V, k, autocast)
    fwd.update(slice_fwd)
    return {"forward: a loss slice": fwd, "start of backward": back}


def peak_candidates(cfg: TrainConfig) -> dict[str, dict[str, tuple[str, int]]]:
    """Every moment of a steady-state step that can hold its peak, each as {term: (ledger category, bytes)}.

    - the output layer and the loss, in forward and in backward (loss_terms), with all the forward's activations;
    - the last block's backward (block_backward_terms), with the other blocks' kept activations, the position ids
      and the tied embedding's gradient from the output layer, which waits for the embedding's (V x h fp32);
    - the end of backward: parameters + gradients + state + the tied embedding's gradient temporaries: the output
      layer and the embedding each produce a (V x h) gradient, which are summed into .grad: three V x h fp32 tensors
      when .grad already exists (set_to_none=False), two when it is None. (AdamW's own temporaries, one or two
      tensors the size of a parameter, are smaller.)
    Gradients exist before backward unless zero_grad(set_to_none=True) freed them and this is the first micro-batch;
    with accumulation the last micro-batch is the worst. Autocast keeps the parameters, gradients and state in fp32.
    """
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

    emb_grad = V * h * 4
    cands["end of backward"] = {
        **static,
        "gradients": ("gradients", st["gradients"]),
        "tied embedding's gradients, summed into .grad": ("other", (2 if grads_before == 0 else 3) * emb_grad),
    }
    return cands


# ---- the peak of a step, and "will it fit?" --------------------------------------------------------


@dataclass
class Estimate:
    """Predicted peak of a training step, by category, in bytes."""

    by_category: dict[str, int]
    peak_bytes: int
    when: str  # where in the step the peak falls
    phases: dict[str, int] = field(default_factory=dict)  # the candidates for the peak
    notes: list[str] = field(default_factory=list)
    terms: dict[str, int] = field(default_factory=dict)  # the peak, term by term

    def gib(self) -> dict[str, float]:
        return {k: v / GiB for k, v in self.by_category.items()}

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GiB

    def verdict(self, device_gib: float, margin: float = 0.1) -> str:
        """ "fits", "tight" (within the margin kept for the CUDA context and fragmentation) or "does not fit"; a
        ConfigError for a device size or margin that is not one (check_device_gib)."""
        check_device_gib(device_gib, margin)
        if self.peak_gib <= device_gib * (1 - margin):
            return "fits"
        if self.peak_gib <= device_gib:
            return "tight"
        return "does not fit"


def estimate(cfg: TrainConfig) -> Estimate:
    """Predict the steady-state peak of one optimizer step of `cfg` (a later step: the optimizer state exists).

    The largest of peak_candidates wins. Every lever the ledger measures moves a term: precision (16-bit activations
    and weight copies under autocast, fp32 LayerNorm inputs and logits), attention (the a s^2 b terms of naive
    attention), activation checkpointing (what each block keeps, and the recompute of one block in backward),
    loss_chunks (one chunk of logits at a time), set_to_none and accumulation (whether gradients exist before backward),
    the micro-batch size, the optimizer (its state) and vocabulary padding (V is the padded vocabulary).
    """
    cands = peak_candidates(cfg)
    phases = {name: sum(nbytes for _, nbytes in terms.values()) for name, terms in cands.items()}
    when = max(phases, key=phases.get)
    by = dict.fromkeys(CATEGORIES, 0)
    for category, nbytes in cands[when].values():
        by[category] += nbytes
    notes = ["activations and logits are for one micro-batch of %d sequences" % cfg.micro_batch_size]
    if cfg.model.dropout > 0:
        notes.append("with dropout the gradients in flight inside a block's backward are approximate")
    return Estimate(
        by_category=by,
        peak_bytes=phases[when],
        when=when,
        phases=phases,
        notes=notes,
        terms={name: nbytes for name, (_, nbytes) in cands[when].items()},
    )


def will_it_fit(cfg: TrainConfig, device_gib: float, margin: float = 0.1) -> tuple[Estimate, str]:
    """The calculator: a config and a device's memory in GiB in; the predicted peak by category and a verdict out.
    Not included: the CUDA context (a few hundred MiB), the caching allocator's fragmentation, library workspaces;
    the margin is kept for them."""
    est = estimate(cfg)
    return est, est.verdict(device_gib, margin)


def check_device_gib(device_gib, margin: float = 0.1) -> None:
    """A ConfigError unless `device_gib` is a positive number of GiB and `margin` a fraction in [0, 1)."""
    if isinstance(device_gib, bool) or not isinstance(device_gib, (int, float)) or not 0 < device_gib < math.inf:
        raise ConfigError(f"device_gib={device_gib!r}: give the device's memory as a positive number of GiB, e.g. 80")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise ConfigError(f"margin={margin!r}: give the share kept free as a number in [0, 1), e.g. 0.1")


def calculator_config(
    preset: str = "gpt2-small", batch_size: int = 32, context: int = 1024, attention: str = "naive", **changes
) -> TrainConfig:
    """The calculator's config (notebook 02): a preset's network at any batch and context (its position table grown to
    the context where needed), with its attention and any TrainConfig fields changed (precision, optimizer,
    activation_checkpointing, loss_chunks, set_to_none...). On the CPU: the formula and FakeTensorMode need no GPU."""
    from .config import preset as make_preset

    cfg = make_preset(preset, "cpu")
    cfg = cfg.with_model(attention=attention, block_size=max(cfg.model.block_size, context))
    return dataclasses.replace(cfg, batch_size=batch_size, context=context, **changes)


def max_batch_that_fits(cfg: TrainConfig, device_gib: float, margin: float = 0.1, limit: int = 4096) -> int:
    """The largest batch_size (no accumulation) whose predicted peak fits; 0 when even batch 1 does not. The search goes
    up to `limit`: when that fits too, a ConfigError says so (the answer is "more than limit", not limit). A device
    size or margin that is not one is refused by the first verdict (Estimate.verdict)."""

    def fits(bs: int) -> bool:
        return (
            estimate(dataclasses.replace(cfg, batch_size=bs, grad_accum_steps=1)).verdict(device_gib, margin) == "fits"
        )

    if not fits(1):
        return 0
    if fits(limit):
        raise ConfigError(
            f"every batch up to limit={limit} fits in {device_gib:g} GiB: the search stops there; pass a larger "
            "limit to look further"
        )
    lo, hi = 1, limit  # fits(lo), not fits(hi): the peak grows with the batch
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
