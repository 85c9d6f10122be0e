"""The notebooks run top to bottom; the main job prints its table."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path):
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), \
        f"{path.name} is stored with outputs"
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()


def test_main_job_prints_table():
    out = subprocess.run([sys.executable, "-m", "jax_nbx", "--model", "granite-3.0-1b-a400m",
                          "--tokens", "16", "--repeats", "1"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert "E=32 k=8 H=1024 I=512" in out
    rows = [re.split(r"\s{2,}", line.strip()) for line in out.splitlines()
            if line.strip().startswith(("ffi", "xla"))]
    assert [r[0] for r in rows] == ["ffi", "ffi, prepacked", "xla"]
    for r in rows:
        assert float(r[-1]) < 1e-5, r  # max relative error vs float64


def test_main_job_rejects_bad_options():
    r = subprocess.run([sys.executable, "-m", "jax_nbx", "--tokens", "0"], capture_output=True, text=True)
    assert r.returncode == 2 and "--tokens must be >= 1; got 0" in r.stderr
