"""Shared helpers: random MoE problems and a float64 numpy reference."""
from __future__ import annotations

import math
import pathlib
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nbx as nbx

# tests/support/: helpers the test files import by name (ffi_testing: the test-only module)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "support"))
import ffi_testing  # noqa: E402


def pytest_configure(config):
    """jax_nbx._ffi_testing (NBX_TESTING=ON builds) loaded before collection: its poisoned
    twins registered with XLA, the simulated Metal device installed; a usage error naming
    the build option where this build lacks it."""
    ffi_testing.load()


DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
# max |y - ref| / max |ref|: f32 accumulation; bf16/f16 add the output's rounding.
TOL = {"f32": 1e-5, "bf16": 1e-2, "f16": 2e-3}


def np_silu(g):
    return g / (1.0 + np.exp(-g))


def np_gelu_tanh(g):
    return 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g ** 3)))


NP_ACT = {"swiglu": np_silu, "geglu": np_gelu_tanh}
_np_erf = np.vectorize(math.erf, otypes=[np.float64])


def np_glu(g, u, activation="swiglu"):
    """(glu(g, u), d glu/dg, d glu/du) in float64, jax_nbx.activations' table
    written out: swiglu_clamped from transformers' modeling_gpt_oss.py
    (GptOssExperts.forward: gate.clamp(max=limit), up.clamp(-limit, limit),
    gate * sigmoid(gate * alpha) * (up + 1)); a clamp passes the gradient
    inside its range only (torch.clamp)."""
    a = nbx.activations.as_activation(activation)
    if a.name == "swiglu_clamped":
        L, al = a.limit, a.alpha
        gc, uc = np.minimum(g, L), np.clip(u, -L, L)
        s = 1.0 / (1.0 + np.exp(-al * gc))
        f, df = gc * s, s * (1.0 + al * gc * (1.0 - s))
        return f * (uc + 1.0), np.where(g <= L, df * (uc + 1.0), 0.0), np.where(np.abs(u) <= L, f, 0.0)
    if a.name == "geglu_erf":
        cdf = 0.5 * (1.0 + _np_erf(g / np.sqrt(2.0)))
        f, df = g * cdf, cdf + g * np.exp(-0.5 * g * g) / np.sqrt(2.0 * np.pi)
    else:
        f, df = np_act_grad(g, a.name)
    return f * u, df * u, f


def f64(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a).astype(jnp.float32), dtype=np.float64)


def np_moe(x, w, ids, experts: nbx.Experts, activation="swiglu") -> np.ndarray:
    """float64 MoE forward, one expert at a time; x [T, H], w/ids [T, k]."""
    x, w, ids = f64(x), f64(w), np.asarray(ids)
    gate, up, down = f64(experts.gate), f64(experts.up), f64(experts.down)
    T, H = x.shape
    y = np.zeros((T, H))
    for e in range(gate.shape[0]):
        t_idx, j_idx = np.nonzero(ids == e)
        if t_idx.size == 0:
            continue
        a = x[t_idx]
        h = np_glu(a @ gate[e], a @ up[e], activation)[0]
        np.add.at(y, t_idx, w[t_idx, j_idx][:, None] * (h @ down[e]))
    return y


def np_act_grad(g, activation="swiglu"):
    """(act(g), act'(g)) in float64."""
    if activation == "geglu":
        c = np.sqrt(2.0 / np.pi)
        th = np.tanh(c * (g + 0.044715 * g ** 3))
        return 0.5 * g * (1.0 + th), 0.5 * (1.0 + th) + 0.5 * g * (1.0 - th ** 2) * c * (1.0 + 3 * 0.044715 * g ** 2)
    s = 1.0 / (1.0 + np.exp(-g))
    return g * s, s + g * s * (1.0 - s)


def np_moe_grads(x, w, ids, experts: nbx.Experts, ct, activation="swiglu"):
    """float64 gradients of sum(y * ct): (dx, dw, dgate, dup, ddown).  Slots
    whose id is outside [0, E) contribute nothing (their dw is 0)."""
    x, w, ids, ct = f64(x), f64(w), np.asarray(ids), f64(ct)
    G, U, D = f64(experts.gate), f64(experts.up), f64(experts.down)
    dx, dw = np.zeros_like(x), np.zeros_like(w)
    dG, dU, dD = np.zeros_like(G), np.zeros_like(U), np.zeros_like(D)
    for e in range(G.shape[0]):
        t_idx, j_idx = np.nonzero(ids == e)
        if t_idx.size == 0:
            continue
        a, c, wt = x[t_idx], ct[t_idx], w[t_idx, j_idx][:, None]
        g, u = a @ G[e], a @ U[e]
        h, dh_dg, dh_du = np_glu(g, u, activation)
        o = h @ D[e]
        np.add.at(dw, (t_idx, j_idx), np.sum(o * c, axis=1))
        do = wt * c
        dD[e] += h.T @ do
        dh = do @ D[e].T
        dg = dh * dh_dg
        du = dh * dh_du
        dG[e] += a.T @ dg
        dU[e] += a.T @ du
        np.add.at(dx, t_idx, dg @ G[e].T + du @ U[e].T)
    return dx, dw, dG, dU, dD


def rel_err(y, ref) -> float:
    y = np.asarray(jnp.asarray(y).astype(jnp.float32), dtype=np.float64)
    scale = max(np.max(np.abs(ref)), 1e-30) if ref.size else 1.0
    return float(np.max(np.abs(y - ref)) / scale) if ref.size else 0.0


def make_problem(seed, T, E, k, H, I, x_dtype=jnp.float32, w_dtype=jnp.float32,
                 routing="topk"):
    """x [T, H], routed (w, ids) [T, k] and Experts with unit-scale outputs."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((T, H)), x_dtype)
    experts = nbx.Experts(
        gate=jnp.asarray(rng.standard_normal((E, H, I)) / np.sqrt(H), w_dtype),
        up=jnp.asarray(rng.standard_normal((E, H, I)) / np.sqrt(H), w_dtype),
        down=jnp.asarray(rng.standard_normal((E, I, H)) / np.sqrt(I), w_dtype),
    )
    if routing == "topk":
        w, ids = nbx.route(jnp.asarray(rng.standard_normal((T, E)), jnp.float32), k)
    elif routing == "one":  # every slot to expert E-1 (skewed), repeated ids allowed
        ids = jnp.full((T, k), E - 1, jnp.int32)
        w = jnp.asarray(rng.uniform(0.1, 1.0, (T, k)), jnp.float32)
    else:  # independent draws: repeats within a token allowed
        ids = jnp.asarray(rng.integers(0, E, (T, k)), jnp.int32)
        w = jnp.asarray(rng.uniform(0.1, 1.0, (T, k)), jnp.float32)
    return x, w, ids, experts


ISAS = ["avx512", "avx2", "generic"]
X86_ISAS = ("avx512", "avx2")


@pytest.fixture(params=ISAS)
def isa(request):
    """Runs the test once per micro-kernel instruction set this CPU supports."""
    if request.param not in nbx.cpu.supported_isas():
        machine = platform.machine()
        if request.param in X86_ISAS and machine not in ("x86_64", "AMD64"):
            pytest.skip(f"{request.param} is an x86-64 instruction set; this is {machine}, "
                        f"whose kernels are the portable ones ({nbx.cpu.supported_isas()})")
        pytest.skip(f"this CPU lacks {request.param} (supports {nbx.cpu.supported_isas()})")
    before = nbx.cpu.isa()
    nbx.cpu.set_isa(request.param)
    yield request.param
    nbx.cpu.set_isa(before)


@pytest.fixture
def metal_sim():
    """The simulated Metal device, fresh for the test (default limits); after
    it, nothing live on metal:0, no live wrap, no unreported violation.  Yields
    the test module (its metal_sim_* controls)."""
    ffi = ffi_testing.load()
    nbx.tables.release_pinned()
    nbx.metal.use("sim")
    yield ffi
    nbx.tables.release_pinned()
    ffi.metal_sim_hold_completions(False)
    s = nbx.memory.stats()["metal:0"]
    assert s["live"] == 0, s
    assert ffi.metal_sim_state()["live_wraps"] == 0
    assert ffi.metal_sim_take_violations() == []
    nbx.tables.set_capacity(256)
    nbx.metal.use("none")


@pytest.fixture(autouse=True)
def _no_leaked_handler_bytes():
    """Every test leaves the handlers' live allocation count at zero."""
    yield
    assert nbx.memory.stats()["cpu:0"]["live"] == 0


# --- the arm64 subset -------------------------------------------------------------------
# `pytest -m arm64 tests`: what .ci/arm64 runs on an arm64 Python under qemu-aarch64
# against the cross-built module (natively the same tests take ~20 s) -- the CPU kernels'
# testers and the planner (C++ alone), forward and backward against float64 at small odd
# shapes, ids, errors, the account, and the Metal emulation's kernels.  Chosen for few
# compilations (~3 s each under qemu) and small numerics (several hundred times slower
# there); tests that start a subprocess are left out (an arm64 process cannot start
# another without binfmt_misc).  Listed here, not marked in the files, so that one
# parametrization can be picked and tests/test_metal_*.py stay untouched.  Per file: "*"
# (every test) or entries, each a test's name (every parametrization) or
# (name, {parameter: value}) (those with these values; a test taking the `isa` fixture
# runs on every ISA: on aarch64 the x86 ones skip).  With `-m arm64` an entry that
# selects nothing in a collected file is an error, not a silent gap.
_T33 = (33, 8, 2, 129, 511)
ARM64_SUBSET = {
    "test_kernels.py": "*",
    "test_planner.py": "*",
    "test_contract.py": ["test_target_names_are_the_abis"],
    "test_scratch.py": ["test_tiny_problem_needs_a_small_workspace",
                        "test_scratch_grows_with_h_and_i_up_to_the_blocking"],
    "test_forward.py": [
        ("test_ffi_matches_float64_reference", {"case": (1, 1, 1, 129, 511), "xd": "f32", "wd": "f32"}),
        ("test_ffi_matches_float64_reference", {"case": _T33, "xd": "f32", "wd": "f32"}),
        ("test_ffi_matches_float64_reference", {"case": (33, 64, 6, 65, 129), "xd": "f16", "wd": "bf16"}),
        ("test_activations", {"impl": "ffi", "activation": "geglu"}),
        ("test_activations", {"impl": "ffi", "activation": "swiglu_clamped"}),
        ("test_expert_groups_split_an_expert", {"band": 5, "routing": "one"}),
        "test_int64_and_uint8_ids_and_bf16_weights_accepted",
        "test_default_implementation_is_ffi_on_cpu",
    ],
    "test_backward.py": [
        ("test_backward_matches_float64", {"T": 1, "activation": "swiglu"}),
        ("test_backward_matches_float64", {"T": 33, "activation": "geglu"}),
        ("test_backward_16bit", {"xd": "f32", "wd": "bf16"}),
    ],
    "test_ids.py": [
        ("test_every_integer_dtype_runs_the_same_experts", {"impl": "ffi", "dtype": np.uint64}),
        ("test_every_integer_dtype_runs_the_same_experts", {"impl": "ffi", "dtype": np.int8}),
        "test_skip_mode_skips_wide_out_of_range_ids",
        "test_float_and_bool_ids_stay_refused",
        ("test_vmap_over_an_empty_batch", {"impl": "ffi"}),
    ],
    "test_errors.py": [
        "test_out_of_range_id_eager",
        "test_out_of_range_id_under_jit_then_recovers",
        "test_retyping_keeps_other_errors",
        "test_int64_id_beyond_int32_is_still_refused",
        ("test_shape_errors_name_the_argument", {"impl": "ffi"}),
        ("test_dtype_errors_name_the_argument", {"impl": "ffi"}),
        "test_option_errors",
    ],
    "test_memory.py": [
        "test_stats_and_report_keys", "test_parse_bytes", "test_parse_bytes_rejects",
        "test_advice_bands", "test_advice_bands_with_fixed_part", "test_advice_no_split_reaches_it",
        "test_advice_without_shape_and_when_it_fits", "test_non_oom_errors_pass_untouched",
        "test_full_workspace_fits_one_band", "test_small_caps_force_bands_with_identical_results",
        "test_small_budget_forces_bands", "test_impossible_cap_raises_at_trace_time_with_advice",
        "test_refusal_at_run_time_then_recovery", "test_concurrent_calls_stay_within_budget",
        "test_idle_blocks_are_reused_counted_and_give_way",
        "test_plan_ignores_bytes_held_by_concurrent_calls",
        "test_a_call_traced_under_load_keeps_the_plan_it_has_alone_and_waits",
        "test_a_refusal_after_waiting_says_the_call_fits_the_budget_alone",
        "test_hold_workspace_is_refused_past_the_budget",
        "test_workspace_formulas_refuse_slot_counts_past_the_limit",
        "test_workspace_formulas_saturate_instead_of_wrapping",
        "test_fused_moe_refuses_calls_past_the_slot_limit_at_trace_time",
    ],
    "test_metal_kernels.py": [
        ("test_expert_gemms_match_float64", {"T": 1, "activation": "swiglu"}),
        ("test_expert_gemms_match_float64", {"T": 3, "activation": "geglu_erf"}),
        ("test_expert_gemms_match_float64", {"T": 33, "activation": "swiglu"}),
        ("test_decode_gemv_and_combine_match_float64", {"T": 2, "wtype": "bf16", "activation": "swiglu"}),
        "test_combine_sums_each_token_in_slot_order",
        "test_nbx_erf_is_within_2e_7_of_erf",
        "test_a_missing_barrier_shows_as_a_wrong_result",
        "test_weights_not_made_resident_fail_the_launch",
        ("test_ordering_kernels_match_the_cpu_planner", {"S": 1}),
        ("test_ordering_kernels_match_the_cpu_planner", {"S": 7}),
        ("test_ordering_kernels_match_the_cpu_planner", {"S": 66}),
        "test_kernel_sources_keep_to_the_emulated_subset",
    ],
}


def _arm64_entries(filename):
    entries = ARM64_SUBSET.get(filename, [])
    return [(e, {}) if isinstance(e, str) else e for e in ([] if entries == "*" else entries)]


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    used, files = set(), set()
    for item in items:
        name = item.path.name
        files.add(name)
        if ARM64_SUBSET.get(name) == "*":
            item.add_marker(pytest.mark.arm64)
            continue
        params = item.callspec.params if hasattr(item, "callspec") else {}
        for i, (test, want) in enumerate(_arm64_entries(name)):
            if item.originalname == test and all(k in params and params[k] == v for k, v in want.items()):
                item.add_marker(pytest.mark.arm64)
                used.add((name, i))
    if "arm64" in (config.option.markexpr or ""):
        stale = [f"{name}: {entry}" for name in sorted(files)
                 for i, entry in enumerate(_arm64_entries(name)) if (name, i) not in used]
        if stale:
            raise pytest.UsageError("conftest.ARM64_SUBSET entries that select no test (renamed?):\n  "
                                    + "\n  ".join(stale))


jax.config.update("jax_numpy_rank_promotion", "raise")
