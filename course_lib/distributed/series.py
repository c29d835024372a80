"""Several strategies in series, in one torchrun launch: the processes start once.

Before a launch trains anything, each process starts Python, imports torch, joins the process group and (at its first
optimizer) imports TorchDynamo: about 5 CPU-s for torchrun and 2 processes on a small CPU, and 2-3 s of wall time
(measure it: `launch("selftest").wall_s`). A workshop machine or a test suite that runs every strategy pays that
once here instead of once per strategy. Each strategy runs exactly as its own launch would (its own `main`, its own
options and config, its own rank<r>.json), in the process group joined once and kept between them.

Options: {"runs": [{"strategy": "ddp", "options": {...}, "config": {a TrainConfig as a dict} (optional)}, ...]}.
Run i writes to <out>/<i>_<strategy>/; launch.launch_series reads each back as its own LaunchResult. The series' own
rank<r>.json lists the runs finished so far and each one's wall time (start-up excluded), rewritten after each run. A
run that raises stops the launch (the other ranks would wait for it in their next collective): the runs after it write
nothing.
"""

from __future__ import annotations

import importlib
import json
import time
from pathlib import Path

from ..cache import write_atomic
from . import _common


def run_dir(out: str | Path, index: int, strategy: str) -> Path:
    return Path(out) / f"{index}_{strategy}"


# What --options may set, with the defaults (_common.check_options checks a launch's options against it).
OPTIONS = {"runs": []}


def main(argv=None) -> None:
    ctx = _common.start(argv, OPTIONS, "series")
    done = []
    with _common.keep_group():
        for i, run in enumerate(ctx.options["runs"]):
            t0 = time.perf_counter()
            out = run_dir(ctx.out, i, run["strategy"])
            out.mkdir(parents=True, exist_ok=True)
            args = ["--out", str(out), "--device", ctx.device.type, "--options", json.dumps(run.get("options", {}))]
            if "config" in run:
                # every rank writes it, in one step: a rank reading it meanwhile never sees half a file
                write_atomic(out / "config.json", lambda f: f.write_text(json.dumps(run["config"])), strict=True)
                args += ["--config", str(out / "config.json")]
            importlib.import_module(f"{__package__}.{run['strategy']}").main(args)
            done.append({"strategy": run["strategy"], "wall_s": time.perf_counter() - t0})
            # after each run: what finished, should a later one fail
            _common.write(ctx, {"strategy": "series", "runs": done})
    _common.leave()


if __name__ == "__main__":
    main()
