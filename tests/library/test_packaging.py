"""The product apart from its tests: `import jax_nbx` loads the product's module
jax_nbx._ffi and never the test-only jax_nbx._ffi_testing (NBX_TESTING=ON
builds), whose bindings the product's module does not have; both link one
core library, so what the test module reaches is the product's own state.
And an optional backend that fails to compile never breaks the build."""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

import jax_nbx as nbx
from jax_nbx import _registry

from support import ffi_testing

pytestmark = pytest.mark.fast

_ENV = {k: v for k, v in os.environ.items() if k not in ("JAX_NBX_METAL",)}


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_ENV,
                          timeout=300)


def test_import_and_a_call_never_load_the_test_module():
    code = """
import sys
import jax.numpy as jnp
import numpy as np
import jax_nbx as nbx

rng = np.random.default_rng(0)
x = jnp.asarray(rng.standard_normal((3, 8)), jnp.float32)
ex = nbx.Experts(*(jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((4, 8, 5), (4, 8, 5), (4, 5, 8))))
w, ids = nbx.route(jnp.asarray(rng.standard_normal((3, 4)), jnp.float32), 2)
y = nbx.fused_moe(x, w, ids, ex)
assert y.shape == (3, 8) and bool(jnp.all(jnp.isfinite(y)))
assert "jax_nbx._ffi_testing" not in sys.modules, "import jax_nbx loaded the test module"
names = dir(nbx._registry.ffi_module())
test_only = [n for n in names if n in ("testing_handlers", "handlers", "run_kernel_tests", "kernel_names",
                                       "plan_slots", "hold_workspace", "decode_program",
                                       "metal_library_source", "metal_order_slots", "metal_pin",
                                       "metal_buffer", "metal_table", "metal_commit")
             or n.startswith(("metal_sim", "metal_run", "run_", "dot_kernel"))]
assert test_only == [], test_only
print("ok")
"""
    out = _run(code)
    assert out.returncode == 0 and out.stdout.split() == ["ok"], out.stdout + out.stderr[-3000:]


def test_the_product_module_has_none_of_the_test_modules_bindings():
    product, testing = _registry.ffi_module(), ffi_testing.load()
    shared = {n for n in dir(product) if not n.startswith("__")} & set(dir(testing))
    assert shared == set(), f"bound in both modules: {sorted(shared)}"


def test_the_simulated_device_without_the_test_module_is_refused_by_name():
    # the test module made unimportable: what a build without NBX_TESTING=ON says
    code = """
import sys

class _Hide:
    def find_spec(self, name, path=None, target=None):
        if name == "jax_nbx._ffi_testing":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, _Hide())
import jax_nbx as nbx
try:
    nbx.metal.use("sim")
except ValueError as e:
    print(e)
"""
    out = _run(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "the simulated Metal device is test-only: it lives in jax_nbx._ffi_testing" in out.stdout
    assert "NBX_TESTING=ON" in out.stdout
    bad = subprocess.run([sys.executable, "-c", code.split("import jax_nbx as nbx")[0] + "import jax_nbx"],
                         capture_output=True, text=True, env={**_ENV, "JAX_NBX_METAL": "sim"}, timeout=300)
    assert bad.returncode != 0 and "JAX_NBX_METAL=sim: the simulated Metal device is test-only" in bad.stderr


def test_both_modules_reach_one_account_and_one_metal_runtime():
    testing = ffi_testing.load()
    before = nbx.memory.stats()["cpu:0"]["live"]
    hold = testing.hold_workspace("cpu", 0, 1 << 20)  # through the test module's binding
    try:
        assert nbx.memory.stats()["cpu:0"]["live"] == before + (1 << 20)  # seen by the product's
    finally:
        hold.release()
    nbx.tables.release_pinned()
    nbx.metal.use("sim")  # the product's runtime activates the device the test module registered
    try:
        assert nbx.metal.implementation() == "sim"
        testing.metal_sim_configure(3 * 2**20, 2**20, 64)  # the test module's view of the active device
        assert nbx.memory.budget("metal") == 3 * 2**20
    finally:
        nbx.metal.use("none")


def test_a_source_tree_without_its_module_says_what_to_do(tmp_path):
    """jax_nbx/ sits at the repository's top level: python started there
    imports the source tree, which has no compiled module unless installed
    in place.  As numpy and jax do, the import then fails saying what to do
    (here a source tree is made in tmp_path and the editable install's finder
    taken off, as where the package is installed elsewhere)."""
    import shutil

    root = pathlib.Path(nbx.__file__).resolve().parents[1]
    shutil.copytree(root / "jax_nbx", tmp_path / "jax_nbx",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copy(root / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "xla_ffi").mkdir()
    code = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "ScikitBuild" not in type(f).__name__]
try:
    import jax_nbx
except ImportError as e:
    print(e)
else:
    print("imported", jax_nbx.__file__)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_ENV, cwd=tmp_path,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"jax_nbx was imported from its source tree ({tmp_path / 'jax_nbx'})" in out.stdout, out.stdout
    assert "pip install -e ." in out.stdout and "python -P" in out.stdout


def test_an_optional_backend_that_fails_to_compile_is_left_out_saying_why(tmp_path):
    """NBX_BREAK_OPTIONAL=cuda (cmake/optional_backend.cmake's test switch)
    breaks the CUDA handler's sources.  With NBX_CUDA=AUTO the configure goes
    on without the handler, warning with the compiler's first error, and writes
    the reason the module reports at run time (generated/optional_backends.h:
    `jax_nbx._ffi.cuda_not_built`); with NBX_CUDA=ON it stops there.  Configure
    only: .ci/sanitize builds such a module and runs the tests on it."""
    cmake, ninja = shutil.which("cmake"), shutil.which("ninja")
    if cmake is None or shutil.which("nvcc") is None:
        pytest.skip("needs cmake and nvcc (without nvcc, AUTO leaves the CUDA handler out before compiling it)")
    root = pathlib.Path(__file__).resolve().parents[2]
    args = [cmake, "-S", str(root), "-B", str(tmp_path), f"-DPython_EXECUTABLE={sys.executable}",
            "-DNBX_BREAK_OPTIONAL=cuda", *(["-G", "Ninja"] if ninja else [])]
    auto = subprocess.run([*args, "-DNBX_CUDA=AUTO"], capture_output=True, text=True, timeout=600)
    said = " ".join(auto.stderr.split())
    assert auto.returncode == 0, auto.stdout[-3000:] + auto.stderr[-3000:]
    assert "jax_nbx: building without the CUDA handler (NBX_CUDA=AUTO): the CUDA handler failed to compile" in said
    assert re.search(r"break_optional\.h:\d+:\d+: error: #error \"NBX_BREAK_OPTIONAL", said), said
    header = (tmp_path / "generated" / "optional_backends.h").read_text()
    assert "NBX_WITH_CUDA" not in header
    assert re.search(r'#define NBX_CUDA_NOT_BUILT "the CUDA handler failed to compile when jax_nbx was built: '
                     r'cmake/break_optional\.h:\d+:\d+: error: #error \\"NBX_BREAK_OPTIONAL: .*\\"; the '
                     r"build's CMake output has the first errors, and NBX_CUDA=ON makes the failure fatal",
                     header), header
    on = subprocess.run([*args, "-DNBX_CUDA=ON"], capture_output=True, text=True, timeout=600)
    said = " ".join(on.stderr.split())
    assert on.returncode != 0 and "NBX_CUDA=ON: the CUDA handler failed to compile" in said, said[-3000:]
    assert re.search(r"break_optional\.h:\d+:\d+: error: #error", said)
