"""A small Qwen3-MoE model end to end (jax_nbx.models.qwen3_moe): checkpoint round
trip through transformers' names, logits against the float64 forward written
from transformers' modeling_qwen3_moe.py (support.qwen3_moe_ref), KV-cache
generation, the three MoE implementations, gradients."""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import rel_err

pytest.importorskip("flax")
pytest.importorskip("safetensors")

from flax import nnx  # noqa: E402
from safetensors.flax import load_file, save_file  # noqa: E402

from jax_nbx.loaders import CheckpointError  # noqa: E402
from jax_nbx.models import qwen3_moe as q3  # noqa: E402

from support.qwen3_moe_ref import read_checkpoint, reference_logits  # noqa: E402

CONFIG = q3.Qwen3MoeConfig()  # vocab 512, hidden 128, 2 layers, 4 heads / 2 kv, head_dim 32, E=16, k=4, I=64
TOL = 1e-4


def _randomize_norms(model, seed):
    """Norm weights drawn around 1 (a fresh model's are all ones, which would
    hide a norm weight read from the wrong place) and a wider router (routing
    less uniform)."""
    rng = np.random.default_rng(seed)

    def draw(n):
        return nnx.Param(jnp.asarray(1.0 + 0.3 * rng.standard_normal(n), jnp.float32))

    H, D = CONFIG.hidden_size, CONFIG.head_dim
    model.norm.weight = draw(H)
    for layer in model.layers:
        layer.input_layernorm.weight = draw(H)
        layer.post_attention_layernorm.weight = draw(H)
        layer.self_attn.q_norm.weight = draw(D)
        layer.self_attn.k_norm.weight = draw(D)
        layer.mlp.router = nnx.Param(layer.mlp.router[...] * 10.0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(model, folder of a 2-file checkpoint of it, float64 reference inputs)."""
    model = q3.Qwen3MoeForCausalLM(CONFIG, rngs=nnx.Rngs(0))
    _randomize_norms(model, 1)
    folder = tmp_path_factory.mktemp("qwen3_moe")
    written = q3.save_hf(model, folder, shards=2)
    assert [os.path.basename(f) for f in written] == [
        "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json"]
    config, tensors = read_checkpoint(folder)
    return model, folder, config, tensors


@pytest.fixture(scope="module")
def loaded(ckpt):
    return {impl: q3.load_hf(ckpt[1], implementation=impl) for impl in ("ffi", "xla")}


def _prompt(T, seed=2):
    return np.random.default_rng(seed).integers(0, CONFIG.vocab_size, T)


def test_config_json_round_trip(ckpt):
    with open(os.path.join(ckpt[1], "config.json")) as f:
        d = json.load(f)
    assert d["model_type"] == "qwen3_moe" and d["architectures"] == ["Qwen3MoeForCausalLM"]
    assert q3.Qwen3MoeConfig.from_hf(d) == CONFIG
    with pytest.raises(ValueError, match="mlp_only_layers"):
        q3.Qwen3MoeConfig.from_hf({**d, "mlp_only_layers": [0]})


@pytest.mark.parametrize("shards", [1, 2])
def test_save_load_round_trip_every_parameter_equal(ckpt, tmp_path, shards):
    model = ckpt[0]
    folder = ckpt[1] if shards == 2 else tmp_path
    if shards == 1:
        q3.save_hf(model, folder)
        assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors"]
    back = q3.load_hf(folder)
    a, b = q3.hf_state_dict(model), q3.hf_state_dict(back)
    assert sorted(a) == sorted(b)
    c = CONFIG
    per_layer = 4 + 2 + 2 + 1 + 3 * c.num_experts  # q/k/v/o, q/k norms, 2 layer norms, router, experts
    assert len(a) == 3 + c.num_hidden_layers * per_layer  # embed, norm, lm_head
    for name in a:
        np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]), err_msg=name)
    # the MoE blocks hold the checkpoint's per-expert [out, in] tensors (load_moe, read in place)
    ex = back.layers[0].mlp.params().experts
    assert ex.is_list and ex.layout == "out_in" and ex.gate[0].shape == (c.moe_intermediate_size, c.hidden_size)


@pytest.mark.parametrize("impl", ["ffi", "xla"])
@pytest.mark.parametrize("T", [1, 33])
def test_logits_match_float64_reference(ckpt, loaded, impl, T):
    ids = _prompt(T)
    ref = reference_logits(ckpt[2], ckpt[3], ids)
    got = nnx.jit(lambda m, x: m(x))(loaded[impl], ids[None])[0]
    assert got.shape == (T, CONFIG.vocab_size) and got.dtype == jnp.float32
    assert rel_err(got, ref) <= TOL, rel_err(got, ref)


def test_kv_cache_generation_matches_reference_token_by_token(ckpt, loaded):
    model, n_new = loaded["ffi"], 6
    ids = _prompt(9, seed=3)
    tokens, step_logits = q3.generate(model, ids, n_new, return_logits=True)
    assert tokens.shape == (n_new,) and step_logits.shape == (n_new, CONFIG.vocab_size)
    seq = list(ids)
    for i in range(n_new):
        ref = reference_logits(ckpt[2], ckpt[3], seq)[-1]
        assert int(tokens[i]) == int(np.argmax(ref)), (i, tokens, seq)
        assert rel_err(step_logits[i], ref) <= TOL, (i, rel_err(step_logits[i], ref))
        seq.append(int(tokens[i]))
    # the incremental logits against the model's own full forward (no cache)
    full = model(np.asarray(seq[:-1])[None])[0][len(ids) - 1:]
    np.testing.assert_allclose(np.asarray(step_logits), np.asarray(full), rtol=0, atol=TOL * float(jnp.abs(full).max()))


def test_three_moe_implementations_agree(loaded):
    ids = _prompt(33, seed=4)[None]
    fused = loaded["ffi"]
    y = fused(ids)
    for moe in ("dense", "ragged_dot"):
        other = q3.with_moe(fused, moe)
        assert not other.layers[0].mlp.params().experts.is_list  # the baselines' stacked copy
        err = rel_err(other(ids), np.asarray(y, np.float64))
        assert err <= 1e-5, (moe, err)


def test_gradient_through_fused_equals_dense(loaded):
    ids = _prompt(17, seed=5)
    x, labels = ids[None, :-1], ids[None, 1:]

    def loss_fn(model):
        logp = jax.nn.log_softmax(model(x), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))

    grads = {}
    for moe in ("fused", "dense"):
        model = q3.with_moe(loaded["ffi"], moe)
        graphdef, _ = nnx.split(model)
        g = nnx.jit(nnx.grad(loss_fn))(model)
        grads[moe] = {k: np.asarray(v, np.float64) for k, v in q3.hf_state_dict(nnx.merge(graphdef, g)).items()}
    assert sorted(grads["fused"]) == sorted(grads["dense"])
    for name, d in grads["dense"].items():
        f = grads["fused"][name]
        scale = max(np.max(np.abs(d)), 1e-12)
        assert np.max(np.abs(f - d)) / scale <= 1e-4, name
    # not vacuous: the experts and the attention get gradient
    assert np.max(np.abs(grads["fused"]["model.layers.0.mlp.experts.3.down_proj.weight"])) > 0
    assert np.max(np.abs(grads["fused"]["model.layers.1.self_attn.q_norm.weight"])) > 0


@pytest.mark.parametrize("missing", ["model.layers.1.self_attn.k_norm.weight",
                                     "model.layers.0.mlp.experts.5.up_proj.weight"])
def test_missing_tensor_is_named(ckpt, tmp_path, missing):
    q3.save_hf(ckpt[0], tmp_path)
    path = os.path.join(tmp_path, "model.safetensors")
    tensors = load_file(path)
    del tensors[missing]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=missing.replace(".", r"\.")):
        q3.load_hf(tmp_path)
