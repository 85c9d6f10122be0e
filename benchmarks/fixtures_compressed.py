"""compressed-tensors' fixtures of make_loader_fixtures.py (``--only=fp8``,
``--only=nvfp4_ct``): FP8 and NVFP4 checkpoints of a tiny Qwen3-MoE written by
compressed-tensors itself, each beside the block output transformers computes
on the dequantized weights.  Imports torch, transformers and
compressed-tensors when called (the producer venv, never the test install)."""
from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
from fixtures_common import linear_tree, tiny_qwen3_moe


def _fp8_reference(d: str, cfg, dequantized: dict, out: str) -> None:
    """<d>.reference.safetensors: x, the block output ``y`` of transformers' own float32
    Qwen3MoeSparseMoeBlock with ``dequantized`` ({(e, proj): [out, in]}) as every expert's weights,
    and the first 16 output rows of expert 0's (kept small)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    sd = load_file(os.path.join(d, "model.safetensors"))
    blk = Qwen3MoeSparseMoeBlock(cfg).to(torch.float32).eval()
    x = torch.from_numpy(np.random.default_rng(4).standard_normal((9, cfg.hidden_size)).astype(np.float32))
    with torch.no_grad():
        blk.gate.weight.copy_(sd["model.layers.0.mlp.gate.weight"].float())
        for e in range(cfg.num_experts):
            blk.experts.gate_up_proj[e].copy_(torch.cat([dequantized[(e, "gate_proj")], dequantized[(e, "up_proj")]]))
            blk.experts.down_proj[e].copy_(dequantized[(e, "down_proj")])
        y = blk(x[None])
        y = (y[0] if isinstance(y, tuple) else y)[0]
    ref = {"x": x, "y": y.contiguous()}
    ref.update({f"experts.0.{p}.rows16": dequantized[(0, p)][:16].contiguous()
                for p in ("gate_proj", "up_proj", "down_proj")})
    save_file(ref, d + ".reference.safetensors", metadata={"producer": out})


def _save_compressed(root, hf: str, dst: str, pfx: str) -> dict:
    """compressed-tensors' ``compress_model`` of ``root``; its tensors under ``pfx`` saved to
    ``dst``/model.safetensors beside the tiny model's config.json with the quantization_config
    compressed-tensors writes (``update_config``); returns them."""
    from compressed_tensors.compressors import ModelCompressor
    from safetensors.torch import save_file
    mc = ModelCompressor.from_pretrained_model(root)
    mc.compress_model(root)
    os.makedirs(dst, exist_ok=True)
    csd = {k: v.contiguous() for k, v in root.state_dict().items() if k.startswith(pfx)}
    save_file(csd, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(os.path.join(hf, "config.json"), dst)
    mc.update_config(dst)
    return csd


def nvfp4_checkpoint(out: str) -> None:
    """``nvfp4/qwen3_moe_nvfp4``: compressed-tensors' NVFP4 (its ``NVFP4A16`` preset:
    ``nvfp4-pack-quantized``: E2M1 pairs ``weight_packed`` [N, K/2], E4M3 ``weight_scale`` per 16,
    a float32 ``weight_global_scale`` per matrix) of a tiny Qwen3-MoE's experts (H=256, I=128,
    E=2), its MoE block's tensors kept: ``apply_quantization_config``, the global scale by its
    ``generate_gparam`` and the group scales by its ``calculate_qparams`` from each matrix's and
    group's min/max (what its min-max observers give), ``ModelCompressor.compress_model``.
    Beside it (<folder>.reference) expert 0's weights by compressed-tensors' own
    ``unpack_fp4_from_uint8`` and ``dequantize`` (what its ``NVFP4PackedCompressor.decompress``
    runs, there in bfloat16; here in float32) and the block output of transformers' float32
    ``Qwen3MoeSparseMoeBlock`` with every expert so dequantized."""
    import compressed_tensors
    import torch
    import transformers as tf
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
    d = os.path.join(out, "nvfp4")
    os.makedirs(d, exist_ok=True)
    pfx = "model.layers.0.mlp."
    with tempfile.TemporaryDirectory() as tmp:
        hf = os.path.join(tmp, "hf")
        tiny_qwen3_moe(hf, H=256, I=128, E=2, k=2, seed=6)
        cfg = tf.AutoConfig.from_pretrained(hf)
        root = linear_tree(os.path.join(hf, "model.safetensors"), pfx)
        scheme = preset_name_to_scheme("NVFP4A16", [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"])
        apply_quantization_config(root, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
        for _, mod in root.named_modules():
            if hasattr(mod, "quantization_scheme"):
                wt = mod.weight.data
                gs = generate_gparam(wt.amin(), wt.amax()).reshape(mod.weight_global_scale.shape)
                grp = wt.reshape(wt.shape[0], -1, 16)
                sc, _ = calculate_qparams(grp.amin(-1), grp.amax(-1), mod.quantization_scheme.weights,
                                          global_scale=gs)
                mod.weight_global_scale.data.copy_(gs)
                mod.weight_scale.data.copy_(sc.to(mod.weight_scale.dtype))
        dst = os.path.join(d, "qwen3_moe_nvfp4")
        csd = _save_compressed(root, hf, dst, pfx)
        w = {}
        for e in range(cfg.num_experts):
            for p in ("gate_proj", "up_proj", "down_proj"):
                local = {k.split(".")[-1]: v for k, v in csd.items() if k.startswith(pfx + f"experts.{e}.{p}.")}
                m, n = local["weight_packed"].shape
                codes = unpack_fp4_from_uint8(local["weight_packed"], m, n * 2, dtype=torch.float32)
                w[(e, p)] = dequantize(x_q=codes, scale=local["weight_scale"].float(), args=scheme.weights,
                                       global_scale=local["weight_global_scale"], dtype=torch.float32)
        _fp8_reference(dst, cfg, w, f"compressed-tensors {compressed_tensors.__version__} nvfp4-pack-quantized: "
                                    "its unpack_fp4_from_uint8 and dequantize in float32")


def fp8_checkpoints(out: str) -> None:
    """FP8 experts as two real producers write them (``fp8/``), a tiny Qwen3-MoE (H=256, I=128,
    E=2: weight blocks along both axes of every projection), only its MoE block's tensors kept:

    * ``qwen3_moe_fp8_block``: transformers 5.24's fine-grained FP8 --
      ``from_pretrained(..., quantization_config=FineGrainedFP8Config(weight_block_size=[128, 128]))``
      then ``save_pretrained``.  Its CPU environment check (it refuses without a GPU) is the one
      thing replaced; the quantization math and the save are stock.  5.24 writes the experts'
      weights per expert and their scales fused and stacked (``experts.gate_up_proj_scale_inv``
      [E, 2I/128, H/128], ``experts.down_proj_scale_inv``).
    * ``qwen3_moe_fp8_channel``: compressed-tensors' FP8 per-channel (``float-quantized``):
      ``apply_quantization_config`` on the experts' linears, scales by its ``calculate_qparams``
      from per-row min/max (what a min-max observer gives), ``ModelCompressor.compress_model``.

    Beside each (<folder>.reference): expert 0's weights dequantized by the producer's own code
    (transformers' ``Fp8Dequantize``; compressed-tensors' ``float-quantized`` decompress) and the
    block output of transformers' float32 ``Qwen3MoeSparseMoeBlock`` with every expert so
    dequantized (weights only: the checkpoints' dynamic FP8 activations are their kernels' choice)."""
    import compressed_tensors
    import torch
    import transformers as tf
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from safetensors.torch import load_file, save_file
    from transformers.integrations import finegrained_fp8 as F8
    from transformers.quantizers import quantizer_finegrained_fp8 as Q
    d = os.path.join(out, "fp8")
    os.makedirs(d, exist_ok=True)
    pfx = "model.layers.0.mlp."
    with tempfile.TemporaryDirectory() as tmp:
        hf = os.path.join(tmp, "hf")
        tiny_qwen3_moe(hf, H=256, I=128, E=2, k=2, seed=5)
        cfg = tf.AutoConfig.from_pretrained(hf)
        # 1. transformers' fine-grained FP8
        Q.FineGrainedFP8HfQuantizer.validate_environment = lambda self, *a, **k: None
        m = tf.AutoModelForCausalLM.from_pretrained(
            hf, quantization_config=tf.FineGrainedFP8Config(weight_block_size=[128, 128]), device_map="cpu")
        conv = os.path.join(tmp, "fp8_block")
        m.save_pretrained(conv)
        dst = os.path.join(d, "qwen3_moe_fp8_block")
        sd = {k: v for k, v in load_file(os.path.join(conv, "model.safetensors")).items() if k.startswith(pfx)}
        os.makedirs(dst, exist_ok=True)
        save_file(sd, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
        shutil.copy(os.path.join(conv, "config.json"), dst)
        deq = F8.Fp8Dequantize(None)._dequantize_one
        gu, dn = sd[pfx + "experts.gate_up_proj_scale_inv"], sd[pfx + "experts.down_proj_scale_inv"]
        nb = cfg.moe_intermediate_size // 128
        w = {}
        for e in range(cfg.num_experts):
            w[(e, "gate_proj")] = deq(sd[pfx + f"experts.{e}.gate_proj.weight"], gu[e, :nb], torch.float32)
            w[(e, "up_proj")] = deq(sd[pfx + f"experts.{e}.up_proj.weight"], gu[e, nb:], torch.float32)
            w[(e, "down_proj")] = deq(sd[pfx + f"experts.{e}.down_proj.weight"], dn[e], torch.float32)
        _fp8_reference(dst, cfg, w, f"transformers {tf.__version__} FineGrainedFP8Config; Fp8Dequantize")
        # 2. compressed-tensors FP8 per-channel, on the experts' nn.Linear layers under their checkpoint names
        root = linear_tree(os.path.join(hf, "model.safetensors"), pfx)
        scheme = QuantizationScheme(
            targets=[r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"],
            weights=QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True, dynamic=False),
            input_activations=QuantizationArgs(num_bits=8, type="float", strategy="token", symmetric=True,
                                               dynamic=True))
        apply_quantization_config(root, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
        for _, mod in root.named_modules():
            if hasattr(mod, "quantization_scheme"):
                wt = mod.weight.data
                sc, _ = calculate_qparams(wt.amin(dim=1, keepdim=True), wt.amax(dim=1, keepdim=True),
                                          mod.quantization_scheme.weights)
                mod.weight_scale.data.copy_(sc.to(mod.weight_scale.dtype))
        dst = os.path.join(d, "qwen3_moe_fp8_channel")
        csd = _save_compressed(root, hf, dst, pfx)
        comp = BaseCompressor.get_value_from_registry("float-quantized")
        w = {}
        for e in range(cfg.num_experts):
            for p in ("gate_proj", "up_proj", "down_proj"):
                local = {k.split(".")[-1]: v for k, v in csd.items() if k.startswith(pfx + f"experts.{e}.{p}.")}
                w[(e, p)] = comp.decompress(local, scheme)["weight"].float()
        _fp8_reference(dst, cfg, w, f"compressed-tensors {compressed_tensors.__version__} float-quantized decompress")
