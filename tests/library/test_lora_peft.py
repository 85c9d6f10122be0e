"""PEFT's LoRA adapters on the routed experts (`jax_nbx.loaders.from_peft`)
against PEFT's own forward (tests/data/peft/, README there: PEFT 0.21.2 on
transformers 5.24.0): the fused 3-D experts' adapter (``target_parameters``,
PEFT's ParamWrapper) and the per-expert one (``target_modules``, lora.Linear,
with a rank_pattern and an alpha_pattern), applied by ``fused_moe(...,
lora=)`` to the base block `load_moe` reads, give the PEFT-wrapped
Qwen3MoeSparseMoeBlock's output on the same routing; what is not read is
refused by name.  Neither PEFT nor torch is imported here."""
from __future__ import annotations

import json
import math
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("safetensors")
import ml_dtypes  # noqa: E402  (bfloat16 for safetensors.numpy)
from safetensors.numpy import load_file, save_file  # noqa: E402

import jax_nbx as nbx  # noqa: E402
from jax_nbx import nn  # noqa: E402
from jax_nbx.loaders import from_peft, load_moe  # noqa: E402

from support.problems import rel_err  # noqa: E402

PEFT = pathlib.Path(__file__).resolve().parents[1] / "data" / "peft"
E, H, I = 4, 32, 16
DIMS = dict(num_experts=E, hidden_size=H, intermediate_size=I)
PFX = "base_model.model.model.layers.0.mlp.experts."


@pytest.fixture(scope="module")
def base():
    """The base block's experts as load_moe reads them (bfloat16 per-expert lists, out_in), in
    float32 (exact) as the reference model ran them."""
    params = load_moe(PEFT / "qwen3_moe_base", layer=0)
    config = nn.MoEConfig.from_hf(PEFT / "qwen3_moe_base")
    assert (config.num_experts, config.hidden_size, config.intermediate_size) == (E, H, I)
    assert params.experts.is_list
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params.experts)


def _run(experts, ref, lora):
    return jax.jit(lambda x, w, ids, ex, lo: nbx.fused_moe(x, w, ids, ex, lora=lo, implementation="xla"))(
        jnp.asarray(ref["x"]), jnp.asarray(ref["topk_weights"]), jnp.asarray(ref["topk_ids"]), experts, lora)


@pytest.mark.parametrize("name, scales, ranks", [
    ("qwen3_moe_lora", dict(gate=2.0, up=2.0, down=2.0), dict(gate=4, up=4, down=4)),
    ("qwen3_moe_lora_per_expert", dict(gate=2.0, up=2.0, down=8.0), dict(gate=4, up=4, down=2)),
])
def test_adapter_matches_peft_block(base, name, scales, ranks):
    """Both forms PEFT writes give the PEFT-wrapped block's output (float32)
    with the router's own top-k; the adapter changes it a lot."""
    lora = from_peft(PEFT / name, layer=0, **DIMS)
    assert lora.projections == ("gate", "up", "down")
    for p in lora.projections:
        A, B = lora.pair(p)
        assert lora.scale(p) == scales[p] and A.shape[2] == ranks[p] and B.shape[1] == ranks[p], p
        assert A.dtype == jnp.float32
    ref = load_file(str(PEFT / name) + ".reference.safetensors")
    y = _run(base, ref, lora)
    assert rel_err(y, ref["y"]) <= 2e-6, rel_err(y, ref["y"])
    y0 = _run(base, ref, None)
    assert rel_err(y0, ref["y"]) > 0.1  # the adapter matters
    if "y_base" in ref:  # the block with PEFT's adapter disabled
        assert rel_err(y0, ref["y_base"]) <= 2e-6, rel_err(y0, ref["y_base"])


def test_fused_layout_is_peft_param_wrapper():
    """ParamWrapper's layout, bit for bit: expert e's A is rows e*r..(e+1)*r of
    lora_A.weight (expert-major), its B the columns e::E of lora_B.weight
    (rank-major); gate_up_proj (the inner wrapper, ``base_layer.``) is split
    gate then up, both sharing A."""
    t = load_file(str(PEFT / "qwen3_moe_lora" / "adapter_model.safetensors"))
    assert sorted(t) == [PFX + "base_layer.lora_A.weight", PFX + "base_layer.lora_B.weight",
                         PFX + "lora_A.weight", PFX + "lora_B.weight"]
    lora = from_peft(PEFT / "qwen3_moe_lora", layer=0, **DIMS)
    r = 4
    gA, gB = (t[PFX + "base_layer.lora_A.weight"], t[PFX + "base_layer.lora_B.weight"])  # [rE, H], [2I, rE]
    dA, dB = (t[PFX + "lora_A.weight"], t[PFX + "lora_B.weight"])                        # [rE, I], [H, rE]
    for e in range(E):
        np.testing.assert_array_equal(lora.gate[0][e], gA[e * r:(e + 1) * r].T)
        np.testing.assert_array_equal(lora.up[0][e], gA[e * r:(e + 1) * r].T)
        np.testing.assert_array_equal(lora.gate[1][e], gB[:I, e::E].T)
        np.testing.assert_array_equal(lora.up[1][e], gB[I:, e::E].T)
        np.testing.assert_array_equal(lora.down[0][e], dA[e * r:(e + 1) * r].T)
        np.testing.assert_array_equal(lora.down[1][e], dB[:, e::E].T)
    bf = from_peft(PEFT / "qwen3_moe_lora", layer=0, dtype=jnp.bfloat16, **DIMS)
    assert bf.gate[0].dtype == jnp.bfloat16


# --- refusals, and what the config changes ------------------------------------------------------

def _edit(tmp_path, name="qwen3_moe_lora", tensors=None, **config):
    """A copy of fixture ``name`` with its adapter_config.json's keys set (None: removed) and
    ``tensors(dict) -> dict`` applied to its adapter_model.safetensors."""
    dst = tmp_path / f"{name}_{len(list(tmp_path.iterdir()))}"
    shutil.copytree(PEFT / name, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(config)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        st = dst / "adapter_model.safetensors"
        save_file(tensors(load_file(str(st))), str(st), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("config, match", [
    (dict(peft_type="IA3"), r"peft_type='IA3'"),
    (dict(use_dora=True), r"use_dora=True"),
    (dict(base_model_name_or_path="openai/gpt-oss-20b"), r"gpt-oss adapters are not read"),
    (dict(alora_invocation_tokens=[5]), r"alora_invocation_tokens=\[5\]"),
    (dict(use_qalora=True), r"use_qalora=True"),
    (dict(fan_in_fan_out=True), r"fan_in_fan_out=True"),
    (dict(lora_bias=True), r"lora_bias=True"),
    (dict(layer_replication=[[0, 1]]), r"layer_replication"),
    (dict(init_lora_weights="pissa_niter_4"), r"init_lora_weights='pissa_niter_4'.*residual base"),
    (dict(rank_pattern={"gate_up_proj": 8}), r"rank 4 but the config's rank_pattern gives r=8 for "
                                              r"'model\.layers\.0\.mlp\.experts\.gate_up_proj'"),
    (dict(r=2), r"rank 4 but the config's r gives r=2"),
    (dict(target_parameters=["mlp.experts.down_proj"]), r"target_parameters=.*does not name gate_up_proj"),
    (dict(target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj",
                                "mlp.experts.gate_proj"]), r"\['mlp\.experts\.gate_proj'\] are not read"),
])
def test_config_refused_by_name(tmp_path, config, match):
    with pytest.raises(ValueError, match=match):
        from_peft(_edit(tmp_path, **config), layer=0, **DIMS)


def test_config_fields_that_change_the_scale(tmp_path):
    """use_rslora: alpha / sqrt(r); alpha_pattern / rank_pattern resolved as
    PEFT's get_pattern_key does (the first pattern matching the end of the
    module's key), on the fused parameters' keys."""
    lo = from_peft(_edit(tmp_path, use_rslora=True), layer=0, **DIMS)
    assert lo.scales == (8 / math.sqrt(4),) * 3
    lo = from_peft(_edit(tmp_path, alpha_pattern={r"experts\.down_proj": 4, "gate_up_proj": 2}), layer=0, **DIMS)
    assert lo.scales == (0.5, 0.5, 1.0)
    lo = from_peft(_edit(tmp_path, rank_pattern={"layers.1.mlp.experts.down_proj": 2}), layer=0, **DIMS)
    assert lo.scales == (2.0, 2.0, 2.0)  # a pattern for another layer leaves layer 0 alone


def test_tensors_refused_by_name(tmp_path):
    """Missing, extra and mis-shaped tensors, tensors of the block outside the
    routed experts, a layer without adapters, per-expert ranks that differ."""
    with pytest.raises(ValueError, match=r"layer=1 has no LoRA adapters.*the adapter's layers: \[0\]"):
        from_peft(PEFT / "qwen3_moe_lora", layer=1, **DIMS)
    with pytest.raises(ValueError, match=r"fit neither gate_up_proj"):
        from_peft(PEFT / "qwen3_moe_lora", layer=0, **dict(DIMS, hidden_size=40))
    with pytest.raises(ValueError, match=r"are not \[r\*E, in\] and \[out, r\*E\] with E=3"):
        from_peft(PEFT / "qwen3_moe_lora", layer=0, **dict(DIMS, num_experts=3))
    with pytest.raises(ValueError, match=r"experts\.base_layer\.lora_B\.weight' is missing"):
        from_peft(_edit(tmp_path, tensors=lambda t: {k: v for k, v in t.items() if "base_layer.lora_B" not in k}),
                  layer=0, **DIMS)
    with pytest.raises(ValueError, match=r"experts\.lora_B\.bias' is not read"):
        from_peft(_edit(tmp_path, tensors=lambda t: {**t, PFX + "lora_B.bias": np.zeros(H, np.float32)}),
                  layer=0, **DIMS)
    router = "base_model.model.model.layers.0.mlp.gate.lora_A.weight"
    with pytest.raises(ValueError, match=r"mlp\.gate\.lora_A\.weight'.*routed experts only"):
        from_peft(_edit(tmp_path, tensors=lambda t: {**t, router: np.zeros((4, H), np.float32)}), layer=0, **DIMS)
    pe = "qwen3_moe_lora_per_expert"
    with pytest.raises(ValueError, match=r"experts\.3\.up_proj\.lora_B\.weight' is missing"):
        from_peft(_edit(tmp_path, pe, tensors=lambda t: {k: v for k, v in t.items() if "3.up_proj.lora_B" not in k}),
                  layer=0, **DIMS)
    with pytest.raises(ValueError, match=r"experts\.3\.down_proj\.lora_A\.weight' is of expert 3; num_experts=3"):
        from_peft(PEFT / pe, layer=0, **dict(DIMS, num_experts=3))

    def rank2(t):  # expert 0's gate_proj at rank 2
        t[PFX + "0.gate_proj.lora_A.weight"] = t[PFX + "0.gate_proj.lora_A.weight"][:2]
        t[PFX + "0.gate_proj.lora_B.weight"] = t[PFX + "0.gate_proj.lora_B.weight"][:, :2]
        return t

    with pytest.raises(ValueError, match=r"rank 2 but the config's r gives r=4"):
        from_peft(_edit(tmp_path, pe, tensors=rank2), layer=0, **DIMS)
    with pytest.raises(ValueError, match=r"gate_proj adapters differ in rank or scale"):
        from_peft(_edit(tmp_path, pe, tensors=rank2, rank_pattern={"down_proj": 2, r"experts\.0\.gate_proj": 2}),
                  layer=0, **DIMS)
    with pytest.raises(FileNotFoundError, match=r"adapter_config\.json"):
        from_peft(tmp_path, layer=0, **DIMS)


def test_bfloat16_adapter_kept_as_stored(tmp_path):
    """An adapter saved in bfloat16 (training in bf16) reads as bfloat16, the same values."""
    bf = _edit(tmp_path, tensors=lambda t: {k: v.astype(ml_dtypes.bfloat16) for k, v in t.items()})
    lo = from_peft(bf, layer=0, **DIMS)
    ref = from_peft(PEFT / "qwen3_moe_lora", layer=0, **DIMS)
    assert lo.down[1].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(lo.down[1], np.float32),
                                  np.asarray(ref.down[1].astype(jnp.bfloat16), np.float32))
