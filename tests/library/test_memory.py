"""The account: budgets, refusals with advice, bands planned to fit."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest

import jax_nbx as nbx
from jax_nbx import memory
from jax_nbx.planning import plan_band_tokens

from conftest import make_problem, np_moe, rel_err
from support import ffi_testing

pytestmark = pytest.mark.sanitize

T, E, K, H, I = 222, 8, 2, 129, 511


def need(tokens: int) -> int:
    """The handler's workspace for one band of `tokens` tokens of this problem."""
    return memory.fused_moe_workspace_bytes(tokens, K, E, H, I)


@pytest.fixture
def budget():
    """Restores the CPU budget after the test."""
    before = memory.budget()
    yield memory.set_budget
    memory.set_budget(before)


@pytest.fixture(scope="module")
def prob():
    return make_problem(0, T, E, K, H, I)


def _cpu():
    return memory.stats()["cpu:0"]


@pytest.mark.arm64
def test_stats_and_report_keys():
    s = _cpu()
    assert {"live", "peak", "budget", "refusals", "largest_request"} <= set(s)
    text = memory.report()
    assert "cpu:0" in text and "budget" in text.splitlines()[0]


def test_default_budget_is_half_the_available_memory():
    """Half of what is available when the package loads: read just before and
    just after the import (other processes' memory moves meanwhile: the
    CI's jobs run side by side, and the import is slow under the sanitizers)."""
    env_py = pathlib.Path(memory.__file__).with_name("_env.py")
    code = (f"import importlib.util as u; s = u.spec_from_file_location('e', {str(env_py)!r}); "
            "e = u.module_from_spec(s); s.loader.exec_module(e); a0 = e.available_memory(); "
            "from jax_nbx import memory as m; print(a0, m.budget(), m.available_memory())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={k: v for k, v in os.environ.items() if k != "JAX_NBX_BUDGET"}).stdout
    a0, b, a1 = map(int, out.split())
    assert 0.45 * min(a0, a1) <= b <= 0.55 * max(a0, a1), (a0, b, a1)


def test_budget_from_environment():
    code = "from jax_nbx import memory; print(memory.budget())"
    env = dict(os.environ, JAX_NBX_BUDGET="2GiB")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.strip() == str(2 * 2**30)
    env["JAX_NBX_BUDGET"] = "two gigs"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode != 0 and "JAX_NBX_BUDGET='two gigs'" in out.stderr


@pytest.mark.parametrize("text,n", [("2GiB", 2 * 2**30), ("300MB", 300 * 10**6), ("1.5G", int(1.5 * 2**30)),
                                    (" 512 kib ", 512 * 1024), ("1e3", 1000), (4096, 4096)])
@pytest.mark.arm64
def test_parse_bytes(text, n):
    assert memory.parse_bytes(text) == n


@pytest.mark.arm64
@pytest.mark.parametrize("bad", ["", "12 parsecs", "-1GB", True, None, float("inf")])
def test_parse_bytes_rejects(bad):
    with pytest.raises((TypeError, ValueError)):
        memory.parse_bytes(bad)


# --- the advice, word for word on known numbers -------------------------------------------

@pytest.mark.arm64
def test_advice_bands():
    s = memory.what_would_have_fit(1_200_000_000, 300_000_000, 1_000_000_000, shape=(4096, 2048))
    assert s == ("short by 900.0 MB; it would fit in 4 bands of about 300.0 MB; cutting the leading "
                 "axis of (4096, 2048) from 4096 to 1024 per band; a budget of 1.90 GB would have "
                 "taken it whole (the request alone exceeds the whole budget of 1.00 GB)")


@pytest.mark.arm64
def test_advice_bands_with_fixed_part():
    # 100 MB that never shrinks + 1 MB per row over 1000 rows; 400 MB free of 2 GB
    s = memory.what_would_have_fit(1_100_000_000, 400_000_000, 2_000_000_000, shape=(1000, 64),
                                   fixed_bytes=100_000_000)
    assert s == ("short by 700.0 MB; it would fit in 4 bands of about 350.0 MB; cutting the leading "
                 "axis of (1000, 64) from 1000 to 250 per band; a budget of 2.70 GB would have "
                 "taken it whole")


@pytest.mark.arm64
def test_advice_no_split_reaches_it():
    s = memory.what_would_have_fit(5_000_000, 100_000, 100_000, shape=(10, 8), fixed_bytes=4_000_000)
    assert s == ("short by 4.9 MB; no band split alone reaches it: one row of the leading axis of "
                 "(10, 8) already needs 4.1 MB with 100.0 kB free; a budget of 5.0 MB would have "
                 "taken it whole (the request alone exceeds the whole budget of 100.0 kB)")


@pytest.mark.arm64
def test_advice_without_shape_and_when_it_fits():
    assert memory.what_would_have_fit(3_000, 1_000, 10_000) == (
        "short by 2.0 kB; a budget of 12.0 kB would have taken it whole")
    assert memory.what_would_have_fit(1_000, 1_000, 10_000) == ""


@pytest.mark.arm64
def test_non_oom_errors_pass_untouched():
    e = jax.errors.JaxRuntimeError("INVALID_ARGUMENT: topk_ids[0, 0] = 9 is outside [0, 8)")
    assert memory.as_device_oom(e) is e
    v = ValueError("RESOURCE_EXHAUSTED: out of memory while allocating (not ours)")
    assert memory.as_device_oom(v) is v


# --- bands planned to fit -------------------------------------------------------------------

@pytest.mark.arm64
def test_full_workspace_fits_one_band(prob):
    assert plan_band_tokens(T, K, E, H, I) == T


@pytest.mark.arm64
@pytest.mark.parametrize("fraction", [0.5, 0.25, 0.125])
def test_small_caps_force_bands_with_identical_results(prob, fraction):
    x, w, ids, experts = prob
    whole = np.asarray(nbx.fused_moe(x, w, ids, experts))
    cap = need(0) + int((need(T) - need(0)) * fraction)  # the fixed part plus a fraction of the rest
    band = plan_band_tokens(T, K, E, H, I, cap)
    assert band < T
    memory.reset_peak()
    y = nbx.fused_moe(x, w, ids, experts, max_workspace_bytes=cap)
    np.testing.assert_array_equal(np.asarray(y), whole)
    assert 0 < _cpu()["peak"] <= cap


@pytest.mark.arm64
def test_small_budget_forces_bands(prob, budget):
    x, w, ids, experts = prob
    whole = np.asarray(nbx.fused_moe(x, w, ids, experts))
    small = need(T // 3)
    budget(small)
    memory.reset_peak()
    y = jax.jit(nbx.fused_moe)(x, w, ids, experts)   # traced now: planned from the new headroom
    np.testing.assert_array_equal(np.asarray(y), whole)
    assert 0 < _cpu()["peak"] <= small


@pytest.mark.arm64
def test_impossible_cap_raises_at_trace_time_with_advice(prob):
    x, w, ids, experts = prob
    with pytest.raises(nbx.DeviceOOMError, match=r"no band split alone reaches it") as info:
        jax.jit(lambda x: nbx.fused_moe(x, w, ids, experts, max_workspace_bytes="100kB"))(x)
    e = info.value
    assert isinstance(e, MemoryError)
    assert e.free == e.total == 100_000 and e.requested > e.free and e.shortfall == e.requested - e.free
    assert e.shape == (T, H)
    assert "fused_moe workspace for T=222 tokens (E=8 k=2 H=129 I=511)" in str(e)


@pytest.mark.arm64
def test_refusal_at_run_time_then_recovery(prob, budget):
    x, w, ids, experts = prob
    expected = np.asarray(nbx.fused_moe(x, w, ids, experts))
    refusals = _cpu()["refusals"]
    small, cap = need(T // 3), need(T)
    budget(small)
    # the plan trusts max_workspace_bytes (one band); the account still holds the line
    with pytest.raises(nbx.DeviceOOMError, match=r"it would fit in [34] bands of about") as info:
        nbx.fused_moe(x, w, ids, experts, max_workspace_bytes=cap)
    e = info.value
    assert e.total == small and e.free == small and e.shape == (T, H) and e.shortfall == cap - small
    f = jax.jit(lambda x: nbx.fused_moe(x, w, ids, experts, max_workspace_bytes=cap))
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"RESOURCE_EXHAUSTED: jax_nbx account \(cpu:0\) refused .*short by"):
        f(x).block_until_ready()
    r = memory.last_refusal()
    assert r["device"] == "cpu:0" and r["tag"] == "workspace" and r["total"] == small
    assert r["shortfall"] == r["requested"] - r["free"] and "it would fit in" in r["message"]
    s = _cpu()
    assert s["refusals"] == refusals + 2 and s["live"] == 0
    budget("1GiB")
    np.testing.assert_array_equal(np.asarray(f(x)), expected)
    assert _cpu()["live"] == 0


@pytest.mark.arm64
def test_concurrent_calls_stay_within_budget(budget):
    x, w, ids, experts = make_problem(1, 33, 8, 2, 65, 129)
    f = jax.jit(nbx.fused_moe)
    expected = np.asarray(f(x, w, ids, experts))
    one = memory.fused_moe_workspace_bytes(33, 2, 8, 65, 129)
    cap = 3 * one  # 8 threads cannot all hold their workspace at once
    budget(cap)
    memory.reset_peak()
    errors, bad = [], []

    def worker():
        try:
            for _ in range(200):
                y = np.asarray(f(x, w, ids, experts))
                if not np.array_equal(y, expected):
                    bad.append(1)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:1]
    assert not bad
    s = _cpu()
    assert s["live"] == 0 and 0 < s["peak"] <= cap


def test_xla_path_ignores_the_account(prob):
    x, w, ids, experts = prob
    before = _cpu()["allocations"]
    y = nbx.fused_moe(x, w, ids, experts, implementation="xla", max_workspace_bytes=1)
    assert rel_err(y, np_moe(x, w, ids, experts)) < 1e-5
    assert _cpu()["allocations"] == before


def test_without_waiting_concurrent_calls_are_refused_not_overcommitted(budget):
    x, w, ids, experts = make_problem(1, 33, 8, 2, 65, 129)
    f = jax.jit(nbx.fused_moe)
    f(x, w, ids, experts).block_until_ready()
    one = memory.fused_moe_workspace_bytes(33, 2, 8, 65, 129)
    budget(one)  # room for exactly one call at a time
    memory.set_wait(0)
    memory.reset_peak()
    refused = []

    def worker():
        for _ in range(50):
            try:
                f(x, w, ids, experts).block_until_ready()
            except (jax.errors.JaxRuntimeError, ValueError) as e:
                assert "RESOURCE_EXHAUSTED" in str(e)
                refused.append(1)

    try:
        threads = [threading.Thread(target=worker) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        memory.set_wait(10)
    s = _cpu()
    assert s["live"] == 0 and s["peak"] <= one


@pytest.mark.arm64
def test_idle_blocks_are_reused_counted_and_give_way(prob, budget):
    x, w, ids, experts = prob
    memory.release_cached()
    f = jax.jit(lambda *a: nbx.fused_moe(*a))  # a fresh trace: planned with today's headroom
    expected = np.asarray(f(x, w, ids, experts))
    s = _cpu()
    need_t = need(T)
    assert s["live"] == 0 and s["cached"] == need_t          # kept for the next call
    np.testing.assert_array_equal(np.asarray(f(x, w, ids, experts)), expected)
    assert _cpu()["cached"] == need_t                        # reused, not duplicated
    budget(need_t // 2)                                      # lowering the budget frees it
    assert _cpu()["cached"] == 0
    budget("1GiB")
    f(x, w, ids, experts).block_until_ready()
    assert _cpu()["cached"] == need_t
    memory.release_cached()
    assert _cpu()["cached"] == 0 and _cpu()["live"] == 0


# --- plans are a pure function of the problem and the budget (issue #14, item 3) -------------

def _hold(nbytes: int):
    """Bytes held in cpu:0's account as a concurrent call's workspace would be."""
    return ffi_testing.load().hold_workspace("cpu", 0, int(nbytes))


@pytest.mark.arm64
def test_plan_ignores_bytes_held_by_concurrent_calls(prob, budget):
    budget(need(T) + need(T) // 2)
    alone = plan_band_tokens(T, K, E, H, I)
    hold = _hold(need(T))  # another call's band: the headroom is now below one token's need
    try:
        assert memory.headroom() < need(1)
        # planned from the headroom this raised DeviceOOMError ("no band split alone reaches it")
        assert plan_band_tokens(T, K, E, H, I) == alone == T
    finally:
        hold.release()
    assert _cpu()["live"] == 0


@pytest.mark.arm64
def test_a_call_traced_under_load_keeps_the_plan_it_has_alone_and_waits(prob, budget):
    x, w, ids, experts = prob
    expected = np.asarray(nbx.fused_moe(x, w, ids, experts))
    budget(need(T) + need(T) // 2)
    memory.release_cached()
    hold = _hold(need(T))
    timer = threading.Timer(0.3, hold.release)  # the other call returns its bytes
    timer.start()
    try:
        memory.reset_peak()
        y = jax.jit(nbx.fused_moe)(x, w, ids, experts)  # traced (and run) while held: waits
        np.testing.assert_array_equal(np.asarray(y), expected)
    finally:
        timer.join()
        hold.release()
    s = _cpu()
    assert s["live"] == 0
    assert s["largest_request"] >= need(T)  # one band of all T tokens, not a plan shrunk by the load


@pytest.mark.arm64
def test_a_refusal_after_waiting_says_the_call_fits_the_budget_alone(prob, budget):
    x, w, ids, experts = prob
    budget(need(T) + need(T) // 2)
    memory.release_cached()
    hold = _hold(need(T))
    memory.set_wait(0.2)
    try:
        with pytest.raises(nbx.DeviceOOMError,
                           match=r"fits the budget alone, but concurrent calls held .* for the "
                                 r"200 ms it waited") as info:
            nbx.fused_moe(x, w, ids, experts)
        assert "no band split alone reaches it" not in str(info.value)
    finally:
        memory.set_wait(10)
        hold.release()
    assert _cpu()["live"] == 0


@pytest.mark.arm64
def test_hold_workspace_is_refused_past_the_budget(budget):
    budget("1MB")
    with pytest.raises(ValueError, match=r"refused 2.0 MB of test hold: 1.0 MB free"):
        _hold(2_000_000)
    assert _cpu()["live"] == 0


# --- sizes past the int32 slot indices (issue #14, item 7) -------------------------------------

@pytest.mark.arm64
def test_workspace_formulas_refuse_slot_counts_past_the_limit():
    from jax_nbx import contract
    with pytest.raises(ValueError, match="slots exceed the handlers' limit"):
        memory.fused_moe_workspace_bytes(2 ** 62, 2, 8, 64, 96)  # overflowed to 1.9 MB before
    with pytest.raises(ValueError, match="slots exceed the handlers' limit"):
        memory.fused_moe_backward_workspace_bytes(contract.MAX_SLOTS // 2 + 1, 2, 8, 64, 96)
    with pytest.raises(ValueError, match="out of range"):
        memory.fused_moe_workspace_bytes(-1, 2, 8, 64, 96)
    assert memory.fused_moe_workspace_bytes(contract.MAX_SLOTS // 2, 2, 8, 64, 96) > 0


@pytest.mark.arm64
def test_workspace_formulas_saturate_instead_of_wrapping():
    # 2^28 slots x H = 2^40 floats: ~2^70 bytes.  Saturates at int64's largest, never wraps small.
    big = memory.fused_moe_workspace_bytes(2 ** 27, 2, 8, 2 ** 40, 96)
    assert big == 2 ** 63 - 1
    assert memory.fused_moe_backward_workspace_bytes(2 ** 27, 2, 8, 96, 2 ** 40) == 2 ** 63 - 1
    with pytest.raises(nbx.DeviceOOMError, match="no band split alone reaches it"):
        plan_band_tokens(2 ** 27, 2, 8, 2 ** 40, 96)


@pytest.mark.arm64
def test_fused_moe_refuses_calls_past_the_slot_limit_at_trace_time():
    from jax_nbx import contract
    ex = nbx.Experts(*(jax.ShapeDtypeStruct(s, np.float32) for s in ((8, 16, 8), (8, 16, 8), (8, 8, 16))))
    T_big = contract.MAX_SLOTS // 2 + 1
    args = (jax.ShapeDtypeStruct((T_big, 16), np.float32), jax.ShapeDtypeStruct((T_big, 2), np.float32),
            jax.ShapeDtypeStruct((T_big, 2), np.int32))
    with pytest.raises(ValueError, match=r"T \* k = 536870913 \* 2 = 1073741826 slots exceed"):
        jax.eval_shape(lambda x, w, i, e: nbx.fused_moe(x, w, i, e, implementation="ffi"), *args, ex)
    # vmap folds a batch into the tokens: the folded call is checked too
    half = (contract.MAX_SLOTS // 2) // 2 + 1
    bargs = (jax.ShapeDtypeStruct((2, half, 16), np.float32), jax.ShapeDtypeStruct((2, half, 2), np.float32),
             jax.ShapeDtypeStruct((2, half, 2), np.int32))
    with pytest.raises(ValueError, match="slots exceed the FFI handlers' limit"):
        jax.eval_shape(jax.vmap(lambda x, w, i: nbx.fused_moe(x, w, i, nbx.Experts(
            *(np.zeros(s, np.float32) for s in ((8, 16, 8), (8, 16, 8), (8, 8, 16)))),
            implementation="ffi")), *bargs)


def _advice(msg: str, pattern: str) -> int:
    """The byte count of an advice's amount ("192.8 kB"), as a user would type it."""
    m = re.search(pattern, msg)
    assert m, msg
    value, unit = m.group(1).split()
    return nbx.memory.parse_bytes(value + ("" if unit == "bytes" else unit))


def test_the_advice_is_enough_to_follow(monkeypatch):
    """Every amount of a refusal's advice is rounded up: the budget it names
    takes the call whole, the band size it names takes it in bands -- for
    random shapes, worker counts and formats (the CPU backend's plan, the
    refusal every call of that backend makes at trace time)."""
    rng = np.random.default_rng(53)
    cpu_backend = nbx.backends.get("cpu")
    refused = 0
    for case in range(150):
        workers = int(rng.integers(1, 65))
        monkeypatch.setattr(nbx.cpu, "planned_workers", lambda w=workers: w)
        E = int(rng.integers(1, 65))
        k, T = int(rng.integers(1, min(E, 8) + 1)), int(rng.integers(1, 3000))
        H, I = 32 * int(rng.integers(1, 40)), 32 * int(rng.integers(1, 40))
        bf16 = bool(rng.integers(2))
        p = nbx.backends.Problem(E=E, H=H, I=I, k=k, x_dtype=np.dtype("float32"), w_dtype=np.dtype("float32"),
                                 quant=None, lists=False, layout=nbx.experts.WeightLayout.plain(H=H, I=I),
                                 layout_name="in_out", fusion=None, activation=nbx.activations.as_activation("swiglu"),
                                 bf16_dot=bf16)
        whole = cpu_backend.workspace_bytes(p, T)
        one = cpu_backend.workspace_bytes(p, 1)
        for cap in {int(rng.integers(0, one)), one - 1, (one + whole) // 2}:
            if cap < 0 or cap >= whole:
                continue
            try:
                cpu_backend.plan(p.replace(max_workspace_bytes=cap), T)
                continue  # it fits in bands: no refusal to follow
            except nbx.DeviceOOMError as e:
                msg = str(e)
            refused += 1
            budget = _advice(msg, r"a budget of ([0-9.]+ (?:bytes|kB|MB|GB)) would have taken it whole")
            assert budget >= whole, (case, msg)
            assert cpu_backend.plan(p.replace(max_workspace_bytes=budget), T) == T, (case, msg)
            needed = _advice(msg, r": ([0-9.]+ (?:bytes|kB|MB|GB)) needed")
            assert needed >= whole, (case, msg)
            free = _advice(msg, r"needed, ([0-9.]+ (?:bytes|kB|MB|GB)) free")
            assert free <= cap, (case, msg)
    assert refused > 100  # the cases above do reach refusals


def test_format_bytes_rounds_as_asked():
    f = nbx.memory.format_bytes
    assert (f(192_704), f(192_704, "up"), f(192_704, "down")) == ("192.7 kB", "192.8 kB", "192.7 kB")
    assert (f(192_700, "up"), f(999, "up"), f(999_951, "up")) == ("192.7 kB", "999 bytes", "1000.0 kB")
    assert (f(1_234_567_891, "up"), f(1_234_567_891, "down")) == ("1.24 GB", "1.23 GB")
    with pytest.raises(ValueError, match="round must be 'nearest', 'up' or 'down'; got 'sideways'"):
        f(1, "sideways")
