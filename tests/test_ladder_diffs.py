"""course_lib.lessons.ladder_diffs: notebook 09's climb as diffs, each rung against the best loop so far."""

import pytest

from course_lib import techniques as T
from course_lib.doctor import check_config
from course_lib.lessons.ladder_diffs import ladder_diffs

BASE = check_config("cpu")


@pytest.mark.unit
def test_ladder_diffs_show_each_rung_against_the_best_loop_so_far_with_its_verdict():
    """From a climb's results (made up here: the numbers are only carried through): each rung's diff is against the best
    loop so far, the one it was measured against; a rung not kept does not become the next one's base; a rung that did
    not run says why and shows the code it would add; the last row is the optimised loop against naive fp32."""
    from course_lib.ladder import OPTIMISED
    from course_lib.results import RunResult

    results, best, not_kept = [], T.naive(BASE), {"+ 16-bit autocast", "+ vocab to x64"}
    for i, rung in enumerate(T.LADDER):
        if rung.name == "+ compile":
            results.append(RunResult(rung.name, "skipped", {}, {"device": "test"}, reason="left out for the test"))
            continue
        cfg = rung.apply(best)
        kept = rung.name not in not_kept
        results.append(
            RunResult(
                rung.name,
                "ok",
                cfg.to_dict(),
                {"device": "test"},
                tokens_per_s=1000.0 * (i + 1),
                memory={"peak_bytes": 2**30 // (i + 1)},
                ladder={
                    "kept": kept,
                    "why": f"{'kept' if kept else 'not kept'}: made up",
                    "speedup": i + 1.0,
                    "memory_vs_naive": 1 / (i + 1),
                },
            )
        )
        best = cfg if kept else best
    results.append(
        RunResult(
            OPTIMISED,
            "ok",
            best.to_dict(),
            {"device": "test"},
            tokens_per_s=9000.0,
            memory={"peak_bytes": 2**28},
            ladder={"kept": True, "why": "made up", "speedup": 9.0},
        )
    )
    page = ladder_diffs(results).data
    assert page.count("<details") == len(T.LADDER) and "left out for the test" in page
    sdpa = page[page.index("+ sdpa</b>") : page.index("+ compile</b>")]
    n = [r.name for r in T.LADDER].index("+ sdpa") + 1  # its made-up figures: n times naive's speed, 1/n its memory
    assert f"kept: made up; {n * 1000:,} tokens/s ({n}.00x naive), peak {1 / n:.4f} GiB ({1 / n:.2f}x naive" in sdpa
    # measured against naive + tf32, not against the 16-bit rung, which was not kept
    assert "scaled_dot_product_attention" in sdpa and "torch.autocast" not in sdpa
    compiled = page[page.index("+ compile</b>") : page.index("+ vocab to x64</b>")]
    assert "torch.compile(" in compiled and "not measured here" in compiled
    fused = page[page.index("+ fused AdamW</b>") : page.index("+ set_to_none</b>")]
    # the padding was not kept: not in its base either
    assert "fused=True" in fused and "VOCAB_MULTIPLE = 64" not in fused
    last = page[page.index(OPTIMISED) :]
    assert "the optimised loop against naive fp32" in last and "9,000 tokens/s (9.00x naive)" in last
    with pytest.raises(ValueError, match="one result per rung"):
        ladder_diffs(results[:3])
