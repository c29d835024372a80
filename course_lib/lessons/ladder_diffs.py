"""Notebook 09's climb as a sequence of diffs (build-nanogpt style): what each rung of the ladder changes in the
exported script, against the best loop so far, with what the climb measured."""

import html

from IPython.display import HTML

from .. import techniques as T
from ..config import TrainConfig
from ..export import diff_html
from ..ladder import AGAIN, CUDA_GRAPHS, CUDA_GRAPHS_RUNG, FINAL_ROWS, rung_name, rungs_of


def _measured(r, naive) -> str:
    """A ladder result's verdict, speed and memory, as the climb measured them (course_lib.ladder)."""
    if not r.ok:
        return f"not run here ({r.status}): {r.reason}"
    lad = r.ladder or {}
    times = lambda v: f"{v:.2f}x" if v else "n/a"  # noqa: E731
    peak = (
        f"peak {r.peak_text(unit=' GiB')} ({times(lad.get('memory_vs_naive'))} naive's)"
        if r.peak_gib is not None
        else "memory not measured"
    )
    verdict = f"{lad['why']}; " if lad.get("why") and r is not naive else ""
    return (
        f"{verdict}{r.tokens_per_s:,.0f} tokens/s ({times(lad.get('speedup'))} naive), {peak}, "
        f"on {r.provenance.get('device', '?')}"
    )


def _section(r, naive, diff: str) -> str:
    """One result: its label and measurements, over its diff (open, and folded at a click)."""
    summary = f"<b>{html.escape(r.label)}</b>: {html.escape(_measured(r, naive))}"
    return f"<details open><summary>{summary}</summary>{diff}</details>"


def ladder_diffs(results: list) -> HTML:
    """From a climb's results (ladder.run_ladder: one per rung in techniques.LADDER's order, then its last rows): for
    each rung, what it changes in the exported script against the best loop so far, the one it was measured against;
    a rung that was kept becomes the next one's base, one that did not run shows the code it would have added. Last,
    the optimised and the leanest loop against naive fp32, each all at once."""
    climbed = rungs_of(results)
    second_looks = climbed[len(T.RUNGS) :]  # "<rung>, again": a rung tried once more at the top
    if [r.label for r in climbed[: len(T.RUNGS)]] != list(T.RUNGS) or any(
        rung_name(r) not in T.RUNGS and r.label != CUDA_GRAPHS for r in second_looks
    ):
        raise ValueError(
            f"ladder_diffs wants one result per rung, in the ladder's order ({', '.join(T.RUNGS)}), then any second "
            f"looks ('<rung>{AGAIN}'); got {[r.label for r in climbed]}"
        )
    naive = climbed[0]
    naive_cfg = best_cfg = TrainConfig.from_dict(naive.config)
    parts = [f"<p><b>{html.escape(naive.label)}</b>: {html.escape(_measured(naive, naive))}</p>"]
    for r in climbed[1:]:
        rung = T.RUNGS.get(rung_name(r), CUDA_GRAPHS_RUNG)  # (CUDA graphs: a rung only where the GPU waits on launches)
        cfg = TrainConfig.from_dict(r.config) if r.config else rung.apply(best_cfg)
        head = rung.what_changed + ("" if r.ok else " (the code it would add; not measured here)")
        parts.append(_section(r, naive, diff_html(best_cfg, cfg, head)))
        if r.ok and (r.ladder or {}).get("kept"):
            best_cfg = cfg
    for top in (r for r in results if r.label in FINAL_ROWS):
        what = "the optimised loop" if top.label == FINAL_ROWS[0] else "the leanest loop"
        top_cfg = TrainConfig.from_dict(top.config)
        parts.append(_section(top, naive, diff_html(naive_cfg, top_cfg, f"{what} against naive fp32")))
    return HTML("\n".join(parts))
