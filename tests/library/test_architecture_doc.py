"""docs/architecture.md describes the layout as it is: every product source
(src/jax_nbx, xla_ffi) is named there, and every path it names exists."""
from __future__ import annotations

import pathlib
import re

import pytest

pytestmark = pytest.mark.fast

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
SOURCES = [p for base in (ROOT / "src" / "jax_nbx", ROOT / "xla_ffi") for p in base.rglob("*")
           if p.is_file() and p.suffix in (".py", ".cc", ".h", ".mm", ".metal") and "__pycache__" not in p.parts]


def _named(text: str) -> set[str]:
    """Paths the document names: `a/b.py`-like tokens, with `x.{h,cc}` expanded."""
    out = set()
    for tok in re.findall(r"[\w./{},*-]+\.(?:py|cc|h|mm|metal|\{h,cc\}|\{h,mm\})\b|[\w./-]+\.\{h,cc\}", text):
        m = re.match(r"(.*)\.\{([\w,]+)\}$", tok)
        if m:
            out |= {f"{m.group(1)}.{ext}" for ext in m.group(2).split(",")}
        else:
            out.add(tok)
    return out


def test_every_product_source_is_named():
    named = _named(DOC.read_text())
    names = {n.rsplit("/", 1)[-1] for n in named}
    missing = [str(p.relative_to(ROOT)) for p in SOURCES
               if p.name not in names and str(p.relative_to(ROOT)) not in named and p.name != "__init__.py"]
    assert missing == [], f"docs/architecture.md does not name: {missing}"


def test_every_named_path_exists():
    files = {p.name for p in SOURCES} | {str(p.relative_to(ROOT)) for p in SOURCES}
    gone = [n for n in _named(DOC.read_text()) if "*" not in n and n.rsplit("/", 1)[-1] not in files
            and n not in files and not (ROOT / n).exists()]
    assert gone == [], f"docs/architecture.md names what does not exist: {gone}"
