"""Band planning: how many tokens one band of a call takes so that its
workspace fits the account's budget (or a cap), as pure functions of the
problem and the budget (`plan_bands`), and the CPU handler's bands
(`plan_band_tokens`).  Each backend plans with `plan_bands` and its own
workspace formula."""
from __future__ import annotations

import functools

from . import memory
from .memory import DeviceOOMError, budget, parse_bytes

__all__ = ["plan_bands", "plan_band_tokens"]


def plan_bands(need, T: int, H: int, platform: str, max_workspace_bytes=None,
               detail: str = "") -> int:
    """Tokens per band so that one band's workspace ``need(tokens)`` fits the
    budget of ``platform``:0 (or ``max_workspace_bytes``); equal-sized bands.
    Raises DeviceOOMError with the advice when one token does not fit.

    A pure function of the problem and the budget: never of the bytes that
    concurrent calls hold at the moment of planning (a call that fits the
    budget waits for them at run time, `set_wait`).  Under ``jax.jit`` the
    plan is made once, when the function is traced."""
    if max_workspace_bytes is None:
        free = total = budget(platform)
    else:
        free = total = parse_bytes(max_workspace_bytes)
    if need(T) <= free:
        return T
    if need(1) > free:
        # The advice's line through (T, need(T)) must not pass under need(1)
        # (need is not quite linear: padding grows with min(slots, E)), so its
        # fixed part is at least the chord's intercept through need(1).
        chord = (T * need(1) - need(T)) // (T - 1) + 1 if T > 1 else 0
        raise DeviceOOMError.from_numbers(f"fused_moe workspace for T={T} tokens {detail}".rstrip(),
                                          requested=need(T), free=free,
                                          total=total, shape=(T, H),
                                          fixed_bytes=max(need(0), chord), device=f"{platform}:0")
    lo, hi = 1, T  # need(lo) fits, need(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if need(mid) <= free else (lo, mid)
    n_bands = -(-T // lo)
    return -(-T // n_bands)


def plan_band_tokens(T: int, k: int, E: int, H: int, I: int,
                     max_workspace_bytes: int | None = None, backward: bool = False,
                     bf16_dot: bool = False, lora_rank: int = 0) -> int:
    """Tokens per band so that one band's workspace fits the CPU budget
    (or ``max_workspace_bytes``); equal-sized bands.  ``backward=True``: the
    bands of the CPU backward handler (its workspace holds ``H + 3I``
    float32 values per slot).  ``lora_rank``: LoRA adapters of these ranks
    summed (`memory`'s formulas).  Raises DeviceOOMError with the advice when
    a single token does not fit."""
    if backward:
        workspace = functools.partial(memory.fused_moe_backward_workspace_bytes, lora_rank=lora_rank)
    else:
        workspace = functools.partial(memory.fused_moe_workspace_bytes, bf16_dot=bf16_dot,
                                      lora_rank=lora_rank)
    return plan_bands(lambda t: workspace(t, k, E, H, I), T, H, "cpu", max_workspace_bytes,
                             f"({'backward, ' if backward else ''}E={E} k={k} H={H} I={I})")
