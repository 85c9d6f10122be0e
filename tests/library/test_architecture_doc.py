"""docs/architecture.md describes the layout as it is: every product source
(jax_nbx, xla_ffi) is named there, and every path it names exists; and every
path any document names (docs/*.md, README.md) exists."""
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


# ---- every path any document names exists (docs/*.md and README.md)

DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
# Where a path may be relative to: the repository's root, tests/, the package, the C++, benchmarks/
# (docs/benchmarks.md names its scripts as `cpu.py`); a document's own folder is tried too (links).
DOC_BASES = (ROOT, ROOT / "tests", ROOT / "jax_nbx", ROOT / "xla_ffi", ROOT / "benchmarks")
# The folders of the repository a bare name (no folder) is looked for in.
TREES = ("jax_nbx", "xla_ffi", "tests", "benchmarks", "docs", "notebooks", "cmake", ".ci")
# Paths in other projects, written from the project's name (`peft/utils/...`, or its source tree's
# `src/transformers/...`): not ours.
OTHER_PROJECTS = tuple(f"{src}{p}/" for p in ("transformers", "peft", "mlx", "mlx_lm", "triton", "xla", "jaxlib",
                                              "keras_hub")
                       for src in ("", "src/"))
# Build outputs: they exist only in a build tree.
GENERATED = ("build/", "generated/")

_EXT = r"(?:py|cc|h|mm|metal|md|toml|json|cmake|sh|txt|ipynb|yml|yaml|cfg|safetensors|csv|cu)"
_TOP = r"(?:\.ci|tests|jax_nbx|xla_ffi|benchmarks|docs|cmake|notebooks|src)"
_C = r"[\w./{},-]"  # the characters of a path (braces: `a/{b,c}.h`)
_PATH = re.compile(
    r"(?<![\w./{},<>*~$-])(?:"
    + _C + r"*\." + _EXT + r"(?![\w/{}*<>-]|\.\w)"          # a file: `x/y.py`, `kernels_{a,b}.cc`
    + r"|" + _C + r"*\.\{[\w,]+\}(?![\w/{}*<>-]|\.\w)"       # a file group: `account.{h,cc}`
    + r"|[\w.{},-]" + _C + r"*/(?=[\s`'\",;:)\]|]|\.(?:\s|$)|$)"  # a folder: `tests/cpu/`
    + r"|" + _TOP + r"/" + _C + r"*[\w}](?=[\s`'\",;:)\]|]|\.(?:\s|$)|$)"  # from a top folder: `.ci/run`
    + r")")


def _doc_paths(text: str) -> set[str]:
    """The paths a document names, braces expanded.  Left out: URLs, globs (`*`),
    placeholders (`<name>`, `...`), module names (`nbx.metal`), extensions alone
    (`.py`), absolute and home paths."""
    text = re.sub(r"\S*://\S*", " ", text)
    out = set()
    for m in _PATH.finditer(text):
        tok = m.group(0)
        if "..." in tok or tok.startswith("/") or text[m.end():m.end() + 1] in ("*", "<"):
            continue
        if "/" not in tok and ("." in tok.rsplit(".", 1)[0] or tok.startswith((".", "nbx.", "jax_nbx."))):
            continue  # `.py` (a kind of file), `nbx.metal` (a module)
        for t in _expand(tok):
            out |= set(_expand(t))
    return out


def _names_in_trees() -> set[str]:
    names = {p.name for p in ROOT.iterdir()}
    for top in TREES:
        for p in (ROOT / top).rglob("*"):
            if "__pycache__" not in p.parts:
                names.add(p.name)
    return names


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_document_names_exists(doc):
    """A path with a folder exists relative to the root, tests/, jax_nbx/, xla_ffi/,
    benchmarks/ or the document's folder; a bare name (`abi.h`, `configs/`) is a
    file or folder of that name somewhere in the repository."""
    names = _names_in_trees()
    gone = []
    for n in sorted(_doc_paths(doc.read_text())):
        if n.startswith(OTHER_PROJECTS + GENERATED):
            continue
        if "/" not in n.rstrip("/"):
            ok = n.rstrip("/") in names or (doc.parent / n).exists()
        else:
            ok = any((b / n).exists() for b in (*DOC_BASES, doc.parent))
        if not ok:
            gone.append(n)
    assert gone == [], f"{doc.relative_to(ROOT)} names what does not exist: {gone}"
