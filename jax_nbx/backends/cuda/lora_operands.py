"""The LoRA part of a CUDA launch program (`plan.build`): the kernels'
adapter constexprs and arguments (abi.h "LoRA adapters": float32 stacked
A_p [E, in, r_p], B_p [E, r_p, out] as inputs after the biases).

The ranks' limit: gemm1 / gemm2 hold an A tile [BK, RP] and a B tile
[RP, BN] in float32 beside the weights' stages, RP the rank padded to a
power of two.  Compiled for sm_90 at the OLMoE shape (E=64, k=8, H=2048,
I=1024) with the H200's tile configs, rank 64 takes at most 213 KB of
shared memory (int4 experts, 4096 tokens) of the 227 KB a block may use;
rank 128 takes 311 KB.  Ranks above `MAX_LORA_RANK` are refused by name
(`plan.kernels_refusal`).
"""
from __future__ import annotations

from ... import contract

MAX_LORA_RANK = 64


def pow2(n: int, lo: int = 16) -> int:
    """n rounded up to a power of two, at least ``lo`` (`tl.arange`, `tl.dot`)."""
    return max(lo, 1 << max(0, int(n) - 1).bit_length())


def lora_operands(lora, first: int) -> tuple[tuple, tuple, list]:
    """The kernels' LoRA constexprs (gemm1/decode1's, gemm2/decode2's) and
    the input numbers of their (A, B) arguments per projection: from
    ``first`` on (A then B of each adapted projection, abi.h "LoRA
    adapters"), or topk_weights as a float32 placeholder the kernels never
    read (rank 0)."""
    ranks, scales = (lora.ranks, lora.scales) if lora is not None else ((0, 0, 0), (1.0, 1.0, 1.0))
    pairs, at = [], first
    for r in ranks:
        if r:
            pairs.append((at, at + 1))
            at += 2
        else:
            pairs.append((contract.IN_W,) * 2)
    c1 = (("RG", ranks[0]), ("RU", ranks[1]), ("SG", float(scales[0])), ("SU", float(scales[1])),
          ("RP", pow2(max(ranks[0], ranks[1]))))
    c2 = (("RD", ranks[2]), ("SD", float(scales[2])), ("RP", pow2(ranks[2])))
    return c1, c2, pairs
