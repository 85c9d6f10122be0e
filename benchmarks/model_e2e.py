"""A Qwen3-MoE-shaped model end to end: build, save as a Hugging Face
checkpoint, reload, check against float64, time prefill and decode with the
MoE blocks fused (jax_nbx.fused_moe) and as the XLA baselines.

    python benchmarks/model_e2e.py                        # ~1-2 min on 2 cores
    python benchmarks/model_e2e.py --dtype bf16 --plot --out /tmp/e2e
    python benchmarks/model_e2e.py --layers 4 --hidden 1024 --experts 64 --prompt 512

The model (`jax_nbx.models.qwen3_moe`) is written to ``--out``/checkpoint as
``config.json`` and two safetensors shards with transformers' names, then
loaded back (`load_hf`: the MoE blocks through `jax_nbx.loaders.load_moe`).
The loaded model's logits on the prompt are compared with the float64 numpy
forward (`support.qwen3_moe_ref`), max |diff| / max |ref|.  Then, for
moe = fused / ragged_dot / dense (the same parameters; the baselines hold a
stacked copy of the experts), in the same process and in interleaved rounds:
prefill of the prompt (one jitted call, the KV cache of length prompt +
new tokens written) and greedy decode (one jitted call per token), the median
over rounds of prefill ms and decode ms/token.  Printed with ratios to fused
(> 1: fused is faster); written to ``--out``/model_e2e.json, and with
``--plot`` ``--out``/model_e2e.png (ms per token by implementation).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import jax.numpy as jnp
import numpy as np
from bench_common import DTYPES, format_table, machine

import jax_nbx as nbx

IMPLS = ("fused", "ragged_dot", "dense")


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8, help="attention heads (head_dim = hidden / heads)")
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--moe-intermediate", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens (prefill)")
    ap.add_argument("--new-tokens", type=int, default=16, help="decoded tokens per round")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (after one warm-up round)")
    ap.add_argument("--dtype", choices=("f32", "bf16"), default="f32")
    ap.add_argument("--out", default=None, help="folder for the checkpoint, JSON and plot (default: a temp dir)")
    ap.add_argument("--plot", action="store_true")
    args = ap.parse_args(argv)
    for name in ("layers", "hidden", "heads", "kv_heads", "experts", "topk", "moe_intermediate", "vocab",
                 "prompt", "new_tokens", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        ap.error("--hidden must be a multiple of --heads, and --heads of --kv-heads")
    if args.topk > args.experts:
        ap.error(f"--topk={args.topk} exceeds --experts={args.experts}")
    return args


def main(argv=None) -> int:
    from flax import nnx

    from jax_nbx.models import qwen3_moe as q3
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from support.qwen3_moe_ref import read_checkpoint, reference_logits  # a test oracle

    a = parse(argv)
    out = a.out or tempfile.mkdtemp(prefix="model_e2e_")
    os.makedirs(out, exist_ok=True)
    config = q3.Qwen3MoeConfig(vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers,
                               num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                               head_dim=a.hidden // a.heads, moe_intermediate_size=a.moe_intermediate,
                               num_experts=a.experts, num_experts_per_tok=a.topk,
                               max_position_embeddings=max(4096, a.prompt + a.new_tokens))
    dtype = DTYPES[a.dtype]
    t0 = time.perf_counter()
    built = q3.Qwen3MoeForCausalLM(config, rngs=nnx.Rngs(0), dtype=dtype)
    ckpt = os.path.join(out, "checkpoint")
    q3.save_hf(built, ckpt, shards=2)
    del built
    model = q3.load_hf(ckpt)
    n_params = sum(int(np.prod(v.shape)) for v in q3.hf_state_dict(model).values())
    print(f"model: {config}\n{n_params / 1e6:.1f} M parameters ({a.dtype}), saved to and loaded from {ckpt} "
          f"in {time.perf_counter() - t0:.1f} s", flush=True)

    ids = np.random.default_rng(0).integers(0, a.vocab, (1, a.prompt))
    hf_config, tensors = read_checkpoint(ckpt)
    ref = reference_logits(hf_config, tensors, ids[0])
    got = np.asarray(nnx.jit(lambda m, x: m(x))(model, ids)[0], np.float64)
    err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
    print(f"logits vs float64 (T={a.prompt}): max|diff|/max|ref| = {err:.2e}", flush=True)

    models = {impl: nnx.split(q3.with_moe(model, impl)) for impl in IMPLS}
    cache_len = a.prompt + a.new_tokens
    times: dict[str, dict[str, list[float]]] = {impl: {"prefill": [], "decode": []} for impl in IMPLS}
    tokens: dict[str, list[int]] = {}

    def one_round(impl):
        split = models[impl]
        t = time.perf_counter()
        logits, cache = q3.prefill(split, ids, cache_len)
        tok = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
        tok.block_until_ready()
        t_prefill = time.perf_counter() - t
        seq = [int(tok[0])]
        t = time.perf_counter()
        for i in range(a.new_tokens - 1):
            step, cache = q3.decode_step(split, tok, a.prompt + i, cache)
            tok = jnp.argmax(step, axis=-1).astype(jnp.int32)
            seq.append(int(tok[0]))  # greedy: each step waits for its token
        t_decode = (time.perf_counter() - t) / max(a.new_tokens - 1, 1)
        return t_prefill, t_decode, seq

    for r in range(a.rounds + 1):  # round 0 compiles
        for impl in IMPLS:
            tp, td, seq = one_round(impl)
            sys.stderr.write(f"\rround {r}/{a.rounds} {impl:<10}")
            if r:
                times[impl]["prefill"].append(tp)
                times[impl]["decode"].append(td)
            tokens[impl] = seq
    sys.stderr.write("\n")

    med = {impl: {k: statistics.median(v) * 1e3 for k, v in times[impl].items()} for impl in IMPLS}
    # XLA's temporary buffers of the compiled prefill (what the program allocates beyond its inputs
    # and outputs; the fused handler's own workspace is counted by jax_nbx's account, shown apart)
    temp_mib = {}
    for impl in IMPLS:
        graphdef, state = models[impl]
        compiled = q3._prefill.lower(graphdef, state, jnp.asarray(ids, jnp.int32), cache_len).compile()
        temp_mib[impl] = compiled.memory_analysis().temp_size_in_bytes / 2 ** 20
    peak_ws = nbx.memory.stats().get("cpu:0", {}).get("peak", 0) / 2 ** 20
    rows = []
    for impl in IMPLS:
        m = med[impl]
        rows.append([impl, f"{m['prefill']:.1f}", f"{m['prefill'] / med['fused']['prefill']:.2f}",
                     f"{m['decode']:.2f}", f"{m['decode'] / med['fused']['decode']:.2f}",
                     f"{temp_mib[impl]:.1f}", "yes" if tokens[impl] == tokens["fused"] else "no"])
    print(f"\n{machine()}, ISA {nbx.cpu.isa()}")
    print(f"{a.layers} layers, H={a.hidden}, E={a.experts}, k={a.topk}, I={a.moe_intermediate}, "
          f"vocab={a.vocab}, {a.dtype}; prefill T={a.prompt}, decode {a.new_tokens} tokens; "
          f"median of {a.rounds} interleaved rounds")
    print(format_table(["moe", "prefill ms", "x fused", "decode ms/token", "x fused", "prefill XLA temp MiB",
                        "same tokens"], rows))
    print(f"(the fused handler's workspace, counted by jax_nbx's account: peak {peak_ws:.1f} MiB)")
    result = {"machine": machine(), "isa": nbx.cpu.isa(), "args": vars(a), "config": config.to_hf_dict(),
              "logits_max_rel_err_vs_float64": err, "median_ms": med, "prefill_xla_temp_mib": temp_mib,
              "handler_workspace_peak_mib": peak_ws,
              "all_ms": {i: {k: [x * 1e3 for x in v] for k, v in times[i].items()} for i in IMPLS},
              "tokens": tokens}
    path = os.path.join(out, "model_e2e.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    if a.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
        for ax, key, label in ((axes[0], "prefill", f"prefill ms per token (T={a.prompt})"),
                               (axes[1], "decode", "decode ms per token")):
            per_tok = [med[i][key] / (a.prompt if key == "prefill" else 1) for i in IMPLS]
            ax.bar(IMPLS, per_tok, color=["tab:green", "tab:blue", "tab:gray"])
            ax.set_title(label)
            ax.set_ylabel("ms")
        axes[2].bar(IMPLS, [temp_mib[i] for i in IMPLS], color=["tab:green", "tab:blue", "tab:gray"])
        axes[2].set_title(f"prefill: XLA temporaries (MiB, T={a.prompt})")
        axes[2].set_ylabel("MiB")
        fig.suptitle(f"Qwen3-MoE-shaped model, {a.layers} layers, E={a.experts} k={a.topk}, {a.dtype}")
        fig.tight_layout()
        png = os.path.join(out, "model_e2e.png")
        fig.savefig(png, dpi=100)
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
