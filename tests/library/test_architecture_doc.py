"""docs/architecture.md describes the layout as it is: every product source
(jax_nbx, xla_ffi) is named there, and every path it names exists."""
from __future__ import annotations

import pathlib
import re

import pytest

pytestmark = pytest.mark.fast

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
SOURCES = [p for base in (ROOT / "jax_nbx", ROOT / "xla_ffi") for p in base.rglob("*")
           if p.is_file() and p.suffix in (".py", ".cc", ".h", ".mm", ".metal") and "__pycache__" not in p.parts]


def _expand(token: str) -> list[str]:
    """`cpu/kernels_{a,b}.cc` -> cpu/kernels_a.cc, cpu/kernels_b.cc (one brace group)."""
    m = re.match(r"(.*)\{([\w,]+)\}(.*)$", token)
    return [f"{m.group(1)}{alt}{m.group(3)}" for alt in m.group(2).split(",")] if m else [token]


def _named(text: str) -> set[str]:
    """Paths the document names: `a/b.py`-like tokens, braces expanded (module
    names such as ``nbx.metal`` are not paths)."""
    out = set()
    for tok in re.findall(r"[\w./{},-]+\.(?:py|cc|h|mm|metal)\b|[\w./{},-]+\.\{[\w,]+\}", text):
        if tok.startswith(("nbx.", "jax_nbx.")):
            continue
        for t in _expand(tok):
            out |= set(_expand(t))
    return out


def test_every_product_source_is_named():
    named = _named(DOC.read_text())
    names = {n.rsplit("/", 1)[-1] for n in named}
    missing = [str(p.relative_to(ROOT)) for p in SOURCES
               if p.name not in names and str(p.relative_to(ROOT)) not in named and p.name != "__init__.py"]
    assert missing == [], f"docs/architecture.md does not name: {missing}"


def test_every_named_path_exists():
    files = {p.name for p in SOURCES} | {str(p.relative_to(ROOT)) for p in SOURCES}
    bases = (ROOT, ROOT / "tests", ROOT / "jax_nbx", ROOT / "xla_ffi")
    gone = [n for n in _named(DOC.read_text()) if "*" not in n and n.rsplit("/", 1)[-1] not in files
            and n not in files and not any((b / n).exists() for b in bases)]
    assert gone == [], f"docs/architecture.md names what does not exist: {gone}"
