"""The shipped data (tokenizer ranks, measured and reference results) lives in the repository's top-level data/ and
is installed as the package data `course_lib._data`: these tests build the project the three ways pip installs it
(a wheel, as `pip install .` does; an editable install; a strict editable install) from a copy of the repository,
and load the tokenizer from each in a fresh interpreter that cannot see this checkout; and a source tree on sys.path
with no install at all (how .ci/gpu runs the course on a GPU machine), where the data/ beside the package is used.

Nothing reaches the network: builds run with setuptools from this environment, without build isolation or an index.
"""

import importlib.metadata
import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest


def _setuptools_major() -> int:
    try:
        return int(importlib.metadata.version("setuptools").split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        return 0


# The builds run without isolation, on this environment's setuptools: as new as pyproject's build-system asks.
builds = pytest.mark.skipif(
    _setuptools_major() < 77,
    reason="the builds need setuptools 77 or later in this environment: pip install 'setuptools>=77'",
)

ROOT = Path(__file__).resolve().parent.parent
RANKS = "shakespeare_bpe.tiktoken"

# Run in the child interpreter: load the tokenizer through the course's own function, check where every file was
# found, then run `python -m course_lib bpe` (without and with --force) with the (slow) trainer replaced by a stub, to
# see where it writes.
CHECK = r"""
import contextlib, io, json, sys
from pathlib import Path

expect_pkg, expect_data, expect_ranks = (Path(p) for p in sys.argv[1:4])
import course_lib, course_lib.data as d, course_lib.reference as ref
assert Path(course_lib.__file__).is_relative_to(expect_pkg), course_lib.__file__
assert d.DATA_DIR == expect_data, d.DATA_DIR
assert d.RANKS_FILE.resolve() == expect_ranks, d.RANKS_FILE
assert ref.REFERENCE_DIR == d.DATA_DIR / "reference"
enc = d.get_tokenizer()
text = "Now is the winter of our discontent\nMade glorious summer by this sun of York;"
assert enc.n_vocab == 4097 and enc.decode(enc.encode(text)) == text
measured = sorted(p.name for p in d.MEASURED_DIR.glob("*.json"))
assert measured, d.MEASURED_DIR
# An exported script finds the same ranks file, the way course_lib.data does (it cannot import course_lib.data).
from course_lib import config, export
script = {"__name__": "exported_train"}
exec(compile(export.script(config.tiny_preset("cpu")), "train.py", "exec"), script)
assert script["course_ranks_file"]().resolve() == expect_ranks, script["course_ranks_file"]()

from course_lib import __main__ as cli, bpe
bpe.train_bpe = lambda text, n: {bytes([i]): i for i in range(256)}
d.corpus_text = lambda: ""
def bpe_cli(*args):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        return cli.main(["bpe", *args]), err.getvalue()

unforced_rc, unforced_err = bpe_cli()  # the shipped ranks are replaced only with --force
rc, err = bpe_cli("--force")
print(json.dumps({"data_dir": str(d.DATA_DIR), "measured": measured, "bpe_rc": rc, "bpe_err": err,
                  "unforced_rc": unforced_rc, "unforced_err": unforced_err}))
"""


def copy_of_repository(dest: Path) -> Path:
    """What a build needs, copied, so that builds neither write into this checkout nor pick up stale build/ files."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, dest / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints")
    for name in ("course_lib", "data"):
        shutil.copytree(ROOT / name, dest / name, ignore=skip)
    return dest


def build(src: Path, out: Path, editable_mode: str | None = None) -> Path:
    """A wheel of `src` (as `pip install .` builds one), or the editable wheel `pip install -e .` would install."""
    out.mkdir()
    if editable_mode is None:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            str(out),
            ".",
        ]
    else:
        cmd = [
            sys.executable,
            "-c",
            "import sys, setuptools.build_meta as b; "
            f"b.build_editable(sys.argv[1], {{'editable_mode': {editable_mode!r}}})",
            str(out),
        ]
    subprocess.run(cmd, cwd=src, check=True, capture_output=True, timeout=120)
    (wheel,) = out.glob("*.whl")
    return wheel


def run_check(tmp_path: Path, sitedir: Path, expect_pkg: Path, expect_data: Path, expect_ranks: Path) -> dict:
    """CHECK in a fresh interpreter that sees `sitedir` (its .pth files processed, as pip's install would) and this
    environment's site-packages for torch and tiktoken, but not this checkout: no site (so not this environment's
    editable install of course_lib), no current directory on sys.path, and run from elsewhere."""
    deps = [p for p in site.getsitepackages() if Path(p).is_dir()]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = os.pathsep.join(deps)
    # First on sys.path: this environment's site-packages holds its own editable finder module of the same name.
    code = f"import site, sys; sys.path.insert(0, {str(sitedir)!r}); site.addsitedir({str(sitedir)!r})\n" + CHECK
    cwd = tmp_path / "elsewhere"
    cwd.mkdir(exist_ok=True)
    proc = subprocess.run(
        [sys.executable, "-S", "-P", "-c", code, str(expect_pkg), str(expect_data), str(expect_ranks)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@builds
def test_wheel_ships_the_data_and_an_installed_copy_finds_it(tmp_path):
    src = copy_of_repository(tmp_path / "src")
    wheel = build(src, tmp_path / "dist")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert z.read(f"course_lib/_data/{RANKS}") == (ROOT / "data" / RANKS).read_bytes()
    assert "course_lib/_data/__init__.py" in names
    for sub in ("measured", "reference"):
        for f in (ROOT / "data" / sub).glob("**/*.json"):
            assert f"course_lib/_data/{f.relative_to(ROOT / 'data').as_posix()}" in names
    assert not any(n.startswith("data/") for n in names)  # no top-level `data` package in site-packages
    # The licence travels with every install: its text in the wheel, its SPDX name in the metadata.
    with zipfile.ZipFile(wheel) as z:
        (licence,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        assert z.read(licence) == (ROOT / "LICENSE").read_bytes()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        assert "License-Expression: MIT" in z.read(metadata).decode().splitlines()

    installed = tmp_path / "site-packages"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(installed)
    data_dir = installed / "course_lib" / "_data"
    ranks_before = (data_dir / RANKS).read_bytes()
    out = run_check(tmp_path, installed, installed / "course_lib", data_dir, data_dir / RANKS)
    assert out["measured"] == sorted(p.name for p in (ROOT / "data" / "measured").glob("*.json"))
    # Retraining the shipped ranks inside an installed package is refused, saying what to do instead.
    assert out["bpe_rc"] == 2 and "--out" in out["bpe_err"] and "pip install -e ." in out["bpe_err"]
    assert (data_dir / RANKS).read_bytes() == ranks_before


def test_a_source_tree_with_no_install_reads_its_own_data_folder(tmp_path):
    src = copy_of_repository(tmp_path / "src")  # on sys.path as PYTHONPATH=$PWD puts it: no course_lib._data package
    out = run_check(tmp_path, src, src / "course_lib", src / "data", src / "data" / RANKS)
    assert out["data_dir"] == str(src / "data") and out["bpe_rc"] == 0, out["bpe_err"]
    assert out["unforced_rc"] == 2 and "--force" in out["unforced_err"], out["unforced_err"]


@builds
@pytest.mark.parametrize("mode", ["lenient", "strict"])  # lenient: what plain `pip install -e .` does
def test_editable_install_reads_and_writes_the_repository_data_folder(tmp_path, mode):
    src = copy_of_repository(tmp_path / "src")
    installed = tmp_path / "site-packages"
    with zipfile.ZipFile(build(src, tmp_path / "dist", editable_mode=mode)) as z:
        z.extractall(installed)
    if mode == "strict":  # a tree of links to the repository's files, under its build/
        (tree,) = (src / "build").glob("__editable__.*")
        pkg, data_dir = tree / "course_lib", tree / "course_lib" / "_data"
    else:
        pkg, data_dir = src / "course_lib", src / "data"
    out = run_check(tmp_path, installed, pkg, data_dir, src / "data" / RANKS)
    # `python -m course_lib bpe --force` rewrites the repository's own data/ file (here the stub's 256 ranks); without
    # --force it refuses.
    assert out["bpe_rc"] == 0, out["bpe_err"]
    assert out["unforced_rc"] == 2 and "--force" in out["unforced_err"], out["unforced_err"]
    assert len((src / "data" / RANKS).read_text().splitlines()) == 256
