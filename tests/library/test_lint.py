"""The Python code is lint-clean (ruff, configured in pyproject.toml)."""
from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.fast

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_ruff_clean():
    ruff = shutil.which("ruff") or str(pathlib.Path(sys.executable).with_name("ruff"))
    if not pathlib.Path(ruff).exists():
        pytest.skip("ruff is not installed (pip install -e '.[test]' brings it)")
    out = subprocess.run([ruff, "check", "jax_nbx", "tests", "benchmarks"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
