"""benchmarks/tune_gpu.py's search without a GPU: a stand-in timer picks the
configs, the budget stops it, and the file it writes is what the CUDA
planner (`jax_nbx.backends.cuda.plan.gemm_configs`) then reads."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import tune_gpu  # noqa: E402

from jax_nbx.backends.cuda import plan  # noqa: E402
from jax_nbx.models import MODELS  # noqa: E402

pytestmark = pytest.mark.fast


def fake_time(job, c1, c2):
    """A stand-in for the GPU: fastest at BM=64, BN=128, BK=64, 8 warps, 3 stages."""
    if c1["BK"] == 128 and c1["num_stages"] == 4:
        raise RuntimeError("out of shared memory")  # a candidate that does not fit: skipped
    return (1.0 + abs(np.log2(c1["BM"] / 64)) + abs(np.log2(c1["BN"] / 128)) + abs(np.log2(c1["BK"] / 64))
            + 0.5 * (c1["num_warps"] != 8) + 0.25 * (c1["num_stages"] != 3)) * 1e-3


def test_search_writes_what_the_planner_reads(tmp_path, monkeypatch):
    out = tmp_path / "H200.json"
    out.write_text(json.dumps({"1,2,3,bf16": {"7": [{"BM": 16}, {"BM": 16}]}}))  # kept: merged into
    jobs = [tune_gpu.Job(MODELS["olmoe-1b-7b"], 4096), tune_gpu.Job(MODELS["qwen3-30b-a3b"], 512)]
    report = tune_gpu.tune(jobs, fake_time, out, progress=False)
    table = json.loads(out.read_text())
    assert "1,2,3,bf16" in table
    best = {"BM": 64, "BN": 128, "BK": 64, "num_warps": 8, "num_stages": 3}
    olmoe = table["64,2048,1024,bf16"][str(4096 * 8)]
    assert olmoe == [best, dict(best, BN=256)]
    d, b, c1, _ = report["olmoe-1b-7b T=4096"]
    assert c1 == best and b < d  # the defaults were timed first
    # Qwen3 at T=512: 32 rows per expert, so BM is capped at 64 -- the best stays reachable
    assert table["128,2048,768,bf16"][str(512 * 8)][0] == best
    # the planner reads the file (nearest M) instead of its defaults
    monkeypatch.setenv("JAX_NBX_TRITON_CONFIGS", str(out))
    c1, c2 = plan.gemm_configs(4096 * 8, 64, 2048, 1024, np.dtype("bfloat16"), None)
    assert (c1.BM, c1.BN, c1.BK, c1.num_warps, c1.num_stages) == (64, 128, 64, 8, 3) and c2.BN == 256


def test_candidates_skip_wasteful_row_blocks_and_start_with_defaults():
    d = ({"BM": 16, "BN": 64, "BK": 64, "num_warps": 4, "num_stages": 3},
         {"BM": 16, "BN": 128, "BK": 64, "num_warps": 4, "num_stages": 3})
    pairs = tune_gpu.candidates_for(3.0, d)  # 3 rows per expert: BM <= 2 * 16
    assert pairs[0] == d and d not in pairs[1:]
    assert {c["BM"] for c, _ in pairs[1:]} == {16, 32}
    assert all(c2["BM"] == c1["BM"] and c2["BN"] == min(2 * c1["BN"], 256) for c1, c2 in pairs[1:])
    assert {c["BM"] for c, _ in tune_gpu.candidates_for(500.0, d)[1:]} == {16, 32, 64, 128}


def test_budget_stops_new_candidates_and_keeps_finished_jobs(tmp_path):
    out = tmp_path / "cfg.json"
    jobs = [tune_gpu.Job(MODELS["olmoe-1b-7b"], 4096), tune_gpu.Job(MODELS["mixtral-8x7b"], 4096)]
    calls = []

    def timer(job, c1, c2):
        calls.append(job.label)
        return fake_time(job, c1, c2)

    report = tune_gpu.tune(jobs, timer, out, budget_s=0.0, progress=False)
    assert calls == [] and report == {} and not out.exists()  # nothing started past the budget
    tune_gpu.tune(jobs[:1], timer, out, progress=False)
    assert list(json.loads(out.read_text())) == ["64,2048,1024,bf16"]
