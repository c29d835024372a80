import statistics
import sys

import pytest
import torch

from course_lib import config as C, train as train_mod


def test_a_run_records_what_it_measured(splits, tiny):
    cfg = tiny(steps=6)
    r = train_mod.train(cfg, "t", splits=splits)
    assert r.ok and len(r.losses) == len(r.step_times) == len(r.lrs) == len(r.grad_norms) == 6
    assert r.excluded_steps == [0, 5]  # warm-up and the memory-ledger step
    # throughput recomputed from the raw step times and the batch shape, not from the loop's own fields
    assert r.tokens_per_s == pytest.approx(cfg.batch_size * cfg.context / statistics.median(r.step_times[1:5]))
    assert r.provenance["torch"] == torch.__version__ and "CPU" in r.provenance["device"]
    # at the peak: parameters, gradients and AdamW's two moments (16 bytes per parameter) and one fp32 b x s x V tensor
    assert r.memory["peak_bytes"] >= 16 * r.n_params + 4 * cfg.batch_size * cfg.context * cfg.model.padded_vocab_size
    assert r.losses[0] == pytest.approx(torch.log(torch.tensor(4097.0)).item(), abs=0.3)  # starts near uniform
    # no data sheet for a CPU: against this machine's own matmuls, labelled so
    assert r.mfu_basis == "measured matmul peak"
    # fp32: a small model's step stays below the big fp32 matmuls this machine measured (not a bound for bf16 on a CPU
    # without bf16 instructions, where big bf16 matmuls are slow and a small model's can beat them)
    print(f"MFU {r.mfu:.1%} of the {r.mfu_basis}")
    assert 0 < r.mfu <= 1, r.mfu


def test_training_reduces_the_loss(splits, tiny):
    r = train_mod.train(tiny(steps=30, lr=3e-3, measure_memory=False), "t", splits=splits)
    assert sum(r.losses[-5:]) / 5 < r.losses[0] - 1.0


def test_same_seed_same_losses(splits, tiny):
    a = train_mod.train(tiny(), "a", splits=splits)
    b = train_mod.train(tiny(), "b", splits=splits)
    assert a.losses == b.losses


def test_accumulated_step_equals_the_big_batch(splits, tiny):
    """Two micro-batches of 2 give the same training as one batch of 4 (fp32)."""
    g = torch.Generator().manual_seed(0)
    from course_lib.data import random_windows

    batch = [random_windows(splits.train, 4, 64, g) for _ in range(3)]
    big = train_mod.train(
        tiny(steps=3, timing_warmup=1, measure_memory=False), "big", splits=splits, batches=lambda s: [batch[s]]
    )
    split = lambda s: [(batch[s][0][:2], batch[s][1][:2]), (batch[s][0][2:], batch[s][1][2:])]  # noqa: E731
    acc = train_mod.train(
        tiny(steps=3, timing_warmup=1, grad_accum_steps=2, measure_memory=False), "acc", splits=splits, batches=split
    )
    assert big.losses == pytest.approx(acc.losses, rel=1e-5)
    assert big.grad_norms == pytest.approx(acc.grad_norms, rel=1e-4)


def test_clipping_uses_the_global_norm(splits, tiny):
    r = train_mod.train(tiny(steps=3, clip_norm=1e-3, measure_memory=False), "clip", splits=splits)
    assert all(n > 1e-3 for n in r.grad_norms)  # the norm before clipping is what is logged


def test_the_loops_step_clips_the_global_norm_and_keeps_the_direction(splits, tiny):
    """With plain SGD, a clipped step moves the parameters by exactly lr * clip_norm, along the gradient."""
    from course_lib import techniques
    from course_lib.model import GPT

    cfg = tiny(optimizer="sgd", lr=0.1, clip_norm=1e-3)
    torch.manual_seed(0)
    model = GPT(cfg.model)
    setup = techniques.build(cfg, model)
    params = list(model.parameters())
    x, y = splits.train[:64].view(1, 64), splits.train[1:65].view(1, 64)
    (setup.loss_fn(x, y) / 64).backward()
    grads = torch.cat([p.grad.flatten() for p in params])
    setup.optimizer.zero_grad()
    before = torch.cat([p.detach().flatten() for p in params])
    _, norm, lr, _ = train_mod.train_step(setup, cfg, params, [(x, y)])
    delta = torch.cat([p.detach().flatten() for p in params]) - before
    assert norm.item() == pytest.approx(grads.norm().item(), rel=1e-5) and norm.item() > 1e-3
    assert delta.norm().item() == pytest.approx(0.1 * 1e-3, rel=1e-3)
    assert torch.nn.functional.cosine_similarity(delta, -grads, dim=0).item() == pytest.approx(1.0, abs=1e-4)


def test_a_memory_ledger_run_counts_the_static_parts_exactly(splits, tiny):
    from course_lib.model import GPT

    cfg = tiny(steps=3)
    r = train_mod.train(cfg, "t", splits=splits)
    n = GPT(cfg.model).num_params()
    by = r.memory["by_category"]
    assert by["parameters"] == 4 * n
    assert by["gradients"] == 4 * n  # set_to_none=False keeps them, and at the peak they all exist
    # exp_avg, exp_avg_sq + step counters
    assert by["optimizer state"] == 2 * 4 * n + 4 * len(list(GPT(cfg.model).parameters()))


# What each allocator raises: CUDA's, and a CPU's on Linux (torch 2.13, asked for 20 GB under `ulimit -v`) and Windows
OUT_OF_MEMORY = [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError(
        "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to allocate "
        "20976640000 bytes. Error code 12 (Cannot allocate memory)"
    ),
    RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 20976640000 bytes."),
    RuntimeError("std::bad_alloc"),  # C++ code's (a batch of 10^7 windows under `ulimit -v 6000000`, torch 2.13)
]


@pytest.mark.parametrize("error", OUT_OF_MEMORY, ids=["gpu-allocator", "cpu-linux", "cpu-windows", "cpp-bad-alloc"])
def test_out_of_memory_becomes_a_result_and_the_caller_goes_on(monkeypatch, splits, tiny, error):
    def boom(*a, **k):
        raise error

    monkeypatch.setattr(train_mod, "train_step", boom)
    r = train_mod.run(tiny(), "too big")
    assert r.status == "oom" and "out of memory" in r.reason and not r.ok


def test_a_cpu_step_past_the_free_memory_is_an_oom_row_before_anything_is_allocated(monkeypatch, tiny):
    """Past the free memory Linux kills the process (the kernel's OOM killer) instead of failing an allocation: the
    result and the notebook's kernel would be lost. The runs whose sizes a learner picks (a panel's, the ladder's) check
    the memory formula's peak first (memory_estimate.run_checked); train.run itself does not run the formula."""
    from course_lib import measure, memory_estimate, memory_formula

    monkeypatch.setattr(measure, "available_cpu_memory", lambda: 2 * measure.GiB)
    big = tiny(batch_size=10**6)
    assert memory_formula.estimate(big).peak_bytes > 2 * measure.GiB
    r = memory_estimate.run_checked(big, "too big")
    assert r.status == "oom" and "GiB are free here: not started" in r.reason and "lower batch_size" in r.reason
    assert r.step_times == []  # refused before its first step
    assert memory_estimate.run_checked(tiny(), "fits").ok  # and the next run goes on
    monkeypatch.setattr(memory_formula, "estimate", lambda cfg: 1 / 0)  # the formula is not on a plain run's way
    assert train_mod.run(tiny(), "plain").ok
    monkeypatch.undo()
    monkeypatch.setattr(measure, "available_cpu_memory", lambda: None)  # not Linux: the allocator is left to say
    memory_estimate.check_cpu_memory(big)


def test_the_free_memory_is_read_from_linux_and_its_container_limit(tmp_path):
    from course_lib import measure

    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    proc.mkdir(), cgroup.mkdir()
    (proc / "meminfo").write_text("MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\n")
    assert measure.available_cpu_memory(proc, cgroup) == 20000000 * 1024  # no container: what Linux says
    (cgroup / "memory.max").write_text("max\n")
    assert measure.available_cpu_memory(proc, cgroup) == 20000000 * 1024
    # a container of 8 GiB holding 7 GiB, 2 GiB of it file cache the kernel drops first: 3 GiB are free
    (cgroup / "memory.max").write_text(f"{8 * 2**30}\n")
    (cgroup / "memory.current").write_text(f"{7 * 2**30}\n")
    (cgroup / "memory.stat").write_text(f"anon {5 * 2**30}\ninactive_file {2 * 2**30}\nactive_file 0\n")
    assert measure.available_cpu_memory(proc, cgroup) == 3 * 2**30
    assert measure.available_cpu_memory(tmp_path / "nowhere", cgroup) is None  # not Linux

    free = measure.available_cpu_memory()  # this machine's
    if sys.platform == "linux":
        assert free is not None and 0 < free < 2**50
    else:
        assert free is None


def test_another_runtime_error_is_not_taken_for_out_of_memory(monkeypatch, tiny):
    def boom(*a, **k):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)")

    monkeypatch.setattr(train_mod, "train_step", boom)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        train_mod.run(tiny(), "a bug")


def test_too_few_steps_is_explained(splits, tiny):
    with pytest.raises(C.ConfigError, match="leaves no step to time"):
        train_mod.train(tiny(steps=2, timing_warmup=1), "t", splits=splits)


def test_a_too_small_vocab_is_explained(splits, tiny):
    with pytest.raises(C.ConfigError, match="smaller than the tokenizer"):
        train_mod.train(tiny().with_model(vocab_size=100), "t", splits=splits)


def test_fp16_records_loss_scale(splits, tiny):
    r = train_mod.train(tiny(precision="fp16", steps=3), "fp16", splits=splits)
    assert r.ok and len(r.loss_scales) == 3 and r.loss_scales[0] == 65536.0
