"""Regenerate tests/data/: the loaders' fixtures, written by the real
third-party tools (never by jax_nbx), so that the loader tests check jax_nbx
against producers nobody here wrote.  Run by hand, in a throwaway venv
OUTSIDE the test install (the test suite imports none of these tools):

    python3 -m venv /tmp/prod
    /tmp/prod/bin/pip install "transformers==5.24.0" "mlx[cpu]==0.32.4" "mlx-lm==0.32.2" safetensors numpy
    /tmp/prod/bin/pip install torch==2.13.0            # the CPU wheel (any CPU build)
    /tmp/prod/bin/pip install peft==0.21.2             # peft/ (--only=peft)
    # GPTQModel 7.6.0's quantization_config (its source, no build): optional
    pip download --no-deps --no-binary :all: gptqmodel==7.6.0 -d /tmp/gptqm && tar xzf ... -C /tmp/gptqm
    /tmp/prod/bin/pip install pypcre logbar device-smi tokenicer defuser threadpoolctl accelerate pillow requests
    PYTHONPATH=/tmp/gptqm/gptqmodel-7.6.0 /tmp/prod/bin/python benchmarks/make_loader_fixtures.py tests/data

Writes (tests/data/README.md says what each file is):

* transformers/configs/: each MoE family's config class, written by
  transformers: ``<model_type>.defaults.json`` (``Cls().to_json_file(...,
  use_diff=False)``: every key at the class's default) and
  ``<model_type>.tiny.json`` (``Cls(**tiny).save_pretrained``: the shapes of
  tests/library/test_families.py's blocks), a few variants, and
  ``attribute_maps.json`` (each class's ``attribute_map``);
* transformers/qwen3_moe_tiny/: a tiny Qwen3-MoE model's
  ``save_pretrained`` (bfloat16), and beside it (qwen3_moe_tiny.block_io)
  its MoE block's output on a fixed input, computed by transformers' own
  ``Qwen3MoeSparseMoeBlock`` (float32);
* mlx_lm/: that kind of model converted by ``mlx_lm.convert`` (affine 4-bit,
  groups of 64 and 32, its 8-bit router; 8-bit and mxfp4 / nvfp4 for the
  refusals), beside them (<folder>.reference) the block's output computed by
  mlx-lm's own ``Qwen3MoeSparseMoeBlock``, ``mx.dequantize``'s router and expert 3, and
  ``affine_bits.safetensors`` (``mx.quantize``/``mx.dequantize`` at 2..8 bits), and
  MLX's mxfp4: the block's output on the mxfp4 conversion and
  ``mxfp4_matrices.safetensors`` (``mx.quantize``/``mx.dequantize``/``mx.gather_qmm``);
* gptqmodel/: GPTQModel 7.6.0's ``AWQConfig(...).to_dict()`` (the
  ``quantization_config`` its ``save`` writes into config.json), and a
  Qwen3-MoE block whose experts GPTQModel's own AWQ packer packed, with the
  weights its own ``dequantize_gemm`` gives, when the GPTQModel source is
  importable;
* peft/: PEFT 0.21.2's LoRA adapters on a tiny Qwen3-MoE's routed experts
  (``save_pretrained``: transformers 5's fused 3-D experts through
  ``target_parameters``, and per-expert nn.Linear modules through
  ``target_modules``), the base block's tensors, and beside each adapter
  (<folder>.reference) the routing and the output of the PEFT-wrapped
  ``Qwen3MoeSparseMoeBlock`` (float32).

Every file is small (a few KB; the largest ~60 KB).  The outputs are
deterministic up to the tools' own float formatting.  The compressed-tensors
and PEFT generators live in fixtures_compressed.py and fixtures_peft.py, the
tiny model they all start from in fixtures_common.py.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

import numpy as np
from fixtures_common import tiny_qwen3_moe
from fixtures_compressed import fp8_checkpoints, nvfp4_checkpoint
from fixtures_peft import peft_adapter

# The blocks of tests/library/test_families.py (H = 40), in each config class's own key names.
SMALL = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
TINY = {
    "mixtral": ("MixtralConfig", dict(hidden_size=40, intermediate_size=24, num_local_experts=8,
                                      num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(hidden_size=40, moe_intermediate_size=24, num_experts=16,
                                         num_experts_per_tok=4, norm_topk_prob=False,
                                         shared_expert_intermediate_size=52)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(hidden_size=40, moe_intermediate_size=20, num_experts=32,
                                         num_experts_per_tok=8, norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", dict(hidden_size=40, intermediate_size=24, num_experts=16, num_experts_per_tok=4,
                                  norm_topk_prob=False)),
    "granitemoe": ("GraniteMoeConfig", dict(hidden_size=40, intermediate_size=24, num_local_experts=33,
                                            num_experts_per_tok=8)),
    "gpt_oss": ("GptOssConfig", dict(hidden_size=40, intermediate_size=24, num_local_experts=32,
                                     num_experts_per_tok=4, head_dim=10)),
    "deepseek_v3": ("DeepseekV3Config", dict(hidden_size=40, moe_intermediate_size=24, n_routed_experts=64,
                                             num_experts_per_tok=8, n_shared_experts=2, n_group=8, topk_group=4,
                                             norm_topk_prob=True, routed_scaling_factor=2.5, q_lora_rank=None,
                                             kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=6,
                                             v_head_dim=10)),
    "deepseek_v2": ("DeepseekV2Config", dict(hidden_size=40, moe_intermediate_size=24, n_routed_experts=64,
                                             num_experts_per_tok=6, n_shared_experts=2, n_group=8, topk_group=3,
                                             topk_method="group_limited_greedy", routed_scaling_factor=16.0,
                                             q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4,
                                             qk_nope_head_dim=6, v_head_dim=10)),
    "llama4_text": ("Llama4TextConfig", dict(hidden_size=40, intermediate_size=24, intermediate_size_mlp=48,
                                             num_local_experts=16, num_experts_per_tok=1, head_dim=10)),
}
# Variants: a key at a value other than the default (hidden_act, gpt-oss's swiglu_*).
VARIANTS = {
    "olmoe.gelu": ("OlmoeConfig", dict(TINY["olmoe"][1], hidden_act="gelu")),
    "mixtral.gelu_pytorch_tanh": ("MixtralConfig", dict(TINY["mixtral"][1], hidden_act="gelu_pytorch_tanh")),
    "qwen3_moe.relu": ("Qwen3MoeConfig", dict(TINY["qwen3_moe"][1], hidden_act="relu")),
    "gpt_oss.swiglu": ("GptOssConfig", dict(TINY["gpt_oss"][1], swiglu_alpha=1.5, swiglu_limit=5.0)),
}
# Classes whose defaults alone are no block (DeepSeek-V2's num_experts_per_tok defaults to None).
DEFAULT_ARGS = {"deepseek_v2": dict(num_experts_per_tok=6)}


def _save_config(cfg, path: str) -> None:
    """``save_pretrained`` (what a checkpoint's config.json is), renamed."""
    with tempfile.TemporaryDirectory() as d:
        cfg.save_pretrained(d)
        shutil.copy(os.path.join(d, "config.json"), path)


def transformers_configs(out: str) -> None:
    import transformers as tf
    d = os.path.join(out, "transformers", "configs")
    os.makedirs(d, exist_ok=True)
    maps = {}
    for mt, (cls_name, kw) in TINY.items():
        cls = getattr(tf, cls_name)
        maps[mt] = dict(getattr(cls, "attribute_map", {}))
        cls(**DEFAULT_ARGS.get(mt, {})).to_json_file(os.path.join(d, f"{mt}.defaults.json"), use_diff=False)
        _save_config(cls(**SMALL, **kw), os.path.join(d, f"{mt}.tiny.json"))
    for name, (cls_name, kw) in VARIANTS.items():
        _save_config(getattr(tf, cls_name)(**SMALL, **kw), os.path.join(d, f"{name}.json"))
    # Llama-4 as released: the composite "llama4" config, the MoE text model under text_config
    t = dict(SMALL, **TINY["llama4_text"][1])
    _save_config(tf.Llama4Config(text_config=t, vision_config=dict(hidden_size=16, intermediate_size=32,
                                                                    num_hidden_layers=1, num_attention_heads=2,
                                                                    vision_output_dim=16, projector_input_dim=16,
                                                                    projector_output_dim=16)),
                 os.path.join(d, "llama4.tiny.json"))
    with open(os.path.join(d, "attribute_maps.json"), "w") as f:
        json.dump({"transformers": tf.__version__, "attribute_map": maps}, f, indent=2, sort_keys=True)
        f.write("\n")


def transformers_checkpoint(out: str) -> None:
    """A tiny Qwen3-MoE saved by transformers, and its block's output by transformers' module."""
    import torch
    import transformers as tf
    from safetensors.numpy import save_file
    d = os.path.join(out, "transformers", "qwen3_moe_tiny")
    os.makedirs(d, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tiny_qwen3_moe(tmp, H=32, I=16, E=4, k=2, seed=1)
        for f in ("config.json", "model.safetensors"):
            shutil.copy(os.path.join(tmp, f), d)
        model = tf.Qwen3MoeForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    block = model.model.layers[0].mlp
    x = np.random.default_rng(2).standard_normal((7, 32)).astype(np.float32)
    with torch.no_grad():
        y = block(torch.from_numpy(x)[None])
    y = y[0] if isinstance(y, tuple) else y
    save_file({"x": x, "y": y[0].numpy().astype(np.float32)}, d + ".block_io.safetensors",
              metadata={"producer": f"transformers {tf.__version__} Qwen3MoeSparseMoeBlock, float32"})


def _hub_style(folder: str) -> None:
    """mlx-lm 0.32.2's qwen3_moe.ModelArgs needs ``num_experts`` and ``rope_theta``, which
    transformers 5.24's config.json names ``num_local_experts`` and ``rope_parameters``: written
    back as the hub's Qwen3-MoE configs have them."""
    p = os.path.join(folder, "config.json")
    with open(p) as f:
        c = json.load(f)
    c["num_experts"] = c.pop("num_local_experts")
    c["rope_theta"] = c["rope_parameters"]["rope_theta"]
    with open(p, "w") as f:
        json.dump(c, f, indent=2)


def _block_only(src: str, dst: str, prefix: str = "model.layers.0.mlp.") -> None:
    """The MoE block's tensors of an mlx-lm output, re-saved with mlx's own save (metadata as
    mlx-lm's save_model writes it), and its config.json: the refusal fixtures, kept small."""
    import mlx.core as mx
    os.makedirs(dst, exist_ok=True)
    arrays = {k: v for k, v in mx.load(os.path.join(src, "model.safetensors")).items() if k.startswith(prefix)}
    mx.save_safetensors(os.path.join(dst, "model.safetensors"), arrays, metadata={"format": "mlx"})
    shutil.copy(os.path.join(src, "config.json"), dst)


def mlx_checkpoints(out: str) -> None:
    import mlx.core as mx
    import mlx_lm
    from mlx.utils import tree_map
    from mlx_lm import convert
    from mlx_lm.utils import load_model
    d = os.path.join(out, "mlx_lm")
    os.makedirs(d, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        hf = os.path.join(tmp, "hf")
        tiny_qwen3_moe(hf, H=64, I=64, E=4, k=2, seed=3)
        _hub_style(hf)
        runs = {"qwen3_moe_q4_g64": dict(q_group_size=64, q_bits=4),
                "qwen3_moe_q4_g32": dict(q_group_size=32, q_bits=4),
                "qwen3_moe_q8_g64": dict(q_group_size=64, q_bits=8),
                "qwen3_moe_mxfp4": dict(q_mode="mxfp4")}
        for name, kw in runs.items():
            conv = os.path.join(tmp, name)
            convert(hf, conv, quantize=True, **kw)
            dst = os.path.join(d, name)
            if name == "qwen3_moe_q4_g64":  # kept whole, as mlx-lm wrote it
                os.makedirs(dst, exist_ok=True)
                for f in ("config.json", "model.safetensors", "model.safetensors.index.json"):
                    shutil.copy(os.path.join(conv, f), dst)
            else:
                _block_only(conv, dst)
            if name not in ("qwen3_moe_q4_g64", "qwen3_moe_q4_g32"):
                continue
            # the block's output by mlx-lm's own module, scales and biases made float32 (exact) so
            # that mlx computes in float32; and mx.dequantize's weights
            from pathlib import Path
            model, config = load_model(Path(conv))
            block = model.model.layers[0].mlp
            block.update(tree_map(lambda a: a.astype(mx.float32) if a.dtype == mx.bfloat16 else a,
                                  block.parameters()))
            x = mx.array(np.random.default_rng(4).standard_normal((9, 64)).astype(np.float32))
            y = block(x)
            ref = {"x": x, "y": y}
            mods = (("gate", block.gate), ("switch_mlp.gate_proj", block.switch_mlp.gate_proj),
                    ("switch_mlp.up_proj", block.switch_mlp.up_proj),
                    ("switch_mlp.down_proj", block.switch_mlp.down_proj))
            for n, m in mods if name == "qwen3_moe_q4_g64" else ():
                w = mx.dequantize(m.weight, m.scales, m.biases, group_size=m.group_size, bits=m.bits)
                ref[n] = w if n == "gate" else w[3]  # the router; expert 3 of each projection
            mx.eval(ref)
            mx.save_safetensors(dst + ".reference.safetensors", ref,
                                metadata={"producer": f"mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}"})
    # mx.quantize / mx.dequantize of one small matrix at every affine width (the router's reader)
    rng = np.random.default_rng(5)
    arrays = {}
    for bits in (2, 3, 4, 5, 6, 8):
        for G in (32, 64):
            w = mx.array(rng.standard_normal((2, 128)).astype(np.float32)).astype(mx.bfloat16)
            q, s, b = mx.quantize(w, group_size=G, bits=bits)
            arrays.update({f"b{bits}g{G}.weight": q, f"b{bits}g{G}.scales": s, f"b{bits}g{G}.biases": b,
                           f"b{bits}g{G}.dequantized": mx.dequantize(q, s.astype(mx.float32), b.astype(mx.float32),
                                                                     group_size=G, bits=bits)})
    mx.eval(arrays)
    mx.save_safetensors(os.path.join(d, "affine_bits.safetensors"), arrays,
                        metadata={"producer": f"mlx {mx.__version__} mx.quantize / mx.dequantize"})


def gptqmodel_configs(out: str) -> bool:
    try:
        import gptqmodel
        from gptqmodel.quantization.config import FORMAT, AWQConfig, GPTQConfig
    except Exception as err:  # noqa: BLE001  (optional: its source on PYTHONPATH)
        print(f"gptqmodel not importable ({err!r}): gptqmodel/ left as it is", file=sys.stderr)
        return False
    d = os.path.join(out, "gptqmodel")
    os.makedirs(d, exist_ok=True)

    def clean(qc: dict) -> dict:  # the temporary folder GPTQModel picks at each run, made stable
        if "offload_to_disk_path" in qc.get("meta", {}):
            qc["meta"]["offload_to_disk_path"] = "/tmp/gptqmodel_offload"
        return qc

    written = {
        "awq_gemm": clean(AWQConfig(bits=4, group_size=32).to_dict()),
        "awq_gemv": clean(AWQConfig(bits=4, group_size=32, format=FORMAT.GEMV).to_dict()),
        "gptq": clean(GPTQConfig(bits=4, group_size=32).to_dict()),
        "gptq_v2": clean(GPTQConfig(bits=4, group_size=32, format=FORMAT.GPTQ_V2).to_dict()),
    }
    for name, qc in written.items():
        with open(os.path.join(d, f"{name}.quantization_config.json"), "w") as f:
            json.dump({"gptqmodel": gptqmodel.__version__, "quantization_config": qc}, f, indent=2, default=str)
            f.write("\n")
    return True


def gptqmodel_awq_checkpoint(out: str) -> None:
    """A Qwen3-MoE block whose experts are packed by GPTQModel 7.6.0's own AWQ GEMM packer
    (``AwqTorchLinear.pack``, the CPU module; its CUDA twin AwqGEMMLinear.pack is the same code),
    with AWQ's asymmetric min/max scales and zeros, and the weights GPTQModel's own
    ``dequantize_gemm`` gives (float32 scales: exact).  Not a whole GPTQModel quantization
    (that needs a calibration run): its packing and its config.json."""
    import torch
    import transformers as tf
    from gptqmodel.nn_modules.qlinear.torch_awq import AwqTorchLinear
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm
    from gptqmodel.quantization.config import AWQConfig
    from safetensors.torch import save_file
    d = os.path.join(out, "gptqmodel", "qwen3_moe_awq")
    os.makedirs(d, exist_ok=True)
    E, H, I, G = 4, 32, 32, 32
    torch.manual_seed(6)
    pfx = "model.layers.0.mlp."
    tensors = {pfx + "gate.weight": (torch.randn(E, H) * H ** -0.5).to(torch.bfloat16)}
    ref = {}
    for e in range(E):
        for n, K, N in (("gate_proj", H, I), ("up_proj", H, I), ("down_proj", I, H)):
            lin = torch.nn.Linear(K, N, bias=False)
            with torch.no_grad():
                lin.weight.normal_(0.0, K ** -0.5)
            w = lin.weight.data.reshape(N, K // G, G)  # AWQ's pseudo_quantize_tensor, zero_point=True
            mx_, mn_ = w.amax(-1), w.amin(-1)
            scales = ((mx_ - mn_).clamp(min=1e-5) / 15).half().float()
            zeros = (-torch.round(mn_ / scales)).clamp(0, 15)
            m = AwqTorchLinear(bits=4, group_size=G, sym=False, desc_act=False, in_features=K, out_features=N)
            m.pack(lin, scales, zeros)
            base = f"{pfx}experts.{e}.{n}."
            for t in ("qweight", "qzeros", "scales"):
                tensors[base + t] = getattr(m, t).contiguous()
            ref[base + "weight"] = dequantize_gemm(m.qweight, m.qzeros, m.scales.float(), 4, G).contiguous()
    save_file(tensors, os.path.join(d, "model.safetensors"))
    cfg = tf.Qwen3MoeConfig(vocab_size=32, hidden_size=H, intermediate_size=2 * H, moe_intermediate_size=I,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=H // 2,
                            num_experts=E, num_experts_per_tok=2, norm_topk_prob=True)
    qc = AWQConfig(bits=4, group_size=G, sym=False).to_dict()
    qc["meta"]["offload_to_disk_path"] = "/tmp/gptqmodel_offload"
    cfg.quantization_config = qc  # as gptqmodel/models/writer.py sets it before save_pretrained
    _save_config(cfg, os.path.join(d, "config.json"))
    save_file(ref, d + ".dequantized.safetensors", metadata={"producer": "GPTQModel 7.6.0 dequantize_gemm"})


MLX_FLOAT_MODES = ("mxfp4", "nvfp4", "mxfp8")


def mlx_float_mode(out: str, mode: str) -> None:
    """MLX's own float mode ``mode`` (mxfp4, nvfp4, mxfp8): ``mlx_lm/qwen3_moe_<mode>`` (the
    block of mlx-lm's conversion; an existing folder is checked byte for byte against the
    re-conversion) and ``mlx_lm/qwen3_moe_<mode>.reference``, the block output of mlx-lm's
    ``Qwen3MoeSparseMoeBlock`` on it and ``mx.dequantize`` of expert 3; and
    ``mlx_lm/<mode>_matrices``: ``mx.quantize(w, mode=mode)`` of float32 matrices (random,
    exact E2M1 ties, blocks of zeros, large and tiny magnitudes), ``mx.dequantize`` of them,
    and ``mx.gather_qmm`` of x against them (per expert ids)."""
    from pathlib import Path

    import mlx.core as mx
    import mlx_lm
    from mlx_lm import convert
    from mlx_lm.utils import load_model
    d = os.path.join(out, "mlx_lm")
    meta = {"producer": f"mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}"}
    with tempfile.TemporaryDirectory() as tmp:
        hf = os.path.join(tmp, "hf")
        tiny_qwen3_moe(hf, H=64, I=64, E=4, k=2, seed=3)
        _hub_style(hf)
        conv = os.path.join(tmp, mode)
        convert(hf, conv, quantize=True, q_mode=mode)
        _block_only(conv, os.path.join(tmp, "block"))
        new = mx.load(os.path.join(tmp, "block", "model.safetensors"))
        stored = os.path.join(d, f"qwen3_moe_{mode}")
        if os.path.exists(stored):
            old = mx.load(os.path.join(stored, "model.safetensors"))
            assert new.keys() == old.keys() and all(mx.array_equal(new[n], old[n]).item() for n in new), \
                f"the re-conversion differs from the stored qwen3_moe_{mode}/"
        else:
            shutil.copytree(os.path.join(tmp, "block"), stored)
        model, _ = load_model(Path(conv))
        block = model.model.layers[0].mlp
        x = mx.array(np.random.default_rng(4).standard_normal((9, 64)).astype(np.float32))
        ref = {"x": x, "y": block(x)}
        for n in ("gate_proj", "up_proj", "down_proj"):
            m = getattr(block.switch_mlp, n)
            ref["switch_mlp." + n] = mx.dequantize(m.weight, m.scales, group_size=m.group_size, bits=m.bits,
                                                   mode=mode, dtype=mx.float32)[3]
        mx.eval(ref)
        mx.save_safetensors(os.path.join(d, f"qwen3_moe_{mode}.reference.safetensors"), ref, metadata=meta)
    rng = np.random.default_rng(6)
    w = rng.standard_normal((3, 40, 96)).astype(np.float32)
    w[0, 0, :32] = 0.0                                          # a block of zeros
    w[0, 1, :32] = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4, np.float32)  # E2M1 ties
    w[1, 2] *= 1e4                                              # large magnitudes
    w[2, 3] *= 1e-6                                             # tiny ones
    arrays = {"w": mx.array(w)}
    q, s = mx.quantize(arrays["w"], mode=mode)
    arrays.update({"weight": q, "scales": s,
                   "dequantized": mx.dequantize(q, s, mode=mode, dtype=mx.float32)})
    x = rng.standard_normal((5, 1, 96)).astype(np.float32)
    ids = np.array([0, 2, 1, 2, 0], np.uint32)
    arrays.update({"x": mx.array(x), "ids": mx.array(ids.astype(np.int32)),
                   "gather_qmm": mx.gather_qmm(mx.array(x), q, s, transpose=True, mode=mode,
                                               rhs_indices=mx.array(ids))})
    mx.eval(arrays)
    mx.save_safetensors(os.path.join(d, f"{mode}_matrices.safetensors"), arrays,
                        metadata={"producer": f"mlx {mx.__version__} mx.quantize / mx.dequantize / "
                                              f"mx.gather_qmm, mode='{mode}'"})


def gpt_oss_mxfp4(out: str) -> None:
    """gpt-oss's MXFP4 release layout (``gpt_oss/gpt_oss_mxfp4``): a tiny ``GptOssConfig`` (H=64,
    I=64, E=4, top-2; its config.json as transformers 5.24 saves it, plus the release's
    ``quantization_config = {"quant_method": "mxfp4", ...}``) whose experts' weights MLX 0.32's
    ``mx.quantize(mode="mxfp4")`` quantized -- its bytes along each row are gpt-oss's -- stored
    under gpt-oss's names and shapes (``experts.gate_up_proj_blocks`` [E, 2I, H/32, 16], ``_scales``
    [E, 2I, H/32], gate and up rows interleaved; ``down_proj_blocks``/``_scales``; bf16 biases and
    router).  ``gpt_oss_mxfp4.reference``: transformers' own ``convert_moe_packed_tensors``
    dequantization of expert 0 (``[K, N]`` float32) and the output of transformers' ``GptOssMLP``
    (router and experts, float32) with the dequantized weights, on x (numpy seed 4)."""
    import mlx.core as mx
    import torch
    import transformers as tf
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    H, I, E = 64, 64, 4
    d = os.path.join(out, "gpt_oss", "gpt_oss_mxfp4")
    os.makedirs(d, exist_ok=True)
    cfg = tf.GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=2,
                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                          vocab_size=32)
    with tempfile.TemporaryDirectory() as tmp:
        cfg.save_pretrained(tmp)
        with open(os.path.join(tmp, "config.json")) as f:
            c = json.load(f)
    c["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
    g = torch.Generator().manual_seed(7)
    gate_up = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5      # [E, N=2I, K=H] rows interleaved
    down = torch.randn(E, H, I, generator=g) / I ** 0.5             # [E, N=H, K=I]
    pfx = "model.layers.0.mlp."
    t = {pfx + "router.weight": (torch.randn(E, H, generator=g) / H ** 0.5).to(torch.bfloat16),
         pfx + "router.bias": (torch.randn(E, generator=g) * 0.1).to(torch.bfloat16),
         pfx + "experts.gate_up_proj_bias": (torch.randn(E, 2 * I, generator=g) * 0.1).to(torch.bfloat16),
         pfx + "experts.down_proj_bias": (torch.randn(E, H, generator=g) * 0.1).to(torch.bfloat16)}
    for name, w in (("gate_up_proj", gate_up), ("down_proj", down)):
        q, sc = mx.quantize(mx.array(w.numpy()), mode="mxfp4")          # uint32 [E, N, K/8], uint8 [E, N, K/32]
        by = np.array(q).astype("<u4").view(np.uint8)                    # [E, N, K/2]
        t[pfx + f"experts.{name}_blocks"] = torch.from_numpy(by.reshape(by.shape[0], by.shape[1], -1, 16).copy())
        t[pfx + f"experts.{name}_scales"] = torch.from_numpy(np.array(sc).copy())
    save_file(t, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    deq = {n: convert_moe_packed_tensors(t[pfx + f"experts.{n}_blocks"], t[pfx + f"experts.{n}_scales"],
                                         dtype=torch.float32) for n in ("gate_up_proj", "down_proj")}
    mlp = GptOssMLP(cfg).to(torch.float32).eval()
    x = torch.from_numpy(np.random.default_rng(4).standard_normal((9, H)).astype(np.float32))
    with torch.no_grad():
        mlp.router.weight.copy_(t[pfx + "router.weight"].float())
        mlp.router.bias.copy_(t[pfx + "router.bias"].float())
        mlp.experts.gate_up_proj.copy_(deq["gate_up_proj"])              # [E, H, 2I]
        mlp.experts.gate_up_proj_bias.copy_(t[pfx + "experts.gate_up_proj_bias"].float())
        mlp.experts.down_proj.copy_(deq["down_proj"])                    # [E, I, H]
        mlp.experts.down_proj_bias.copy_(t[pfx + "experts.down_proj_bias"].float())
        y, _ = mlp(x[None])
    ref = {"x": x, "y": y[0].contiguous(), "gate_up_proj.0": deq["gate_up_proj"][0].contiguous(),
           "down_proj.0": deq["down_proj"][0].contiguous()}
    save_file(ref, os.path.join(out, "gpt_oss", "gpt_oss_mxfp4.reference.safetensors"),
              metadata={"producer": f"transformers {tf.__version__} convert_moe_packed_tensors / GptOssMLP; "
                                    f"bytes by mlx {mx.__version__} mx.quantize(mode='mxfp4')"})


def main(out: str, only: str | None = None) -> int:
    if only in MLX_FLOAT_MODES:
        mlx_float_mode(out, only)
        return 0
    if only == "fp8":
        fp8_checkpoints(out)
        return 0
    if only == "gpt_oss":
        gpt_oss_mxfp4(out)
        return 0
    if only == "nvfp4_ct":
        nvfp4_checkpoint(out)
        return 0
    if only == "peft":
        peft_adapter(out)
        return 0
    transformers_configs(out)
    transformers_checkpoint(out)
    mlx_checkpoints(out)
    for mode in MLX_FLOAT_MODES:
        mlx_float_mode(out, mode)
    fp8_checkpoints(out)
    nvfp4_checkpoint(out)
    gpt_oss_mxfp4(out)
    peft_adapter(out)
    if gptqmodel_configs(out):
        gptqmodel_awq_checkpoint(out)
    return 0


if __name__ == "__main__":
    # make_loader_fixtures.py [OUT] [--only=mxfp4|nvfp4|mxfp8|fp8|nvfp4_ct|gpt_oss|peft]
    args = [a for a in sys.argv[1:] if not a.startswith("--only")]
    only = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--only=")), None)
    sys.exit(main(args[0] if args else "tests/data", only))
