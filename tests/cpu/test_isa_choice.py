"""The CPU micro-kernels' choice per kernel family (xla_ffi/cpu/kernels/isa.cc,
jax_nbx.cpu, jax_nbx.isa_calibration): compositions, the default rule,
errors, and that a composed table gives each family's results bit for bit
as its instruction set alone."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nbx as nbx
from jax_nbx import _registry
from jax_nbx.isa_calibration import choose

_ffi = _registry.ffi_module()
ISAS = nbx.cpu.supported_isas()
two_isas = pytest.mark.skipif(len(ISAS) < 2, reason=f"this CPU runs one kernel build only ({ISAS})")


@pytest.fixture(autouse=True)
def _restore_isa():
    before = nbx.cpu.isa()
    yield
    nbx.cpu.set_isa(before)


def test_default_is_in_effect_and_reported():
    nbx.cpu.set_isa(nbx.cpu.default_isa())
    fams = nbx.cpu.isa_families()
    assert set(fams) == set(nbx.cpu.FAMILIES)
    assert all(i in ISAS for i in fams.values())
    if len(set(fams.values())) == 1:
        assert nbx.cpu.isa() == next(iter(fams.values()))
    else:
        assert nbx.cpu.isa() == ",".join(f"{f}={fams[f]}" for f in nbx.cpu.FAMILIES)


@pytest.mark.fast
def test_default_rule_per_cpu():
    full = "avx512,avx2,generic"
    every = lambda i: {f: i for f in nbx.cpu.FAMILIES}  # noqa: E731
    assert _ffi.cpu_default_families("GenuineIntel", 6, full) == every("avx512")
    # AMD family 19h (Zen 4 double-pumps 512-bit FMAs): AVX2 measured faster for the packed GEMMs,
    # float32 streaming and the bfloat16 dot products; AVX-512 for bf16 and quantized streaming
    # and precision="int8"
    assert _ffi.cpu_default_families("AuthenticAMD", 0x19, full) == {
        **every("avx2"), "stream": "avx512", "qstream": "avx512", "qdot": "avx512"}
    assert _ffi.cpu_default_families("AuthenticAMD", 0x19, "avx2,generic") == every("avx2")
    assert _ffi.cpu_default_families("AuthenticAMD", 0x1A, full) == every("avx512")  # Zen 5
    assert _ffi.cpu_default_families("GenuineIntel", 6, "avx2,generic") == every("avx2")
    assert _ffi.cpu_default_families("", 0, "generic") == every("generic")


@two_isas
def test_composition_forms_and_report():
    a, b = ISAS[-2], ISAS[-1]  # e.g. avx2, generic
    nbx.cpu.set_isa(f"packed={b},stream={a},qstream={b},dot={a},stream_f32={b},qdot={a}")
    assert nbx.cpu.isa() == f"packed={b},stream={a},qstream={b},dot={a},stream_f32={b},qdot={a}"
    assert nbx.cpu.isa_families() == {"packed": b, "stream": a, "qstream": b, "dot": a, "stream_f32": b,
                                      "qdot": a}
    nbx.cpu.set_isa({"stream": b})  # the families not named take the default's
    assert nbx.cpu.isa_families()["stream"] == b
    nbx.cpu.set_isa(a)  # one name: every family
    assert nbx.cpu.isa() == a and set(nbx.cpu.isa_families().values()) == {a}
    nbx.cpu.set_isa(",".join(f"{f}={a}" for f in nbx.cpu.FAMILIES))  # all the same: the plain table
    assert nbx.cpu.isa() == a


@two_isas
def test_dot_family_sets_the_bfloat16_blocking():
    """precision="bfloat16" runs on the dot family's blocking: its plan
    (workspace bytes) follows the dot family and nothing else, the float32
    plan ignores it, and the bits do not depend on the blocking (the dot
    products' documented arithmetic on every table; avx512_bf16 on both
    blockings where the CPU has it)."""
    a, b = ISAS[0], ISAS[1]  # e.g. avx512 (16 x 12), avx2 (8 x 6)
    plan = lambda dot: nbx.memory.fused_moe_workspace_bytes(150, 2, 4, 224, 96, bf16_dot=dot)  # noqa: E731
    nbx.cpu.set_isa(a)
    dot_a, f32_a = plan(True), plan(False)
    nbx.cpu.set_isa(f"packed={a},stream={a},qstream={a},dot={b},stream_f32={a}")
    assert plan(False) == f32_a and plan(True) != dot_a
    nbx.cpu.set_isa(f"packed={b},stream={b},qstream={b},dot={a},stream_f32={b}")
    assert plan(True) == dot_a and plan(False) != f32_a
    x, w, ids, ex = _layer(150, 4, 2, 224, 96, jnp.bfloat16, seed=3)  # 75 rows per expert: packed
    x = x.astype(jnp.bfloat16)
    f = jax.jit(lambda x, w, i, e: nbx.fused_moe(x, w, i, e, implementation="ffi", precision="bfloat16"))
    ys = []
    for spec in (f"packed={b},dot={a}", f"packed={a},dot={b}"):
        nbx.cpu.set_isa(spec)
        ys.append(np.asarray(jax.block_until_ready(f(x, w, ids, ex))).view(np.uint16))
    np.testing.assert_array_equal(ys[0], ys[1])


@pytest.mark.parametrize("spec, message", [
    ("sse9", "unknown instruction set"),
    ("packed", "unknown instruction set"),
    ("wide=avx2", "unknown kernel family 'wide'"),
    ("packed=sse9", "unknown instruction set 'sse9' for packed"),
    ("packed=generic,", "is not family=isa"),
    ("", "expected an instruction set name"),
])
def test_bad_names_are_refused_by_name(spec, message):
    before = nbx.cpu.isa()
    with pytest.raises(ValueError, match=message):
        nbx.cpu.set_isa(spec)
    assert nbx.cpu.isa() == before  # nothing changed


def test_unsupported_isa_is_refused():
    missing = [i for i in ("avx512", "avx2") if i not in ISAS]
    if not missing:
        pytest.skip("this CPU supports every instruction set")
    with pytest.raises(ValueError, match=f"does not support {missing[0]} \\(for stream\\)"):
        nbx.cpu.set_isa(f"stream={missing[0]}")


def _layer(T, E, k, H, I, dtype, seed):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    ex = nbx.Experts(gate=jnp.asarray(rng.standard_normal((E, H, I)) / H ** 0.5, dtype),
                     up=jnp.asarray(rng.standard_normal((E, H, I)) / H ** 0.5, dtype),
                     down=jnp.asarray(rng.standard_normal((E, I, H)) / I ** 0.5, dtype))
    ids = jnp.asarray((np.arange(T * k) % E).reshape(T, k), jnp.int32)
    w = jnp.asarray(rng.uniform(0.1, 1.0, (T, k)), jnp.float32)
    return x, w, ids, ex


def _run(spec, args):
    nbx.cpu.set_isa(spec)
    f = jax.jit(lambda x, w, i, e: nbx.fused_moe(x, w, i, e, implementation="ffi"))
    return np.asarray(jax.block_until_ready(f(*args)))


@two_isas
@pytest.mark.parametrize("case", ["decode-bf16", "decode-f32", "decode-int4", "decode-int8", "prefill-f32",
                                  "prefill-int8"])
def test_each_family_gives_its_isas_bits(case):
    """Under a composition, a call that runs one family's kernels only gives
    exactly the bits of that family's instruction set alone, and not the
    other's (the two differ on this input, so the test can fail)."""
    a, b = ISAS[-2], ISAS[-1]
    kind, fmt = case.split("-")
    streams = {"int4": "qstream", "int8": "qstream", "bf16": "stream", "f32": "stream_f32"}
    T, family = (1, streams[fmt]) if kind == "decode" else (150, "packed")
    # decode: 1 row per expert (streamed); prefill: 75 rows per expert (packed); H, I multiples of
    # the int4 group (32) only
    x, w, ids, ex = _layer(T, 4, 2, 224, 96, jnp.float32 if fmt in ("f32", "int8", "int4") else jnp.bfloat16,
                           seed=len(case))
    if fmt.startswith("int"):
        ex = nbx.quantize(ex, fmt, **({"group_size": 32} if fmt == "int4" else {}))
    args = (x, w, ids, ex)
    y_a, y_b = _run(a, args), _run(b, args)
    assert not np.array_equal(y_a, y_b), "the two builds agree bit for bit here: the test could not fail"
    others = [f for f in nbx.cpu.FAMILIES if f != family]
    # this family from `a`, every other from `b`: a's bits; and the reverse
    y_ab = _run(",".join([f"{family}={a}"] + [f"{o}={b}" for o in others]), args)
    y_ba = _run(",".join([f"{family}={b}"] + [f"{o}={a}" for o in others]), args)
    np.testing.assert_array_equal(y_ab, y_a)
    np.testing.assert_array_equal(y_ba, y_b)


@two_isas
def test_mixed_call_and_gradient_under_a_composition():
    """A call with both streamed (few rows) and packed (many rows) experts,
    and its gradient, under a composition: close to float64."""
    a, b = ISAS[-2], ISAS[-1]
    T, E, k, H, I = 33, 3, 2, 50, 24
    x, w, _, ex = _layer(T, E, k, H, I, jnp.float32, seed=7)
    ids = np.zeros((T, k), np.int32)
    ids[:, 1] = 1
    ids[0, 0] = 2  # expert 2: one row (streamed); experts 0, 1: 33 rows (packed)
    ids = jnp.asarray(ids)
    nbx.cpu.set_isa(f"packed={b},stream_f32={a},qstream={b}")
    y = nbx.fused_moe(x, w, ids, ex, implementation="ffi")
    ref = nbx.moe_reference(x, w, ids, ex)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=2e-5, atol=2e-5)
    g = jax.grad(lambda x_: jnp.sum(nbx.fused_moe(x_, w, ids, ex, implementation="ffi") ** 2))(x)
    g_ref = jax.grad(lambda x_: jnp.sum(nbx.moe_reference(x_, w, ids, ex) ** 2))(x)
    np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-4, atol=1e-4)


@pytest.mark.fast
def test_choose_keeps_the_default_within_tolerance():
    assert choose({"avx512": 10.0, "avx2": 9.8}, "avx512", 0.03) == "avx512"  # 2 % faster: keep
    assert choose({"avx512": 10.0, "avx2": 9.0}, "avx512", 0.03) == "avx2"    # 10 % faster: switch
    assert choose({"avx2": 5.0, "generic": 4.0}, "avx2", 0.0) == "generic"
    assert choose({"avx2": 5.0}, "avx512", 0.03) == "avx2"  # default not measured
    with pytest.raises(ValueError, match="no times"):
        choose({}, "avx2", 0.03)


def test_calibrate_isa_measures_every_family_and_applies(monkeypatch):
    from jax_nbx import isa_calibration
    from jax_nbx.isa_calibration import candidates

    # the mechanics, on problems a tenth the size (each still runs its family's kernels: packed
    # 48 rows per expert, the streaming ones T = 1; int4's groups of 128 divide H and I)
    small = {"packed": (48, 2, 2, 128, 64, "f32"), "stream": (1, 4, 2, 256, 128, "bf16"),
             "stream_f32": (1, 4, 2, 256, 128, "f32"), "qstream": (1, 4, 2, 256, 128, "int4"),
             "dot": (48, 2, 2, 128, 64, "bf16dot"), "qdot": (1, 4, 2, 256, 128, "int8x8")}
    assert set(small) == set(isa_calibration.PROBLEMS)
    monkeypatch.setattr(isa_calibration, "PROBLEMS", small)

    want = [i for i in ISAS if i != "generic"] or ISAS  # generic (no FMA on x86) only where it is all
    assert candidates() == want
    cal = nbx.calibrate_isa(rounds=1, force=True)
    assert set(cal.times_ms) == set(nbx.cpu.FAMILIES)
    for fam in nbx.cpu.FAMILIES:
        assert set(cal.times_ms[fam]) == set(want) and all(t > 0 for t in cal.times_ms[fam].values())
        assert cal.families[fam] == choose(cal.times_ms[fam], cal.default[fam], cal.tolerance)
    assert nbx.cpu.isa() == cal.chosen and nbx.cpu.isa_families() == cal.families
    # cached for the process: the same object, applied again
    nbx.cpu.set_isa(ISAS[-1])
    assert nbx.calibrate_isa(rounds=1) is cal and nbx.cpu.isa() == cal.chosen
    # apply=False leaves the selection as it is (the cached measurement: measuring again costs 20 s)
    nbx.cpu.set_isa(ISAS[-1])
    assert nbx.calibrate_isa(rounds=1, apply=False) is cal
    assert nbx.cpu.isa() == ISAS[-1]


@pytest.mark.parametrize("kw, message", [({"rounds": 0}, "rounds must be a positive int"),
                                         ({"tolerance": 1.5}, "tolerance must be in")])
def test_calibrate_isa_bad_arguments(kw, message):
    with pytest.raises(ValueError, match=message):
        nbx.calibrate_isa(**kw)
