"""The GPU check's script (benchmarks/gpu_check.sh) and its rows (benchmarks/gpu_rows.txt): every
row names a test that exists, once, on the "cuda" runner, and the script parses.  Its rehearsal on
a machine without a GPU (GPU_CHECK_REHEARSAL=1, docs/backends.md) runs longer than CI allows."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rows() -> list[tuple[str, str]]:
    with open(os.path.join(ROOT, "benchmarks", "gpu_rows.txt")) as f:
        lines = [ln.rstrip("\n") for ln in f if ln.strip() and not ln.startswith("#")]
    return [tuple(ln.split("\t")) for ln in lines]


def test_every_row_names_one_existing_test_on_the_cuda_runner():
    rows = _rows()
    assert all(len(r) == 2 and r[0] and r[1] for r in rows), rows
    ids = [i for _, i in rows]
    assert len(set(ids)) == len(ids) and len({r for r, _ in rows}) == len(rows)
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "-p", "no:xdist", "--backends", "cuda", *ids], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    collected = {ln.strip() for ln in r.stdout.splitlines()}
    missing = [i for i in ids if i not in collected]
    assert r.returncode == 0 and not missing, (missing, r.stdout[-2000:], r.stderr[-2000:])


def test_the_check_script_parses():
    r = subprocess.run(["bash", "-n", os.path.join(ROOT, "benchmarks", "gpu_check.sh")], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
