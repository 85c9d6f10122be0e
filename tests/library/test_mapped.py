"""Mapped experts (`jax_nbx.loaders.map_moe`, `jax_nbx.expert_store`): the
experts read from the checkpoint's files when routed give `load_moe`'s
bits in every layout and format mapped; a file changed under the mapping is
named, never read; the resident budget holds over a long routed sequence;
LoRA adapters train over a mapped base; jit, vmap, grad and threads; the
account's figures; a closed mapping refuses by name."""
from __future__ import annotations

import os
import pathlib
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("safetensors")

from test_checkpoint import _quant_checkpoint, _tensors, _write  # noqa: E402

import jax_nbx as nbx  # noqa: E402
from jax_nbx import expert_store  # noqa: E402
from jax_nbx.checkpoint_files import safetensors_header  # noqa: E402
from jax_nbx.loaders import load_moe, map_moe, unmap  # noqa: E402
from jax_nbx.loaders.mapped import store_of_experts  # noqa: E402

from test_families import FAMILIES  # noqa: E402

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
FIXTURES = ("fp8/qwen3_moe_fp8_block", "fp8/qwen3_moe_fp8_channel", "gptqmodel/qwen3_moe_awq",
            "nvfp4/qwen3_moe_nvfp4", "transformers/qwen3_moe_tiny", "gpt_oss/gpt_oss_mxfp4",
            "mlx_lm/qwen3_moe_q4_g32", "mlx_lm/qwen3_moe_mxfp4", "mlx_lm/qwen3_moe_mxfp8", "mlx_lm/qwen3_moe_nvfp4")


@pytest.fixture(autouse=True)
def _unmap_all():
    """Every store a test opened is closed after it, failed or not (conftest checks the account is empty)."""
    yield
    for store in list(expert_store._STORES.values()):
        store.close()


def _routing(E, H, T=9, k=2, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, H)).astype(dtype)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    return x, rng.random((T, k)).astype(np.float32), ids


def _same(params_a, params_b, dtype=np.float32, T=9):
    E, H = params_a.router.shape
    x, w, ids = _routing(E, H, T=T, dtype=dtype)
    ya = nbx.fused_moe(x, w, ids, params_a.experts, implementation="cpu")
    yb = nbx.fused_moe(x, w, ids, params_b.experts, implementation="cpu")
    np.testing.assert_array_equal(np.asarray(ya), np.asarray(yb))
    assert np.abs(np.asarray(ya, np.float32)).max() > 0


@pytest.mark.parametrize("fixture", FIXTURES)
def test_mapped_equals_copied_on_producers_files(fixture):
    """The producers' files of tests/data/: FP8 (block, channel), AWQ,
    compressed-tensors NVFP4, transformers' own dense checkpoint, gpt-oss's
    MXFP4 blocks (stacked, biases) and mlx-lm's stacked switch_mlp (affine
    int4, mxfp4, mxfp8, nvfp4): mapped bits == load_moe's."""
    folder = DATA / fixture
    mapped = map_moe(folder, layer=0)
    try:
        _same(load_moe(folder, layer=0), mapped)
        _same(load_moe(folder, layer=0), mapped, T=40)  # prefill-sized: bands
    finally:
        unmap(mapped.experts)


@pytest.mark.parametrize("method", ["gptq", "mlx"])
def test_mapped_gptq_and_mlx_per_expert(method, tmp_path):
    _quant_checkpoint(tmp_path, method, act_order_down=method == "gptq")
    mapped = map_moe(tmp_path, layer=0)
    _same(load_moe(tmp_path, layer=0), mapped)
    unmap(mapped.experts)


@pytest.mark.parametrize("name,dtype", [("mixtral", np.float32), ("olmoe", jnp.bfloat16),
                                        ("gpt_oss", np.float32)])
def test_mapped_dense_lists_and_fused(name, dtype, tmp_path):
    """Per-expert [out, in] lists (Mixtral's w1/w3/w2, OLMoE's *_proj) and
    transformers 5's fused gate_up_proj (gpt-oss: interleaved, biases)."""
    p = FAMILIES[name](np.random.default_rng(sum(map(ord, name))))[0]
    t = {k: v.astype(dtype) if "experts" in k else v for k, v in _tensors(name, p).items()}
    _write(tmp_path, name, t, shards=2)
    starts = [i.start for f in tmp_path.glob("*.safetensors") for n, i in safetensors_header(f).items()
              if "experts" in n]
    assert any(s % 64 for s in starts)  # safetensors aligns to 8 bytes at most: misaligned tensors read too
    mapped = map_moe(tmp_path, layer=1)
    assert store_of_experts(mapped.experts).stats()["resident_experts"] == 0  # nothing read yet
    _same(load_moe(tmp_path, layer=1), mapped, dtype=np.float32)
    unmap(mapped.experts)


def _olmoe(tmp_path, dtype=np.float32):
    p = FAMILIES["olmoe"](np.random.default_rng(3))[0]
    _write(tmp_path, "olmoe", {k: v.astype(dtype) for k, v in _tensors("olmoe", p).items()})
    return tmp_path


@pytest.mark.sanitize
def test_a_changed_file_is_named_not_read(tmp_path):
    folder = _olmoe(tmp_path)
    mapped = map_moe(folder, layer=1, resident_bytes=0)
    E, H = mapped.router.shape
    x, w, ids = _routing(E, H)
    nbx.fused_moe(x, w, ids, mapped.experts)  # reads, then frees (nothing resident)
    f = folder / "model.safetensors"
    size = f.stat().st_size
    with open(f, "r+b") as fh:  # truncated under the mapping
        fh.truncate(size - 100)
    with pytest.raises(Exception, match=r"model\.safetensors changed since its experts were mapped: truncated"):
        np.asarray(jax.jit(lambda x: nbx.fused_moe(x, w, ids, mapped.experts))(x))
    os.replace(f, folder / "old")  # replaced: another file under the name
    (folder / "old").rename(f)
    os.utime(f, ns=(1, 1))  # rewritten (modification time)
    with pytest.raises(Exception, match="changed since its experts were mapped"):
        nbx.fused_moe(x, w, ids, mapped.experts)
    unmap(mapped.experts)
    assert nbx.memory.stats()["cpu:0"]["live_by_tag"].get("mapped experts", 0) == 0


def test_resident_budget_holds_over_a_routed_sequence(tmp_path):
    folder = _olmoe(tmp_path)
    copied = load_moe(folder, layer=1)
    probe = map_moe(folder, layer=1)
    per = store_of_experts(probe.experts).expert_bytes
    unmap(probe.experts)
    mapped = map_moe(folder, layer=1, resident_bytes=3 * per)
    store = store_of_experts(mapped.experts)
    E, H = mapped.router.shape
    rng = np.random.default_rng(5)
    hot = np.array([1, 4, 6])  # routed most often
    f = jax.jit(lambda x, w, i, e: nbx.fused_moe(x, w, i, e))
    for _ in range(40):
        ids = np.where(rng.random((3, 2)) < 0.7, rng.choice(hot, (3, 2)), rng.integers(0, E, (3, 2)))
        ids[:, 1] = np.where(ids[:, 1] == ids[:, 0], (ids[:, 0] + 1) % E, ids[:, 1])
        x, w = rng.standard_normal((3, H)).astype(np.float32), rng.random((3, 2)).astype(np.float32)
        y = f(x, w, ids.astype(np.int32), mapped.experts)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(f(x, w, ids.astype(np.int32), copied.experts)))
        s = store.stats()
        assert s["resident_bytes"] <= 3 * per and s["streamed_bytes"] == 0 and s["leases"] == 0
    assert store.resident == set(hot.tolist())
    assert s["hits"] / (s["hits"] + s["misses"]) > 0.35, s  # well above 3 of 16 experts held
    figures = nbx.memory.stats()["cpu:0"]["mapped"]
    assert figures["resident"] == 3 * per and figures["mapped"] >= E * per
    unmap(mapped.experts)


def test_a_call_whose_experts_do_not_fit_is_refused_with_advice(tmp_path):
    folder = _olmoe(tmp_path)
    mapped = map_moe(folder, layer=1, resident_bytes=0)
    per = store_of_experts(mapped.experts).expert_bytes
    E, H = mapped.router.shape
    x, w, ids = _routing(E, H)
    old = nbx.memory.budget()
    ws = nbx.memory.fused_moe_workspace_bytes(9, 2, E, H, mapped.experts.intermediate)
    nbx.memory.set_budget(ws + 2 * per)  # the workspace and two experts fit; the call routes to more
    try:
        with pytest.raises(Exception, match="mapped experts"):
            nbx.fused_moe(x, w, ids, mapped.experts)
    finally:
        nbx.memory.set_budget(old)
    assert store_of_experts(mapped.experts).stats()["leases"] == 0
    unmap(mapped.experts)


def test_lora_trains_over_a_mapped_base(tmp_path):
    """QLoRA-style: adapters' gradients over mapped int4 (GPTQ) experts equal
    those over the copied experts bit for bit, and match float64 (the
    dequantized base) to float32's bound."""
    _quant_checkpoint(tmp_path, "gptq")
    copied, mapped = load_moe(tmp_path, layer=0), map_moe(tmp_path, layer=0)
    E, H = copied.router.shape
    I = copied.experts.intermediate
    lora = nbx.LoRA.init(jax.random.PRNGKey(0), E, H, I, 4)
    lora = jax.tree.map(lambda a: a + 0.01, lora)  # B != 0
    x, w, ids = _routing(E, H)

    def loss(lo, ex):
        return jnp.sum(nbx.fused_moe(x, w, ids, ex, lora=lo) ** 2)

    g_mapped = jax.jit(jax.grad(loss))(lora, mapped.experts)
    g_copied = jax.jit(jax.grad(loss))(lora, copied.experts)
    for a, b in zip(jax.tree.leaves(g_mapped), jax.tree.leaves(g_copied)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ref = jax.grad(loss)(lora, nbx.dequantize(copied.experts))
    for a, b in zip(jax.tree.leaves(g_mapped), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5)
    assert store_of_experts(mapped.experts).stats()["leases"] == 0
    unmap(mapped.experts)


@pytest.mark.sanitize
def test_jit_vmap_grad_and_threads(tmp_path):
    folder = _olmoe(tmp_path)
    copied, mapped = load_moe(folder, layer=1), map_moe(folder, layer=1, resident_bytes=0)
    E, H = mapped.router.shape
    x, w, ids = _routing(E, H, T=6)
    xb = np.stack([x, x[::-1]])
    f = jax.jit(jax.vmap(lambda x, e: nbx.fused_moe(x, w, ids, e), in_axes=(0, None)))
    np.testing.assert_array_equal(np.asarray(f(xb, mapped.experts)), np.asarray(f(xb, copied.experts)))
    g = jax.grad(lambda x, e: jnp.sum(nbx.fused_moe(x, w, ids, e) ** 2))
    np.testing.assert_array_equal(np.asarray(g(x, mapped.experts)), np.asarray(g(x, copied.experts)))
    want = np.asarray(nbx.fused_moe(x, w, ids, copied.experts))
    errors = []

    def run():
        try:
            for _ in range(5):
                np.testing.assert_array_equal(np.asarray(nbx.fused_moe(x, w, ids, mapped.experts)), want)
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert store_of_experts(mapped.experts).stats()["leases"] == 0
    unmap(mapped.experts)


def test_closed_mapping_refuses_by_name_and_other_backends_refuse(tmp_path):
    folder = _olmoe(tmp_path)
    mapped = map_moe(folder, layer=1)
    E, H = mapped.router.shape
    x, w, ids = _routing(E, H)
    with pytest.raises(ValueError, match=r"mapped experts \(jax_nbx.loaders.map_moe\) run on 'cpu' only"):
        nbx.fused_moe(x, w, ids, mapped.experts, implementation="xla")
    with pytest.raises(TypeError, match="sharded_moe does not take mapped experts"):
        nbx.sharded_moe(x, w, ids, mapped.experts, mesh=None)
    f = jax.jit(lambda x: nbx.fused_moe(x, w, ids, mapped.experts))
    f(x)
    unmap(mapped.experts)
    with pytest.raises(Exception, match="closed"):
        np.asarray(f(x))
    with pytest.raises(ValueError, match="closed"):
        nbx.fused_moe(x, w, ids, mapped.experts)
    with pytest.raises(TypeError, match="read by the op from its checkpoint file"):
        np.asarray(mapped.experts.down[0])


def test_qwen3_moe_model_generates_over_mapped_experts(tmp_path):
    """load_hf(experts="mapped"): every layer's experts mapped; greedy
    generate gives the copied model's tokens and logits bit for bit."""
    pytest.importorskip("flax.nnx")
    from flax import nnx
    from test_qwen3_moe import CONFIG

    from jax_nbx.models import qwen3_moe as q3

    q3.save_hf(q3.Qwen3MoeForCausalLM(CONFIG, rngs=nnx.Rngs(0)), tmp_path, shards=2)
    copied = q3.load_hf(tmp_path, implementation="cpu")
    mapped = q3.load_hf(tmp_path, implementation="cpu", experts="mapped")
    prompt = np.random.default_rng(2).integers(0, CONFIG.vocab_size, 5)
    toks_c, logits_c = q3.generate(copied, prompt, 3, return_logits=True)
    toks_m, logits_m = q3.generate(mapped, prompt, 3, return_logits=True)
    np.testing.assert_array_equal(np.asarray(toks_m), np.asarray(toks_c))
    np.testing.assert_array_equal(np.asarray(logits_m), np.asarray(logits_c))
    assert nbx.memory.stats()["cpu:0"]["mapped"]["stores"] == CONFIG.num_hidden_layers
    with pytest.raises(ValueError, match="experts must be 'copied' or 'mapped'"):
        q3.load_hf(tmp_path, experts="lazy")


@pytest.mark.parametrize("k", [2, 4])
def test_a_call_in_passes_holds_its_stream_budget(k, tmp_path):
    """stream_bytes: a call's experts in passes of stream_bytes / 2 (the next
    read ahead), outputs and gradients summed over the passes: equal to the
    copied experts' (k=2: bits; k=4: the sum's rounding), nothing resident,
    every routed expert read once per call."""
    folder = _olmoe(tmp_path)
    copied = load_moe(folder, layer=1)
    probe = map_moe(folder, layer=1)
    per = store_of_experts(probe.experts).expert_bytes
    unmap(probe.experts)
    mapped = map_moe(folder, layer=1, resident_bytes=0, stream_bytes=6 * per)  # 3 experts a pass
    store = store_of_experts(mapped.experts)
    assert store.pass_experts == 3
    E, H = mapped.router.shape
    x, w, ids = _routing(E, H, T=12, k=k, seed=k)
    distinct = len(np.unique(ids))
    assert distinct > 2 * store.pass_experts  # three passes or more
    y = jax.jit(lambda x: nbx.fused_moe(x, w, ids, mapped.experts))(x)
    y0 = nbx.fused_moe(x, w, ids, copied.experts)
    if k == 2:
        np.testing.assert_array_equal(np.asarray(y), np.asarray(y0))
    np.testing.assert_allclose(np.asarray(y), np.asarray(y0), rtol=1e-5, atol=1e-6)
    s = store.stats()
    assert s["misses"] == distinct and s["read_bytes"] > 0 and s["resident_bytes"] == s["streamed_bytes"] == 0
    g = jax.grad(lambda x, e: jnp.sum(nbx.fused_moe(x, w, ids, e) ** 2))
    np.testing.assert_allclose(np.asarray(g(x, mapped.experts)), np.asarray(g(x, copied.experts)), rtol=1e-5,
                               atol=1e-5)
    assert store.stats()["leases"] == 0
    bad = ids.copy()
    bad[0, 0] = E
    with pytest.raises(Exception, match="outside"):
        np.asarray(nbx.fused_moe(x, w, bad, mapped.experts))
    with pytest.raises(ValueError, match="stream_bytes"):
        map_moe(folder, layer=1, stream_bytes=per)


def test_layers_take_mapped_experts(tmp_path):
    """moe_block, NNXMoE and EqxMoE on a mapped block give the copied block's bits."""
    nnx = pytest.importorskip("flax.nnx")
    eqx = pytest.importorskip("equinox")
    from jax_nbx import nn

    folder = _olmoe(tmp_path)
    config = nn.MoEConfig.from_hf(folder)
    copied, mapped = load_moe(folder, layer=1), map_moe(folder, layer=1)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((5, config.hidden_size)), jnp.float32)
    for layer in (lambda p: nnx.jit(lambda m, x: m(x))(nn.NNXMoE(config, params=p), x),
                  lambda p: eqx.filter_jit(lambda m, x: m(x))(nn.EqxMoE(config, params=p), x),
                  lambda p: jax.jit(lambda p, x: nn.moe_block(p, x, config))(p, x)):
        (y_m, _), (y_c, _) = layer(mapped), layer(copied)
        np.testing.assert_array_equal(np.asarray(y_m), np.asarray(y_c))
