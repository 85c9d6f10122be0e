"""The weight formats by name: each format module registers one `Format`.

Nothing here knows a format: `register` is called by each format's module
(``formats/<name>.py``, imported by ``jax_nbx.formats`` for every name of the
contract's list) and `get` refuses a name it does not hold by name.  A format
outside the contract (`Format.spec`) may be registered and `unregister`-ed.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .spec import Format

_FORMATS: dict[str, Format] = {}


def register(fmt: Format) -> Format:
    """Adds ``fmt`` under its name (once)."""
    if fmt.name in _FORMATS:
        raise ValueError(f"weight format {fmt.name!r} is registered twice")
    _FORMATS[fmt.name] = fmt
    return fmt


def unregister(name: str) -> None:
    """Removes a format outside the contract (one registered with its own
    ``spec``); the contract's formats stay."""
    fmt = _FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"unknown weight format {name!r}; jax_nbx knows {names()}")
    if fmt.spec is None:
        raise ValueError(f"weight format {name!r} is the contract's: it cannot be unregistered")
    del _FORMATS[name]


def next_code() -> int:
    """The code a format outside the contract gets: one past every code taken."""
    return max((f.code for f in _FORMATS.values()), default=-1) + 1


def get(name: str) -> Format:
    """The format named ``name``; ValueError naming it and the known ones."""
    fmt = _FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"unknown weight format {name!r}; jax_nbx knows {names()}")
    return fmt


def names() -> tuple[str, ...]:
    """Every registered format's name, dense first, in code order."""
    return tuple(sorted(_FORMATS, key=lambda n: _FORMATS[n].code))


def quantized_names() -> tuple[str, ...]:
    """The formats `jax_nbx.quantize` makes (every format but dense)."""
    return tuple(n for n in names() if n != "dense")
