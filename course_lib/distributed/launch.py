"""Start a strategy module under torchrun in a subprocess and read back each rank's JSON.

A notebook must not fork training processes itself (mp.spawn fails in IPython), so it runs

    python -m torch.distributed.run --nproc_per_node=N --master_addr=127.0.0.1 --master_port=<free port> \\
        -m course_lib.distributed.<strategy> --out <dir> [--config cfg.json] [--options '{...}']

with a timeout; torchrun and its workers get a process group of their own, and the whole group is stopped
when the run ends, fails or hangs, so no process is left behind. On a failure the captured stderr is shown.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

STRATEGIES = (
    "ddp",
    "ddp_by_hand",
    "collectives",
    "fsdp",
    "pipeline",
    "tensor_parallel",
    "selftest",
    "zero_stages",
    "zero1_by_hand",
    "resume",
    "expert_parallel",
    "ring_attention",
    "series",
)


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_known(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}")


def torchrun_command(
    strategy: str,
    nproc: int,
    out_dir: str | Path,
    *,
    config_file: str | Path | None = None,
    options: dict | None = None,
    device: str = "auto",
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
) -> list[str]:
    """The command line, the same on a laptop, a multi-GPU node or (with nnodes > 1, run once per node with
    its node_rank and the first node's address) a cluster."""
    _check_known(strategy)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--nnodes={nnodes}",
        f"--node_rank={node_rank}",
        f"--master_addr={master_addr}",
        f"--master_port={master_port or free_port()}",
        "-m",
        f"course_lib.distributed.{strategy}",
        "--out",
        str(out_dir),
        "--device",
        device,
    ]
    if config_file:
        cmd += ["--config", str(config_file)]
    if options:
        cmd += ["--options", json.dumps(options)]
    return cmd


@dataclass
class LaunchResult:
    strategy: str
    nproc: int
    command: list[str]
    returncode: int | None
    timed_out: bool
    wall_s: float
    ranks: list[dict] = field(default_factory=list)  # rank<r>.json, in rank order
    stderr: str = ""
    stdout: str = ""
    out_dir: str = ""
    pid: int = 0  # torchrun's process id (its process group is the run's)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and len(self.ranks) == self.nproc

    def why(self) -> str:
        if self.timed_out:
            head = f"{self.strategy} with {self.nproc} processes was stopped after {self.wall_s:.0f} s (timeout)"
        elif self.returncode != 0:
            head = f"{self.strategy} with {self.nproc} processes failed (exit code {self.returncode})"
        else:
            head = f"{self.strategy}: {len(self.ranks)} of {self.nproc} ranks wrote results"
        if first := root_cause(self.stderr):
            head += "\n" + first
        # The ranks' own exceptions first (the root cause is usually one rank's error, the rest is fallout).
        # An exception's own line ("[rank1]: ConfigError: n_head=2 ..."), not a source line that mentions one.
        errors = [
            ln
            for ln in self.stderr.splitlines()
            if re.match(r"\[rank\d+\]: (\w+\.)*\w*(Error|Exception|Exit)\w*: ", ln) or re.match(r"error: ", ln)
        ]
        cause = ("\n--- errors raised in the ranks ---\n" + "\n".join(errors[:10])) if errors else ""
        return head + cause + "\n--- stderr (last 3000 characters) ---\n" + self.stderr[-3000:]

    def raise_for_status(self) -> "LaunchResult":
        if not self.ok:
            raise RuntimeError(self.why())
        return self


def _stopped_with_this_process() -> None:
    """Run in torchrun's process before it starts (Linux): SIGTERM to it when the process that launched it dies, even
    by SIGKILL (a notebook kernel restarted), so that torchrun stops its workers; its own session would outlive the
    kernel otherwise. Elsewhere nothing: the launch's own timeout and the stop in `launch` still hold."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def root_cause(stderr: str) -> str:
    """The first rank to fail, as torchrun's summary names it ("Root Cause"), in a sentence; "" where it names none. A
    rank killed by a signal raised nothing: the other ranks' errors (a connection closed) are only what followed."""
    found = re.search(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", stderr, flags=re.S)
    if not found:
        return ""
    rank, code = int(found[1]), int(found[2])
    if code >= 0:
        return f"the first to fail: rank {rank}, with exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    why = ": the system's out-of-memory killer (see `dmesg`) or a kill by hand" if name == "SIGKILL" else ""
    return (
        f"rank {rank} was killed by {name}{why}; the other ranks' errors below followed from it, and torchrun stopped "
        "them"
    )


def _stop_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM to the run's own process group (torchrun and its workers), then SIGKILL what is left."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        return
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)  # does any member of the group remain?
            except ProcessLookupError:
                return
            time.sleep(0.1)


def _stop_ranks(out: Path) -> None:
    """SIGKILL to any worker of this launch still alive (each wrote its pid in `out`): torchrun gives each worker a
    session of its own, which a signal to torchrun's group does not reach when torchrun itself could not stop them."""
    for f in out.glob("pid_rank*"):
        try:
            pid = int(f.read_text())
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError):  # gone already, or a pid file half written by a rank that died writing it
            pass


def check_strategy_options(strategy: str, options: dict) -> None:
    """A ConfigError (a ValueError) for options the strategy's module does not declare (its OPTIONS), or values of the
    wrong kind; a series' runs are checked each against its own strategy."""
    import importlib

    from . import _common

    _check_known(strategy)
    module = importlib.import_module(f"{__package__}.{strategy}")
    options = _common.check_options(options, module.OPTIONS, strategy)
    if hasattr(module, "check"):  # what the kinds alone cannot say (collectives: a size range, the ops' names)
        module.check(options)
    for run in options.get("runs", []) if strategy == "series" else []:
        check_strategy_options(run["strategy"], run.get("options", {}))


def read_ranks(out: Path) -> tuple[list[dict], str]:
    """The ranks' results in `out` (rank<r>.json, in rank order), and a line for each file that is not whole JSON (a
    rank killed while writing it, by an older course that wrote in place): left out, so the run is not ok."""
    ranks, damaged = [], ""
    for f in sorted(out.glob("rank*.json"), key=lambda f: int(f.stem[4:]) if f.stem[4:].isdigit() else -1):
        try:
            ranks.append(json.loads(f.read_text()))
        except (OSError, ValueError) as e:
            damaged += f"\nerror: {f} is not a rank's whole result ({e}): left out\n"
    return ranks, damaged


def launch(
    strategy: str,
    nproc: int = 2,
    *,
    cfg=None,
    options: dict | None = None,
    device: str = "auto",
    timeout_s: float = 180,
    out_dir: str | Path | None = None,
    threads_per_process: int | None = None,
    show_errors: bool = True,
) -> LaunchResult:
    """Run course_lib.distributed.<strategy> on `nproc` processes of this machine and collect their results.

    cfg: a TrainConfig (default: the tiny preset). device: "auto" (NCCL if there are `nproc` GPUs, else gloo
    on CPU), "cpu" or "cuda". A run that fails or outlives `timeout_s` comes back with ok=False, its stderr
    kept (and printed when show_errors); every process it started is stopped either way."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc={nproc!r}: a launch needs a whole number of processes >= 1 (2 for a first try)")
    check_strategy_options(strategy, options or {})  # here, before any process starts: one message, not one per rank
    out = _results_dir(out_dir, strategy)
    config_file = None
    if cfg is not None:
        config_file = out / "config.json"
        config_file.write_text(json.dumps(cfg.to_dict()))
    cmd = torchrun_command(strategy, nproc, out, config_file=config_file, options=options, device=device)
    env = dict(os.environ)
    # Share the cores: each process gets its slice (torchrun would set 1 and warn about it).
    env["OMP_NUM_THREADS"] = str(threads_per_process or max(1, (os.cpu_count() or 1) // nproc))
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["TORCHELASTIC_ERROR_FILE"] = str(out / "error.json")
    t0 = time.perf_counter()
    proc, stdout, stderr, timed_out = _run_to_the_end(cmd, env, timeout_s, out)
    wall = time.perf_counter() - t0
    ranks, damaged = read_ranks(out)
    result = LaunchResult(
        strategy, nproc, cmd, proc.returncode, timed_out, wall, ranks, stderr + damaged, stdout, str(out), proc.pid
    )
    if show_errors and not result.ok:
        print(result.why(), file=sys.stderr)
    return result


def _results_dir(out_dir: str | Path | None, strategy: str) -> Path:
    """The folder the ranks write to (a new temporary one by default), checked writable and cleared of an earlier
    launch's results."""
    out = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix=f"course_{strategy}_"))
    try:
        out.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out).close()  # the ranks write here: a folder they cannot write is said now
    except OSError as e:
        raise ValueError(
            f"out_dir={str(out)!r}: no file can be written there ({e.strerror}); give a folder you can write"
        ) from None
    for old in [*out.glob("rank*.json"), *out.glob("pid_rank*")]:
        old.unlink()
    return out


def _run_to_the_end(cmd: list[str], env: dict, timeout_s: float, out: Path):
    """Run torchrun in a process group of its own until it ends or outlives `timeout_s`; then stop whatever of it is
    left. Returns (the process, its stdout, its stderr, whether it timed out)."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
        preexec_fn=_stopped_with_this_process,
    )
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _stop_group(proc)
        stdout, stderr = proc.communicate()
    finally:
        _stop_group(proc, grace_s=1.0)  # workers that outlived torchrun, if any
        _stop_ranks(out)
    return proc, stdout, stderr, timed_out


def launch_series(
    runs: list[tuple[str, dict]],
    nproc: int = 2,
    *,
    cfgs: dict | None = None,
    device: str = "auto",
    timeout_s: float = 600,
    out_dir: str | Path | None = None,
) -> dict[str, LaunchResult]:
    """Several strategies, one after another in one launch (series.py: the processes start once): [(strategy, options)]
    -> {strategy: its LaunchResult}; cfgs: {strategy: TrainConfig} where a run needs one other than the tiny preset.
    A run that finished on every rank is ok, with its own wall time (start-up excluded), even if a later one failed;
    the run that failed, and every run after it (they never start), carry the launch's exit code and stderr, which
    ends with a line naming the run that failed. Command, pid and stdout are the whole launch's."""
    import shutil

    from .series import run_dir

    names = [s for s, _ in runs]
    if len(set(names)) != len(names) or "series" in names:
        raise ValueError(f"each strategy at most once in a series, and not 'series' itself: {names}")
    spec = [
        {"strategy": s, "options": o or {}, **({"config": cfgs[s].to_dict()} if cfgs and s in cfgs else {})}
        for s, o in runs
    ]
    out_dir = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="course_series_"))
    for i, strategy in enumerate(names):  # an earlier series' files in this folder must not be read as this one's
        shutil.rmtree(run_dir(out_dir, i, strategy), ignore_errors=True)
    whole = launch(
        "series", nproc, options={"runs": spec}, device=device, timeout_s=timeout_s, out_dir=out_dir, show_errors=False
    )
    walls = [r["wall_s"] for r in whole.ranks[0]["runs"]] if whole.ranks else []
    results, failed = {}, None
    for i, strategy in enumerate(names):
        out = run_dir(whole.out_dir, i, strategy)
        ranks, _ = read_ranks(out)
        one = replace(whole, strategy=strategy, ranks=ranks, out_dir=str(out))
        if len(ranks) == nproc and failed is None:
            wall = walls[i] if i < len(walls) else whole.wall_s
            results[strategy] = replace(one, returncode=0, timed_out=False, wall_s=wall, stderr="")
            continue
        failed = failed or strategy
        which = "" if failed == strategy else f", so {strategy} did not run"
        results[strategy] = replace(one, stderr=f"{whole.stderr}\nin a series: {failed} failed{which}\n")
    if not whole.ok:
        print(whole.why(), file=sys.stderr)
    return results


def rank_pids(result: LaunchResult) -> list[int]:
    """The worker processes' ids (each rank writes its pid when it starts)."""
    return [int(f.read_text()) for f in Path(result.out_dir).glob("pid_rank*")]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie has exited; only its parent has not collected it yet
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
