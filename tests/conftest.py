"""What every test shares: the test-only module loaded, the oracles
(tests/support/problems.py), the shared suite's backends (`backend`, one
runner each, tests/support/runners.py; ``--backends`` restricts them), the
instruction sets (`isa`), the simulated Metal device (`metal_sim`), and the
check that no test leaves bytes live in the account.

Tiers are markers (declared in pyproject.toml, applied in the test files):
``fast``, ``sanitize`` (what .ci/sanitize runs under ASan + UBSan, with
``--backends cpu``, less the cases marked ``asan_skip``) and ``arm64`` (what .ci/arm64 runs under
qemu-aarch64, with ``--backends cpu``)."""
from __future__ import annotations

import os
import platform

# The tests' programs are tiny: XLA's compile time dominates, so its own code is
# compiled at its lowest optimization level here (measured: about a third less
# time; our handlers are prebuilt C++ and unaffected).  A given
# --xla_backend_optimization_level in XLA_FLAGS is kept.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402
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


def pytest_collection_modifyitems(config, items):
    """The suite's ``sweep`` parametrizations (more dtypes, shapes and
    options of a behaviour that every backend also runs in its core cases)
    run on the backends whose runner sweeps (the CPU handler); the slow ones
    (the emulated Metal device, the Triton interpreter, the XLA reference's
    compilations) run the core cases."""
    keep, drop = [], []
    for item in items:
        runner = item.callspec.params.get("backend") if hasattr(item, "callspec") else None
        if runner is not None and not runner.sweeps and item.get_closest_marker("sweep"):
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


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


jax.config.update("jax_numpy_rank_promotion", "raise")
