"""Fault tolerance: save a sharded training state with torch.distributed.checkpoint (DCP), stop, and resume, on the
same number of processes or another (DCP reshards), through the course's one training loop (FSDP2 on every rank).

What a training state is, to continue exactly: the model and the optimizer (each rank's shards, named by their
fully qualified names, so another sharding can read them), the LR schedule, the step, the data position, and the
random state. The course's batches are a pure function of (seed, step) (course_lib.distributed._common.global_batches),
so the step is the data position; a stateful data loader would add its own state_dict here.

A save goes to `step_<k>.partial/` and is renamed to `step_<k>/` once every rank has written and DCP has written the
metadata (its last act): a rename within a folder is atomic, so a run killed mid-save leaves a `.partial` folder that
`latest_checkpoint` never picks, and the last complete checkpoint stays loadable.

Rank results: each run's losses, where it resumed from, the seconds each save took, the bytes of parameters, gradients
and optimizer state the rank holds, the collectives of its last step (and the bytes it wrote meanwhile, gloo), and the
size of each complete checkpoint and of this rank's file in it.

Options: {"steps": S, "global_batch": G (sequences per step, divisible by the processes), "save_at": [k, ...] (save
after k steps), "ckpt": folder, "resume": bool (continue from the newest complete checkpoint in `ckpt`),
"die_in_final_save": bool (after the run, save once more and kill the last rank midway, after it wrote its shard and
before the metadata), "resume_in_place": bool (after the run, load the newest checkpoint into a new model and optimizer
in the same processes and train the steps left)}
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from .. import measure
from ..config import TrainConfig
from ..train import Trainer
from . import _common

PARTIAL = ".partial"
DIED = 17  # the exit code of the rank killed mid-save


def checkpoint_dir(root: str | Path, step: int, partial: bool = False) -> Path:
    return Path(root) / (f"step_{step:06d}" + (PARTIAL if partial else ""))


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint: renamed from .partial (so every rank finished) and holding DCP's metadata."""
    done = [
        p
        for p in Path(root).glob("step_*")
        if p.is_dir() and not p.name.endswith(PARTIAL) and (p / ".metadata").exists()
    ]
    return max(done, key=lambda p: int(p.name.split("_")[1]), default=None)


def training_state(setup, step: int, rank: int) -> dict:
    """What a resume needs, as DCP saves it: sharded model and optimizer state keyed by parameter names (DTensors:
    each rank writes its own shards), the schedule and the step (the same on every rank: written once), and this
    rank's random state under its own key."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(setup.model, setup.optimizer)
    return {
        "model": model_sd,
        "optim": optim_sd,
        "scheduler": setup.scheduler.state_dict(),
        "progress": {"step": step},
        f"rng_rank{rank}": torch.get_rng_state(),
    }


class DyingWriter(FileSystemWriter):
    """A FileSystemWriter whose process exits as soon as its own shard files are on disk: a crash in the middle of a
    save, after the data and before DCP's metadata (what a killed job, a lost node or a full disk leaves behind)."""

    def write_data(self, plan, planner):
        written = super().write_data(plan, planner)
        written.wait()
        os._exit(DIED)


def save(setup, root: str | Path, step: int, rank: int, writer=FileSystemWriter) -> float:
    """Save the training state after `step` steps; returns the seconds it took. Written to a .partial folder and
    renamed when complete (dcp.save returns on every rank only after the coordinator wrote the metadata)."""
    t0 = time.perf_counter()
    partial, final = checkpoint_dir(root, step, partial=True), checkpoint_dir(root, step)
    dcp.save(training_state(setup, step, rank), storage_writer=writer(partial))
    if rank == 0:
        os.replace(partial, final)
    if dist.is_initialized():
        dist.barrier()  # nobody goes on (or reads the checkpoint) before the rename
    return time.perf_counter() - t0


def load(setup, path: str | Path, rank: int) -> int:
    """Load a checkpoint into the model, optimizer and schedule built for this run, however many processes saved it
    and however many load it; returns the step to continue from. A rank's random state is restored when the saving
    run had a rank of that number (with another number of processes the per-rank random streams cannot continue
    exactly; the course's preset has no dropout, so its arithmetic does not depend on them)."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = training_state(setup, 0, rank)
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    rng_key = f"rng_rank{rank}"
    if rng_key not in saved:
        del state[rng_key]
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(setup.model, setup.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    setup.scheduler.load_state_dict(state["scheduler"])
    if rng_key in state:
        torch.set_rng_state(state[rng_key])
    return int(state["progress"]["step"])


def global_batches(cfg: TrainConfig, global_batch: int):
    """The same `global_batch` sequences per step whatever the number of processes: a rank takes its slice."""
    return _common.global_batches(replace(cfg, batch_size=global_batch, grad_accum_steps=1), 1, seed=cfg.seed)[1]


def train(
    cfg: TrainConfig,
    at,
    rank: int,
    world: int,
    root: str | Path,
    *,
    save_at=(),
    resume: bool = False,
    label: str = "run",
) -> dict:
    """Train cfg.steps steps in all (the course's loop, this rank's slice of every global batch), saving after the
    steps in `save_at`; with `resume`, first load the newest complete checkpoint in `root` and train the steps left.
    Works in a torchrun process (cfg.data_parallel="fsdp") and in a plain process (data_parallel="none")."""
    begin = [0]
    trainer = Trainer(cfg, batches=lambda i: [_common.shard(b, rank, world) for b in at(begin[0] + i)])
    loaded, save_s = None, {}
    if resume:
        loaded = latest_checkpoint(root)
        if loaded is None:
            raise FileNotFoundError(f"no complete checkpoint in {root}")
        begin[0] = load(trainer.setup, loaded, rank)
        # The schedule was built for the whole run (its lambda reads cfg.steps) and now stands at the saved step;
        # the loop trains the steps that are left.
        trainer.cfg = replace(cfg, steps=cfg.steps - begin[0])

    counter = _common.CollectiveCounter()  # the collectives of the last step (FSDP2's gathers and reduce-scatters)
    with counter.last_step_of(trainer.cfg.steps) as count:

        def callback(i, result):
            count(i, result)
            if begin[0] + i + 1 in save_at:
                save_s[begin[0] + i + 1] = save(trainer.setup, root, begin[0] + i + 1, rank)

        result = trainer.fit(label, callback)
    gloo = dist.is_initialized() and dist.get_backend() == "gloo"
    return {
        "result": result.to_dict(),
        "start_step": begin[0],
        "loaded": str(loaded) if loaded else None,
        "save_s": save_s,
        # gradients as they were at the end of backward (zero_grad has freed them since): the size of the
        # parameters' shards
        "memory": measure.static_bytes(trainer.setup.model, trainer.setup.optimizer, gradients_at_parameter_size=True),
        "collectives_last_step": dict(counter.counts),
        "written_last_step": counter.written if gloo else None,
        "setup": trainer.setup,
    }


def checkpoint_bytes(path: str | Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


# What --options may set, with the defaults (_common.check_options checks a launch's options against it).
OPTIONS = {
    "global_batch": None,
    "steps": 6,
    "ckpt": None,
    "resume": False,
    "save_at": [],
    "resume_in_place": False,
    "die_in_final_save": False,
}


def main(argv=None) -> None:
    ctx = _common.start(argv, OPTIONS, "resume")
    o = ctx.options
    global_batch = int(o["global_batch"] or 2 * ctx.cfg.micro_batch_size)
    if global_batch % ctx.world:
        raise ValueError(f"global_batch={global_batch} does not split over {ctx.world} processes")
    cfg = replace(
        ctx.cfg,
        steps=o["steps"],
        timing_warmup=1,
        grad_accum_steps=1,
        batch_size=global_batch // ctx.world,
        data_parallel="fsdp",
    )
    root = Path(o["ckpt"] or ctx.out / "checkpoints")
    at = global_batches(cfg, global_batch)
    resume = bool(o.get("resume"))
    run = train(
        cfg,
        at,
        ctx.rank,
        ctx.world,
        root,
        save_at=[int(k) for k in o.get("save_at", ())],
        resume=resume,
        label=f"FSDP2 x{ctx.world}" + (", resumed" if resume else ""),
    )
    setup = run.pop("setup")
    payload = {"strategy": "resume", "global_batch": global_batch, "ckpt": str(root), "run": run}
    if o.get("resume_in_place"):
        # Resume in these processes from the files alone: a new model, optimizer and schedule, nothing carried over.
        again = train(cfg, at, ctx.rank, ctx.world, root, resume=True, label=f"FSDP2 x{ctx.world}, resumed")
        del again["setup"]
        payload["resumed_in_place"] = again
    payload["checkpoints"] = {
        p.name: checkpoint_bytes(p) for p in sorted(root.glob("step_*")) if not p.name.endswith(PARTIAL)
    }
    # This rank's own file in each checkpoint (DCP writes one per rank, __<rank>_0.distcp; the metadata is rank 0's)
    payload["checkpoint_rank_bytes"] = {
        p.name: sum(f.stat().st_size for f in p.glob(f"__{ctx.rank}_*.distcp"))
        for p in sorted(root.glob("step_*"))
        if not p.name.endswith(PARTIAL)
    }
    _common.write(ctx, payload)
    if o.get("die_in_final_save"):
        # The results are written; now a save that never completes: the last rank dies after writing its shard.
        save(setup, root, cfg.steps, ctx.rank, writer=DyingWriter if ctx.is_last else FileSystemWriter)
    _common.leave()


if __name__ == "__main__":
    main()
