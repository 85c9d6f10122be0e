"""keras-hub's MoE models through the fused op (`jax_nbx.integrations.keras_hub`),
checked against keras-hub itself: for every family keras-hub 0.32 ships, a tiny
model with seeded random weights (tests/support/keras_hub_models.py) gives the
unpatched model's logits, greedy tokens and one ``fit`` step's gradients once
patched; quantized experts give the unpatched model run on the dequantized
weights; LoRA adapters give the unpatched model on the merged weights."""
from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

keras = pytest.importorskip("keras")
keras_hub = pytest.importorskip("keras_hub")
if keras.backend.backend() != "jax":  # pragma: no cover - keras imported earlier on another backend
    pytest.skip("keras runs on another backend in this process", allow_module_level=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_nbx as nbx  # noqa: E402
from jax_nbx.integrations import keras_hub as kh  # noqa: E402
from jax_nbx.integrations.keras_hub_blocks import KINDS  # noqa: E402
from jax_nbx.quantization import quant_format  # noqa: E402

from support.keras_hub_models import FAMILIES, TINY, tiny_causal_lm, token_batch  # noqa: E402

F32 = dict(rtol=2e-5, atol=2e-5)


@pytest.fixture(autouse=True)
def _keras_hubs_broadcasts():
    """keras-hub's own layers broadcast by rank promotion (its layer norms' ``x * scale``), which the
    suite otherwise raises on (tests/conftest.py); jax_nbx's code under them still runs."""
    with jax.numpy_rank_promotion("allow"):
        yield
# One quantized format per family (every format checked once; tiny shapes that the format's groups fit)
FORMATS = {"mixtral": ("int8", None), "qwen_moe": ("fp8", 32), "qwen3_moe": ("int4", 32),
           "qwen3_5_moe": ("mxfp8", None), "gpt_oss": ("mxfp4", None), "gemma4": ("nvfp4", None)}


def _logits(model, batch):
    return np.asarray(model.predict_on_batch(batch))


def _spy(monkeypatch):
    """Counts the patched blocks' fused_moe calls (at trace time), so that a check cannot pass by
    running the original blocks."""
    calls = []
    real = kh._Patch.moe

    def moe(self, block, *a, **k):
        calls.append(block.path)
        return real(self, block, *a, **k)
    monkeypatch.setattr(kh._Patch, "moe", moe)
    return calls


def _layout(kind, dense: nbx.Experts) -> list[np.ndarray]:
    """Plain [E, H, I] / [E, I, H] experts in the keras-hub block's own variables' layout."""
    g, u, d = (np.asarray(a, np.float32) for a in (dense.gate, dense.up, dense.down))
    if kind.fusion is None:
        return [g, u, d]
    if kind.fusion == "concat":
        return [np.concatenate([g, u], -1), d]
    gu = np.stack([g, u], -1).reshape(g.shape[:-1] + (2 * g.shape[-1],))
    return [gu, d]


def _set_experts(model, arrays_per_block):
    for (_, b, kind, _), arrays in zip(kh._blocks(model), arrays_per_block):
        own = kind.owner_of(b)
        for n, a in zip(kind.weights, arrays):
            getattr(own, n).assign(a)


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_logits_and_generate_equal_keras_hubs(family, monkeypatch):
    model = tiny_causal_lm(family)
    model.compile(sampler="greedy")
    batch = token_batch(family)
    before = [(id(v), v.path) for v in model.weights]
    ref = _logits(model, batch)
    prompt = dict(batch)
    prompt["padding_mask"] = np.zeros_like(batch["padding_mask"])
    prompt["padding_mask"][:, :3] = True
    ref_tokens = np.asarray(model.generate(prompt, stop_token_ids=None)["token_ids"])

    calls = _spy(monkeypatch)
    assert kh.patch_moe(model) is model
    assert [(id(v), v.path) for v in model.weights] == before       # the same variables, in order
    got = _logits(model, batch)
    np.testing.assert_allclose(got, ref, **F32)
    assert len(calls) == TINY[family][2]["num_layers"]              # every block ran the fused op
    np.testing.assert_array_equal(np.asarray(model.generate(prompt, stop_token_ids=None)["token_ids"]), ref_tokens)

    kh.unpatch_moe(model)
    assert not kh.patched_blocks(model)
    np.testing.assert_array_equal(_logits(model, batch), ref)


def _fit_step(model, batch):
    """One SGD step with learning rate 1 through keras' ``fit`` (one batch; keras-hub's data pipeline
    runs on grain): returns [(path, -gradient)] in the model's order (paths carry Keras' per-process
    layer numbers, so two models compare by order)."""
    x = {k: v for k, v in batch.items()}
    y = np.roll(batch["token_ids"], -1, axis=1)
    model.compile(optimizer=keras.optimizers.SGD(1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=True)
    before = [np.asarray(v.numpy(), np.float64) for v in model.trainable_variables]
    model.fit(x, y, sample_weight=batch["padding_mask"].astype("float32"), batch_size=len(y), epochs=1, verbose=0)
    return [(v.path, np.asarray(v.numpy(), np.float64) - b) for v, b in zip(model.trainable_variables, before)]


@pytest.mark.parametrize("family", FAMILIES)
def test_fit_step_gradients_equal_keras_hubs(family):
    batch = token_batch(family, seed=3)
    ref = _fit_step(tiny_causal_lm(family), batch)
    got = _fit_step(kh.patch_moe(tiny_causal_lm(family)), batch)
    assert [d.shape for _, d in got] == [d.shape for _, d in ref]
    scale = max(np.abs(d).max() for _, d in ref)
    assert scale > 0
    moved = 0
    for (path, g), (_, d) in zip(got, ref):
        np.testing.assert_allclose(g, d, rtol=1e-4, atol=1e-5 * scale, err_msg=path)
        moved += "expert" in path.lower() and np.abs(d).max() > 0
    assert moved   # the experts' own gradients came through the op


@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_experts_equal_keras_hub_on_the_dequantized_weights(family):
    fmt, group_size = FORMATS[family]
    batch = token_batch(family)
    model = kh.patch_moe(tiny_causal_lm(family), format=fmt, group_size=group_size)
    names = {v.path for v in model.weights}
    blocks = kh._blocks(model)
    for _, b, kind, _ in blocks:
        own = kind.owner_of(b)
        assert not any(hasattr(own, n) for n in kind.weights)       # the float experts left the model
        assert quant_format(vars(b)["_nbx_patch"].experts(b))[0] == fmt
    got = _logits(model, batch)
    deq = [_layout(kind, nbx.dequantize(vars(b)["_nbx_patch"].experts(b), jnp.float32))
           for _, b, kind, _ in blocks]
    ref_model = tiny_causal_lm(family)
    ref_before = _logits(ref_model, batch)
    _set_experts(ref_model, deq)
    ref = _logits(ref_model, batch)
    np.testing.assert_allclose(got, ref, **F32)
    assert np.abs(ref - ref_before).max() > 2e-5                      # the quantization is visible
    assert any("nbx_q" in n for n in names)
    with pytest.raises(ValueError, match="cannot be undone"):
        kh.unpatch_moe(model)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])  # separate and fused gate/up
def test_lora_equals_keras_hub_on_the_merged_weights_and_trains_under_fit(family, tmp_path):
    batch = token_batch(family)
    model = kh.patch_moe(tiny_causal_lm(family), lora_rank=3, lora_alpha=6.0)
    rng = np.random.default_rng(5)
    for _, b, kind, _ in kh._blocks(model):
        for a, bv in vars(b)["_nbx_patch"].lora[0].values():
            bv.assign(0.3 * rng.standard_normal(bv.shape).astype("float32"))
            assert a.trainable and bv.trainable
        assert not any(getattr(kind.owner_of(b), n).trainable for n in kind.weights)
    got = _logits(model, batch)
    loras = kh.lora_of(model)
    assert sorted(loras) == [0, 1]
    ref_model = tiny_causal_lm(family)
    merged = [_layout(kind, nbx.merge_lora(kind.experts(b, [np.asarray(getattr(kind.owner_of(b), n).numpy())
                                                          for n in kind.weights]).canonical()[0], loras[i]))
              for i, b, kind, _ in kh._blocks(model)]
    _set_experts(ref_model, merged)
    np.testing.assert_allclose(got, _logits(ref_model, batch), **F32)
    if family != "gpt_oss":   # exported to PEFT and read back: the same merged experts (gpt-oss: refused by to_peft)
        from jax_nbx.loaders import from_peft, to_peft
        to_peft(loras, tmp_path / "peft", form="per_expert", model_type=family)
        for i, b, kind, _ in kh._blocks(model):
            base = kind.experts(b, [np.asarray(getattr(kind.owner_of(b), n).numpy()) for n in kind.weights])
            E, H, I = b.num_experts, b.hidden_dim, base.down.shape[-2]
            back = from_peft(tmp_path / "peft", layer=i, num_experts=E, hidden_size=H, intermediate_size=I)
            for x, y in zip(_layout(kind, nbx.merge_lora(base.canonical()[0], back)), merged[i]):
                np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)

    if family == "gpt_oss":  # fit trains the adapters alone (once: on the fused interleaved experts)
        step = _fit_step(model, batch)
        lora_moved = [p for p, d in step if "nbx_lora" in p and np.abs(d).max() > 0]
        assert len(lora_moved) == 2 * 3 * 2          # A and B of gate, up, down in both layers
        assert not any(p.endswith(n.lstrip("_")) for p, _ in step for _, _, kind, _ in kh._blocks(model)
                       for n in kind.weights)        # the adapted experts are frozen

    kh.unpatch_moe(model)
    assert not any("nbx_lora" in v.path for v in model.weights)
    assert all(v.trainable for v in model.weights if "expert" in v.path and "norm" not in v.path)


# ---------------------------------------------------------------- refusals

@pytest.mark.fast
def test_every_kind_has_a_family_and_source():
    assert sorted(kh.SUPPORTED) == sorted(FAMILIES)
    for cls, kind in KINDS.items():
        assert os.path.exists(os.path.join(os.path.dirname(keras_hub.__file__), "src", "models", kind.source)), cls


def test_refusals():
    model = tiny_causal_lm("qwen3_moe")
    with pytest.raises(TypeError, match="CausalLM or its Backbone"):
        kh.patch_moe(keras.layers.Dense(3))
    with pytest.raises(ValueError, match="no block .* is patched"):
        kh.unpatch_moe(model)
    with pytest.raises(ValueError, match="lora_rank must be a positive int; got 0"):
        kh.patch_moe(model, lora_rank=0)
    with pytest.raises(ValueError, match="kind must be one of"):
        kh.patch_moe(model, format="int3")
    assert not kh.patched_blocks(model)          # a refused patch leaves the model as it was
    kh.patch_moe(model)
    with pytest.raises(ValueError, match="already patched"):
        kh.patch_moe(model)
    with pytest.raises(ValueError, match="carries LoRA"):
        kh.lora_of(model)

    class FakeSparseMoeBlock(keras.layers.Layer):
        pass

    class FakeDecoder(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.moe = FakeSparseMoeBlock()

    class FakeBackbone:
        transformer_layers = [FakeDecoder()]
    with pytest.raises(ValueError, match="FakeSparseMoeBlock .* which jax_nbx does not patch"):
        kh.patch_moe(FakeBackbone())
    FakeBackbone.transformer_layers = [keras.layers.Dense(2)]
    with pytest.raises(ValueError, match="has no sparse MoE block"):
        kh.patch_moe(FakeBackbone())


def test_other_keras_backend_refused(monkeypatch):
    monkeypatch.setattr(keras.backend, "backend", lambda: "torch")
    with pytest.raises(RuntimeError, match="'torch' backend"):
        kh.patch_moe(tiny_causal_lm("mixtral"))


def test_implementation_option_reaches_the_op():
    model = tiny_causal_lm("mixtral")
    kh.patch_moe(model, implementation="xla")
    batch = token_batch("mixtral")
    with jax.disable_jit(False):
        got = _logits(model, batch)
    kh.unpatch_moe(model)
    np.testing.assert_allclose(got, _logits(model, batch), **F32)
    with pytest.raises(Exception, match="implementation"):
        kh.patch_moe(model, implementation="tpu")
        _logits(model, batch)


@pytest.mark.parametrize("fmt, group_size", [("int8", None), ("int4", 32), ("mxfp4", None)])
def test_quantized_a_few_experts_at_a_time_equals_one_quantize(fmt, group_size):
    """patch_moe(format=...) quantizes a block's experts a few at a time (its transient float copies
    stay small): the same codes and scales as one `quantize` of them all, in every layout.  (The
    chunking concatenates whatever leaves a format has: one format of each kind of leaves -- per-column
    scales, scales and mins, byte scales -- stands for the rest, which test_quantized_experts_equal_...
    runs through the patch.)"""
    rng = np.random.default_rng(0)
    E, H, I = kh._QUANTIZE_EXPERTS * 2 + 3, 64, 32
    for fusion in ("concat", "interleaved", None):
        if fusion:
            ex = nbx.Experts.fused(rng.standard_normal((E, H, 2 * I), np.float32),
                                   rng.standard_normal((E, I, H), np.float32), fusion=fusion)
        else:
            ex = nbx.Experts(*(rng.standard_normal(s, np.float32) for s in [(E, H, I), (E, H, I), (E, I, H)]))
        leaves, treedef = jax.tree_util.tree_flatten(nbx.quantize(ex, fmt, group_size=group_size))
        got_def, got = kh._quantize_stacked(ex, fmt, group_size)
        assert got_def == treedef
        for a, b in zip(leaves, got):
            np.testing.assert_array_equal(np.asarray(a), b)
