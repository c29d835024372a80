"""The analytic memory model of a training step, and accounting for models too big to run.

Where the bytes of one training step go, by category (the same categories as measure.MemoryLedger):

- static: parameters, gradients and optimizer state, num_params x bytes x count;
- activations: what autograd keeps from the forward pass for the backward pass. Korthikanti et al.,
  "Reducing Activation Recomputation in Large Transformer Models" (2022), count sbh(34 + 5as/h) bytes per
  transformer layer with 16-bit values and 1-byte dropout masks; `layer_activation_terms` itemises what
  this course's own GPT block saves, term by term, so the two can be set side by side;
- logits: the (tokens x vocab) output layer and cross-entropy, which the paper's formula leaves out and which
  dominate small models;
- and the peak of a step, estimated from these, with a verdict for a device ("will it fit?").

`account_step` runs one training step of a config under the CPU ledger, optionally under FakeTensorMode, so
that a model too big for this machine (GPT-2 small at batch 32, context 1024) is accounted without allocating.
It is one step for accounting only (no data, no timing, no results): the training loop is course_lib.train.
Sharding the static memory across GPUs (ZeRO) is notebook 07's calculator (course_lib.distributed.zero).
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field

import torch

from . import measure, techniques
from .config import ModelConfig, TrainConfig
from .measure import CATEGORIES, GiB, MemoryReport

# Bytes per value of each precision (tf32 is stored as fp32; it only changes how matmuls multiply).
BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}
# Optimizer states per parameter: SGD keeps none, momentum one buffer, Adam/AdamW two moments (m and v).
OPTIMIZER_STATES = {"sgd": 0, "sgd_momentum": 1, "adamw": 2}
# PyTorch's Adam/AdamW also keep a `step` counter per parameter tensor: a 4-byte fp32 scalar tensor.
STEP_COUNTER_BYTES = {"sgd": 0, "sgd_momentum": 0, "adamw": 4}
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


def static_bytes(n_params: int, optimizer: str = "adamw", bytes_per_value: int = 4, n_param_tensors: int = 0) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state: num_params x bytes x count.

    count is 1 for parameters, 1 for gradients and OPTIMIZER_STATES[optimizer] for the state; AdamW's per-tensor
    step counters add 4 bytes per parameter tensor (pass n_param_tensors to include them).
    """
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer={optimizer!r} is not one of {', '.join(OPTIMIZER_STATES)}")
    n_states = OPTIMIZER_STATES[optimizer]
    return {"parameters": n_params * bytes_per_value,
            "gradients": n_params * bytes_per_value,
            "optimizer state": n_states * n_params * bytes_per_value + STEP_COUNTER_BYTES[optimizer] * n_param_tensors}


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


def layer_activation_terms(s: int, b: int, h: int, a: int, value_bytes: int = 4, attention: str = "naive",
                           dropout: bool = False, norm_bytes: int | None = None, mask_bytes: int = 1) -> dict[str, int]:
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


def outside_activation_terms(s: int, b: int, h: int, value_bytes: int = 4, dropout: bool = False, mask_bytes: int = 1) -> dict[str, int]:
    """What the model keeps outside its blocks: position ids, the final LayerNorm's input and statistics, and the
    output layer's input. (The token ids are the batch itself: they exist before the forward pass.)"""
    sbh = s * b * h
    terms = {"position ids (int64)": s * 8, "final LayerNorm input (sbh)": sbh * value_bytes,
             "final LayerNorm mean and 1/std": 2 * b * s * 4, "output layer input (sbh)": sbh * value_bytes}
    if dropout:
        terms["embedding dropout mask (sbh)"] = sbh * mask_bytes
    return terms


def logits_terms(b: int, s: int, vocab: int) -> dict[str, int]:
    """The output layer and the loss (F.cross_entropy = log_softmax + nll_loss), which the paper leaves out.
    Cross-entropy runs in fp32 (also under autocast). At the start of backward three (tokens x vocab) fp32 tensors
    are alive: the saved log-softmax, the gradient arriving at it, and the gradient of the logits."""
    tv = b * s * vocab * 4
    return {"log-softmax output, saved (b s V fp32)": tv, "gradient of the log-softmax (b s V fp32)": tv,
            "gradient of the logits (b s V fp32)": tv}


def activation_bytes(cfg: TrainConfig) -> dict[str, int]:
    """Activations of the whole model for one micro-batch: per layer, all layers, outside the layers, total.
    With activation checkpointing each block keeps only its input (sbh) in forward; one block's activations
    come back, recomputed, during its backward ("recompute")."""
    m = cfg.model
    s, b, h, a = cfg.context, cfg.micro_batch_size, m.n_embd, m.n_head
    autocast = cfg.precision in ("bf16", "fp16")
    vb = BYTES[cfg.precision]
    mask = vb if torch.device(cfg.device).type == "cpu" else 1  # CPU dropout keeps a mask in the values' dtype
    layer = sum(layer_activation_terms(s, b, h, a, vb, m.attention, m.dropout > 0, norm_bytes=4 if autocast else None, mask_bytes=mask).values())
    outside = sum(outside_activation_terms(s, b, h, 4 if autocast else vb, m.dropout > 0, mask_bytes=mask).values())
    if autocast:  # 16-bit copies of the matmul weights, saved for backward
        outside += 2 * (count_params(m) - m.block_size * h)
    if cfg.activation_checkpointing == "full":
        kept = m.n_layer * s * b * h * (4 if autocast else vb)
        return {"per layer": layer, "layers": kept, "outside layers": outside, "total": kept + outside, "recompute": layer}
    return {"per layer": layer, "layers": m.n_layer * layer, "outside layers": outside, "total": m.n_layer * layer + outside, "recompute": 0}


# ---- the peak of a step, and "will it fit?" --------------------------------------------------------

@dataclass
class Estimate:
    """Predicted peak of a training step, by category, in bytes."""

    by_category: dict[str, int]
    peak_bytes: int
    when: str  # where in the step the peak falls
    phases: dict[str, int] = field(default_factory=dict)  # the candidates for the peak
    notes: list[str] = field(default_factory=list)

    def gib(self) -> dict[str, float]:
        return {k: v / GiB for k, v in self.by_category.items()}

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GiB

    def verdict(self, device_gib: float, margin: float = 0.1) -> str:
        """"fits", "tight" (within the margin kept for the CUDA context and fragmentation) or "does not fit"."""
        if self.peak_gib <= device_gib * (1 - margin):
            return "fits"
        if self.peak_gib <= device_gib:
            return "tight"
        return "does not fit"


def estimate(cfg: TrainConfig) -> Estimate:
    """Predict the steady-state peak of one optimizer step of `cfg` (a later step: the optimizer state exists).

    Candidates for the peak, the largest wins:
      start of backward: static (gradients only if zero_grad keeps them) + all activations + the logits terms;
      recompute (activation checkpointing): static + kept block inputs + one block recomputed;
      end of backward: parameters + gradients + state + the tied embedding's gradient temporaries: the output layer
        and the embedding each produce a (V x h) gradient, which are summed into .grad: three V x h fp32 tensors
        when .grad already exists (set_to_none=False), two when it is None. (AdamW's own temporaries, one or two
        tensors the size of a parameter, are smaller.)
    """
    m = cfg.model
    n = count_params(m)
    st = static_bytes(n, cfg.optimizer, 4, count_param_tensors(m))  # autocast keeps fp32 weights
    act = activation_bytes(cfg)
    lg = sum(logits_terms(cfg.micro_batch_size, cfg.context, m.padded_vocab_size).values())
    saved_logits = logits_terms(cfg.micro_batch_size, cfg.context, m.padded_vocab_size)
    grads_before = 0 if (cfg.set_to_none and cfg.grad_accum_steps == 1) else st["gradients"]
    emb_grad = m.padded_vocab_size * m.n_embd * 4
    tied = (2 if grads_before == 0 else 3) * emb_grad
    phases = {
        "start of backward": st["parameters"] + grads_before + st["optimizer state"] + act["total"] + lg,
        "end of backward": st["parameters"] + st["gradients"] + st["optimizer state"] + tied,
    }
    if cfg.activation_checkpointing == "full":
        phases["recompute in backward"] = st["parameters"] + st["gradients"] + st["optimizer state"] + act["total"] + act["recompute"]
    when = max(phases, key=phases.get)
    by = dict.fromkeys(CATEGORIES, 0)
    by["parameters"], by["optimizer state"] = st["parameters"], st["optimizer state"]
    if when == "start of backward":
        by["gradients"] = grads_before
        by["activations"] = act["total"]
        first = next(iter(saved_logits))
        by["logits"] = saved_logits[first]
        by["other"] = lg - saved_logits[first]
    elif when == "recompute in backward":
        by["gradients"] = st["gradients"]
        by["activations"] = act["total"] + act["recompute"]
    else:
        by["gradients"] = st["gradients"]
        by["other"] = tied
    notes = ["activations and logits are for one micro-batch of %d sequences" % cfg.micro_batch_size]
    if cfg.precision in ("bf16", "fp16"):
        notes.append("16-bit activations are approximate here (notebook 03 measures them); weights stay fp32 under autocast")
    return Estimate(by_category=by, peak_bytes=phases[when], when=when, phases=phases, notes=notes)


def will_it_fit(cfg: TrainConfig, device_gib: float, margin: float = 0.1) -> tuple[Estimate, str]:
    """The calculator: a config and a device's memory in GiB in; the predicted peak by category and a verdict out.
    Not included: the CUDA context (a few hundred MiB), the caching allocator's fragmentation, library workspaces;
    the margin is kept for them."""
    est = estimate(cfg)
    return est, est.verdict(device_gib, margin)


def max_batch_that_fits(cfg: TrainConfig, device_gib: float, margin: float = 0.1, limit: int = 4096) -> int:
    """The largest batch_size (no accumulation) whose predicted peak fits; 0 when even batch 1 does not."""
    best = 0
    for bs in range(1, limit + 1):
        if estimate(dataclasses.replace(cfg, batch_size=bs, grad_accum_steps=1)).verdict(device_gib, margin) != "fits":
            break
        best = bs
    return best


# ---- accounting one step with the ledger, optionally without allocating ----------------------------

def account_step(cfg: TrainConfig, fake: bool = True, warm_steps: int = 1) -> MemoryReport:
    """The memory of one training step of `cfg`, by the CPU ledger, with a per-op timeline of live bytes.

    fake=True runs under FakeTensorMode: every tensor has its shape, dtype and size but no memory, so GPT-2 small at
    batch 32, context 1024 is accounted on a laptop in seconds. warm_steps steps run first (unwatched) so that the
    optimizer state exists, as in a steady-state step. One step for accounting, not a training loop: random token
    ids, no timing, no loss values; the techniques come from techniques.build as in course_lib.train.
    Activation checkpointing, chunked loss and autocast are followed; compile is not (the ledger needs eager ops).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .model import GPT
    from .train import run_step

    cfg = dataclasses.replace(cfg, compile=False, device="cpu")
    mode = FakeTensorMode() if fake else contextlib.nullcontext()
    torch.manual_seed(cfg.seed)
    with mode:
        model = GPT(cfg.model)
        setup = techniques.build(cfg, model)
        params = list(model.parameters())
        V = cfg.model.vocab_size
        micro = [(torch.randint(0, V, (cfg.micro_batch_size, cfg.context)), torch.randint(0, V, (cfg.micro_batch_size, cfg.context)))
                 for _ in range(cfg.grad_accum_steps)]
        n_targets = cfg.batch_size * cfg.context  # random ids: no padding
        for _ in range(warm_steps):  # so that the optimizer state exists, as in a steady-state step
            run_step(setup, cfg, params, micro, n_targets=n_targets)
        meter = measure.LedgerMeasurement(setup.parts.head)
        run_step(setup, cfg, params, micro, meter, n_targets=n_targets)  # the loop's own step body, watched by the ledger
        report = meter.report()
    report.method = ("CPU ledger under FakeTensorMode: shapes only, nothing allocated" if fake
                     else "CPU ledger: every tensor storage followed through one training step")
    return report


def timeline_by_phase(report: MemoryReport) -> dict[str, list[tuple[int, int]]]:
    """The ledger's timeline as {phase: [(op index, live bytes), ...]} for plotting."""
    out: dict[str, list[tuple[int, int]]] = {}
    for i, (phase, live) in enumerate(report.timeline):
        out.setdefault(phase, []).append((i, live))
    return out


def fmt_bytes(n: int | float) -> str:
    """Bytes with a binary unit (KiB, MiB, GiB = 1024^3)."""
    for unit, k in (("GiB", 3), ("MiB", 2), ("KiB", 1)):
        if abs(n) >= 1024**k:
            return f"{n / 1024**k:.2f} {unit}"
    return f"{int(n)} B"
