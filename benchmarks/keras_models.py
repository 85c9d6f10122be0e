"""keras-hub models, unpatched against patched (`jax_nbx.integrations.keras_hub.patch_moe`).

    python benchmarks/keras_models.py [--models qwen3_moe,gpt_oss] [--layers 2] [--prompt 32] \
        [--new 16] [--repeats 3] [--ways unpatched,bf16,quant]

Models: keras-hub's ``Qwen3MoeCausalLM`` with Qwen3-30B-A3B's layer shapes (H 2048, expert I 768,
E 128, k 8, 32 query / 4 KV heads of 128) and ``GptOssCausalLM`` with gpt-oss-20b's (H 2880, I 2880,
E 32, k 4, 64 query / 8 KV heads of 64), ``--layers`` decoder layers (default 2, not the real 48 /
24) and a 4,096-token vocabulary (not the real 151,936 / 201,088: the embedding and the output
projection are not what is measured); keras' random initializers; bfloat16 (``dtype="bfloat16"``).

Ways, each in a fresh subprocess (its own peak RSS):
  unpatched  keras-hub's own blocks (every token through every expert: keras-hub's dense einsum)
  bf16       patch_moe(model): the same bf16 experts through fused_moe
  quant      patch_moe(model, format=...): int4 (group 128) for Qwen3-MoE, mxfp4 for gpt-oss

Per way: ``generate`` of ``--new`` tokens after a ``--prompt``-token prompt (batch 1, greedy; keras-hub
pads the prompt to ``prompt + new`` and prefills that, then decodes token by token), the median of
``--repeats`` warm runs, divided by ``--new``: the time per generated token, prefill included; a
``predict`` of the prompt alone (prefill, warm median); peak RSS of the first ``generate`` (compile and
run; it also frees what the build left) and of the warm runs after it (VmHWM reset after the build, the
patch and the first call; the build's and the patch's own peaks on the line); the prefill logits' max
|difference| from the unpatched
model's, over max |logits| (bfloat16: keras-hub rounds its per-expert intermediates to bf16, the
fused op accumulates in float32; greedy tokens may then differ on random weights).
Ratios: unpatched ÷ way (speed-up).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MODELS = {
    "qwen3_moe": ("Qwen3MoeCausalLM", "Qwen3MoeBackbone", dict(
        vocabulary_size=4096, num_query_heads=32, num_key_value_heads=4, head_dim=128, hidden_dim=2048,
        intermediate_dim=6144, moe_intermediate_dim=768, num_experts=128, top_k=8, norm_top_k_prob=True),
        ("int4", 128)),
    "gpt_oss": ("GptOssCausalLM", "GptOssBackbone", dict(
        vocabulary_size=4096, num_query_heads=64, num_key_value_heads=8, head_dim=64, hidden_dim=2880,
        intermediate_dim=2880, num_experts=32, top_k=4, sliding_window=128), ("mxfp4", None)),
}


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024 / 1e9
    return float("nan")


def _reset_peak() -> None:
    """VmHWM back to the current RSS (Linux: 5 > /proc/self/clear_refs), so that each phase has its own
    peak; garbage collected and freed heap returned to the system first (the build leaves temporaries)."""
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def run_one(model_name: str, way: str, layers: int, prompt: int, new: int, repeats: int, logits_to: str) -> dict:
    """One (model, way) in this process; returns its figures."""
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras_hub
    import numpy as np

    from jax_nbx.integrations.keras_hub import patch_moe

    lm_name, bb_name, kwargs, (fmt, gs) = MODELS[model_name]
    t0 = time.perf_counter()
    backbone = getattr(keras_hub.models, bb_name)(num_layers=layers, **kwargs, dtype="bfloat16")
    lm = getattr(keras_hub.models, lm_name)(backbone=backbone, preprocessor=None)
    import jax
    jax.block_until_ready([v.value for v in lm.weights])   # the initializers run asynchronously
    build, build_peak = time.perf_counter() - t0, _status("VmHWM")
    _reset_peak()
    t0 = time.perf_counter()
    if way == "bf16":
        patch_moe(lm)
    elif way == "quant":
        patch_moe(lm, format=fmt, group_size=gs)
    patch, patch_peak = time.perf_counter() - t0, _status("VmHWM")
    _reset_peak()
    lm.compile(sampler="greedy")
    rng = np.random.default_rng(0)
    L = prompt + new
    ids = np.zeros((1, L), "int32")
    ids[0, :prompt] = rng.integers(1, kwargs["vocabulary_size"], prompt)
    mask = np.zeros((1, L), bool)
    mask[0, :prompt] = True
    gen_in = {"token_ids": ids, "padding_mask": mask}
    pre_in = {"token_ids": ids[:, :prompt], "padding_mask": mask[:, :prompt]}

    def timed(fn):
        t = time.perf_counter()
        out = fn()
        return time.perf_counter() - t, out

    first, out = timed(lambda: lm.generate(gen_in, stop_token_ids=None))
    first_peak = _status("VmHWM")
    _reset_peak()
    gen = sorted(timed(lambda: lm.generate(gen_in, stop_token_ids=None))[0] for _ in range(repeats))[repeats // 2]
    np.save(logits_to, np.asarray(lm.predict_on_batch(pre_in), np.float32))
    pre = sorted(timed(lambda: np.asarray(lm.predict_on_batch(pre_in)))[0] for _ in range(repeats))[repeats // 2]
    tokens = np.asarray(out["token_ids"])[0, prompt:].tolist()
    return {"model": model_name, "way": way, "format": fmt if way == "quant" else "bf16", "build_s": build,
            "patch_s": patch, "first_generate_s": first, "per_token_s": gen / new, "prefill_s": pre,
            "build_peak_gb": build_peak, "patch_peak_gb": patch_peak, "first_peak_gb": first_peak,
            "peak_gb": _status("VmHWM"),
            "rss_gb": _status("VmRSS"), "tokens": tokens}


def check_f32(model_name: str, prompt: int) -> dict:
    """One decoder layer in float32, the real layer shapes: the patched model's prefill logits against
    the unpatched model's, same weights, same process (bfloat16 runs cannot be compared this way:
    keras-hub's router rounds its probabilities to bfloat16 and ties among them pick other experts)."""
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras_hub
    import numpy as np

    from jax_nbx.integrations.keras_hub import patch_moe
    lm_name, bb_name, kwargs, _ = MODELS[model_name]
    backbone = getattr(keras_hub.models, bb_name)(num_layers=1, **kwargs, dtype="float32")
    lm = getattr(keras_hub.models, lm_name)(backbone=backbone, preprocessor=None)
    ids = np.random.default_rng(0).integers(1, kwargs["vocabulary_size"], (1, prompt)).astype("int32")
    inp = {"token_ids": ids, "padding_mask": np.ones_like(ids, bool)}
    ref = np.asarray(lm.predict_on_batch(inp), np.float64)
    patch_moe(lm)
    got = np.asarray(lm.predict_on_batch(inp), np.float64)
    return {"model": model_name, "f32_rel": float(np.abs(got - ref).max() / np.abs(ref).max())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen3_moe,gpt_oss")
    ap.add_argument("--ways", default="unpatched,bf16,quant")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--one", help=argparse.SUPPRESS)   # model:way, run in this process (the subprocesses)
    ap.add_argument("--logits", help=argparse.SUPPRESS)   # where --one saves its prefill logits
    args = ap.parse_args()
    if args.one:
        m, w = args.one.split(":")
        r = (check_f32(m, args.prompt) if w == "check" else
             run_one(m, w, args.layers, args.prompt, args.new, args.repeats, args.logits))
        print("RESULT " + json.dumps(r))
        return

    import tempfile

    import numpy as np
    from bench_common import machine
    tmp = tempfile.mkdtemp(prefix="nbx_keras_hub_")
    print(f"# keras-hub {_version('keras-hub')}, keras {_version('keras')}, jax {_version('jax')}; {machine()}")
    print(f"# {args.layers} decoder layers, batch 1, prompt {args.prompt}, {args.new} new tokens, "
          f"median of {args.repeats}; bfloat16")
    rows, checks = [], {}
    for m in args.models.split(","):
        cmd = [sys.executable, __file__, "--one", f"{m}:check", "--prompt", str(args.prompt)]
        p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, KERAS_BACKEND="jax"))
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        checks[m] = json.loads(line[0][7:])["f32_rel"] if line and not p.returncode else float("nan")
        print(f"  {m:9s} float32, 1 layer: patched prefill logits vs unpatched, max|diff|/max|logits| "
              f"{checks[m]:.2e}", flush=True)
    for m in args.models.split(","):
        base = None
        for w in args.ways.split(","):
            cmd = [sys.executable, __file__, "--one", f"{m}:{w}", "--layers", str(args.layers), "--prompt",
                   str(args.prompt), "--new", str(args.new), "--repeats", str(args.repeats),
                   "--logits", os.path.join(tmp, f"{m}_{w}.npy")]
            p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, KERAS_BACKEND="jax"))
            line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            if p.returncode or not line:
                print(f"{m} {w}: failed\n{p.stderr[-3000:]}")
                continue
            r = json.loads(line[0][7:])
            if w == "unpatched":
                base = r
            r["speedup"] = base["per_token_s"] / r["per_token_s"] if base else float("nan")
            r["prefill_speedup"] = base["prefill_s"] / r["prefill_s"] if base else float("nan")
            r["same_tokens"] = (base["tokens"] == r["tokens"]) if base else None
            if base:
                a, b = (np.load(os.path.join(tmp, f"{m}_{x}.npy")) for x in ("unpatched", w))
                r["logits_diff"] = float(np.abs(a - b).max() / np.abs(a).max())
            rows.append(r)
            print(f"  {m:9s} {w:9s} {r['format']:5s} per token {r['per_token_s'] * 1e3:8.1f} ms "
                  f"(x{r['speedup']:.2f})  prefill {r['prefill_s'] * 1e3:8.1f} ms (x{r['prefill_speedup']:.2f})  "
                  f"warm peak {r['peak_gb']:.2f} GB  rss {r['rss_gb']:.2f} GB  first call peak "
                  f"{r['first_peak_gb']:.2f} GB  build {r['build_s']:.1f} s "
                  f"(peak {r['build_peak_gb']:.2f} GB)  patch {r['patch_s']:.1f} s (peak {r['patch_peak_gb']:.2f} GB)  "
                  f"first generate {r['first_generate_s']:.1f} s  same tokens: {r['same_tokens']}  "
                  f"prefill logits max|diff|/max|logits| {r.get('logits_diff', 0):.2e}", flush=True)
    print()
    print("float32 check (1 layer, the prompt): " + ", ".join(f"{m} {v:.1e}" for m, v in checks.items()))
    print("| model | way | per generated token | ÷ unpatched | prefill (prompt) | ÷ unpatched | peak RSS, warm "
          "| peak RSS, first call | patch time (peak) | prefill logits vs unpatched |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['way']} ({r['format']}) | {r['per_token_s'] * 1e3:.1f} ms | "
              f"{r['speedup']:.2f}× | {r['prefill_s'] * 1e3:.1f} ms | {r['prefill_speedup']:.2f}× | "
              f"{r['peak_gb']:.2f} GB | {r['first_peak_gb']:.2f} GB | {r['patch_s']:.1f} s "
              f"({r['patch_peak_gb']:.2f} GB) | {r.get('logits_diff', 0):.1e} |")


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    main()
