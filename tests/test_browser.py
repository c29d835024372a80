"""The course in a real browser: for every notebook with a panel (01-09, see PANELS), JupyterLab in headless
Chromium runs the cells that panel needs, changes that notebook's key control, clicks Run twice, and checks after
each click that the results table gains a row naming the change and that the panel's figure is a new, drawn figure:
its PNG, read from the page, has real content (a share of non-background pixels, also as the browser decodes it, and
at least half the bytes of the figure before the click). A blank image of the right
size is a change too, which is why "the image changed" is not enough: a figure displayed into an Output widget from
a button's callback came out blank or half drawn in JupyterLab (from the first or second click).

Running every cell of nine notebooks in a browser would take far too long on a small machine, so the browser gets
a fresh copy of each notebook holding only its cells tagged "panel-setup" (the imports and environment, and what the
panel cell uses) and "panel" (the panel itself), in their order; nbval still runs every notebook top to bottom.
A learner's exercise is solved through the page too: 05's warm-up + cosine stub is overwritten in the cell's editor
with an answer, and the checker must say "solved" and the next cell draw the learner's schedule.
One JupyterLab serves all the copies, in one browser tab: each notebook is opened there as a learner opens the next one
(a page load of JupyterLab costs ~4 CPU-s of Chromium on 2 cores), and they share one kernel, each running its own
tagged cells in it after the widgets of the one before were closed (a kernel's start, imports included, costs ~5 CPU-s).
That its tagged cells are enough on their own, in a fresh kernel, is checked without a browser
(test_each_panel_copy_runs_on_its_own_cells: pyflakes finds every name its cells use defined in them).
Screenshots of each panel after its last click go to $BROWSER_TEST_SHOTS (default /tmp).

Needs Debian's `chromium` (installed by .ci/run) and the Python `playwright` package (the test extra).
Skipped, with the reason in the summary, only where those cannot be had.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
]
SETUP_TAG, PANEL_TAG = "panel-setup", "panel"


@dataclasses.dataclass(frozen=True)
class PanelCase:
    """One notebook's panel as the browser test drives it: choose options of its dropdowns, press Run `clicks` times."""

    notebook: str  # file in notebooks/
    settings: tuple[tuple[str, str], ...]  # (a dropdown's label in the panel, the option's text to choose)
    expect: tuple[str, ...]  # text the new row of the results table holds
    # a figure drawn into an Output widget from a callback went blank after the first or the second click
    clicks: int = 2
    # After the clicks, the code section (one panel is enough: it is the same widget everywhere): opened, it shows the
    # diff against naive fp32; (a dropdown's label, an option, text the diff then holds); then the export button.
    code: tuple[str, str, str] | None = None

    def __str__(self) -> str:
        return self.notebook.split("_")[0]


# The bytes lesson of 07's and 08's panels, in each row's note (distributed/strategy_panel.py's _note).
BYTES_LESSON = (
    "sent per rank",
    "counted x ring share",
    *(("written to sockets",) if Path("/proc/self/io").exists() else ()),
)

# Every notebook with a panel, each with its key lesson as the control changed (test_every_panel_is_driven checks).
PANELS = [
    # 01 and 02: each run's row sets the formula's peak beside the measured one
    # (lessons.formula_beside_measured.run_beside_estimate), which the figure draws category by category
    PanelCase(
        "01_naive_loop.ipynb",
        (("attention", "sdpa"),),
        ("attention=sdpa", "peak: formula", "measured"),
        code=("activation checkpointing", "full", "CheckpointedBlock(block)"),
    ),
    PanelCase(
        "02_memory_accounting.ipynb",
        (("activation checkpointing", "selective"),),
        ("activation_checkpointing=selective", "peak: formula", "measured"),
    ),
    # 03: pure bf16 with stochastic rounding (the note names the dtype each op ran in and the updates lost)
    PanelCase(
        "03_mixed_precision.ipynb",
        (("precision", "bf16"), ("weights", "pure bf16, stochastic rounding")),
        ("precision=bf16", "weights=pure bf16, stochastic rounding", "layer norm bf16", "of the updates lost"),
    ),
    # compile is 04's other lesson, but a compiled run costs a minute of a 2-core CPU: flash attention is cheap
    PanelCase("04_compile_and_flash_attention.ipynb", (("attention", "sdpa"),), ("attention=sdpa",)),
    PanelCase(
        "05_algorithmic_hyperparameters.ipynb",
        (("schedule", "wsd"), ("clipping", "per_tensor"), ("bad batch at steps/2", "repeated token")),
        ("schedule=wsd", "clip_kind=per_tensor", "bad_batch=repeated token"),
    ),
    PanelCase(
        "06_gradient_accumulation.ipynb", (("normalisation", "mean_of_means"),), ("normalisation=mean_of_means",)
    ),
    # 07: a ZeRO stage the old panel did not reach (ZeRO-2: gradients and optimizer state sharded, parameters kept
    # gathered), with the note's bytes lesson: what each rank sent (counted x ring share), and what it wrote to its
    # sockets where gloo can read that (Linux: /proc/self/io)
    PanelCase("07_data_parallelism.ipynb", (("strategy", "ZeRO-2"),), ("strategy=zero2", "ZeRO-2 x2", *BYTES_LESSON)),
    # 08: expert parallelism (MoE), which the old panel did not reach: the bytes lesson and what only the MoE note says
    PanelCase(
        "08_model_parallelism.ipynb",
        (("strategy", "MoE, expert parallel"),),
        ("strategy=moe", "MoE, expert parallel x2", "4 experts top-2", "assignments", *BYTES_LESSON),
    ),
    # (the panel starts from the loop the ladder kept, with 8 chunks where the chunked loss was kept: 4 always differs)
    PanelCase("09_putting_it_together.ipynb", (("loss chunks", "4"),), ("loss_chunks=4",)),
]
MIN_INK = 0.03  # share of the figure's pixels that are not background (panel figures here: 10-30%, a blank one 0)
MIN_BYTES_RATIO = 0.5  # the PNG after a click holds at least half the bytes of the one before it
FIGURE = "img.course-plots, .course-plots img"  # the panel's figure (an Image widget; an <img> inside the hook before)
RUN_ALL_S, CLICK_S = 300, 300  # limits: the tagged cells of one notebook, one run of its panel
POLL_S = 0.25  # how often the page is read while waiting: a wait ends at most this long after what it waits for


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def panel_cells(notebook: str) -> dict:
    """A fresh copy of the notebook with only its cells tagged "panel-setup" or "panel", in order, outputs stripped."""
    nb = json.loads((ROOT / "notebooks" / notebook).read_text(encoding="utf-8"))
    keep = [c for c in nb["cells"] if {SETUP_TAG, PANEL_TAG} & set(c.get("metadata", {}).get("tags", []))]
    for c in keep:
        if c["cell_type"] == "code":
            c["outputs"], c["execution_count"] = [], None
    return {**nb, "cells": keep}


def _has_panel(notebook: Path) -> bool:
    nb = json.loads(notebook.read_text(encoding="utf-8"))
    return any(c["cell_type"] == "code" and re.search(r"\bPanel\(", "".join(c["source"])) for c in nb["cells"])


def test_every_panel_is_driven_and_its_cells_are_tagged():
    """Every notebook that builds a Panel is a case here, and its copy for the browser has a setup and a panel cell,
    the panel cell last (it shows the panel)."""
    with_panel = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb") if _has_panel(p))
    assert with_panel == sorted(c.notebook for c in PANELS)
    for case in PANELS:
        cells = panel_cells(case.notebook)["cells"]
        tags = [c["metadata"]["tags"] for c in cells]
        assert SETUP_TAG in tags[0] and PANEL_TAG in tags[-1], (case.notebook, tags)
        assert re.search(r"^panel\s*$", "".join(cells[-1]["source"]), flags=re.M), (
            f"{case.notebook}: the panel cell should show `panel`"
        )


def test_each_panel_copy_runs_on_its_own_cells(tmp_path, pyflakes, monkeypatch):
    """The browser runs each copy's cells in the kernel the copy before it used, where an earlier notebook's import
    would hide a missing one. So pyflakes checks that every name a copy's cells use is defined in them, as a fresh
    kernel needs (nbval runs every whole notebook in a fresh kernel)."""
    monkeypatch.setenv("PYFLAKES_BUILTINS", "display")  # a name IPython gives every kernel
    for case in PANELS:
        code = "\n\n".join(
            "".join(c["source"]) for c in panel_cells(case.notebook)["cells"] if c["cell_type"] == "code"
        )
        (tmp_path / f"copy_{case}.py").write_text(code + "\n")
        found = pyflakes(tmp_path / f"copy_{case}.py").splitlines()
        # what matters here: names used but not defined, and code pyflakes cannot read (an IPython magic, a syntax
        # error)
        undefined = [
            ln
            for ln in found
            if "undefined name" in ln or not re.match(r"^\S+:\d+:\d+:? \S", ln) or "syntax" in ln.lower()
        ]
        assert undefined == [], (
            f"{case.notebook}: its panel-setup and panel cells use names defined elsewhere: {undefined}"
        )


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on 127.0.0.1 with a token, serving the panel copies of every case's notebook; stopped
    afterwards."""
    tmp_path = tmp_path_factory.mktemp("lab")
    work = tmp_path / "work"
    work.mkdir()
    for case in PANELS:
        (work / case.notebook).write_text(
            json.dumps(panel_cells(case.notebook), indent=1, ensure_ascii=False), encoding="utf-8"
        )
    (work / EXERCISE.notebook).write_text(json.dumps(exercise_cells(), indent=1, ensure_ascii=False), encoding="utf-8")
    settings = tmp_path / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False})
    )
    # Render every cell (JupyterLab 4 otherwise only puts the cells near the viewport in the page).
    notebook_settings = tmp_path / "settings" / "@jupyterlab" / "notebook-extension"
    notebook_settings.mkdir(parents=True)
    (notebook_settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    port, token = free_port(), secrets.token_hex(16)
    env = {
        **{k: v for k, v in os.environ.items() if k != "MPLBACKEND"},
        "COURSE_BUDGET": os.environ.get("COURSE_BUDGET", "smoke"),
        "COURSE_FILL_EXERCISES": "0",  # a learner's page: a stub stays a stub (the exercise test types an answer)
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
        "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
        "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings"),
    }
    cmd = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        f"--port={port}",
        "--ip=127.0.0.1",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={work}",
        "--ServerApp.open_browser=False",
        f"--LabApp.user_settings_dir={tmp_path / 'settings'}",
        "--LabApp.expose_app_in_browser=True",
    ]  # window.jupyterapp: the next notebook opens in the same tab
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(tmp_path / "jupyterlab.log", "w")
    server = subprocess.Popen(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.time() > deadline:
                    raise RuntimeError(
                        f"JupyterLab did not start:\n{(tmp_path / 'jupyterlab.log').read_text()[-3000:]}"
                    )
                time.sleep(0.5)
        yield url, token
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server and the kernels it started
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()


@pytest.fixture(scope="module")
def browser_context():
    exe = chromium_path()
    if exe is None:
        pytest.skip("Debian's chromium is not installed here (.ci/run installs it: apt-get install chromium)")
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="the playwright package is missing: pip install -e '.[test]'"
    )
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS, headless=True)
        try:
            # One browser context for every case: its HTTP and compiled-script caches keep JupyterLab's code from being
            # fetched and compiled again for each notebook (a context per page cost ~5 CPU-s a notebook on 2 cores).
            yield b.new_context(viewport={"width": 1400, "height": 1000})
        finally:
            b.close()


@pytest.fixture(scope="module")
def lab_tab(browser_context, lab):
    """open(case): JupyterLab's tab with that case's notebook open in it, alone. The first case (or the one after a
    case that failed, which may have left a dialog open or a kernel in a bad state) loads JupyterLab, which starts a
    kernel; each next notebook is opened by JupyterLab itself in the same tab, on the same kernel, after the notebook
    before it was closed and every widget of it closed in the kernel."""
    url, token = lab
    tab = {"page": None}

    def open_notebook(case: PanelCase):
        page = tab["page"]
        if page is None or page.is_closed():
            shut_down_kernels(url, token)
            page = tab["page"] = browser_context.new_page()
            page.goto(f"{url}/lab/workspaces/panel-tests/tree/{case.notebook}?reset&token={token}")
        else:
            page.evaluate(NEXT_NOTEBOOK_JS, case.notebook)
        page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
        return page

    def drop():
        if tab["page"] is not None:
            tab["page"].close()
        tab["page"] = None

    open_notebook.drop = drop
    yield open_notebook
    drop()
    shut_down_kernels(url, token)


# The notebook open now: its widgets closed in the kernel (else the next notebook's widget manager would load them
# all from the kernel), the notebook closed without asking about unsaved changes (the copies are throwaway), then the
# next notebook opened on the same kernel.
NEXT_NOTEBOOK_JS = """async (path) => {
  const app = window.jupyterapp;
  const kernel = app.shell.currentWidget.sessionContext.session.kernel;
  await kernel.requestExecute(
    {code: "import ipywidgets; ipywidgets.Widget.close_all()", silent: true, store_history: false}
  ).done;
  for (const w of Array.from(app.shell.widgets('main'))) {
    if (w.context) { w.context.model.dirty = false; w.dispose(); }
  }
  await app.commands.execute('docmanager:open', {path, kernel: {id: kernel.id}});
}"""


def shut_down_kernels(url: str, token: str) -> None:
    """Stop every session of the server and its kernel (several notebooks' sessions share one), so that what runs
    next starts afresh and has the CPU to itself."""
    req = urllib.request.Request(f"{url}/api/sessions?token={token}")
    for session in json.loads(urllib.request.urlopen(req, timeout=10).read()):
        try:
            urllib.request.urlopen(
                urllib.request.Request(f"{url}/api/sessions/{session['id']}?token={token}", method="DELETE"), timeout=30
            )
        except urllib.error.HTTPError as e:  # gone with a session before it that had the same kernel
            if e.code != 404:
                raise


# Reads the panel figure's PNG as the page has it (data: or blob: URL) and what the browser itself decoded:
# the share of non-background pixels drawn onto a canvas.
READ_FIGURE_JS = """async (sel) => {
  const img = document.querySelector(sel);
  if (!img || !img.src) return null;
  const src = img.src;
  if (!img.complete || !img.naturalWidth) return {src, decoded: false};
  const bytes = new Uint8Array(await (await fetch(src)).arrayBuffer());
  let bin = "";
  for (let i = 0; i < bytes.length; i += 0x8000) bin += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  const canvas = document.createElement("canvas");
  canvas.width = img.naturalWidth; canvas.height = img.naturalHeight;
  const ctx = canvas.getContext("2d");
  ctx.drawImage(img, 0, 0);
  const px = ctx.getImageData(0, 0, canvas.width, canvas.height).data;
  let ink = 0;
  for (let i = 0; i < px.length; i += 4) if (px[i + 3] > 16 && Math.min(px[i], px[i + 1], px[i + 2]) < 235) ink++;
  return {
    src, decoded: true, b64: btoa(bin), width: img.naturalWidth, height: img.naturalHeight,
    browser_ink: ink / (px.length / 4),
  };
}"""


def png_ink(png: bytes) -> tuple[float, tuple[int, int]]:
    """Share of pixels that are neither transparent nor (near-)white, and the (width, height) of a PNG."""
    import matplotlib.image as mpimg
    import numpy as np

    a = mpimg.imread(io.BytesIO(png), format="png")
    if a.ndim == 2:
        a = a[..., None].repeat(3, axis=2)
    rgb = a[..., :3].astype(float)
    opaque = a[..., 3] > 0.06 if a.shape[2] == 4 else np.ones(a.shape[:2], bool)
    ink = opaque & (rgb.min(axis=2) < 235 / 255)
    return float(ink.mean()), (a.shape[1], a.shape[0])


def read_figure(page) -> dict | None:
    fig = page.evaluate(READ_FIGURE_JS, FIGURE)
    if fig and fig.get("decoded"):
        fig["png"] = base64.b64decode(fig.pop("b64"))
        fig["ink"], fig["size"] = png_ink(fig["png"])
        fig["bytes"] = len(fig["png"])
    return fig


def describe(fig: dict | None) -> str:
    if not fig:
        return "no figure in the page"
    if not fig.get("decoded"):
        return f"an image the browser could not decode ({fig['src'][:40]}...)"
    return (
        f"{fig['size'][0]}x{fig['size'][1]} px, {fig['bytes']:,} bytes, {fig['ink']:.2%} of pixels drawn "
        f"(the browser's canvas: {fig['browser_ink']:.2%})"
    )


@pytest.mark.parametrize("case", PANELS, ids=str)
def test_a_notebooks_panel_reruns_its_lesson_and_redraws_a_real_figure(lab_tab, lab, case):
    url, token = lab
    shots = Path(os.environ.get("BROWSER_TEST_SHOTS", "/tmp"))
    t0 = time.time()
    passed = False
    try:
        page = lab_tab(case)
        _run_all_cells(page)

        n_code = sum(1 for c in panel_cells(case.notebook)["cells"] if c["cell_type"] == "code")
        deadline = time.time() + RUN_ALL_S
        while True:
            prompts = page.locator(".jp-CodeCell .jp-InputPrompt").all_inner_texts()
            done = sum(1 for t in prompts if re.search(r"\[\d+\]", t))
            error = _first_error(page)
            if error:
                pytest.fail(f"a cell failed in JupyterLab:\n{error}")
            if done == n_code and not any("*" in t for t in prompts):
                break
            if time.time() > deadline:
                page.screenshot(path=str(shots / f"browser_test_{case}_timeout.png"))
                pytest.fail(f"only {done} of {n_code} cells finished in time (of {len(prompts)} in the page)")
            time.sleep(POLL_S)
        report = [f"cells ran in {time.time() - t0:.0f} s"]

        page.wait_for_selector(".course-run", timeout=30_000)
        table_rows = page.locator(".course-table .course-results tbody tr")
        before = read_figure(page)  # None or not decoded where no run was made from code: the panel starts empty
        if before and before.get("decoded"):
            assert before["ink"] >= MIN_INK, f"the figure after the cells ran: {describe(before)}"
            report.append(f"before: {describe(before)}")
        else:
            before = None

        for label, option in case.settings:
            _choose(page, label, option)
        for click in range(1, case.clicks + 1):
            rows_before = table_rows.count()
            t_click = time.time()
            page.locator(".course-run").click()
            deadline = time.time() + CLICK_S
            while table_rows.count() == rows_before:
                error = _first_error(page)
                assert error is None, error
                assert time.time() < deadline, f"click {click} on Run added no row to the results table"
                time.sleep(POLL_S)
            new_row = table_rows.nth(rows_before).inner_text()
            assert all(e in new_row for e in case.expect) and "ok" in new_row.split(), new_row
            # The row comes before the figure: wait for a new image, then for it to hold a drawn figure.
            page.wait_for_function(
                "([sel, before]) => { const i = document.querySelector(sel); return i && i.src && i.src !== before; }",
                arg=[FIGURE, before["src"] if before else ""],
                timeout=60_000,
            )
            deadline = time.time() + 30
            while True:
                after = read_figure(page)
                good = (
                    after
                    and after.get("decoded")
                    and after["ink"] >= MIN_INK
                    and after["browser_ink"] >= MIN_INK
                    and (before is None or after["bytes"] >= MIN_BYTES_RATIO * before["bytes"])
                )
                if good or time.time() > deadline:
                    break
                time.sleep(POLL_S)
            report.append(f"click {click} ({time.time() - t_click:.0f} s): {describe(after)}")
            if click == case.clicks or not good:
                page.locator(".jp-CodeCell", has=page.locator(".course-run")).first.screenshot(
                    path=str(shots / f"browser_test_{case}_click{click}.png")
                )
            assert good, (
                f"the panel's figure is not a drawn figure after click {click} on Run "
                f"(needs >= {MIN_INK:.0%} drawn pixels and >= {MIN_BYTES_RATIO:.0%} of the bytes before):\n"
                + "\n".join(report)
            )
            before = after
        if case.code:
            report.append(_check_code_and_export(page, *case.code))
        print(f"\n{case.notebook} in {time.time() - t0:.0f} s: " + "; ".join(report))
        passed = True
    finally:
        if not passed:
            lab_tab.drop()  # the next case starts from a fresh page and a fresh kernel


# ---- a learner solves an exercise in the page ---------------------------------------------------------------------

# 05's warm-up + cosine exercise: its setup cells, the exercise cell (the stub), and the cell after it, which draws the
# learner's schedule beside torch's. The test types a solution over the stub, as a learner would, and runs the cells.
EXERCISE = PanelCase("exercise_05.ipynb", (), ())
EXERCISE_SOURCE, EXERCISE_NAME = "05_algorithmic_hyperparameters.ipynb", '"warmup_cosine"'
SOLUTION = """def lr_at(step, lr, warmup, total, min_lr_ratio=0.1):
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - 1 - warmup)
    floor = min_lr_ratio * lr
    return floor + 0.5 * (lr - floor) * (1 + math.cos(math.pi * progress))

lr_at = exercises.attempt("warmup_cosine", lr_at)
"""


def exercise_cells() -> dict:
    nb = json.loads((ROOT / "notebooks" / EXERCISE_SOURCE).read_text(encoding="utf-8"))
    cells = nb["cells"]
    i = next(
        k
        for k, c in enumerate(cells)
        if "exercise" in c.get("metadata", {}).get("tags", []) and EXERCISE_NAME in "".join(c["source"])
    )
    keep = [c for c in cells if SETUP_TAG in c.get("metadata", {}).get("tags", [])] + cells[i : i + 2]
    for c in keep:
        if c["cell_type"] == "code":
            c["outputs"], c["execution_count"] = [], None
    return {**nb, "cells": keep}


def test_a_learner_types_a_solution_and_the_checker_passes_and_the_figure_draws_it(lab_tab):
    """The exercise cell, solved through the page (typed over the stub in the cell's editor), says "solved", and the
    cell after it draws the learner's schedule (its figure has real content, and the printout names lr_at's gap)."""
    page = lab_tab(EXERCISE)
    try:
        cells = page.locator(".jp-Notebook .jp-CodeCell")
        n = sum(c["cell_type"] == "code" for c in exercise_cells()["cells"])
        stub = cells.nth(n - 2)  # the exercise cell; the last one draws what it returns
        _wait_for_text(stub, "raise NotImplementedError", "the exercise cell, rendered", timeout_s=60)
        stub.locator(".cm-content").click()
        page.keyboard.press("Control+A")
        page.keyboard.insert_text(SOLUTION)
        assert "raise NotImplementedError" not in stub.inner_text()
        _run_all_cells(page)
        verdict = stub.locator(".jp-OutputArea")
        _wait_for_text(verdict, "solved", "the exercise cell's verdict", timeout_s=RUN_ALL_S)
        assert "not solved" not in verdict.inner_text()
        drawn = cells.nth(cells.count() - 1).locator(".jp-OutputArea")
        _wait_for_text(drawn, "lr_at's gap", "the cell that draws the learner's schedule", timeout_s=RUN_ALL_S)
        img = drawn.locator("img").first
        img.wait_for(timeout=60_000)
        png = base64.b64decode(img.get_attribute("src").split(",", 1)[1])
        ink, size = png_ink(png)
        assert ink > MIN_INK, f"the learner's schedule figure is {size} px with {ink:.2%} drawn"
        assert (error := _first_error(page)) is None, error
    finally:
        lab_tab.drop()


def _choose(page, label: str, option: str) -> None:
    """Choose `option` in the panel's dropdown labelled `label`."""
    dropdown = page.locator(".widget-dropdown").filter(
        has=page.locator("label", has_text=re.compile(rf"^{re.escape(label)}$"))
    )
    assert dropdown.count() == 1, f"the panel has {dropdown.count()} dropdowns labelled {label!r}"
    dropdown.locator("select").select_option(label=option)


def _wait_for_text(locator, text: str, what: str, timeout_s: float = 30) -> str:
    deadline = time.time() + timeout_s
    while text not in (seen := locator.inner_text()):
        assert time.time() < deadline, f"{what}: {text!r} not shown; it shows {seen[-500:]!r}"
        time.sleep(POLL_S)
    return seen


def _check_code_and_export(page, label: str, option: str, marker: str) -> str:
    """The panel's code section, opened, shows the diff of the configuration against naive fp32 and follows a control;
    the export button writes that script next to the notebook and says where."""
    t0 = time.time()
    page.locator(".course-code").get_by_text(re.compile(r"^Code: ")).click()
    diff = page.locator(".course-diff")
    _wait_for_text(diff, "lines added", "the code section after it was opened")
    assert marker not in diff.inner_text()
    _choose(page, label, option)
    _wait_for_text(diff, marker, f"the code section after {label} = {option}")
    page.locator(".course-export").click()
    status = _wait_for_text(page.locator(".course-export-status"), "Wrote", "the export button's status")
    path = Path(re.search(r"Wrote (\S+\.py)", status).group(1))
    assert path.is_file() and marker in path.read_text(), status
    return f"code section follows {label}; exported {path.name} ({time.time() - t0:.1f} s)"


def _run_all_cells(page) -> None:
    """Run > Run All Cells once the kernel is idle; again if no cell started (a click made while the kernel was still
    connecting can be lost on a loaded machine: the notebook then sits idle with every prompt empty)."""
    for _ in range(3):
        try:
            page.wait_for_function(
                "() => /\\bIdle\\b/.test(document.querySelector('#jp-main-statusbar')?.innerText || '')"
                " || !!document.querySelector(\".jp-Notebook-ExecutionIndicator[data-status='idle']\")",
                timeout=90_000,
            )
        except Exception:  # noqa: BLE001 - the status bar differs between versions: fall back to a pause
            time.sleep(5)
        time.sleep(1)  # the kernel may still be connecting: a click made now can be lost
        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
        page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
        deadline = time.time() + 30
        while time.time() < deadline:
            if any(
                re.search(r"\[(\*|\d+)\]", t) for t in page.locator(".jp-CodeCell .jp-InputPrompt").all_inner_texts()
            ):
                return
            time.sleep(POLL_S)
    pytest.fail("Run All Cells started no cell (3 tries)")


def _first_error(page) -> str | None:
    for text in page.locator(".jp-OutputArea-output").all_inner_texts():
        if "Traceback (most recent call last)" in text or re.search(r"^\w+Error\b", text, flags=re.M):
            return text[-3000:]
    return None
