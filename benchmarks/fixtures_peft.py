"""PEFT's fixtures of make_loader_fixtures.py (``--only=peft``): LoRA adapters
on a tiny Qwen3-MoE's routed experts written by PEFT itself, each beside the
output of the PEFT-wrapped block.  Imports torch, transformers and peft when
called (the producer venv, never the test install)."""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np
from fixtures_common import linear_tree, tiny_qwen3_moe

PEFT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _peft_block_reference(block, config, x, meta: str, path: str, **extra) -> dict:
    """<path>: x, the routing transformers' own router computes (``topk_weights``, ``topk_ids``), and
    the output ``y`` of the (PEFT-wrapped) Qwen3MoeSparseMoeBlock on x, its experts run as the
    model's default ``experts_implementation`` (``config``'s) and checked against "eager"."""
    import torch
    from safetensors.torch import save_file
    xt = torch.from_numpy(x)
    impl = config._experts_implementation
    with torch.no_grad():
        _, w, ids = block.gate(xt)
        y = block(xt[None])[0]
        config._experts_implementation = "eager"
        y_eager = block(xt[None])[0]
        config._experts_implementation = impl
    assert torch.allclose(y, y_eager, rtol=0, atol=1e-6 * float(y.abs().max())), "the experts' implementations differ"
    ref = {"x": xt, "topk_weights": w.contiguous(), "topk_ids": ids.to(torch.int32).contiguous(),
           "y": y.contiguous(), **{k: v.contiguous() for k, v in extra.items()}}
    save_file(ref, path, metadata={"producer": f"{meta}; experts_implementation={impl} (eager agrees)"})
    return ref


def peft_adapter(out: str) -> None:
    """PEFT LoRA adapters on a tiny Qwen3-MoE's routed experts (``peft/``; H=32, I=16, E=4, top-2,
    torch seed 8, the base saved by transformers in bfloat16 and loaded back in float32):

    * ``qwen3_moe_base/``: the base MoE block's tensors as transformers saved them (per-expert
      ``experts.{e}.gate_proj/up_proj/down_proj.weight``, the router) and its config.json;
    * ``qwen3_moe_lora/``: ``get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=[],
      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
      init_lora_weights=False))`` (transformers 5's fused 3-D experts, PEFT's ``ParamWrapper``;
      ``init_lora_weights=False`` keeps nn.Linear's random init of lora_B, not zeros),
      ``save_pretrained``: adapter_config.json and adapter_model.safetensors as written (its
      README.md model card dropped; in the config the temporary base folder and the order of
      target_modules / target_parameters, sets in PEFT, made stable);
    * ``qwen3_moe_lora_per_expert/``: the per-expert form (transformers 4's ``experts.{e}.gate_proj``
      nn.Linear modules, here the checkpoint's per-expert tensors as nn.Linear layers under their
      names): ``LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"],
      rank_pattern={"down_proj": 2}, alpha_pattern={"down_proj": 16}, init_lora_weights=False)``.

    Beside each adapter (<folder>.reference): x (7 x 32, numpy seed 9), the routing of transformers'
    own router, and ``y``, the float32 PEFT-wrapped model's own Qwen3MoeSparseMoeBlock on x (the
    per-expert adapter loaded onto the transformers 5 model by ``PeftModel.from_pretrained``, i.e.
    PEFT's own v4 -> v5 conversion of it, and checked against PEFT's per-expert lora.Linear modules
    run on the same routing); for the fused one also ``y_base``, the block with the adapter
    disabled."""
    import peft
    import torch
    import transformers as tf
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file, save_file
    d = os.path.join(out, "peft")
    os.makedirs(d, exist_ok=True)
    pfx = "model.layers.0.mlp."
    meta = f"peft {peft.__version__}, transformers {tf.__version__}, torch {torch.__version__}"
    x = np.random.default_rng(9).standard_normal((7, 32)).astype(np.float32)

    def keep(src: str, name: str) -> str:
        dst = os.path.join(d, name)
        os.makedirs(dst, exist_ok=True)
        shutil.copy(os.path.join(src, "adapter_model.safetensors"), dst)
        with open(os.path.join(src, "adapter_config.json")) as f:
            c = json.load(f)
        # made stable: the temporary base folder, and the order of target_modules / target_parameters
        # (sets in PEFT; it sorts target_parameters itself before matching them)
        if c.get("base_model_name_or_path") == hf:
            c["base_model_name_or_path"] = "/tmp/peft_qwen3_moe_hf"
        for key in ("target_modules", "target_parameters"):
            if isinstance(c.get(key), list):
                c[key] = sorted(c[key])
        with open(os.path.join(dst, "adapter_config.json"), "w") as f:
            f.write(json.dumps(c, indent=2, sort_keys=True))  # as PEFT's save_pretrained writes it
        return dst

    with tempfile.TemporaryDirectory() as tmp:
        hf = os.path.join(tmp, "hf")
        tiny_qwen3_moe(hf, H=32, I=16, E=4, k=2, seed=8)
        base = os.path.join(d, "qwen3_moe_base")
        os.makedirs(base, exist_ok=True)
        sd = {k: v for k, v in load_file(os.path.join(hf, "model.safetensors")).items() if k.startswith(pfx)}
        save_file(sd, os.path.join(base, "model.safetensors"), metadata={"format": "pt"})
        shutil.copy(os.path.join(hf, "config.json"), base)
        # 1. transformers 5's fused experts: target_parameters (PEFT's ParamWrapper)
        model = tf.Qwen3MoeForCausalLM.from_pretrained(hf, dtype=torch.float32)
        torch.manual_seed(10)
        pm = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=[], target_parameters=PEFT_TARGETS,
                                              init_lora_weights=False))
        pm.save_pretrained(os.path.join(tmp, "fused"))
        keep(os.path.join(tmp, "fused"), "qwen3_moe_lora")
        block = pm.base_model.model.model.layers[0].mlp
        with torch.no_grad(), pm.disable_adapter():
            y_base = block(torch.from_numpy(x)[None])[0]
        _peft_block_reference(block, model.config, x, meta + ", target_parameters (ParamWrapper)",
                              os.path.join(d, "qwen3_moe_lora.reference.safetensors"), y_base=y_base)
        # 2. per-expert nn.Linear modules (transformers 4's names): target_modules (lora.Linear)
        root = linear_tree(os.path.join(hf, "model.safetensors"), pfx)
        torch.manual_seed(11)
        pe = get_peft_model(root, LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"],
                                             rank_pattern={"down_proj": 2}, alpha_pattern={"down_proj": 16},
                                             init_lora_weights=False))
        pe.save_pretrained(os.path.join(tmp, "per_expert"))
        keep(os.path.join(tmp, "per_expert"), "qwen3_moe_lora_per_expert")
        model = tf.Qwen3MoeForCausalLM.from_pretrained(hf, dtype=torch.float32)
        pm = PeftModel.from_pretrained(model, os.path.join(tmp, "per_expert"))  # PEFT's v4 -> v5 conversion
        block = pm.base_model.model.model.layers[0].mlp
        ref = _peft_block_reference(block, model.config, x,
                                    meta + ", target_modules (lora.Linear per expert), loaded onto transformers 5's "
                                    "fused experts by PeftModel.from_pretrained",
                                    os.path.join(d, "qwen3_moe_lora_per_expert.reference.safetensors"))
        experts = pe.base_model.model.get_submodule(pfx + "experts")  # PEFT's own per-expert lora.Linear
        y = torch.zeros(x.shape)
        with torch.no_grad():
            for t in range(x.shape[0]):
                xt = torch.from_numpy(x[t:t + 1])
                for w, e in zip(ref["topk_weights"][t], ref["topk_ids"][t]):
                    ex = getattr(experts, str(int(e)))
                    y[t] += w * ex.down_proj(torch.nn.functional.silu(ex.gate_proj(xt)) * ex.up_proj(xt))[0]
        err = float((y - ref["y"]).abs().max() / ref["y"].abs().max())
        assert err < 1e-6, f"PEFT's v5 conversion of the per-expert adapter differs from its lora.Linear: {err}"
