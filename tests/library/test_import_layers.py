"""The package's modules form a stack without cycles (docs/architecture.md),
and environment variables are read in one place (jax_nbx/_env.py)."""
from __future__ import annotations

import ast
import pathlib

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
