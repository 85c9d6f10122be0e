"""The loaders against files written by third-party tools (tests/data/,
README there: transformers 5.24.0's config classes and save_pretrained,
mlx-lm 0.32.2's convert with mlx 0.32.4, GPTQModel 7.6.0's
quantization_config): MoEConfig.from_hf reads every family's config.json as
transformers writes it, with each class's defaults for what a config.json
leaves out and each class's attribute_map names; load_moe reads a
transformers checkpoint and mlx-lm's stacked quantized experts and quantized
router, and the blocks equal the tools' own blocks on the same input; what is
not read (a config key, a format, a mode) is refused by name.  None of the
tools is imported here."""
from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("safetensors")
from safetensors.numpy import load_file, save_file  # noqa: E402

import jax_nbx as nbx  # noqa: E402
from jax_nbx import nn  # noqa: E402
from jax_nbx.loaders import CheckpointError, dequantize_mlx, from_mlx, load_moe  # noqa: E402
from jax_nbx.nn.block import HF_DEFAULTS  # noqa: E402

from test_families import FAMILIES, H, _rand  # noqa: E402

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
CONFIGS = DATA / "transformers" / "configs"
FAMILIES_HF = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "gpt_oss", "deepseek_v2", "deepseek_v3",
               "llama4_text")


def _json(path) -> dict:
    return json.loads(pathlib.Path(path).read_text())


def _rel(y, ref) -> float:
    ref = np.asarray(ref, np.float64)
    return float(np.max(np.abs(np.asarray(y, np.float64) - ref)) / np.max(np.abs(ref)))


def _copy(src: pathlib.Path, dst: pathlib.Path, **config_changes) -> pathlib.Path:
    shutil.copytree(src, dst)
    if config_changes:
        cfg = _json(dst / "config.json")
        for k, v in config_changes.items():
            if v is KeyError:
                cfg.pop(k)
            else:
                cfg[k] = v
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


# --- 1. transformers 5.24's Qwen3-MoE config.json (num_local_experts) ---------------------------

def test_from_hf_reads_transformers_524_qwen3_moe_config():
    """transformers 5.24 writes Qwen3-MoE's expert count as num_local_experts
    (its attribute_map); the hub's older files say num_experts: both read."""
    cfg = _json(CONFIGS / "qwen3_moe.tiny.json")
    assert "num_local_experts" in cfg and "num_experts" not in cfg
    c = nn.MoEConfig.from_hf(cfg)
    assert (c.hidden_size, c.intermediate_size, c.num_experts, c.top_k, c.norm_topk_prob) == (40, 20, 32, 8, True)
    old = {("num_experts" if k == "num_local_experts" else k): v for k, v in cfg.items()}
    assert nn.MoEConfig.from_hf(old) == c
    with pytest.raises(ValueError, match=r"num_local_experts=32 and num_experts=31 disagree"):
        nn.MoEConfig.from_hf({**cfg, "num_experts": 31})


def test_transformers_checkpoint_matches_its_own_block():
    """A tiny Qwen3-MoE saved by transformers 5.24 (bfloat16, per-expert
    tensors, its config.json): load_moe takes the config from the folder, and
    the block equals transformers' Qwen3MoeSparseMoeBlock on the same input."""
    folder = DATA / "transformers" / "qwen3_moe_tiny"
    params = load_moe(folder, layer=0)
    config = nn.MoEConfig.from_hf(folder)
    assert (config.num_experts, config.top_k, config.intermediate_size) == (4, 2, 16)
    assert params.experts.is_list and len(params.experts.gate) == 4
    io = load_file(str(DATA / "transformers" / "qwen3_moe_tiny.block_io.safetensors"))
    p32 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    y, _ = jax.jit(lambda p, x: nn.moe_block(p, x, config))(p32, jnp.asarray(io["x"]))
    assert _rel(y, io["y"]) <= 1e-5, _rel(y, io["y"])


def test_load_moe_refuses_an_unreadable_config_by_key(tmp_path):
    """A config.json that is there but cannot be read is an error naming the
    key (it was dropped silently, and the block loaded without it); an
    unknown model_type likewise, unless config= is given; a folder without
    config.json still loads."""
    src = DATA / "transformers" / "qwen3_moe_tiny"
    bad = _copy(src, tmp_path / "bad", num_experts_per_tok=None)
    with pytest.raises(CheckpointError, match=r"config\.json.*num_experts_per_tok"):
        load_moe(bad, layer=0)
    other = _copy(src, tmp_path / "other", model_type="qwen3_next")
    with pytest.raises(CheckpointError, match=r"config\.json.*model_type 'qwen3_next'.*pass config="):
        load_moe(other, layer=0)
    explicit = nn.MoEConfig(hidden_size=32, intermediate_size=16, num_experts=4, top_k=2)
    assert len(load_moe(other, layer=0, config=explicit).experts.gate) == 4
    broken = _copy(src, tmp_path / "broken")
    (broken / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json"):
        load_moe(broken, layer=0)
    none = _copy(src, tmp_path / "none")
    (none / "config.json").unlink()
    assert len(load_moe(none, layer=0).experts.gate) == 4


# --- 2. GPTQModel's AWQ checkpoints (checkpoint_format "gemm") ----------------------------------

def _gptqmodel_config(name: str) -> dict:
    return _json(DATA / "gptqmodel" / f"{name}.quantization_config.json")["quantization_config"]


def _with_quantization_config(folder: pathlib.Path, qc: dict) -> None:
    cfg = _json(folder / "config.json")
    cfg["quantization_config"] = qc
    (folder / "config.json").write_text(json.dumps(cfg))


def test_gptqmodel_awq_checkpoint_is_its_own_dequantization():
    """A Qwen3-MoE block whose experts GPTQModel 7.6's AWQ GEMM packer packed,
    its config.json saying quant_method "awq", checkpoint_format / format /
    version "gemm": every projection equals GPTQModel's own dequantize_gemm
    bit for bit (ours [in, out], as its)."""
    folder = DATA / "gptqmodel" / "qwen3_moe_awq"
    qc = _json(folder / "config.json")["quantization_config"]
    assert (qc["quant_method"], qc["checkpoint_format"], qc["version"]) == ("awq", "gemm", "gemm")
    params = load_moe(folder, layer=0)
    ref = load_file(str(DATA / "gptqmodel" / "qwen3_moe_awq.dequantized.safetensors"))
    ex = params.experts
    assert ex.is_list and len(ex.gate) == 4 and ex.gate[0].kind == "int4" and ex.gate[0].group_size == 32
    for n, proj in (("gate_proj", ex.gate), ("up_proj", ex.up), ("down_proj", ex.down)):
        for e, w in enumerate(proj):
            want = ref[f"model.layers.0.mlp.experts.{e}.{n}.weight"]
            assert np.array_equal(np.asarray(w.dequantize(jnp.float32)), want), (n, e)
    assert nn.MoEConfig.from_hf(folder).num_experts == 4


def test_gptqmodel_configs_read_or_refused_by_format(tmp_path):
    """GPTQModel 7.6's quantization_config dicts: AWQ "gemm" and GPTQ v1 read
    (the tensors converting losslessly); its other formats (gemv, gptq_v2)
    and a pack_dtype other than int32 are refused naming them."""
    from test_checkpoint import _quant_checkpoint
    qc = _gptqmodel_config("awq_gemm")
    assert (qc["quant_method"], qc["checkpoint_format"]) == ("awq", "gemm")
    _, ref = _quant_checkpoint(tmp_path / "awq", "awq")
    _with_quantization_config(tmp_path / "awq", qc)
    ex = load_moe(tmp_path / "awq", layer=0).experts
    assert ex.gate[0].kind == "int4" and ex.gate[0].group_size == 32
    for j, proj in enumerate((ex.gate, ex.up, ex.down)):
        for e in range(len(proj)):
            assert np.array_equal(np.asarray(proj[e].dequantize(jnp.float32)), ref[j][e])
    _with_quantization_config(tmp_path / "awq", _gptqmodel_config("awq_gemv"))
    with pytest.raises(CheckpointError, match=r"'gemv'"):
        load_moe(tmp_path / "awq", layer=0)

    _quant_checkpoint(tmp_path / "gptq", "gptq")
    _with_quantization_config(tmp_path / "gptq", _gptqmodel_config("gptq"))
    assert load_moe(tmp_path / "gptq", layer=0).experts.down[0].kind == "int4"
    _with_quantization_config(tmp_path / "gptq", _gptqmodel_config("gptq_v2"))
    with pytest.raises(CheckpointError, match=r"checkpoint_format='gptq_v2'"):
        load_moe(tmp_path / "gptq", layer=0)
    _with_quantization_config(tmp_path / "gptq", {**_gptqmodel_config("gptq"), "pack_dtype": "int16"})
    with pytest.raises(CheckpointError, match=r"pack_dtype='int16'"):
        load_moe(tmp_path / "gptq", layer=0)


# --- 3. mlx-lm: stacked switch_mlp experts and a quantized router -------------------------------

MLX = DATA / "mlx_lm"


@pytest.mark.parametrize("name,G", [("qwen3_moe_q4_g64", 64), ("qwen3_moe_q4_g32", 32)])
def test_mlx_lm_checkpoint_matches_mlx_lm_block(name, G):
    """mlx_lm.convert's Qwen3-MoE: experts stacked switch_mlp.*_proj [E, N,
    K/8] uint32 + bfloat16 scales/biases (4-bit affine, groups of G), the
    router 8-bit affine (groups of 64, recorded per layer): stacked int4
    experts and a float32 router; the block equals mlx-lm's own
    Qwen3MoeSparseMoeBlock on the same input."""
    params = load_moe(MLX / name, layer=0)
    config = nn.MoEConfig.from_hf(MLX / name)
    ex = params.experts
    assert not ex.is_list and ex.gate.kind == "int4" and ex.gate.group_size == G and ex.gate.shape == (4, 64, 64)
    assert params.router.dtype == jnp.float32 and params.router.shape == (4, 64)
    ref = load_file(str(MLX / f"{name}.reference.safetensors"))
    y, _ = jax.jit(lambda p, x: nn.moe_block(p, x, config))(params, jnp.asarray(ref["x"]))
    assert _rel(y, ref["y"]) <= 1e-5, _rel(y, ref["y"])


def test_mlx_lm_weights_are_mx_dequantize_bit_for_bit():
    """The router and expert 3 of each projection against mx.dequantize
    (mlx's own, float32): equal bit for bit (transposed: ours is [in, out])."""
    params = load_moe(MLX / "qwen3_moe_q4_g64", layer=0)
    ref = load_file(str(MLX / "qwen3_moe_q4_g64.reference.safetensors"))
    assert np.array_equal(np.asarray(params.router), ref["gate"])
    for n, w in (("gate_proj", params.experts.gate), ("up_proj", params.experts.up),
                 ("down_proj", params.experts.down)):
        dq = np.asarray(w.dequantize(jnp.float32))[3]
        assert np.array_equal(dq.T, ref[f"switch_mlp.{n}"]), n


def test_dequantize_mlx_every_affine_width():
    """dequantize_mlx (the router's reader) against mx.quantize/mx.dequantize
    at 2, 3, 4, 5, 6 and 8 bits, groups of 32 and 64."""
    t = load_file(str(MLX / "affine_bits.safetensors"))
    for bits in (2, 3, 4, 5, 6, 8):
        for G in (32, 64):
            k = f"b{bits}g{G}"
            w = dequantize_mlx(t[k + ".weight"], t[k + ".scales"], t[k + ".biases"], bits=bits, group_size=G)
            assert w.dtype == np.float32 and np.array_equal(w, t[k + ".dequantized"]), k
    with pytest.raises(ValueError, match=r"bits=7"):
        dequantize_mlx(t["b4g32.weight"], t["b4g32.scales"], t["b4g32.biases"], bits=7, group_size=32)


@pytest.mark.parametrize("mode,block", [("mxfp4", 32), ("nvfp4", 16), ("mxfp8", 32)])
def test_mlx_lm_float_mode_block_matches_mlx_lm(mode, block):
    """mlx-lm's conversions in MLX's float modes (uint32 codes, uint8 E8M0
    or E4M3 scales, no biases) load as jax_nbx's format of the same name,
    each expert's weights are mx.dequantize's bit for bit, and the block --
    on the CPU handler and the xla reference -- gives mlx-lm's own
    Qwen3MoeSparseMoeBlock (MLX's gather_qmm on the same bytes)."""
    params = load_moe(MLX / f"qwen3_moe_{mode}", layer=0)
    config = nn.MoEConfig.from_hf(MLX / f"qwen3_moe_{mode}")
    ex = params.experts
    assert ex.gate.kind == mode and ex.gate.group_size == block and ex.gate.shape == (4, 64, 64)
    ref = load_file(str(MLX / f"qwen3_moe_{mode}.reference.safetensors"))
    for n, w in (("gate_proj", ex.gate), ("up_proj", ex.up), ("down_proj", ex.down)):
        assert np.array_equal(np.asarray(w.dequantize(jnp.float32))[3].T, ref[f"switch_mlp.{n}"]), n
    for impl in ("cpu", "xla"):
        cfg = dataclasses.replace(config, implementation=impl)
        y, _ = jax.jit(lambda p, x: nn.moe_block(p, x, cfg))(params, jnp.asarray(ref["x"]))
        assert _rel(y, ref["y"]) <= 1e-5, (impl, _rel(y, ref["y"]))


@pytest.mark.parametrize("kind", ["block", "channel"])
def test_fp8_checkpoints_match_their_producers(kind):
    """FP8 experts as transformers' fine-grained FP8 (per-expert weights,
    5.24's fused stacked ``*_scale_inv``, 128x128 blocks along both axes)
    and compressed-tensors' per-channel FP8 write them load as jax_nbx's fp8
    format: expert 0's weights are the producers' own dequantization bit for
    bit, and the block -- CPU handler and xla reference -- gives
    transformers' Qwen3MoeSparseMoeBlock on those weights."""
    path = DATA / "fp8" / f"qwen3_moe_fp8_{kind}"
    params = load_moe(path, layer=0)
    config = nn.MoEConfig.from_hf(path)
    ex = params.experts
    assert ex.is_list and ex.gate[0].kind == "fp8" and ex.gate[0].shape == (256, 128)
    ref = load_file(str(path) + ".reference.safetensors")
    for n, w in (("gate_proj", ex.gate), ("up_proj", ex.up), ("down_proj", ex.down)):
        got = np.asarray(w[0].dequantize(jnp.float32)).T[:16]
        np.testing.assert_array_equal(got, ref[f"experts.0.{n}.rows16"], err_msg=n)
    for impl in ("cpu", "xla"):
        cfg = dataclasses.replace(config, implementation=impl)
        y, _ = jax.jit(lambda p, x: nn.moe_block(p, x, cfg))(params, jnp.asarray(ref["x"]))
        assert _rel(y, ref["y"]) <= 2e-6, (impl, _rel(y, ref["y"]))


def test_compressed_tensors_nvfp4_matches_its_producer():
    """compressed-tensors' NVFP4 (nvfp4-pack-quantized: E2M1 pairs, E4M3 group
    scales, a float32 global scale per matrix) loads as nvfp4 experts with a
    tensor scale (1 / global_scale): expert 0's weights are compressed-tensors'
    own decompress to within the one rounding of that reciprocal, and the
    block -- CPU handler and xla reference -- gives transformers'
    Qwen3MoeSparseMoeBlock on those weights."""
    path = DATA / "nvfp4" / "qwen3_moe_nvfp4"
    params = load_moe(path, layer=0)
    config = nn.MoEConfig.from_hf(path)
    ex = params.experts
    assert ex.is_list and ex.gate[0].kind == "nvfp4" and ex.gate[0].shape == (256, 128)
    assert ex.gate[0].tensor_scale is not None and ex.gate[0].tensor_scale.dtype == jnp.float32
    ref = load_file(str(path) + ".reference.safetensors")
    for n, w in (("gate_proj", ex.gate), ("up_proj", ex.up), ("down_proj", ex.down)):
        got = np.asarray(w[0].dequantize(jnp.float32)).T[:16]
        np.testing.assert_allclose(got, ref[f"experts.0.{n}.rows16"], rtol=3e-7, atol=0, err_msg=n)
    for impl in ("cpu", "xla"):
        cfg = dataclasses.replace(config, implementation=impl)
        y, _ = jax.jit(lambda p, x: nn.moe_block(p, x, cfg))(params, jnp.asarray(ref["x"]))
        assert _rel(y, ref["y"]) <= 2e-6, (impl, _rel(y, ref["y"]))


def test_gpt_oss_mxfp4_matches_transformers():
    """gpt-oss's MXFP4 release layout (``*_blocks``/``*_scales``, gate and up
    rows interleaved, biases) loads as stacked mxfp4 experts with biases:
    expert 0's weights are transformers' own convert_moe_packed_tensors bit for
    bit, and the block (router with bias, clamped SwiGLU) -- CPU handler and
    xla reference -- gives transformers' GptOssMLP."""
    path = DATA / "gpt_oss" / "gpt_oss_mxfp4"
    params = load_moe(path, layer=0)
    config = nn.MoEConfig.from_hf(path)
    ex = params.experts
    assert ex.gate.kind == "mxfp4" and ex.gate.shape == (4, 64, 64) and ex.has_bias
    assert config.activation == nbx.Activation("swiglu_clamped", alpha=1.702, limit=7.0)
    ref = load_file(str(path) + ".reference.safetensors")
    gate_up = ref["gate_up_proj.0"]  # [H, 2I], gate the even columns
    np.testing.assert_array_equal(np.asarray(ex.gate.dequantize(jnp.float32))[0], gate_up[:, 0::2])
    np.testing.assert_array_equal(np.asarray(ex.up.dequantize(jnp.float32))[0], gate_up[:, 1::2])
    np.testing.assert_array_equal(np.asarray(ex.down.dequantize(jnp.float32))[0], ref["down_proj.0"])
    for impl in ("cpu", "xla"):
        cfg = dataclasses.replace(config, implementation=impl)
        y, _ = jax.jit(lambda p, x: nn.moe_block(p, x, cfg))(params, jnp.asarray(ref["x"]))
        assert _rel(y, ref["y"]) <= 1e-6, (impl, _rel(y, ref["y"]))


def test_fp8_configs_that_are_not_read_are_named(tmp_path):
    """compressed-tensors formats other than FP8 float-quantized and NVFP4
    (and NVFP4 configs whose weights are not 4-bit floats in groups of 16),
    and unknown quant_methods, are refused naming the key and value."""
    src = DATA / "fp8" / "qwen3_moe_fp8_channel"
    qc = _json(src / "config.json")["quantization_config"]
    bad = dict(qc, format="mxfp4-pack-quantized")
    with pytest.raises(CheckpointError, match=r"format='mxfp4-pack-quantized' \(compressed-tensors\) is not read"):
        load_moe(_copy(src, tmp_path / "a", quantization_config=bad), layer=0)
    with pytest.raises(CheckpointError, match=r"nvfp4-pack-quantized weights with num_bits=8, type='float', "
                                              r"group_size=None are not read"):
        load_moe(_copy(src, tmp_path / "n", quantization_config=dict(qc, format="nvfp4-pack-quantized")), layer=0)
    groups = json.loads(json.dumps(qc["config_groups"]))
    groups["group_0"]["weights"].update(num_bits=4, type="int")
    with pytest.raises(CheckpointError, match=r"config_groups\.group_0\.weights has num_bits=4, type='int'"):
        load_moe(_copy(src, tmp_path / "b", quantization_config=dict(qc, config_groups=groups)), layer=0)
    with pytest.raises(CheckpointError, match=r"quant_method='modelopt' is not read"):
        load_moe(_copy(src, tmp_path / "c", quantization_config={"quant_method": "modelopt"}), layer=0)


def test_mlx_lm_other_widths_are_refused_by_name():
    with pytest.raises(CheckpointError, match=r"switch_mlp\.gate_proj.*bits=8"):
        load_moe(MLX / "qwen3_moe_q8_g64", layer=0)


# --- 4. what a config.json leaves out: each config class's defaults --------------------------------

DEFAULT_ARGS = {"deepseek_v2": {"num_experts_per_tok": 6}}  # its class default is None (tests/data/README.md)


@pytest.mark.parametrize("mt", FAMILIES_HF)
def test_from_hf_defaults_are_the_config_classes(mt):
    """A config.json with only model_type reads as transformers fills it in:
    every key at the class's default (its to_json_file(use_diff=False))."""
    written = _json(CONFIGS / f"{mt}.defaults.json")
    assert written["model_type"] == mt
    assert nn.MoEConfig.from_hf({"model_type": mt, **DEFAULT_ARGS.get(mt, {})}) == nn.MoEConfig.from_hf(written)


def test_from_hf_named_defaults():
    """The values of issue #32 (norm_topk_prob of Qwen2/3-MoE; DeepSeek-V3's
    routed_scaling_factor, n_group, topk_group) and Qwen2-MoE's shared expert."""
    sizes = dict(hidden_size=64, moe_intermediate_size=32, num_experts_per_tok=2)
    q3 = nn.MoEConfig.from_hf({"model_type": "qwen3_moe", "num_experts": 8, **sizes})
    q2 = nn.MoEConfig.from_hf({"model_type": "qwen2_moe", "num_experts": 8, **sizes})
    v3 = nn.MoEConfig.from_hf({"model_type": "deepseek_v3", "n_routed_experts": 64, **sizes})
    assert (q3.norm_topk_prob, q2.norm_topk_prob) == (False, False)
    assert (v3.routed_scaling_factor, v3.n_group, v3.topk_group, v3.norm_topk_prob) == (2.5, 8, 4, True)
    assert (q2.shared_intermediate_size, q2.shared_gate) == (5632, True)
    assert v3.shared_intermediate_size == 32  # n_shared_experts 1 x moe_intermediate_size


def test_from_hf_reads_the_attribute_map_names():
    """Every other name a class's attribute_map gives a key the block reads
    (the number of experts, in six of the nine classes)."""
    maps = _json(CONFIGS / "attribute_maps.json")["attribute_map"]
    seen = 0
    for mt, amap in maps.items():
        tiny = _json(CONFIGS / f"{mt}.tiny.json")
        for alias, key in amap.items():
            if key not in HF_DEFAULTS[mt]:  # not a key of the block (DeepSeek-V3's num_mtp_layers)
                continue
            renamed = {(alias if k == key else k): v for k, v in tiny.items()}
            assert nn.MoEConfig.from_hf(renamed) == nn.MoEConfig.from_hf(tiny), (mt, alias)
            seen += 1
    assert seen == 6


@pytest.mark.parametrize("key,value", [("num_experts_per_tok", None), ("moe_intermediate_size", "20"),
                                       ("norm_topk_prob", "yes"), ("hidden_act", "relu")])
def test_from_hf_names_the_key_it_cannot_read(key, value):
    cfg = {**_json(CONFIGS / "qwen3_moe.tiny.json"), key: value}
    with pytest.raises(ValueError, match=rf"qwen3_moe config\.json: {key}="):
        nn.MoEConfig.from_hf(cfg)


# --- 5. Llama-4, hidden_act, gpt-oss's swiglu_alpha / swiglu_limit ------------------------------

def test_from_hf_llama4():
    """Llama4TextMoe (modeling_llama4.py, 5.24.0): top-k sigmoid, the weight
    on the expert's input, gate_up_proj [E, H, 2I] concatenated (x @ W), a
    shared expert of width intermediate_size; as released (model_type
    "llama4", the text model under text_config) too."""
    c = nn.MoEConfig.from_hf(CONFIGS / "llama4_text.tiny.json")
    want = dict(hidden_size=40, intermediate_size=24, num_experts=16, top_k=1, routing="topk_sigmoid",
                weights_on="input", fusion="concat", layout="in_out", shared_intermediate_size=24,
                shared_gate=False, activation="swiglu")
    assert {k: getattr(c, k) for k in want} == want
    assert nn.MoEConfig.from_hf(CONFIGS / "llama4.tiny.json") == c


def test_llama4_checkpoint_block_matches_transformers(tmp_path):
    """A Llama-4 block (tests/library/test_families.py's builder, under
    model.layers.1.feed_forward.) with transformers' config.json: load_moe,
    from_hf, moe_block, jitted, against the float64 Llama4TextMoe."""
    rng = np.random.default_rng(41)
    p, ref, _, _ = FAMILIES["llama4_k1"](rng)
    (tmp_path / "m").mkdir()
    save_file({"model.layers.1.feed_forward." + k: np.ascontiguousarray(v) for k, v in p.items()},
              str(tmp_path / "m" / "model.safetensors"))
    shutil.copy(CONFIGS / "llama4_text.tiny.json", tmp_path / "m" / "config.json")
    params = load_moe(tmp_path / "m", layer=1)
    config = nn.MoEConfig.from_hf(tmp_path / "m")
    assert params.shared is not None and params.experts.fusion == "concat" and params.experts.layout == "in_out"
    x = _rand(rng, 9, H)
    y, _ = jax.jit(lambda p, x: nn.moe_block(p, x, config))(params, jnp.asarray(x))
    y_ref = ref(x.astype(np.float64), jax.tree.map(lambda a: np.asarray(a, np.float64), p))
    assert _rel(y, y_ref) <= 1e-5, _rel(y, y_ref)


def test_from_hf_hidden_act_and_swiglu_parameters():
    """hidden_act picks the gated unit (ACT2FN: silu -> swiglu, gelu ->
    geglu_erf, gelu_pytorch_tanh -> geglu); one jax_nbx has not is refused by
    name; gpt-oss's swiglu_alpha and swiglu_limit are read."""
    assert nn.MoEConfig.from_hf(CONFIGS / "olmoe.tiny.json").activation == "swiglu"
    assert nn.MoEConfig.from_hf(CONFIGS / "olmoe.gelu.json").activation == "geglu_erf"
    assert nn.MoEConfig.from_hf(CONFIGS / "mixtral.gelu_pytorch_tanh.json").activation == "geglu"
    with pytest.raises(ValueError, match=r"hidden_act='relu'"):
        nn.MoEConfig.from_hf(CONFIGS / "qwen3_moe.relu.json")
    assert nn.MoEConfig.from_hf(CONFIGS / "gpt_oss.tiny.json").activation == nbx.Activation(
        "swiglu_clamped", alpha=1.702, limit=7.0)
    assert nn.MoEConfig.from_hf(CONFIGS / "gpt_oss.swiglu.json").activation == nbx.Activation(
        "swiglu_clamped", alpha=1.5, limit=5.0)


# --- 6. MLX's modes: read by name, others refused naming the mode -----------------------------------------------

def test_mlx_modes_are_named():
    """from_mlx refuses a mode MLX does not have, naming it; its default is
    "affine", and uint8 scales without mode= say which modes store them."""
    t = load_file(str(MLX / "qwen3_moe_nvfp4" / "model.safetensors"))
    w, s = t["model.layers.0.mlp.switch_mlp.up_proj.weight"], t["model.layers.0.mlp.switch_mlp.up_proj.scales"]
    with pytest.raises(ValueError, match=r"mode='fp3'.*not one of"):
        from_mlx(w, s, None, mode="fp3")
    with pytest.raises(TypeError, match=r"scales has dtype uint8.*mode="):
        from_mlx(w, s, s)
    with pytest.raises(ValueError, match=r"bits=4: MLX's mxfp8 mode is 8 bits"):
        from_mlx(w, s, None, mode="mxfp8", bits=4)
    with pytest.raises(ValueError, match=r"group_size=32: MLX's nvfp4 mode has blocks of 16"):
        from_mlx(w, s, None, mode="nvfp4", group_size=32)
