"""`jax_nbx.loaders.to_peft`, the inverse of `from_peft`: ``from_peft(to_peft(x)) == x`` bit for bit in both of
PEFT's forms (fused ``target_parameters``, per-expert ``target_modules``), several layers, odd sizes, ranks and
scales per projection, partial projections; the files it writes from the adapters read from the real PEFT fixtures
(tests/data/peft/, PEFT 0.21.2) equal those fixtures (tensor names, shapes, dtypes and bits; the config's fields,
its targets and patterns compared by what PEFT resolves from them); every refusal.  The check against PEFT itself
(torch) is benchmarks/peft_export_check.py.  Neither PEFT nor torch is imported here."""
from __future__ import annotations

import json
import math
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

import jax_nbx as nbx  # noqa: E402
from jax_nbx.loaders import from_peft, to_peft  # noqa: E402
from jax_nbx.loaders.peft_export import _alpha  # noqa: E402

from support.problems import rel_err  # noqa: E402

PEFT = pathlib.Path(__file__).resolve().parents[1] / "data" / "peft"
E, H, I = 3, 20, 12            # odd sizes
DIMS = dict(num_experts=E, hidden_size=H, intermediate_size=I)


def _pair(rng, fi, fo, r, dtype=np.float32):
    return (jnp.asarray(rng.standard_normal((E, fi, r)).astype(dtype)),
            jnp.asarray(rng.standard_normal((E, r, fo)).astype(dtype)))


def _shared_gate_up(rng, r, dtype=np.float32):
    """gate and up sharing A, as a fused gate_up_proj adapter is."""
    A, Bg = _pair(rng, H, I, r, dtype)
    Bu = jnp.asarray(rng.standard_normal((E, r, I)).astype(dtype))
    return (A, Bg), (A, Bu)


def _equal(a: nbx.LoRA, b: nbx.LoRA) -> None:
    """Bit for bit: the projections, their scales, shapes, dtypes and values (a LoRA's scale of a projection it
    does not adapt is not kept)."""
    assert a.projections == b.projections, (a, b)
    assert [a.scale(n) for n in a.projections] == [b.scale(n) for n in b.projections], (a, b)
    for n in a.projections:
        for x, y in zip(a.pair(n), b.pair(n)):
            assert x.dtype == y.dtype and x.shape == y.shape, (n, x.dtype, y.dtype, x.shape, y.shape)
            np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


def _fused_layers(dtype=np.float32):
    rng = np.random.default_rng(1)
    g, u = _shared_gate_up(rng, 3, dtype)
    g5, u5 = _shared_gate_up(rng, 5, dtype)
    return {
        0: nbx.LoRA(gate=g, up=u, down=_pair(rng, I, H, 2, dtype), scale=dict(gate=0.75, up=0.75, down=3.0)),
        2: nbx.LoRA(down=_pair(rng, I, H, 7, dtype), scale=1 / 7),              # down only
        5: nbx.LoRA(gate=g5, up=u5, scale=2.0),                                 # gate_up only
        6: nbx.LoRA(gate=g, up=u, down=_pair(rng, I, H, 3, dtype), scale=0.75),  # the config's r and alpha
    }


def _per_expert_layers(dtype=np.float32):
    rng = np.random.default_rng(2)
    return {
        1: nbx.LoRA(gate=_pair(rng, H, I, 3, dtype), up=_pair(rng, H, I, 5, dtype), down=_pair(rng, I, H, 1, dtype),
                    scale=dict(gate=0.5, up=1.25, down=16.0)),
        3: nbx.LoRA(up=_pair(rng, H, I, 2, dtype), down=_pair(rng, I, H, 4, dtype),   # partial: up and down
                    scale=dict(up=0.1, down=-0.5)),
        4: nbx.LoRA(gate=_pair(rng, H, I, 3, dtype), scale=0.5),
    }


@pytest.mark.fast
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16])
@pytest.mark.parametrize("form", ["fused", "per_expert"])
def test_round_trip_is_bit_for_bit(tmp_path, form, dtype):
    """from_peft(to_peft(x)) == x, every layer, both forms; the config's r and lora_alpha are the first layer's
    first parameter's, the others in rank_pattern / alpha_pattern."""
    layers = _fused_layers(dtype) if form == "fused" else _per_expert_layers(dtype)
    out = to_peft(layers, tmp_path / "a", form=form)
    for n, lo in layers.items():
        _equal(from_peft(out, layer=n, **DIMS), lo)
    c = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert (c["peft_type"], c["task_type"], c["use_rslora"], c["lora_dropout"]) == ("LORA", "CAUSAL_LM", False, 0.0)
    if form == "fused":
        assert (c["r"], c["lora_alpha"], c["target_modules"]) == (3, 2.25, [])
        assert c["target_parameters"] == sorted(f"model.layers.{n}.mlp.experts.{p}" for n, p in
                                                [(0, "gate_up_proj"), (0, "down_proj"), (2, "down_proj"),
                                                 (5, "gate_up_proj"), (6, "gate_up_proj"), (6, "down_proj")])
        assert set(c["rank_pattern"].values()) == {2, 7, 5} and len(c["rank_pattern"]) == 3  # layer 6 at the default
    else:
        assert (c["r"], c["lora_alpha"], c["target_parameters"]) == (3, 1.5, None)
        assert isinstance(c["target_modules"], str)
    t = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    assert {a.dtype for a in t.values()} == {np.dtype(dtype)}
    if form == "fused":  # from_peft matches target_parameters to each block's full names, as PEFT does
        c["target_parameters"] = ["model.layers.9.mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(c))
        with pytest.raises(ValueError, match=r"does not name gate_up_proj of this block "
                                             r"\(model\.layers\.0\.mlp\.experts\.gate_up_proj\)"):
            from_peft(out, layer=0, **DIMS)
        _equal(from_peft(out, layer=2, **DIMS), layers[2])


@pytest.mark.fast
def test_sequence_lists_and_single_layer(tmp_path):
    """A sequence of LoRAs is layers 0, 1, ... (or ``layers``); per-expert lists are stacked; one LoRA with
    ``layers=n``; Mixtral's per-expert names (w1 / w3 / w2 under block_sparse_moe) read back by from_peft."""
    lo = _per_expert_layers()[1]
    lists = nbx.LoRA(**{n: tuple([m[e] for e in range(E)] for m in lo.pair(n)) for n in lo.projections},
                     scale=dict(zip(lo.projections, (lo.scale(n) for n in lo.projections))))
    to_peft([lo, lists], tmp_path / "seq", form="per_expert")
    for n in (0, 1):
        _equal(from_peft(tmp_path / "seq", layer=n, **DIMS), lo)
    to_peft([lists], tmp_path / "at", layers=[7], form="per_expert")
    _equal(from_peft(tmp_path / "at", layer=7, **DIMS), lo)
    to_peft(lo, tmp_path / "mx", layers=2, form="per_expert", model_type="mixtral")
    names = set(load_file(str(tmp_path / "mx" / "adapter_model.safetensors")))
    assert "base_model.model.model.layers.2.block_sparse_moe.experts.0.w3.lora_A.weight" in names
    assert not any("gate_proj" in n for n in names)
    _equal(from_peft(tmp_path / "mx", layer=2, **DIMS), lo)
    # a prefix in PEFT's spelling (base_model.model., the experts module) or from_peft's
    for i, p in enumerate(("base_model.model.model.decoder.{layer}.moe.experts", "model.decoder.{layer}.moe.")):
        to_peft({4: lo}, tmp_path / f"p{i}", form="per_expert", prefix=p)
        _equal(from_peft(tmp_path / f"p{i}", layer=4, prefix="model.decoder.4.moe.", **DIMS), lo)


def _run(lora, x, w, ids, experts):
    return jax.jit(lambda lo: nbx.fused_moe(x, w, ids, experts, lora=lo, implementation="xla"))(lora)


def test_fused_form_of_separate_gate_and_up(tmp_path):
    """gate and up with their own A (LoRA.init's adapters) in the fused form: A = [A_gate | A_up] and B
    block-diagonal at rank r_gate + r_up; gate or up alone: zeros in the other's columns of lora_B.  The block's
    output is the same (float32 reference)."""
    rng = np.random.default_rng(3)
    experts = nbx.Experts(*(jnp.asarray(rng.standard_normal(s).astype(np.float32) / math.sqrt(s[1]))
                            for s in ((E, H, I), (E, H, I), (E, I, H))))
    T = 9
    x = jnp.asarray(rng.standard_normal((T, H)).astype(np.float32))
    ids = jnp.asarray(np.stack([rng.permutation(E)[:2] for _ in range(T)]).astype(np.int32))
    w = jnp.asarray(rng.random((T, 2)).astype(np.float32))
    cases = {
        "both": nbx.LoRA(gate=_pair(rng, H, I, 3), up=_pair(rng, H, I, 5), down=_pair(rng, I, H, 2),
                         scale=dict(gate=0.5, up=0.5, down=2.0)),
        "gate": nbx.LoRA(gate=_pair(rng, H, I, 3), scale=1.5),
        "up": nbx.LoRA(up=_pair(rng, H, I, 4), down=_pair(rng, I, H, 2), scale=dict(up=0.25, down=1.0)),
    }
    for name, lo in cases.items():
        back = from_peft(to_peft(lo, tmp_path / name, layers=0), layer=0, **DIMS)
        assert back.projections[:2] == ("gate", "up")
        r = sum(lo.pair(p)[0].shape[2] for p in ("gate", "up") if lo.pair(p) is not None)
        assert back.gate[0].shape == (E, H, r) and back.scale("gate") == back.scale("up")
        if lo.pair("down") is not None:
            _equal(nbx.LoRA(down=back.down, scale=back.scale("down")), nbx.LoRA(down=lo.down, scale=lo.scale("down")))
        y, y_back = _run(lo, x, w, ids, experts), _run(back, x, w, ids, experts)
        assert rel_err(y_back, y) <= 1e-6, (name, rel_err(y_back, y))
        assert rel_err(_run(None, x, w, ids, experts), y) > 0.1
    t = load_file(str(tmp_path / "gate" / "adapter_model.safetensors"))
    (b,) = [v for k, v in t.items() if "lora_B" in k]
    assert b.shape == (2 * I, 3 * E) and not b[I:].any()     # up's columns: zeros


# --- the real PEFT fixtures, exported again ----------------------------------------------------------------------

def _peft_resolve(c: dict, key: str, is_param: bool):
    """What PEFT 0.21 makes of module or parameter ``key`` under config ``c``: None (not targeted) or its (r,
    alpha) (``check_target_module_exists``; ``_inject_parameters``' match of target_parameters;
    ``get_pattern_key``)."""
    if is_param:
        hit = any(key == t or key.endswith("." + t) for t in (c.get("target_parameters") or []))
    else:
        tm = c.get("target_modules") or []
        hit = bool(re.fullmatch(tm, key)) if isinstance(tm, str) else (
            key in tm or any(key.endswith("." + t) for t in tm))
    if not hit:
        return None

    def pat(d, default):
        return next((v for p, v in d.items() if re.match(rf"(.*\.)?({p})$", key)), default)

    return pat(c["rank_pattern"] or {}, c["r"]), pat(c["alpha_pattern"] or {}, c["lora_alpha"])


_KEYS = {  # the tiny Qwen3-MoE's keys PEFT matches targets against (modules; the fused experts' parameters)
    "qwen3_moe_lora": [(f"model.layers.0.{k}", True) for k in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj",
                                                                "mlp.gate.weight", "self_attn.q_proj.weight")],
    "qwen3_moe_lora_per_expert": [(f"model.layers.0.mlp.experts.{e}.{p}", False) for e in range(4)
                                  for p in ("gate_proj", "up_proj", "down_proj")]
    + [("model.layers.0.mlp.gate", False), ("model.layers.0.self_attn.q_proj", False), ("model.layers.0.mlp", False)],
}


@pytest.mark.fast
@pytest.mark.parametrize("name, form", [("qwen3_moe_lora", "fused"), ("qwen3_moe_lora_per_expert", "per_expert")])
def test_fixture_exported_again_equals_peft_files(tmp_path, name, form):
    """from_peft(fixture) -> to_peft: the same tensor names, shapes, dtypes and bits and the same safetensors
    metadata as PEFT wrote; the config has PEFT 0.21.2's fields, equal to the fixture's but the targets and
    patterns (here the exported layer's exact names, there PEFT's short ones) -- which resolve to the same
    adapted keys, ranks and alphas -- and task_type / base_model_name_or_path (arguments)."""
    lo = from_peft(PEFT / name, layer=0, num_experts=4, hidden_size=32, intermediate_size=16)
    rc = json.loads((PEFT / name / "adapter_config.json").read_text())
    out = to_peft(lo, tmp_path / "a", layers=0, form=form, base_model_name_or_path=rc["base_model_name_or_path"],
                  task_type=None)
    ref_st, our_st = PEFT / name / "adapter_model.safetensors", tmp_path / "a" / "adapter_model.safetensors"
    ref, ours = load_file(str(ref_st)), load_file(str(our_st))
    assert sorted(ours) == sorted(ref)
    for k in ref:
        assert ours[k].dtype == ref[k].dtype and ours[k].shape == ref[k].shape, k
        np.testing.assert_array_equal(ours[k].view(np.uint32), ref[k].view(np.uint32), err_msg=k)
    with safe_open(str(ref_st), "np") as f, safe_open(str(our_st), "np") as g:
        assert f.metadata() == g.metadata() == {"format": "pt"}
    oc = json.loads((pathlib.Path(out) / "adapter_config.json").read_text())
    assert sorted(oc) == sorted(rc)
    # init_lora_weights: the fixtures' False (random lora_B, to test with); ours PEFT's default, True: a module the
    # config targets and the file lacks then starts at lora_B = 0, no change.  auto_mapping: PEFT's
    # save_pretrained records the model's class where task_type is None
    loose = {"target_modules", "target_parameters", "rank_pattern", "alpha_pattern", "auto_mapping",
             "init_lora_weights"}
    assert (rc["init_lora_weights"], oc["init_lora_weights"], oc["auto_mapping"]) == (False, True, None)
    assert {k: v for k, v in oc.items() if k not in loose} == {k: v for k, v in rc.items() if k not in loose}
    for key, is_param in _KEYS[name]:
        assert _peft_resolve(oc, key, is_param) == _peft_resolve(rc, key, is_param), key
    assert sum(_peft_resolve(rc, k, p) is not None for k, p in _KEYS[name]) == (2 if form == "fused" else 12)
    _equal(from_peft(out, layer=0, num_experts=4, hidden_size=32, intermediate_size=16), lo)


# --- scales -------------------------------------------------------------------------------------------------------

@pytest.mark.fast
def test_lora_alpha_gives_the_scale():
    """alpha / r is the scale in float64 (an int where one is); where no float alpha gives it, the nearest, equal in
    float32; every scale alpha / r gives an alpha back."""
    assert _alpha(2.0, 4, "x") == 8 and isinstance(_alpha(2.0, 4, "x"), int)
    assert _alpha(0.75, 3, "x") == 2.25 and _alpha(-0.5, 3, "x") == -1.5 and _alpha(0.0, 5, "x") == 0
    rng = np.random.default_rng(4)
    inexact = 0
    for _ in range(3000):
        r = int(rng.integers(1, 300))
        s = float(rng.uniform(1e-3, 50))
        a = _alpha(s, r, "x")
        assert np.float32(a / r) == np.float32(s)
        inexact += a / r != s
        a2 = float(rng.uniform(1, 200))
        assert _alpha(a2 / r, r, "x") / r == a2 / r
    assert 0 < inexact < 600


@pytest.mark.fast
def test_inexact_scale_reads_back_equal_in_float32(tmp_path):
    r = 3
    s = next(s for s in np.random.default_rng(5).uniform(0.01, 10, 1000) if _alpha(float(s), r, "x") / r != s)
    lo = nbx.LoRA(down=_pair(np.random.default_rng(6), I, H, r), scale=float(s))
    back = from_peft(to_peft(lo, tmp_path / "a", layers=0), layer=0, **DIMS)
    assert back.scale("down") != lo.scale("down") and np.float32(back.scale("down")) == np.float32(lo.scale("down"))


# --- refusals -----------------------------------------------------------------------------------------------------

@pytest.mark.fast
def test_refused_by_name(tmp_path):
    rng = np.random.default_rng(7)
    lo = nbx.LoRA(gate=_pair(rng, H, I, 2), up=_pair(rng, H, I, 2), scale=dict(gate=1.0, up=2.0))
    with pytest.raises(ValueError, match=r"layer 0: form='fused': gate's scale 1\.0 and up's 2\.0 differ.*"
                                         r"form='per_expert'"):
        to_peft(lo, tmp_path / "a", layers=0)
    to_peft(lo, tmp_path / "ok", layers=0, form="per_expert")        # the per-expert form expresses it
    bf = nbx.LoRA(gate=_pair(rng, H, I, 2), up=_pair(rng, H, I, 2, jnp.bfloat16), scale=1.0)
    with pytest.raises(ValueError, match=r"gate's A is float32 and up's bfloat16"):
        to_peft(bf, tmp_path / "a", layers=0)
    good = nbx.LoRA(down=_pair(rng, I, H, 2), scale=1.0)
    cases = [
        (dict(lora="x", layers=0), TypeError, r"lora must be a jax_nbx\.LoRA.*got str"),
        (dict(lora=good), ValueError, r"layers=None with a single LoRA"),
        (dict(lora={0: good}, layers=[0]), ValueError, r"layers=\[0\] with a mapping"),
        (dict(lora=[good, good], layers=[0]), ValueError, r"layers=\[0\] names 1 layers for 2 LoRAs"),
        (dict(lora=[good, good], layers=[3, 3]), ValueError, r"layers=\[3, 3\] names a layer twice"),
        (dict(lora=[good], layers=[-1]), TypeError, r"layers=\[-1\]: -1 is not a layer index"),
        (dict(lora=good, layers="0"), TypeError, r"layers='0' must be an int or a sequence"),
        (dict(lora={0: good, 1: "y"}), TypeError, r"adapters of layer 1 are a str"),
        (dict(lora=[]), ValueError, r"holds no adapters"),
        (dict(lora=good, layers=0, form="merged"), ValueError, r"form='merged'"),
        (dict(lora=[good, good], prefix="model.layers.0.mlp."), ValueError,
         r"prefix='model\.layers\.0\.mlp\.' has no \{layer\} field"),
        (dict(lora=good, layers=0, prefix="model.{n}.mlp."), ValueError, r"prefix='model\.\{n\}\.mlp\.'"),
        (dict(lora=good, layers=0, model_type="gpt_oss"), ValueError, r"model_type='gpt_oss': gpt-oss"),
        (dict(lora=good, layers=0, base_model_name_or_path="openai/gpt-oss-20b"), ValueError,
         r"base_model_name_or_path='openai/gpt-oss-20b': gpt-oss"),
        (dict(lora=good, layers=0, task_type=3), TypeError, r"task_type=3"),
        (dict(lora=nbx.LoRA(down=(good.down[0], good.down[1][:, :1]), scale=1.0), layers=0), ValueError,
         r"adapters of layer 0: lora\.down B has per-expert shape \(1, 20\); expected \[r=2, 20\]"),
        (dict(lora=nbx.LoRA(down=(good.down[0][0], good.down[1]), scale=1.0), layers=0), ValueError,
         r"adapters of layer 0: down's A and B have shapes \(12, 2\)"),
    ]
    for i, (kw, exc, match) in enumerate(cases):
        with pytest.raises(exc, match=match):
            to_peft(kw.pop("lora"), tmp_path / f"r{i}", **kw)
        assert not (tmp_path / f"r{i}").exists()


@pytest.mark.fast
def test_folder_not_empty_needs_overwrite(tmp_path):
    rng = np.random.default_rng(8)
    a, b = (nbx.LoRA(down=_pair(rng, I, H, 2), scale=1.0) for _ in range(2))
    to_peft(a, tmp_path / "f", layers=0)
    (tmp_path / "f" / "README.md").write_text("kept")
    with pytest.raises(FileExistsError, match=r"folder=.* is not empty.*overwrite=True"):
        to_peft(b, tmp_path / "f", layers=0)
    _equal(from_peft(tmp_path / "f", layer=0, **DIMS), a)
    to_peft(b, tmp_path / "f", layers=0, overwrite=True)
    _equal(from_peft(tmp_path / "f", layer=0, **DIMS), b)
    assert sorted(p.name for p in (tmp_path / "f").iterdir()) == ["README.md", "adapter_config.json",
                                                                   "adapter_model.safetensors"]
    (tmp_path / "file").write_text("")
    with pytest.raises(FileExistsError, match=r"is a file"):
        to_peft(a, tmp_path / "file", layers=0, overwrite=True)
    to_peft(a, tmp_path / "empty_ok", layers=0)  # created; an existing empty folder is fine too
    (tmp_path / "empty").mkdir()
    to_peft(a, tmp_path / "empty", layers=0)
