"""The course's command line.

    python -m course_lib ladder [--preset cpu] [--device cpu] [--steps N] [--json PATH]
    python -m course_lib info [--device D]
    python -m course_lib bpe            (retrain the shipped tokenizer ranks from the corpus)
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from . import config as C


def cmd_ladder(args) -> int:
    import torch

    from .ladder import ladder_table, run_ladder
    from .measure import device_name
    from .results import provenance, save_results

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        base = C.preset(args.preset, args.device)
        if args.steps is not None:
            base = dataclasses.replace(base, steps=args.steps)
    except C.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"Ladder on {device_name(base.device)}, torch {torch.__version__}, preset {args.preset}: "
          f"{base.model.n_layer} blocks, width {base.model.n_embd}, {base.model.n_head} heads, context {base.context}, "
          f"batch {base.batch_size}, {base.steps} steps ({base.timing_warmup} warm-up)", file=sys.stderr)
    rungs = None
    if args.rungs:
        try:
            rungs = [C.LADDER[int(i)].name for i in args.rungs.split(",")]
        except (ValueError, IndexError):
            print(f"error: --rungs takes indices 0..{len(C.LADDER) - 1} separated by commas, got {args.rungs!r}", file=sys.stderr)
            return 2
    results = run_ladder(base, progress=lambda name: None, rungs=rungs)
    print(ladder_table(results))
    if args.json:
        path = save_results(results, args.json, preset=args.preset, base_config=base.to_dict(), **provenance(device_name(base.device)))
        print(f"wrote {path}", file=sys.stderr)
    return 0


def cmd_info(args) -> int:
    from .measure import capabilities

    for k, v in capabilities(args.device or C.default_device()).items():
        print(f"{k:>16}: {'yes' if v is True else v}")
    return 0


def cmd_bpe(args) -> int:
    from . import bpe, data

    ranks = bpe.train_bpe(data.corpus_text(), data.N_RANKS)
    bpe.save_ranks(ranks, args.out or data.RANKS_FILE)
    print(f"wrote {len(ranks)} ranks to {args.out or data.RANKS_FILE}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib", description="Optimising the training loop: measurements from the command line")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ladder", help="run every technique rung from naive fp32 to everything on")
    p.add_argument("--preset", default="cpu", choices=list(C.PRESETS))
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per rung (default: the preset's)")
    p.add_argument("--rungs", default=None, help="only these rungs, by index (0 = naive fp32), e.g. 0,2,3")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    p.add_argument("--json", default=None, help="write every result, with device, torch version, date and config, here")
    p.set_defaults(func=cmd_ladder)
    p = sub.add_parser("info", help="what this machine supports")
    p.add_argument("--device", default=None)
    p.set_defaults(func=cmd_info)
    p = sub.add_parser("bpe", help="retrain the course tokenizer's BPE ranks from the corpus")
    p.add_argument("--out", default=None)
    p.set_defaults(func=cmd_bpe)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
