"""Banded vs unbanded: what cutting the tokens into bands costs in time, and
what it saves in memory.

    python benchmarks/bands.py                       # OLMoE-1B-7B layer, T=512, f32
    python benchmarks/bands.py --model granite-3.0-1b-a400m --tokens 2048

With the workspace capped at what a band of T/2, T/4, T/8 tokens needs
(about 1/2, 1/4, 1/8 of the full workspace, plus a fixed part that does not
shrink with the band), prints: tokens per band, bands, the account's peak
(never above the cap), the median time and its ratio to the unbanded run
measured in the same process (runs interleaved), and the growth of the peak
resident memory of a separate process across one call (peak reset before).
"""
from __future__ import annotations

import argparse
import functools
import json
import resource
import subprocess
import sys
import time

import jax
import numpy as np
from bench_common import DTYPES, format_table, machine, make_layer

import jax_nbx as nbx
from jax_nbx.planning import plan_band_tokens

SPLITS = [1, 2, 4, 8]


def cap_for(m, T, split):
    """Workspace of one band of ceil(T / split) tokens."""
    return nbx.memory.fused_moe_workspace_bytes(-(-T // split), m.k, m.E, m.H, m.I)


def _rss_peak() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(model, T, dtype, split):
    """One run in a fresh process: its peak RSS growth and the account's peak."""
    m = nbx.MODELS[model]
    x, w, ids, experts = make_layer(m, T, DTYPES[dtype])
    f = jax.jit(functools.partial(nbx.fused_moe, max_workspace_bytes=cap_for(m, T, split)))
    f = f.lower(x, w, ids, experts).compile()
    jax.block_until_ready((x, w, ids, experts))
    with open("/proc/self/clear_refs", "w") as fh:  # resets VmHWM to the current RSS
        fh.write("5")
    before = _rss_peak()
    f(x, w, ids, experts).block_until_ready()
    after = _rss_peak()
    print(json.dumps({"rss_before": before, "rss_after": after,
                      "account_peak": nbx.memory.stats()["cpu:0"]["peak"]}))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="olmoe-1b-7b", choices=sorted(nbx.MODELS))
    p.add_argument("--tokens", "-T", type=int, default=512)
    p.add_argument("--dtype", default="f32", choices=sorted(DTYPES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child is not None:
        return child(a.model, a.tokens, a.dtype, a.child)

    m, T = nbx.MODELS[a.model], a.tokens
    print(f"bands benchmark: {m.name} (E={m.E} k={m.k} H={m.H} I={m.I}), T={T}, {a.dtype}")
    print(f"machine: {machine()}")
    x, w, ids, experts = make_layer(m, T, DTYPES[a.dtype])
    fns, caps = {}, {}
    for sp in SPLITS:
        caps[sp] = cap_for(m, T, sp)
        fns[sp] = jax.jit(functools.partial(nbx.fused_moe, max_workspace_bytes=caps[sp]))
        fns[sp](x, w, ids, experts).block_until_ready()          # compile + warm
    times = {sp: [] for sp in SPLITS}
    peaks = {}
    for _ in range(a.repeats):                                    # interleaved: same noise for all
        for sp in SPLITS:
            nbx.memory.reset_peak()
            t0 = time.perf_counter()
            fns[sp](x, w, ids, experts).block_until_ready()
            times[sp].append(time.perf_counter() - t0)
            peaks[sp] = nbx.memory.stats()["cpu:0"]["peak"]
    base = float(np.median(times[1]))
    rows = []
    for sp in SPLITS:
        r = subprocess.run([sys.executable, __file__, "--model", a.model, "-T", str(T), "--dtype",
                            a.dtype, "--child", str(sp)], capture_output=True, text=True,
                           check=True)
        c = json.loads(r.stdout.strip().splitlines()[-1])
        band = plan_band_tokens(T, m.k, m.E, m.H, m.I, caps[sp])
        t = float(np.median(times[sp]))
        assert peaks[sp] <= caps[sp] and c["account_peak"] <= caps[sp]
        rows.append(["unbanded" if sp == 1 else f"T/{sp}",
                     nbx.memory.format_bytes(caps[sp]), str(band), str(-(-T // band)),
                     nbx.memory.format_bytes(peaks[sp]), f"{t * 1e3:.0f}", f"{t / base:.3f}",
                     nbx.memory.format_bytes(c["rss_after"] - c["rss_before"])])
    print()
    print(format_table(["cap (band of)", "cap bytes", "tokens/band", "bands", "account peak",
                        "ms (median)", "time / unbanded", "peak RSS growth in call (own process)"],
                       rows))


if __name__ == "__main__":
    main()
