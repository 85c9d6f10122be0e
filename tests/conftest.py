"""Shared helpers: random MoE problems and a float64 numpy reference."""
from __future__ import annotations

import platform

import jax
import numpy as np
import pytest

import jax_nbx as nbx

from support import ffi_testing
from support.problems import (  # noqa: F401  (the oracles, for every test file)
    DTYPES,
    NP_ACT,
    TOL,
    as_lists,
    f64,
    make_problem,
    np_act_grad,
    np_gelu_tanh,
    np_glu,
    np_moe,
    np_moe_grads,
    np_silu,
    rel_err,
)
from support.runners import selected as _selected_runners


def pytest_configure(config):
    """jax_nbx._ffi_testing (NBX_TESTING=ON builds) loaded before collection: its poisoned
    twins registered with XLA, the simulated Metal device installed; a usage error naming
    the build option where this build lacks it."""
    ffi_testing.load()


def pytest_addoption(parser):
    parser.addoption("--backends", default=None,
                     help="the shared suite's backends (tests/support/runners.py): comma-separated id "
                          "prefixes, e.g. 'cpu,metal-sim' (default: every one)")


def pytest_generate_tests(metafunc):
    """The shared suite (tests/suite/) runs once per backend runner."""
    if "backend" in metafunc.fixturenames:
        runners = _selected_runners(metafunc.config.getoption("--backends"))
        metafunc.parametrize("backend", runners, ids=[r.id for r in runners], indirect=True)


@pytest.fixture
def backend(request):
    """A backend runner (support/runners.py), set up for the test; skipped
    (with the reason) where it cannot run."""
    runner = request.param
    why = runner.unavailable()
    if why:
        pytest.skip(why)
    with runner.setting():
        yield runner


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
    with ffi_testing.metal_sim() as ffi:
        yield ffi


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
