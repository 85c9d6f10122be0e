"""The package's modules form a stack without cycles (docs/architecture.md),
and environment variables are read in one place (jax_nbx/_env.py)."""
from __future__ import annotations

import ast
import pathlib
import re

import pytest

pytestmark = pytest.mark.fast

PKG = pathlib.Path(__file__).resolve().parents[2] / "jax_nbx"


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: pathlib.Path) -> set[str]:
    """jax_nbx modules a module imports, at top level or inside functions."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):  # imports for type checking only are not run
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = ".".join(base[:len(base) - node.level + 1])
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            if not mod.startswith("jax_nbx"):
                continue
            for alias in node.names:  # `from . import x` names a module when one exists
                cand = f"{mod}.{alias.name}"
                out.add(cand if _exists(cand) else mod)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("jax_nbx")}
    out.discard(name)
    return out


def _exists(mod: str) -> bool:
    p = PKG.parent.joinpath(*mod.split("."))
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def _graph() -> dict[str, set[str]]:
    g = {}
    for path in PKG.rglob("*.py"):
        g[_module_name(path)] = _imports(path)
    # A package's __init__ imports its submodules to re-export them; a
    # submodule importing its package only means the package is loaded.
    for mod, deps in g.items():
        g[mod] = {d for d in deps if not (mod.startswith(d + ".") and _exists(d))}
    g["jax_nbx"] = set()  # the package's re-exports are not a layer
    return g


def test_no_import_cycles():
    g = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(g.get(m, ())):
            if state.get(d) == 1:
                cycle = stack[stack.index(d):] + [d]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)


def test_the_loading_layer_imports_nothing_above_it():
    g = _graph()
    assert g["jax_nbx._registry"] <= {"jax_nbx.contract", "jax_nbx._env", "jax_nbx._ffi"}
    assert g["jax_nbx.contract"] <= {"jax_nbx._ffi"}
    assert g["jax_nbx._env"] == set()
    assert g["jax_nbx._built"] <= {"jax_nbx._ffi"}


def test_environment_read_in_one_place():
    readers = []
    for path in PKG.rglob("*.py"):
        text = path.read_text()
        if path.name != "_env.py" and ("os.environ" in text or "getenv" in text):
            # the interpreter shim may set TRITON_INTERPRET for itself
            lines = [ln for ln in text.splitlines() if "os.environ" in ln or "getenv" in ln]
            if all("TRITON_INTERPRET" in ln for ln in lines):
                continue
            readers.append(str(path.relative_to(PKG.parent)))
    assert readers == [], f"environment read outside jax_nbx/_env.py: {readers}"
    cpp = [p for p in (PKG.parent.parent / "xla_ffi").rglob("*") if p.suffix in (".cc", ".h")
           and "getenv" in p.read_text()]
    assert cpp == [], f"the C++ reads the environment: {cpp}"


# The C++ layers (docs/architecture.md "C++ layers"): each folder of xla_ffi/ and
# the folders whose headers it may include.  The root holds the contract and the
# process-wide pieces (abi.h, dtypes.h, lru.h, the account); formats/ the weight
# formats' specs; common/ what every handler shares; cpu/kernels/ the CPU
# micro-kernels; cpu/, metal/, cuda/ one backend each, none including another's;
# python/ the product module's bindings, which bind them all.
_CPP_LAYERS = {
    "": {""},
    "formats": {"", "formats"},
    "common": {"", "formats", "common"},
    "cpu/kernels": {"", "formats", "common", "cpu/kernels"},
    "cpu": {"", "formats", "common", "cpu/kernels", "cpu"},
    "metal": {"", "formats", "common", "metal", "metal/kernels"},
    "metal/kernels": {"metal/kernels"},
    "cuda": {"", "formats", "common", "cuda"},
    "python": {"", "formats", "common", "cpu/kernels", "cpu", "metal", "cuda", "python"},
}


def _cpp_includes(path: pathlib.Path) -> list[str]:
    return re.findall(r'^\s*#\s*include\s+"([^"]+)"', path.read_text(), re.M)


def test_cpp_layers_include_only_what_is_below_them():
    src = PKG.parent / "xla_ffi"
    bad, seen = [], set()
    for p in sorted(src.rglob("*")):
        if p.suffix not in (".h", ".cc", ".mm", ".metal"):
            continue
        layer = str(p.parent.relative_to(src)).replace(".", "")
        assert layer in _CPP_LAYERS, f"{p.relative_to(src)}: a folder the layer rule does not know"
        seen.add(layer)
        for inc in _cpp_includes(p):
            if inc.startswith("xla/") or inc.endswith(".inc"):
                continue  # jaxlib's headers; the build's generated Metal library source
            folder = inc.rsplit("/", 1)[0] if "/" in inc else ""
            if folder not in _CPP_LAYERS[layer]:
                bad.append(f"{p.relative_to(src)} includes {inc}")
    assert seen == set(_CPP_LAYERS), f"layers with no file: {set(_CPP_LAYERS) - seen}"
    assert bad == [], "includes against the layer rule:\n" + "\n".join(bad)


def test_nothing_under_xla_ffi_is_test_only():
    """Test-only C++ lives under tests/native/; no product source names it."""
    src = PKG.parent / "xla_ffi"
    named = [f"{p.relative_to(src)}: {inc}" for p in src.rglob("*") if p.suffix in (".h", ".cc", ".mm")
             for inc in _cpp_includes(p) if inc.startswith(("native/", "testing/"))]
    assert named == []
    cmake = (PKG.parent / "CMakeLists.txt").read_text()
    core = cmake[cmake.index("add_library(nbx_core"):cmake.index(")", cmake.index("add_library(nbx_core"))]
    assert "tests/" not in core, "the core library compiles a test source"


def test_no_backend_imports_another():
    g = _graph()
    backends = {"jax_nbx.backends.cpu", "jax_nbx.backends.metal", "jax_nbx.backends.xla", "jax_nbx.backends.cuda"}
    for mod, deps in g.items():
        mine = next((b for b in backends if mod == b or mod.startswith(b + ".")), None)
        if mine is None:
            continue
        others = {d for d in deps for b in backends - {mine} if d == b or d.startswith(b + ".")}
        assert others == set(), f"{mod} imports another backend: {sorted(others)}"
    assert not any(d.startswith("jax_nbx.experts") for m, ds in g.items() if m.startswith("jax_nbx.formats")
                   for d in ds), "jax_nbx.formats imports Experts"


def test_moved_names_still_import_with_a_deprecation_warning():
    import jax_nbx as nbx
    from jax_nbx.backends import cpu as cpu_backend
    from jax_nbx.backends import handler_calls

    for module, name, new in [(nbx.formats, "quantize", nbx.quantization.quantize),
                              (nbx.formats, "is_quantized", nbx.quantization.is_quantized),
                              (nbx.formats, "weight_groups", handler_calls.weight_groups),
                              (cpu_backend, "split_arrays", handler_calls.split_arrays),
                              (cpu_backend, "prepack_call", handler_calls.prepack_call)]:
        with pytest.warns(DeprecationWarning, match=f"{name} moved to"):
            assert getattr(module, name) is new
    with pytest.raises(AttributeError):
        nbx.formats.no_such_name  # noqa: B018


def test_moved_modules_import_from_their_old_names_with_a_warning():
    import subprocess
    import sys

    from jax_nbx import _moved

    code = """
import warnings
import jax_nbx
for old, new in jax_nbx._moved.MOVED.items():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        mod = __import__(old, fromlist=["_"])
    assert mod is __import__(new, fromlist=["_"]), old
    assert [(x.category, x.filename) for x in w] == [(DeprecationWarning, "<string>")], (old, w)
    assert f"{old} moved to {new}" in str(w[0].message)
from jax_nbx.checkpoint import CheckpointError, load_moe
assert load_moe is jax_nbx.load_moe
print("ok")
"""
    assert set(_moved.MOVED) >= {"jax_nbx.checkpoint", "jax_nbx.quant_import"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split() == ["ok"], out.stdout + out.stderr[-3000:]
