"""The Metal layer (issue #15) against the simulated device, on Linux: the
metal:0 account, pinned scopes (one wrap per host allocation, views past
maxBufferLength, the wrap bound, staging), GPU addresses read by command
buffers, deferred release, and the pointer-table LRU whose entries hold the
pins.  Nothing here runs Metal itself (xla_ffi/metal/apple_device.mm is
compiled only on Apple)."""
from __future__ import annotations

import sys

import numpy as np
import pytest

import jax_nbx as nbx
from jax_nbx import memory

from support import ffi_testing

F = ffi_testing.load()  # jax_nbx._ffi_testing: the simulated device's controls, pins, buffers, tables
PAGE = 16384
KiB = 1024


pytestmark = [pytest.mark.usefixtures("metal_sim"), pytest.mark.sanitize]  # conftest.py: the simulated device


def ptr(a: np.ndarray) -> int:
    return int(a.ctypes.data)


def arena(n_bytes: int, track: bool = True, wrappable: bool = True) -> np.ndarray:
    """A host allocation with a byte pattern (i % 251), known to the device."""
    a = (np.arange(n_bytes) % 251).astype(np.uint8)
    if track:
        F.metal_sim_track_host(ptr(a), a.nbytes, wrappable)
    return a


def forget(*arrays):
    for a in arrays:
        F.metal_sim_forget_host(ptr(a))


# --- the device and the account -----------------------------------------------------------------

def test_device_view_and_budget_is_the_working_set():
    d = nbx.metal.info()
    assert d["implementation"] == "sim" and nbx.metal.implementation() == "sim"
    assert nbx.metal.available() and nbx.metal.unavailable_reason() == ""
    assert memory.budget("metal") == d["working_set"] == nbx.metal.working_set_size()
    assert nbx.metal.max_buffer_length() == d["max_buffer_length"] and d["device_count"] == 1
    F.metal_sim_configure(3 * 2**20, 2**20, 64)
    assert memory.budget("metal") == 3 * 2**20
    assert "metal:0" in memory.report()


def test_unknown_device_and_switching_while_bytes_are_held_are_refused():
    with pytest.raises(ValueError, match="unknown Metal device 'cuda'"):
        nbx.metal.use("cuda")
    with pytest.raises(ValueError, match="has no Metal implementation"):
        nbx.metal.use("apple")  # this build (Linux) has no Metal
    # why not: the build's words (cmake/optional_backend.cmake), "" where it has Metal
    P = nbx._registry.ffi_module()
    assert (P.metal_not_built == "") == P.has_metal_apple
    if sys.platform != "darwin":
        assert P.metal_not_built == "this build of jax_nbx has no Metal implementation: it is compiled only on Apple"
    b = F.metal_buffer(1000)
    with pytest.raises(ValueError, match=r"cannot switch the Metal device while the account holds 1.0 kB on metal:0"):
        nbx.metal.use("sim")
    b.release()


def test_refusal_past_the_working_set_says_what_would_have_fit():
    F.metal_sim_configure(2 * 2**20, 2**20, 64)
    held = F.metal_buffer(2**20)
    with pytest.raises(ValueError, match=r"jax_nbx account \(metal:0\) refused 1.5 MB of test buffer: "
                                         r"1.0 MB free of a 2.1 MB budget; short by"):
        F.metal_buffer(1_500_000)
    r = memory.last_refusal()
    assert r["device"] == "metal:0" and r["requested"] == 1_500_000 and r["total"] == 2 * 2**20
    held.release()
    assert memory.stats()["metal:0"]["live"] == 0


def test_bands_are_planned_against_the_working_set():
    F.metal_sim_configure(10_000_000, 2**20, 64)
    need = lambda t: 1_000_000 + 50_000 * t  # noqa: E731 - a workspace formula
    assert nbx.planning.plan_bands(need, 100, 64, "metal") == 100
    F.metal_sim_configure(3_000_000, 2**20, 64)
    band = nbx.planning.plan_bands(need, 100, 64, "metal")
    assert band < 100 and need(band) <= 3_000_000
    F.metal_sim_configure(1_020_000, 2**20, 64)
    with pytest.raises(nbx.DeviceOOMError, match=r"6.0 MB needed, 1.0 MB free of a 1.0 MB budget "
                                                 r"on metal:0; short by .* no band split alone") as e:
        nbx.planning.plan_bands(need, 100, 64, "metal")
    assert e.value.device == "metal:0"


def test_new_buffers_are_not_zeroed_and_memset_writes_what_kernels_read():
    b = F.metal_buffer(3 * PAGE + 5)
    assert b.read([(b.gpu, 1)]) == [0xCD]                  # the simulation never hands out zeros
    b.fill(PAGE, 7, 10)
    assert b.read([(b.gpu + PAGE, 1), (b.gpu + PAGE + 9, 1), (b.gpu + PAGE + 10, 1)]) == [7, 7, 0xCD]
    assert b.read([(b.gpu + 3 * PAGE + 5 + PAGE, 1)]) == [-1]  # past the buffer: the gap
    assert "no buffer or wrap" in F.metal_sim_take_violations()[0]
    b.release()


def test_a_free_is_counted_at_once_and_the_buffer_goes_after_completion():
    b = F.metal_buffer(100_000)
    gpu = b.gpu
    F.metal_sim_hold_completions(True)
    F.metal_submit_using(b)  # a command buffer in flight uses it
    before = F.metal_sim_state()["live_buffers"]
    b.release()
    assert memory.stats()["metal:0"]["live"] == 0          # the account: free now
    st = F.metal_sim_state()
    assert st["pending_releases"] == 1 and st["live_buffers"] == before  # the device: not yet
    F.metal_sim_hold_completions(False)                     # the command buffer completes
    st = F.metal_sim_state()
    assert st["pending_releases"] == 0 and st["live_buffers"] == before - 1
    assert F.metal_sim_resolve(gpu, 1) == 0                 # gone: a read through it is refused
    assert "no buffer or wrap" in F.metal_sim_take_violations()[0]


# --- pinned scopes ------------------------------------------------------------------------------

def test_one_wrap_per_allocation_however_many_experts():
    E, per = 64, 3000                     # 64 experts at odd offsets inside one allocation
    a = arena(E * per + 123)
    ranges = [(ptr(a) + 17 + e * per, per - 40) for e in range(E)]
    pins = F.metal_pin(ranges)
    assert pins.wraps == 1 and pins.staged == 0
    assert F.metal_sim_state()["live_wraps"] == 1
    base = pins.gpu_address(ranges[0][0], 1)
    for p, n in ranges:
        g = pins.gpu_address(p, n)
        assert g == base + (p - ranges[0][0])           # the wrap's address + the offset
        assert g != p                                    # a GPU address, never the host's
    reads = [(pins.gpu_address(p + 5, 1), 1) for p, _ in ranges]
    assert pins.read(reads) == [int(a[p + 5 - ptr(a)]) for p, _ in ranges]
    pins.release()
    assert F.metal_sim_state()["live_wraps"] == 0
    forget(a)


def test_untracked_arrays_with_touching_pages_share_a_wrap():
    """Ranges share a wrap when their 16 KiB pages touch, and not across an
    untouched page.  The ranges are placed against a page boundary found in
    the array, not at numpy's address: 1000 bytes past it, range 2 ends in
    the page before range 3's (one wrap); on it, page 2 lies between them
    (two).  (Placed at ptr(a), this test failed whenever numpy's allocation
    happened to start on a 16 KiB boundary.)"""
    a = arena(6 * PAGE, track=False)
    boundary = ptr(a) + (-ptr(a)) % PAGE
    for offset, wraps in ((1000, 1), (0, 2)):
        p = boundary + offset
        pins = F.metal_pin([(p, PAGE), (p + PAGE, PAGE), (p + 3 * PAGE, 100)])
        assert pins.wraps == wraps, offset
        pins.release()


def test_unaligned_memory_is_wrapped_by_rounding_to_16k_pages():
    a = arena(1000)                        # numpy's alignment (64 bytes), not 16 KiB
    pins = F.metal_pin([(ptr(a) + 10, 900)])
    g = pins.gpu_address(ptr(a) + 10, 900)
    assert pins.wraps == 1 and g % PAGE == (ptr(a) + 10) % PAGE
    assert pins.read([(g, 1), (g + 899, 1)]) == [int(a[10]), int(a[909])]
    pins.release()
    forget(a)


def test_views_overlap_past_max_buffer_length_and_hold_every_array():
    F.metal_sim_configure(2**30, 4 * PAGE, 64)        # maxBufferLength 64 KiB
    per = PAGE + 1000
    a = arena(12 * per)                                # one allocation of ~200 KiB
    ranges = [(ptr(a) + i * per, per) for i in range(12)]
    pins = F.metal_pin(ranges)
    assert pins.wraps > 3                              # several views of one allocation
    reads = [(pins.gpu_address(p, n), n) for p, n in ranges]
    assert all(g for g, _ in reads)
    assert pins.read(reads) == [int(a[i * per]) for i in range(12)]   # whole arrays inside a view
    assert pins.read([(g + n - 1, 1) for g, n in reads]) == [int(a[i * per + per - 1]) for i in range(12)]
    pins.release()
    forget(a)


def test_an_array_longer_than_max_buffer_length_is_refused_by_name():
    F.metal_sim_configure(2**30, 4 * PAGE, 64)
    a = arena(5 * PAGE)
    with pytest.raises(ValueError, match="exceeds the Metal device's maxBufferLength of 65.5 kB"):
        F.metal_pin([(ptr(a), a.nbytes)])
    assert F.metal_sim_state()["live_wraps"] == 0
    forget(a)


def test_the_wrap_bound_is_refused_by_name_and_nothing_stays_pinned():
    F.metal_sim_configure(2**30, 2**30, 3)
    arrays = [arena(4 * PAGE) for _ in range(5)]      # five separate allocations
    with pytest.raises(ValueError, match=r"more no-copy wraps than the Metal device allows "
                                         r"\(live no-copy wraps at the bound of 3"):
        F.metal_pin([(ptr(a), a.nbytes) for a in arrays])
    assert F.metal_sim_state()["live_wraps"] == 0
    ok = F.metal_pin([(ptr(a), a.nbytes) for a in arrays[:3]])
    assert ok.wraps == 3
    ok.release()
    forget(*arrays)


def test_memory_the_device_will_not_wrap_is_staged_and_counted():
    a = arena(3000, wrappable=False)                  # Metal's newBufferWithBytesNoCopy -> nil
    pins = F.metal_pin([(ptr(a), 1000), (ptr(a) + 1000, 2000)])
    assert pins.wraps == 0 and pins.staged == 2
    # one staging buffer for the scope (one request to the account), each copy 64-byte aligned
    assert memory.stats()["metal:0"]["live_by_tag"]["staging"] == 1024 + 2000
    g0, g1 = pins.gpu_address(ptr(a), 1000), pins.gpu_address(ptr(a) + 1000, 2000)
    assert pins.read([(g0 + 7, 1), (g1 + 1999, 1)]) == [int(a[7]), int(a[2999])]
    pins.release()
    assert memory.stats()["metal:0"]["live_by_tag"]["staging"] == 0
    forget(a)


def test_reads_through_uncovered_or_unresident_addresses_fail_loudly():
    a = arena(4 * PAGE)
    pins = F.metal_pin([(ptr(a), 100)])
    g = pins.gpu_address(ptr(a), 100)
    assert pins.read([(g + 4 * PAGE + PAGE, 1)]) == [-1]           # past the wrap: the gap
    assert "no buffer or wrap" in F.metal_sim_take_violations()[0]
    assert pins.read([(ptr(a), 1)]) == [-1]                          # a host address is not a GPU one
    assert F.metal_sim_take_violations()
    assert pins.read([(g, 1)], resident=False) == [-1]               # not made resident
    assert "not made resident" in F.metal_sim_take_violations()[0]
    pins.release()
    forget(a)


# --- pointer tables -----------------------------------------------------------------------------

def _expert_ranges(a: np.ndarray, E: int, per: int):
    return [(ptr(a) + e * per, per) for e in range(E)]


def test_tables_hold_gpu_addresses_and_hit_the_cache():
    a = arena(3 * 8 * 4000)
    ranges = _expert_ranges(a, 24, 4000)
    t = F.metal_table(ranges)
    assert t.cached and t.wraps == 1
    addrs = t.addresses()
    assert len(addrs) == 24 and all(g != p for g, (p, _) in zip(addrs, ranges))
    assert t.read([(g + 3, 1) for g in addrs]) == [int(a[e * 4000 + 3]) for e in range(24)]
    s = nbx.tables.stats("metal")
    assert s["entries"] == 1 and s["wraps"] == 1 and s["bytes"] == 24 * 8
    assert memory.stats()["metal:0"]["live_by_tag"]["tables"] == 24 * 8
    t2 = F.metal_table(ranges)
    assert t2.addresses() == addrs and nbx.tables.stats("metal")["hits"] == s["hits"] + 1
    assert F.metal_sim_state()["wraps_made"] == 1          # the hit made no new wrap
    del t, t2
    forget(a)


def test_eviction_releases_the_pins_of_the_table():
    nbx.tables.set_capacity(2)
    arrays = [arena(2 * PAGE) for _ in range(3)]
    for a in arrays:
        F.metal_table([(ptr(a), a.nbytes)])
    s = nbx.tables.stats("metal")
    assert s["entries"] == 2 and s["evictions"] >= 1 and s["capacity"] == 2
    assert F.metal_sim_state()["live_wraps"] == 2           # the evicted table's wrap is gone
    assert nbx.tables.release_pinned() == 2
    assert F.metal_sim_state()["live_wraps"] == 0
    assert memory.stats()["metal:0"]["live_by_tag"]["tables"] == 0
    forget(*arrays)


def test_a_table_in_use_outlives_its_eviction():
    a = arena(PAGE)
    t = F.metal_table([(ptr(a), 100)])
    assert nbx.tables.release_pinned() == 1
    assert t.read([(t.addresses()[0], 1)]) == [int(a[0])]   # still pinned: the call holds it
    assert F.metal_sim_state()["live_wraps"] == 1
    del t
    assert F.metal_sim_state()["live_wraps"] == 0
    forget(a)


def test_a_table_for_one_call_never_enters_the_cache():
    a = arena(PAGE)
    before = nbx.tables.stats("metal")
    t = F.metal_table([(ptr(a), 100)], cache=False)
    assert not t.cached and nbx.tables.stats("metal")["entries"] == before["entries"]
    assert F.metal_sim_state()["live_wraps"] == 1
    del t
    assert F.metal_sim_state()["live_wraps"] == 0
    forget(a)


def test_staged_tables_are_snapshots_and_never_cached():
    a = arena(PAGE, wrappable=False)
    t = F.metal_table([(ptr(a), 100)])
    assert t.staged == 1 and not t.cached
    del t
    forget(a)


def test_a_stale_table_after_free_and_reallocate_is_never_used():
    a = arena(2 * PAGE)
    ranges = [(ptr(a), 1000)]
    t = F.metal_table(ranges)
    old = t.addresses()[0]
    del t
    # the allocation is freed and a new one lands at the same address (same fingerprint)
    forget(a)
    F.metal_sim_track_host(ptr(a), a.nbytes, True)
    stale_before = nbx.tables.stats("metal")["stale"]
    t = F.metal_table(ranges)
    assert nbx.tables.stats("metal")["stale"] == stale_before + 1
    assert t.addresses()[0] != old                          # rebuilt on a fresh wrap
    assert t.read([(t.addresses()[0], 1)]) == [int(a[0])]
    assert F.metal_sim_resolve(old, 1) == 0                 # the old wrap was released with its entry
    F.metal_sim_take_violations()
    del t
    forget(a)


def test_the_environment_chooses_the_simulated_device_and_its_budget():
    import os
    import subprocess
    import sys
    code = ("import jax_nbx as nbx; from jax_nbx import memory as m; "
            "print(nbx.metal.implementation(), m.budget('metal'))")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NBX_METAL", "JAX_NBX_BUDGET")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**env, "JAX_NBX_METAL": "sim", "JAX_NBX_BUDGET": "3GiB"}).stdout.split()
    assert out == ["sim", str(3 * 2**30)]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=env).stdout.split()
    assert out == ["None", str(2**63 - 1)]  # Linux without JAX_NBX_METAL: no Metal device
    bad = subprocess.run([sys.executable, "-c", "import jax_nbx"], capture_output=True, text=True,
                         env={**env, "JAX_NBX_METAL": "apple"})
    assert bad.returncode != 0 and "JAX_NBX_METAL=apple: this build of jax_nbx has no Metal" in bad.stderr
