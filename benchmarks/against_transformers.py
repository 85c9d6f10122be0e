"""The end-to-end Qwen3-MoE model against the real transformers model (a
check, run by hand: PyTorch stays out of the test install).

Two interpreters, one folder:

    # 1. with jax_nbx: build the model, save it as a Hugging Face checkpoint, write
    #    our logits (float32, fused_moe) and the float64 numpy forward's
    .venv/bin/python benchmarks/against_transformers.py save /tmp/hfcmp
    # 2. with torch + transformers (e.g. a venv with `pip install torch==2.13.0 transformers
    #    safetensors numpy`): load the checkpoint with Qwen3MoeForCausalLM in float64, compare
    /tmp/hfvenv/bin/python benchmarks/against_transformers.py check /tmp/hfcmp

Prints max|diff|/max|ref| of each pair and the greedy next tokens; exits 1 if
transformers' logits and ours differ by more than 1e-4 (float32) or the
float64 forward's by more than 1e-6.  (transformers' "float64" model is not
float64 throughout: Qwen3MoeRMSNorm casts to float32, and the rotary
embedding's angles, the attention softmax and the router's softmax are float32
in modeling_qwen3_moe.py -- hence ~1e-7, not ~1e-15.)
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np


def save(folder: str) -> int:
    from flax import nnx

    from jax_nbx.models import qwen3_moe as q3

    from support.qwen3_moe_ref import read_checkpoint, reference_logits

    config = q3.Qwen3MoeConfig(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=32, moe_intermediate_size=64, num_experts=16,
                               num_experts_per_tok=4, norm_topk_prob=True)
    model = q3.Qwen3MoeForCausalLM(config, rngs=nnx.Rngs(0))
    # O(1)-scaled norm weights and a wider router, so that a misplaced tensor shows
    state = q3.hf_state_dict(model)
    rng = np.random.default_rng(0)
    for name, v in state.items():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            state[name] = (1.0 + 0.3 * rng.standard_normal(v.shape)).astype(np.float32)
        elif name.endswith("mlp.gate.weight"):
            state[name] = (rng.standard_normal(v.shape) * 0.5).astype(np.float32)
    ckpt = os.path.join(folder, "checkpoint")
    os.makedirs(ckpt, exist_ok=True)
    from safetensors.numpy import save_file
    save_file({k: np.ascontiguousarray(np.asarray(v, np.float32)) for k, v in state.items()},
              os.path.join(ckpt, "model.safetensors"))
    with open(os.path.join(ckpt, "config.json"), "w") as f:
        json.dump(config.to_hf_dict(), f, indent=1)
    loaded = q3.load_hf(ckpt)
    ids = rng.integers(0, config.vocab_size, (1, 33))
    ours = np.asarray(nnx.jit(lambda m, x: m(x))(loaded, ids)[0], np.float64)
    hf_config, tensors = read_checkpoint(ckpt)
    ref = reference_logits(hf_config, tensors, ids[0])
    np.savez(os.path.join(folder, "logits.npz"), ids=ids, ours=ours, ref64=ref)
    print(f"saved {ckpt} and logits.npz; ours vs float64 forward: "
          f"{np.max(np.abs(ours - ref)) / np.max(np.abs(ref)):.2e}")
    return 0


def check(folder: str) -> int:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    d = np.load(os.path.join(folder, "logits.npz"))
    model = AutoModelForCausalLM.from_pretrained(os.path.join(folder, "checkpoint"), dtype=torch.float64,
                                                 experts_implementation="eager")
    model.eval()
    with torch.no_grad():
        hf = model(torch.as_tensor(d["ids"])).logits[0].numpy()
    ours, ref = d["ours"], d["ref64"]

    def rel(a, b):
        return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))

    e_ours, e_ref = rel(ours, hf), rel(ref, hf)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {type(model).__name__} float64")
    print(f"jax_nbx (float32, fused_moe) vs transformers: {e_ours:.2e}")
    print(f"jax_nbx's float64 numpy forward vs transformers: {e_ref:.2e}")
    same = bool(np.array_equal(ours.argmax(-1), hf.argmax(-1)))
    print(f"greedy next tokens equal at all {hf.shape[0]} positions: {same}")
    return 0 if (e_ours <= 1e-4 and e_ref <= 1e-6 and same) else 1


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("save", "check"):
        sys.exit(__doc__)
    sys.exit({"save": save, "check": check}[sys.argv[1]](sys.argv[2]))
