"""jax_nbx.loaders.load_moe: every family's block written as a Hugging Face
safetensors checkpoint (the names and layouts of tests/library/test_families.py's
builders, which follow transformers 5.24.0; the config.json transformers
5.24.0 writes for each, from tests/data), loaded back, run through the
NNX and Equinox layers and compared with the family's float64 block; the
tensors kept in place (lists, stored layout); missing and mis-shaped
tensors named."""
from __future__ import annotations

import json
import pathlib
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("safetensors")
from safetensors.numpy import save_file  # noqa: E402

from jax_nbx import nn  # noqa: E402
from jax_nbx.loaders import CheckpointError, load_moe  # noqa: E402

from test_families import FAMILIES, H, _rand  # noqa: E402

# config.json of each builder's block, as transformers 5.24.0 writes it (its config classes'
# save_pretrained: tests/data/README.md)
CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "data" / "transformers" / "configs"
HF_CONFIGS = {name: json.loads((CONFIGS / f"{name}.tiny.json").read_text())
              for name in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "gpt_oss", "deepseek_v3",
                           "deepseek_v2")}
BLOCK = {"mixtral": "block_sparse_moe", "granitemoe": "block_sparse_moe"}
MIXTRAL_LISTS = ("w1", "w3", "w2")


def _tensors(name, p, layer=1):
    """The block's tensors under their full checkpoint names."""
    pfx = f"model.layers.{layer}.{BLOCK.get(name, 'mlp')}."
    out = {}
    for key, v in p.items():
        if key in MIXTRAL_LISTS:
            for e, a in enumerate(v):
                out[f"{pfx}experts.{e}.{key}.weight"] = np.ascontiguousarray(a)
        else:
            out[pfx + key] = np.ascontiguousarray(v)
    return out


def _write(folder, name, tensors, shards=1):
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "config.json", "w") as f:
        json.dump(dict(HF_CONFIGS[name], hidden_size=H), f)
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"))
        return
    names = sorted(tensors)
    wmap = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, str(folder / fname))
        wmap.update(dict.fromkeys(part, fname))
    with open(folder / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": wmap}, f)


def _rel(y, ref):
    return float(np.max(np.abs(np.asarray(y, np.float64) - ref)) / np.max(np.abs(ref)))


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_family_checkpoint_loads_and_matches_transformers(name, tmp_path):
    """load_moe + MoEConfig.from_hf + each layer, jitted, against the float64
    HF block on the same tensors (≤ 1e-5), at T = 33 and T = 1."""
    flax_nnx = pytest.importorskip("flax.nnx")
    eqx = pytest.importorskip("equinox")
    rng = np.random.default_rng(sum(map(ord, name)))
    p, ref, _, _ = FAMILIES[name](rng)
    _write(tmp_path, name, _tensors(name, p))
    params = load_moe(tmp_path, layer=1)
    config = nn.MoEConfig.from_hf(tmp_path)
    nnx_layer = nn.NNXMoE(config, params=params)
    eqx_layer = nn.EqxMoE(config, params=params)
    p64 = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), p)
    for T in (33, 1):
        x = _rand(rng, T, H)
        y_ref = ref(x.astype(np.float64), p64)
        y1, aux = flax_nnx.jit(lambda m, x: m(x))(nnx_layer, jnp.asarray(x))
        y2, _ = eqx.filter_jit(lambda m, x: m(x))(eqx_layer, jnp.asarray(x))
        assert _rel(y1, y_ref) <= 1e-5, (name, T, _rel(y1, y_ref))
        assert np.array_equal(np.asarray(y1), np.asarray(y2)), name
        assert aux.expert_counts.shape == (config.num_experts,) and int(aux.expert_counts.sum()) == T * config.top_k


def test_per_expert_tensors_stay_lists_in_the_stored_layout(tmp_path):
    """Mixtral's experts.{e}.w1/w3/w2: E arrays each, [I, H]/[H, I] as stored
    (layout out_in): nothing stacked or transposed."""
    rng = np.random.default_rng(1)
    p, _, _, _ = FAMILIES["mixtral"](rng)
    _write(tmp_path, "mixtral", _tensors("mixtral", p))
    ex = load_moe(tmp_path, layer=1).experts
    assert ex.is_list and ex.layout == "out_in" and not ex.is_fused and len(ex.gate) == 8
    for e in range(8):
        assert np.array_equal(np.asarray(ex.gate[e]), p["w1"][e])
        assert np.array_equal(np.asarray(ex.up[e]), p["w3"][e])
        assert np.array_equal(np.asarray(ex.down[e]), p["w2"][e])


def test_fused_tensors_stay_fused_in_the_stored_layout(tmp_path):
    rng = np.random.default_rng(2)
    p, _, _, _ = FAMILIES["gpt_oss"](rng)
    _write(tmp_path, "gpt_oss", _tensors("gpt_oss", p))
    params = load_moe(tmp_path, layer=1)
    ex = params.experts
    assert (ex.fusion, ex.layout, ex.is_list) == ("interleaved", "in_out", False)
    assert np.array_equal(np.asarray(ex.gate_up), p["experts.gate_up_proj"])
    assert np.array_equal(np.asarray(params.router_bias), p["router.bias"])


def test_sharded_checkpoint_with_index_and_progress(tmp_path, capsys):
    """model.safetensors.index.json over three files: the same parameters as
    one file; a progress bar is drawn (tqdm, on stderr)."""
    rng = np.random.default_rng(3)
    p, _, _, _ = FAMILIES["qwen2_moe"](rng)
    t = _tensors("qwen2_moe", p)
    _write(tmp_path / "one", "qwen2_moe", t)
    _write(tmp_path / "three", "qwen2_moe", t, shards=3)
    a = load_moe(tmp_path / "one", layer=1)
    b = load_moe(tmp_path / "three", layer=1)
    assert "tensors" in capsys.readouterr().err
    for la, lb in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert np.array_equal(np.asarray(la), np.asarray(lb))
    assert jax.tree.structure(a) == jax.tree.structure(b)
    # and from a list of files, with the prefix given
    files = sorted(str(f) for f in (tmp_path / "three").glob("*.safetensors"))
    c = load_moe(files, prefix="model.layers.1.mlp.")
    assert jax.tree.structure(c) == jax.tree.structure(a)


def test_missing_tensor_is_named(tmp_path):
    rng = np.random.default_rng(4)
    p, _, _, _ = FAMILIES["mixtral"](rng)
    t = _tensors("mixtral", p)
    del t["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    _write(tmp_path, "mixtral", t)
    with pytest.raises(CheckpointError,
                       match=r"'model\.layers\.1\.block_sparse_moe\.experts\.5\.w3\.weight' is missing"):
        load_moe(tmp_path, layer=1)


def test_misshaped_tensor_is_named(tmp_path):
    rng = np.random.default_rng(5)
    p, _, _, _ = FAMILIES["qwen2_moe"](rng)
    t = _tensors("qwen2_moe", p)
    t["model.layers.1.mlp.shared_expert.up_proj.weight"] = t["model.layers.1.mlp.shared_expert.up_proj.weight"][:, :-1]
    _write(tmp_path, "qwen2_moe", t)
    with pytest.raises(CheckpointError, match=r"shared_expert\.up_proj\.weight' has shape \(52, 39\); "
                                              r"expected \(52, 40\)"):
        load_moe(tmp_path, layer=1)
    t = _tensors("qwen2_moe", p)
    t["model.layers.1.mlp.experts.down_proj"] = t["model.layers.1.mlp.experts.down_proj"][:, :, :-2]
    _write(tmp_path, "qwen2_moe", t)
    with pytest.raises(CheckpointError, match=r"experts\.down_proj' has shape \(16, 40, 22\); expected \(16, 40, 24\)"):
        load_moe(tmp_path, layer=1)


def test_wrong_layer_or_no_router(tmp_path):
    rng = np.random.default_rng(6)
    p, _, _, _ = FAMILIES["olmoe"](rng)
    t = _tensors("olmoe", p)
    _write(tmp_path, "olmoe", t)
    with pytest.raises(CheckpointError, match="no MoE block found for layer=7"):
        load_moe(tmp_path, layer=7)
    with pytest.raises(ValueError, match="pass layer="):
        load_moe(tmp_path)
    del t["model.layers.1.mlp.gate.weight"]
    _write(tmp_path, "olmoe", t)
    with pytest.raises(CheckpointError, match=r"the router of 'model\.layers\.1\.mlp\.' is missing"):
        load_moe(tmp_path, layer=1)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_moe(tmp_path / "nope.safetensors", layer=1)


def test_config_disagreeing_with_tensors_is_named(tmp_path):
    rng = np.random.default_rng(7)
    p, _, _, _ = FAMILIES["olmoe"](rng)
    _write(tmp_path, "olmoe", _tensors("olmoe", p))
    cfg = nn.MoEConfig(hidden_size=H, intermediate_size=32, num_experts=16, top_k=4)
    with pytest.raises(CheckpointError, match="intermediate size 24; the config says 32"):
        load_moe(tmp_path, layer=1, config=cfg)


def test_from_hf_rejects_unknown_model_type():
    with pytest.raises(ValueError, match="model_type 'llama' is not one of"):
        nn.MoEConfig.from_hf({"model_type": "llama", "hidden_size": 8})


def test_layer_parameters_round_trip_through_a_checkpoint(tmp_path):
    """An initialized NNXMoE (per-expert lists, out_in) written with the
    Qwen3-MoE names and loaded back: the same parameter tree, the same output."""
    flax_nnx = pytest.importorskip("flax.nnx")
    config = nn.MoEConfig(hidden_size=H, intermediate_size=20, num_experts=32, top_k=8)
    layer = nn.NNXMoE(config, rngs=flax_nnx.Rngs(0), lists=True)
    prm = layer.params()
    t = {"model.layers.0.mlp.gate.weight": np.asarray(prm.router)}
    for e in range(32):
        for n, a in zip(("gate_proj", "up_proj", "down_proj"), (prm.experts.gate, prm.experts.up, prm.experts.down)):
            t[f"model.layers.0.mlp.experts.{e}.{n}.weight"] = np.asarray(a[e])
    (tmp_path / "m").mkdir()
    save_file(t, str(tmp_path / "m" / "model.safetensors"))
    back = load_moe(tmp_path / "m", layer=0)
    assert jax.tree.structure(back) == jax.tree.structure(prm)
    for a, b in zip(jax.tree.leaves(prm), jax.tree.leaves(back)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    x = jnp.asarray(_rand(np.random.default_rng(8), 5, H))
    assert np.array_equal(np.asarray(layer(x)[0]), np.asarray(nn.NNXMoE(config, params=back)(x)[0]))


# --- quantized checkpoints: per-expert GPTQ / AWQ / MLX tensors through load_moe ----------------

QE, QK, QH, QI = 4, 2, 128, 64


def _quant_checkpoint(folder, method, act_order_down=False, act_order_gate=False):
    """A Qwen3-MoE-named block whose experts are stored quantized by ``method``
    (the packers of tests/library/test_quant_import.py, written from the formats'
    specs); returns the format's own dequantized weights [in, out] per expert."""
    from test_quant_import import awq_pack, gptq_pack, mlx_pack
    rng = np.random.default_rng(11)
    pfx = "model.layers.0.mlp."
    t = {pfx + "gate.weight": rng.standard_normal((QE, QH)).astype(np.float32) * QH ** -0.5}
    ref = [[], [], []]
    for e in range(QE):
        for j, (n, K, N) in enumerate((("gate_proj", QH, QI), ("up_proj", QH, QI), ("down_proj", QI, QH))):
            W = (rng.standard_normal((K, N)) * K ** -0.5).astype(np.float32)
            base = f"{pfx}experts.{e}.{n}."
            if method == "gptq":
                ao = (j == 2 and act_order_down) or (j == 0 and act_order_gate)
                g_idx = rng.permutation(np.arange(K) // 32) if ao else None
                qweight, qzeros, scales, gi, w_fmt = gptq_pack(W, 32, g_idx=g_idx)
                t.update({base + "qweight": qweight, base + "qzeros": qzeros, base + "scales": scales,
                          base + "g_idx": gi})
            elif method == "awq":
                qweight, qzeros, scales, w_fmt = awq_pack(W, 32)
                t.update({base + "qweight": qweight, base + "qzeros": qzeros, base + "scales": scales})
            else:
                weight, scales, biases, w_fmt = mlx_pack(W, 32, np.float16)
                t.update({base + "weight": weight, base + "scales": scales, base + "biases": biases})
            ref[j].append(w_fmt)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(model_type="qwen3_moe", hidden_size=QH, moe_intermediate_size=QI, num_experts=QE,
               num_experts_per_tok=QK, norm_topk_prob=True)
    if method == "mlx":
        cfg["quantization"] = {"group_size": 32, "bits": 4}
    else:
        cfg["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": 32}
    with open(folder / "config.json", "w") as f:
        json.dump(cfg, f)
    save_file({k: np.ascontiguousarray(v) for k, v in t.items()}, str(folder / "model.safetensors"))
    return t[pfx + "gate.weight"], ref


@pytest.mark.parametrize("method,act_order", [("gptq", False), ("gptq", True), ("awq", False), ("mlx", False)])
def test_quantized_checkpoint_loads_losslessly(method, act_order, tmp_path):
    """Per-expert quantized projections become int4 lists (float32 scales);
    the block (NNXMoE, jitted; T = 1 and 33) equals float64 on the format's
    own dequantized weights (act-order down: its permutation absorbed into
    gate/up's columns)."""
    flax_nnx = pytest.importorskip("flax.nnx")
    router, ref = _quant_checkpoint(tmp_path, method, act_order_down=act_order)
    params = load_moe(tmp_path, layer=0)
    ex = params.experts
    assert ex.is_list and ex.gate[0].kind == "int4" and ex.gate[0].scale.dtype == jnp.float32
    if not act_order:  # the converted weights are the format's, bit for bit
        for j, proj in enumerate((ex.gate, ex.up, ex.down)):
            for e in range(QE):
                assert np.array_equal(np.asarray(proj[e].dequantize(jnp.float32)), ref[j][e])
    layer = flax_nnx.jit(lambda m, x: m(x))
    m = nn.NNXMoE(nn.MoEConfig.from_hf(tmp_path), params=params)
    rng = np.random.default_rng(12)
    for T in (1, 33):
        x = rng.standard_normal((T, QH)).astype(np.float32)
        logits = x.astype(np.float64) @ router.astype(np.float64).T
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        ids = np.argsort(-p, -1, kind="stable")[:, :QK]
        w = np.take_along_axis(p, ids, -1)
        w /= w.sum(-1, keepdims=True)
        y_ref = np.zeros((T, QH))
        for t in range(T):
            for j in range(QK):
                e = ids[t, j]
                g = x[t].astype(np.float64) @ ref[0][e]
                u = x[t].astype(np.float64) @ ref[1][e]
                y_ref[t] += w[t, j] * ((g / (1 + np.exp(-g)) * u) @ ref[2][e])
        y, _ = layer(m, jnp.asarray(x))
        assert _rel(y, y_ref) <= 1e-5, (method, act_order, T, _rel(y, y_ref))


def test_act_order_gate_is_refused_with_the_reason(tmp_path):
    _quant_checkpoint(tmp_path, "gptq", act_order_gate=True)
    with pytest.raises(CheckpointError, match=r"experts\.0\.gate_proj/up_proj are act-order GPTQ.*not absorbable"):
        load_moe(tmp_path, layer=0)


def test_unsupported_quantized_formats_are_refused_by_name(tmp_path):
    """A gpt-oss MXFP4 checkpoint missing its down projection, and GPTQModel's
    v2 format: refused, named."""
    pfx = "model.layers.0.mlp."
    (tmp_path / "a").mkdir()
    save_file({pfx + "router.weight": np.zeros((4, 16), np.float32),
               pfx + "experts.gate_up_proj_blocks": np.zeros((4, 16, 2, 16), np.uint8),
               pfx + "experts.gate_up_proj_scales": np.zeros((4, 16, 2), np.uint8)},
              str(tmp_path / "a" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"experts\.down_proj_blocks' is missing"):
        load_moe(tmp_path / "a", layer=0)
    _quant_checkpoint(tmp_path / "b", "gptq")
    cfg = json.loads((tmp_path / "b" / "config.json").read_text())
    cfg["quantization_config"]["checkpoint_format"] = "gptq_v2"
    (tmp_path / "b" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="checkpoint_format='gptq_v2'"):
        load_moe(tmp_path / "b", layer=0)


# --- FP8 128x128 block checkpoints of dimensions 128 does not divide (DeepSeek-V3 / Qwen3 "-FP8") -----

FE, FK, FH, FI, FB = 4, 2, 200, 96, 128


def _save_safetensors(tensors: dict, path: pathlib.Path) -> None:
    """safetensors.numpy (0.8) cannot write float8: the file from the format's spec (the header's
    8-byte little-endian length, the JSON header padded with spaces to 8 bytes, each tensor's
    bytes in turn)."""
    import ml_dtypes
    codes = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3"}
    header, data, off = {}, [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        header[name] = {"dtype": codes[a.dtype], "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        data.append(a.tobytes())
        off += a.nbytes
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(data))


def _fp8_block_checkpoint(folder: pathlib.Path, edit=None):
    """A Qwen3-MoE block (H=200, I=96) stored as transformers' fine-grained FP8 writes DeepSeek-V3's
    and Qwen3's "-FP8" checkpoints: per expert and projection ``weight`` float8_e4m3fn [out, in]
    and ``weight_scale_inv`` float32 [ceil(out/128), ceil(in/128)], each 128x128 block (the edge
    ones partial) scaled by its amax / 448 (transformers' ``Fp8Quantize``).  ``edit``: a change to
    the tensors before they are written.  Returns the router and, per projection, each expert's
    weight as DeepSeek-V3's ``weight_dequant`` gives it, W[i, j] = fp8(q[i, j]) * s[i // 128,
    j // 128], in float64, transposed to [in, out]."""
    import ml_dtypes
    rng = np.random.default_rng(21)
    pfx = "model.layers.0.mlp."
    t = {pfx + "gate.weight": (rng.standard_normal((FE, FH)) * FH ** -0.5).astype(np.float32)}
    ref = [[], [], []]
    for e in range(FE):
        for j, (n, K, N) in enumerate((("gate_proj", FH, FI), ("up_proj", FH, FI), ("down_proj", FI, FH))):
            # blocks of different magnitudes, so a block's scale read for another's shows
            W = rng.standard_normal((N, K)) * K ** -0.5 * rng.uniform(0.25, 4.0, (N // 8 + 1, 1)).repeat(8, 0)[:N]
            rows, cols = np.arange(N)[:, None] // FB, np.arange(K)[None, :] // FB
            s = np.zeros((-(-N // FB), -(-K // FB)), np.float32)
            for a in range(s.shape[0]):
                for b in range(s.shape[1]):
                    s[a, b] = np.abs(W[a * FB:(a + 1) * FB, b * FB:(b + 1) * FB]).max() / 448
            q = (W / s.astype(np.float64)[rows, cols]).astype(ml_dtypes.float8_e4m3fn)
            base = f"{pfx}experts.{e}.{n}."
            t.update({base + "weight": q, base + "weight_scale_inv": s})
            ref[j].append((q.astype(np.float64) * s.astype(np.float64)[rows, cols]).T)
    if edit is not None:
        edit(t)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(model_type="qwen3_moe", hidden_size=FH, moe_intermediate_size=FI, num_experts=FE,
               num_experts_per_tok=FK, norm_topk_prob=True,
               quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic",
                                    "weight_block_size": [FB, FB]})
    (folder / "config.json").write_text(json.dumps(cfg))
    _save_safetensors(t, folder / "model.safetensors")
    return t[pfx + "gate.weight"], ref


def test_fp8_block_checkpoint_of_partial_blocks_is_exact(tmp_path):
    """H=200, I=96 (128 divides neither): the 128x128-block FP8 experts load as fp8 lists with
    groups of 128, the last one partial (ceil(K/128) scale rows); (a) every weight is
    weight_dequant's (float64) product, exactly, in float32; (b) the op on the CPU handler
    (streamed, T=1, and packed, T=33) gives float64 on those weights to 1e-5 relative."""
    import jax_nbx as nbx

    from conftest import np_moe, rel_err

    _, ref = _fp8_block_checkpoint(tmp_path)
    ex = load_moe(tmp_path, layer=0).experts
    assert ex.is_list and len(ex.gate) == FE
    for j, (proj, K, N) in enumerate(((ex.gate, FH, FI), (ex.up, FH, FI), (ex.down, FI, FH))):
        for e in range(FE):
            w = proj[e]
            assert w.kind == "fp8" and w.group_size == 128 and w.shape == (K, N)
            assert w.scale.shape == (-(-K // 128), N)
            np.testing.assert_array_equal(np.asarray(w.dequantize(jnp.float32)), ref[j][e].astype(np.float32),
                                          err_msg=f"projection {j}, expert {e}")
    dense = nbx.Experts(*(np.stack(r) for r in ref))
    rng = np.random.default_rng(22)
    for T in (1, 33):
        x = jnp.asarray(rng.standard_normal((T, FH)), jnp.float32)
        w, ids = nbx.route(jnp.asarray(rng.standard_normal((T, FE)), jnp.float32), FK)
        y = nbx.fused_moe(x, w, ids, ex, implementation="cpu")
        assert rel_err(y, np_moe(x, w, ids, dense)) < 1e-5, (T, rel_err(y, np_moe(x, w, ids, dense)))


def test_fp8_block_checkpoint_lying_scale_shape_is_named(tmp_path):
    """A weight_scale_inv whose shape is not [ceil(out/128), ceil(in/128)] of its weight (a column of
    blocks too many for I=96), and a weight_block_size whose columns no fp8 group divides: a
    CheckpointError naming the file and the key."""
    key = "model.layers.0.mlp.experts.1.down_proj."
    _fp8_block_checkpoint(tmp_path / "a", edit=lambda t: t.update(
        {key + "weight_scale_inv": np.ones((2, 2), np.float32)}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*experts\.1\.down_proj\.\*: scale has shape "
                                              r"\(2, 2\); expected \(2, 1\)"):
        load_moe(tmp_path / "a", layer=0)
    _fp8_block_checkpoint(tmp_path / "b")
    cfg = json.loads((tmp_path / "b" / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [128, 48]
    (tmp_path / "b" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json.*weight_block_size=\[128, 48\]: none of the fp8 "
                                              r"format's groups"):
        load_moe(tmp_path / "b", layer=0)
