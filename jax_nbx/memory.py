"""The account's Python view: budgets, statistics, refusals and their advice.

Every byte a jax_nbx handler allocates is counted per device (``"cpu:0"``,
later ``"cuda:N"``) against a budget.  A request past the budget is refused;
the refusal says what would have fit (`what_would_have_fit`).  `fused_moe`
plans its bands from the same numbers so that each fits before it runs.

Default CPU budget: half of the memory available to the process when the
package loads (the cgroup limit or MemAvailable, whichever is smaller;
applied by `jax_nbx._registry`); ``JAX_NBX_BUDGET`` (e.g. ``"2GiB"``) or
`set_budget` override it.
"""
from __future__ import annotations

from . import _registry, cpu
from ._env import available_memory, parse_bytes

__all__ = ["DeviceOOMError", "fused_moe_workspace_bytes", "fused_moe_backward_workspace_bytes",
           "set_budget", "set_wait", "budget", "headroom", "stats", "report",
           "reset_peak", "release_cached", "last_refusal", "what_would_have_fit", "parse_bytes",
           "format_bytes", "available_memory"]

_ffi = _registry.ffi_module


def format_bytes(n: float, round: str = "nearest") -> str:
    """Decimal units, as in refusal messages: ``'300.0 MB'``; ``round``: to
    the printed digits "nearest", "up" (an amount that must be enough) or
    "down" (an amount that is at most what there is)."""
    return _ffi().format_bytes(float(n), round)


def set_budget(nbytes: int | float | str, platform: str = "cpu", device: int = 0) -> int:
    """Sets a device's budget (bytes or a string like ``"2GiB"``); returns it in bytes.

    Calls plan their bands from the budget (`jax_nbx.planning`).  A jitted
    ``fused_moe`` keeps the bands it planned when it was traced; the new
    budget is enforced on its next run (it may be refused).
    """
    n = parse_bytes(nbytes)
    _ffi().set_budget(platform, int(device), n)
    return n


def fused_moe_workspace_bytes(tokens: int, k: int, E: int, H: int, I: int,
                              bf16_dot: bool = False, lora_rank: int = 0) -> int:
    """Bytes of workspace the CPU handler takes for one band of ``tokens``
    tokens: per padded slot the packed x row and activations, plus per worker
    a scratch sized to H and I (a packed K-block of a weight tile, and a
    chunk's partial sums only when a sum spans several K-blocks;
    ``bf16_dot``: for calls that run the bfloat16 dot-product kernels,
    ``precision="bfloat16"``, or ``precision=None`` with bfloat16 x where
    `cpu.bf16_dot_by_default`: the blocking of the ``dot`` kernel family
    (`cpu.isa_families`), and room for a chunk's x or activations as
    bfloat16 pairs, used only where they cannot become pairs in place but
    counted for every such call).  ``tokens=0`` gives the part that does not
    shrink with the band.  ``lora_rank`` > 0 (LoRA adapters, their ranks
    summed): the forward with adapters instead, per slot the weighted output row,
    g | u, the activations and the rank products (float32,
    ``H + 3I + lora_rank`` values), plus one tile's scratch per worker.  The
    same formula the handler allocates by and `fused_moe` plans with."""
    return int(_ffi().forward_workspace_bytes(int(tokens), int(k), int(E), int(H), int(I),
                                              cpu.planned_workers(), bool(bf16_dot), int(lora_rank)))


def fused_moe_backward_workspace_bytes(tokens: int, k: int, E: int, H: int, I: int,
                                       lora_rank: int = 0) -> int:
    """Bytes of workspace the CPU backward takes for one band of ``tokens``
    tokens: per slot the gathered dy row and the recomputed activations
    (float32, ``H + 3I`` values; x is read in place; with LoRA adapters of ranks
    summing to ``lora_rank``, ``2 * lora_rank`` more), plus one tile's
    scratch per worker (sized to H and I).  The formula the handler allocates
    by and the plan uses."""
    return int(_ffi().backward_workspace_bytes(int(tokens), int(k), int(E), int(H), int(I),
                                               cpu.planned_workers(), int(lora_rank)))


def set_wait(seconds: float) -> None:
    """How long a request that fits the budget, but not the headroom left by
    concurrent calls, waits for them to return bytes before it is refused
    (default 10 s; 0 refuses at once)."""
    if not seconds >= 0:
        raise ValueError(f"seconds must be >= 0; got {seconds!r}")
    _ffi().set_wait_ms(int(seconds * 1000))


def budget(platform: str = "cpu", device: int = 0) -> int:
    return int(_ffi().stats(platform, int(device))["budget"])


def headroom(platform: str = "cpu", device: int = 0) -> int:
    """``mem_get_info``-style free bytes: budget minus live, from the account
    (idle cached blocks give way to requests, so they count as free)."""
    s = _ffi().stats(platform, int(device))
    return max(int(s["budget"]) - int(s["live"]), 0)


def stats() -> dict[str, dict]:
    """Per device (``"cpu:0"``, …): live, peak, budget, refusals, largest_request,
    allocations (counts), cached and live_by_tag (bytes live per tag).

    ``cached``: workspace blocks (≥ 1 MiB, at most 4 per device) that calls
    returned and the account keeps idle, so that the next call of the same
    op reuses one instead of faulting in fresh pages.  They count against the
    budget and are freed first whenever a request needs the room, when the
    budget is lowered, or by `release_cached`.

    ``"cpu:0"`` also has ``mapped``: the mapped experts' figures in bytes
    (`jax_nbx.loaders.map_moe`): ``mapped`` (every open mapping's experts,
    as held), ``resident`` (kept between calls), ``streamed`` (read for
    calls running now) and ``stores``; their blocks are live under the tag
    ``"mapped experts"``."""
    out = _ffi().all_stats()
    out.setdefault("cpu:0", _ffi().stats("cpu", 0))
    out = {k: dict(v) for k, v in out.items()}
    out["cpu:0"]["mapped"] = dict(_ffi().store_totals())
    return out


def release_cached() -> None:
    """Frees the idle workspace blocks the account keeps for reuse (see `stats`'s ``cached``)."""
    _ffi().drop_cached()


def reset_peak() -> None:
    """Sets every device's peak to its live bytes."""
    _ffi().reset_peak()


def last_refusal() -> dict | None:
    """The most recent refusal (any device, any thread) as a dict: device, tag,
    requested, free, total, shortfall, shape, fixed_bytes, message; or None."""
    r = _ffi().last_refusal()
    return None if r is None else dict(r)


def what_would_have_fit(requested: int, free: int, total: int,
                        shape: tuple[int, int] | None = None, fixed_bytes: int = 0) -> str:
    """The advice that ends every refusal, from the numbers only.

    ``shape`` is the (rows, cols) of the work whose leading axis can be cut
    into bands, ``fixed_bytes`` the part of the request that does not shrink
    with the band.  Returns ``""`` when the request fits.
    """
    rows, cols = (0, 0) if shape is None else (int(shape[0]), int(shape[1]))
    return _ffi().what_would_have_fit(int(requested), int(free), int(total), rows, cols,
                                      int(fixed_bytes))


class DeviceOOMError(MemoryError):
    """A request past a device's budget.  The message ends with the advice of
    `what_would_have_fit`.  Attributes: requested, free, total, shortfall
    (bytes, or None when unknown), shape, device."""

    def __init__(self, message: str, *, requested: int | None = None, free: int | None = None,
                 total: int | None = None, shape: tuple[int, ...] | None = None,
                 device: str = "cpu:0"):
        super().__init__(message)
        self.requested, self.free, self.total = requested, free, total
        self.shortfall = None if requested is None or free is None else requested - free
        self.shape = shape
        self.device = device

    @classmethod
    def from_numbers(cls, what: str, *, requested: int, free: int, total: int,
                     shape: tuple[int, int] | None = None, fixed_bytes: int = 0,
                     device: str = "cpu:0") -> DeviceOOMError:
        advice = what_would_have_fit(requested, free, total, shape, fixed_bytes)
        msg = (f"{what}: {format_bytes(requested, 'up')} needed, {format_bytes(free, 'down')} free of a "
               f"{format_bytes(total)} budget on {device}; {advice}")
        return cls(msg, requested=requested, free=free, total=total, shape=shape, device=device)


def as_device_oom(err: BaseException) -> BaseException:
    """A handler's RESOURCE_EXHAUSTED refusal as a `DeviceOOMError` carrying the
    account's record; any other error is returned untouched."""
    text = str(err)
    if "RESOURCE_EXHAUSTED" not in text or "jax_nbx account" not in text:
        return err
    r = last_refusal()
    msg = text[text.index("jax_nbx account"):]
    if r is None or r["message"] not in text:
        return DeviceOOMError(msg)
    return DeviceOOMError(msg, requested=r["requested"], free=r["free"], total=r["total"],
                          shape=r["shape"], device=r["device"])


def report() -> str:
    """Prints a table of the account (one row per device) and returns it."""
    rows = []
    for dev, s in sorted(stats().items()):
        b = "unlimited" if s["budget"] == _ffi().account_unlimited() else format_bytes(s["budget"])
        tags = ", ".join(f"{t} {format_bytes(v)}" for t, v in sorted(s["live_by_tag"].items()) if v)
        rows.append([dev, format_bytes(s["live"]), format_bytes(s["peak"]), b,
                     format_bytes(s["cached"]), str(s["refusals"]),
                     format_bytes(s["largest_request"]), str(s["allocations"]), tags or "-"])
    header = ["device", "live", "peak", "budget", "cached", "refusals", "largest request",
              "allocations", "live by tag"]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    text = "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
                     for r in [header, ["-" * w for w in widths], *rows])
    print(text)
    return text

