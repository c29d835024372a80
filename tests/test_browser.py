"""The course in a real browser: JupyterLab in headless Chromium runs notebook 01, changes a toggle of the
panel, clicks Run, and checks that the results table gains a row and the plot changes.

Needs Debian's `chromium` (installed by .ci/run) and the Python `playwright` package (the test extra).
Skipped, with the reason in the summary, only where those cannot be had.
"""
from __future__ import annotations

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
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab(tmp_path):
    """A JupyterLab server on 127.0.0.1 with a token, serving a fresh copy of notebook 01; stopped afterwards."""
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(ROOT / "notebooks" / "01_naive_loop.ipynb", work / "01_naive_loop.ipynb")
    settings = tmp_path / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    # Render every cell (JupyterLab 4 otherwise only puts the cells near the viewport in the page).
    notebook_settings = tmp_path / "settings" / "@jupyterlab" / "notebook-extension"
    notebook_settings.mkdir(parents=True)
    (notebook_settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    port, token = free_port(), secrets.token_hex(16)
    env = {**{k: v for k, v in os.environ.items() if k != "MPLBACKEND"}, "COURSE_BUDGET": os.environ.get("COURSE_BUDGET", "smoke"), "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "JUPYTER_CONFIG_DIR": str(tmp_path / "config"), "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings")}
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ip=127.0.0.1", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={work}", "--ServerApp.open_browser=False", f"--LabApp.user_settings_dir={tmp_path / 'settings'}"]
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
                    raise RuntimeError(f"JupyterLab did not start:\n{(tmp_path / 'jupyterlab.log').read_text()[-3000:]}")
                time.sleep(0.5)
        yield url, token
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server and the kernels it started
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()


def test_notebook_01_runs_in_jupyterlab_and_the_panel_updates(lab):
    exe = chromium_path()
    if exe is None:
        pytest.skip("Debian's chromium is not installed here (.ci/run installs it: apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is missing: pip install -e '.[test]'")
    url, token = lab
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{url}/lab/tree/01_naive_loop.ipynb?token={token}")
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle'], .jp-Toolbar-kernelStatus", timeout=60_000)
            time.sleep(2)  # let the kernel finish starting
            page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
            page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()

            n_code = _count_code_cells()
            deadline = time.time() + 420
            while True:
                prompts = page.locator(".jp-CodeCell .jp-InputPrompt").all_inner_texts()
                done = sum(1 for t in prompts if re.search(r"\[\d+\]", t))
                error = _first_error(page)
                if error:
                    pytest.fail(f"a cell failed in JupyterLab:\n{error}")
                if done == n_code and not any("*" in t for t in prompts):
                    break
                if time.time() > deadline:
                    page.screenshot(path=str(Path(os.environ.get("BROWSER_TEST_SHOTS", "/tmp")) / "browser_test_timeout.png"))
                    pytest.fail(f"only {done} of {n_code} cells finished in time (of {len(prompts)} in the page)")
                time.sleep(1)

            table_rows = page.locator(".course-table .course-results tbody tr")
            rows_before = table_rows.count()
            assert rows_before >= 1, "the panel's results table should hold the run made from code"
            plot_before = page.locator(".course-plots img").first.get_attribute("src")

            page.locator(".widget-dropdown", has_text="attention").locator("select").select_option("sdpa")
            page.locator(".course-run").click()
            deadline = time.time() + 300
            while table_rows.count() == rows_before:
                error = _first_error(page)
                assert error is None, error
                assert time.time() < deadline, "clicking Run added no row to the results table"
                time.sleep(1)
            new_row = table_rows.nth(rows_before).inner_text()
            assert "attention=sdpa" in new_row and "ok" in new_row, new_row
            page.wait_for_function("(before) => { const i = document.querySelector('.course-plots img'); return i && i.src !== before; }",
                                   arg=plot_before, timeout=60_000)
        finally:
            browser.close()


def _count_code_cells() -> int:
    nb = json.loads((ROOT / "notebooks" / "01_naive_loop.ipynb").read_text())
    return sum(1 for c in nb["cells"] if c["cell_type"] == "code")


def _first_error(page) -> str | None:
    for text in page.locator(".jp-OutputArea-output").all_inner_texts():
        if "Traceback (most recent call last)" in text or re.search(r"^\w+Error\b", text, flags=re.M):
            return text[-3000:]
    return None
