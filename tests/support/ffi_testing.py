"""The test-only module jax_nbx._ffi_testing, loaded for the tests.

`import jax_nbx` never loads it: it is built only with CMake's NBX_TESTING=ON
(the README's test command, `pip install -e ".[test]" --config-settings=cmake.define.NBX_TESTING=ON`)
and holds what only the tests use (tests/native/): the kernel and planner
testers, the account holds, the CUDA program decoder, the Metal layer's test
bindings with the simulated device and the MSL emulation, and the poisoned
twins of the CPU handlers.  It links the same core library (libnbx_core) as
jax_nbx._ffi, so what it reaches is the product's own state.

`load()` (once per process) imports it -- which registers the simulated Metal
device in the product's Metal runtime under "sim" -- and registers its
poisoned twins with XLA for platform "cpu" (the CPU handlers with one
NaN-filled aliased input per result: the module's target_forward_poisoned and
target_backward_poisoned, names of the test module's own, which
tests/support/handlers.py (`ffi_forward(..., poison=True)` and
`ffi_backward(..., poison=True)`) calls); it returns the module.
tests/conftest.py calls it before collection.
"""
from __future__ import annotations

import contextlib
import importlib
import os

import jax
import pytest

import jax_nbx  # noqa: F401  (the product first: its handlers and environment)
from jax_nbx import _registry

MODULE = "jax_nbx._ffi_testing"
_loaded = None


def load():
    """jax_nbx._ffi_testing with its targets registered and the simulated
    device installed; a pytest usage error when this build lacks it."""
    global _loaded
    if _loaded is not None:
        return _loaded
    try:
        m = importlib.import_module(MODULE)
    except ModuleNotFoundError as e:
        if e.name != MODULE:
            raise
        raise pytest.UsageError(
            f"{MODULE} is missing: jax_nbx was built without NBX_TESTING=ON, and the tests need "
            "its test-only module.  Install it as the README's test command does:\n"
            '  pip install -e ".[test]" --config-settings=cmake.define.NBX_TESTING=ON') from None
    product = _registry.ffi_module()
    if os.path.dirname(os.path.realpath(m.__file__)) != os.path.dirname(os.path.realpath(product.__file__)):
        raise pytest.UsageError(f"{MODULE} ({m.__file__}) is not beside jax_nbx._ffi ({product.__file__}): "
                                "the two modules must come from one build (they share its libnbx_core)")
    for name, capsule in m.handlers().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    _loaded = m
    return m


def metal_sim_unavailable() -> str:
    """Why the simulated Metal device cannot run here ("" when it can)."""
    load()
    return ""


@contextlib.contextmanager
def metal_sim():
    """The simulated Metal device, fresh (default limits), active for the
    block; afterwards nothing live on metal:0, no live wrap, no unreported
    violation, and no device active.  Yields the test module."""
    ffi = load()
    jax_nbx.tables.release_pinned()
    jax_nbx.metal.use("sim")
    try:
        yield ffi
    finally:
        jax_nbx.tables.release_pinned()
        ffi.metal_sim_hold_completions(False)
    s = jax_nbx.memory.stats()["metal:0"]
    assert s["live"] == 0, s
    assert ffi.metal_sim_state()["live_wraps"] == 0
    assert ffi.metal_sim_take_violations() == []
    jax_nbx.tables.set_capacity(256)
    jax_nbx.metal.use("none")
