"""`jax_nbx.loaders.to_peft` against PEFT itself: adapters written by to_peft, loaded by PEFT's own
``PeftModel.from_pretrained`` onto a tiny transformers Qwen3-MoE (the fixtures' model: fixtures_common.tiny_qwen3_moe,
H=32, I=16, E=4, top-2), give the PEFT-wrapped MoE block's output that jax_nbx's ``fused_moe(..., lora=)`` gives
with the same adapters on the same routing (float32).  Three loads:

* ``fused``: form="fused" (gate and up with their own A and ranks 3 and 5: the block-diagonal gate_up_proj; down
  at rank 2 and another scale: rank_pattern / alpha_pattern) onto transformers 5's fused experts (ParamWrapper);
  PEFT's state dict of the loaded model is checked equal to the file, bit for bit;
* ``per_expert_v5``: form="per_expert" (gate and up at rank 4, the config's r; down at rank 3 and another scale)
  onto transformers 5's fused experts, through PEFT's own v4 -> v5 conversion;
* ``per_expert_tree``: the same adapters (task_type=None) onto the checkpoint's per-expert tensors as nn.Linear
  modules (PEFT's lora.Linear, the form's own target), run on the transformers router's routing.

Two venvs: this script runs in jax_nbx's venv and calls itself (``--peft-side``) in a venv with torch (the CPU
wheel), transformers 5 and peft 0.21, kept out of the test install::

    python3 -m venv /tmp/peftvenv
    /tmp/peftvenv/bin/pip install /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
    /tmp/peftvenv/bin/pip install "transformers==5.24.0" "peft==0.21.2" safetensors numpy ml_dtypes
    .venv/bin/python benchmarks/peft_export_check.py --torch-python /tmp/peftvenv/bin/python

Prints, per load, max |ours - PEFT's| and that over max |PEFT's|, for the "xla" reference and the CPU handler
(``implementation=None``), and fails above 2e-6 of max |y| (the bound tests/library/test_lora_peft.py holds
from_peft to)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
E, H, I, K = 4, 32, 16, 2
PFX = "model.layers.0.mlp."
BOUND = 2e-6


def _scalings(pm) -> list:
    """PEFT's (r, scaling) of each adapted module or parameter of the loaded model (name, r, scaling)."""
    out = []
    for n, m in pm.named_modules():
        sc, r = getattr(m, "scaling", None), getattr(m, "r", None)
        if isinstance(sc, dict) and "default" in sc:
            what = getattr(m, "parameter_name", None) or n.rsplit(".", 1)[-1]
            out.append((n.removeprefix("base_model.model.").replace(".base_layer", "") + f" [{what}]",
                        r["default"], float(sc["default"])))
    return sorted(set(out))


def peft_side(d: str) -> None:
    """In the torch venv: the tiny model (d/hf), PEFT's loads of d/<case>, their block outputs (d/ref_<case>)."""
    sys.path.insert(0, HERE)
    import peft
    import torch
    import transformers as tf
    from fixtures_common import linear_tree, tiny_qwen3_moe
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file, save_file

    hf = os.path.join(d, "hf")
    tiny_qwen3_moe(hf, H=H, I=I, E=E, k=K, seed=8)
    x = torch.from_numpy(np.random.default_rng(9).standard_normal((7, H)).astype(np.float32))
    meta = {"versions": f"peft {peft.__version__}, transformers {tf.__version__}, torch {torch.__version__}"}
    for case in ("fused", "per_expert_v5"):
        model = tf.Qwen3MoeForCausalLM.from_pretrained(hf, dtype=torch.float32)
        pm = PeftModel.from_pretrained(model, os.path.join(d, case))
        block = pm.base_model.model.model.layers[0].mlp
        with torch.no_grad():
            _, w, ids = block.gate(x)
            y = block(x[None])[0]
            with pm.disable_adapter():
                y0 = block(x[None])[0]
        if case == "fused":  # PEFT's state dict of the loaded adapter: the file, bit for bit
            sd, ref = get_peft_model_state_dict(pm), load_file(os.path.join(d, case, "adapter_model.safetensors"))
            assert sorted(sd) == sorted(ref), (sorted(sd), sorted(ref))
            for k in ref:
                assert torch.equal(sd[k], ref[k]), k
            meta["fused_state_dict"] = "equal to the file"
        meta[f"{case}_scaling"] = _scalings(pm)
        save_file({"x": x, "topk_weights": w.contiguous(), "topk_ids": ids.to(torch.int32).contiguous(),
                   "y": y.contiguous(), "y_base": y0.contiguous()}, os.path.join(d, f"ref_{case}.safetensors"))
    # the per-expert form's own target: the checkpoint's per-expert tensors as nn.Linear modules (lora.Linear)
    root = linear_tree(os.path.join(hf, "model.safetensors"), PFX)
    pe = PeftModel.from_pretrained(root, os.path.join(d, "per_expert_tree"))
    experts = pe.base_model.model.get_submodule(PFX + "experts")
    ref = load_file(os.path.join(d, "ref_per_expert_v5.safetensors"))
    y = torch.zeros(x.shape)
    with torch.no_grad():
        for t in range(x.shape[0]):
            xt = x[t:t + 1]
            for w, e in zip(ref["topk_weights"][t], ref["topk_ids"][t]):
                ex = getattr(experts, str(int(e)))
                y[t] += w * ex.down_proj(torch.nn.functional.silu(ex.gate_proj(xt)) * ex.up_proj(xt))[0]
    meta["per_expert_tree_scaling"] = _scalings(pe)
    save_file({**{k: ref[k] for k in ("x", "topk_weights", "topk_ids")}, "y": y},
              os.path.join(d, "ref_per_expert_tree.safetensors"))
    with open(os.path.join(d, "peft_side.json"), "w") as f:
        json.dump(meta, f, indent=1)


def _adapters():
    """The LoRAs written: random A and B (B not zero), odd ranks, scales per projection."""
    import jax.numpy as jnp

    import jax_nbx as nbx
    rng = np.random.default_rng(12)

    def pair(fi, fo, r):
        return (jnp.asarray(rng.uniform(-1, 1, (E, fi, r)).astype(np.float32) / np.sqrt(fi)),
                jnp.asarray(rng.standard_normal((E, r, fo)).astype(np.float32) * 0.3))

    fused = nbx.LoRA(gate=pair(H, I, 3), up=pair(H, I, 5), down=pair(I, H, 2), scale=dict(gate=0.6, up=0.6, down=1.7))
    per_expert = nbx.LoRA(gate=pair(H, I, 4), up=pair(H, I, 4), down=pair(I, H, 3),
                          scale=dict(gate=1.25, up=1.25, down=0.3))
    return fused, per_expert


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--torch-python", default="/tmp/peftvenv/bin/python",
                    help="python of the venv with torch, transformers 5 and peft 0.21")
    ap.add_argument("--peft-side", metavar="DIR", help=argparse.SUPPRESS)
    ap.add_argument("--keep", metavar="DIR", help="write into DIR (kept) instead of a temporary folder")
    a = ap.parse_args()
    if a.peft_side:
        peft_side(a.peft_side)
        return 0
    import jax
    import jax.numpy as jnp
    from safetensors.numpy import load_file

    import jax_nbx as nbx
    from jax_nbx.loaders import load_moe, to_peft

    jax.config.update("jax_default_matmul_precision", "highest")
    with tempfile.TemporaryDirectory() as tmp:
        d = a.keep or tmp
        fused, per_expert = _adapters()
        to_peft(fused, os.path.join(d, "fused"), layers=0, form="fused", overwrite=True)
        to_peft(per_expert, os.path.join(d, "per_expert_v5"), layers=0, form="per_expert", overwrite=True)
        to_peft(per_expert, os.path.join(d, "per_expert_tree"), layers=0, form="per_expert", task_type=None,
                overwrite=True)
        subprocess.run([a.torch_python, os.path.abspath(__file__), "--peft-side", d], check=True)
        with open(os.path.join(d, "peft_side.json")) as f:
            meta = json.load(f)
        print(meta.pop("versions"))
        for k, v in meta.items():
            print(f"  {k}: {v}")
        experts = jax.tree.map(lambda m: jnp.asarray(m, jnp.float32), load_moe(os.path.join(d, "hf"), layer=0).experts)
        worst = 0.0
        for case, lora in (("fused", fused), ("per_expert_v5", per_expert), ("per_expert_tree", per_expert)):
            ref = load_file(os.path.join(d, f"ref_{case}.safetensors"))
            args = [jnp.asarray(ref[k]) for k in ("x", "topk_weights", "topk_ids")]
            ymax = float(np.max(np.abs(ref["y"])))
            for impl in ("xla", None):
                y = jax.jit(lambda x, w, ids, lo, impl=impl: nbx.fused_moe(x, w, ids, experts, lora=lo,
                                                                           implementation=impl))(*args, lora)
                err = float(np.max(np.abs(np.asarray(y, np.float64) - ref["y"])))
                worst = max(worst, err / ymax)
                print(f"{case:16s} implementation={impl!s:4s}: max|ours - PEFT| = {err:.3e}  "
                      f"({err / ymax:.2e} of max|y| = {ymax:.3f})")
            if "y_base" in ref:
                moved = float(np.max(np.abs(ref["y"] - ref["y_base"]))) / ymax
                print(f"{'':16s} the adapter moves PEFT's output by {moved:.2f} of max|y|")
                assert moved > 0.1
        print(f"worst: {worst:.2e} of max|y| (bound {BOUND:g})")
        return 0 if worst <= BOUND else 1


if __name__ == "__main__":
    sys.exit(main())
