"""Layer shapes of real MoE models (E experts, k active, hidden H, expert intermediate I)."""
from __future__ import annotations

from typing import NamedTuple

__all__ = ["ModelShape", "MODELS"]


class ModelShape(NamedTuple):
    name: str
    E: int
    k: int
    H: int
    I: int
    normalize: bool  # renormalize the top-k router weights

    def routed_flops(self, T: int) -> int:
        """FLOPs of the routed work: T*k rows through gate, up (H->I) and down (I->H)."""
        return 2 * T * self.k * 3 * self.H * self.I

    def weight_bytes(self, itemsize: int) -> int:
        return 3 * self.E * self.H * self.I * itemsize


MODELS: dict[str, ModelShape] = {m.name: m for m in (
    ModelShape("mixtral-8x7b", 8, 2, 4096, 14336, True),
    ModelShape("olmoe-1b-7b", 64, 8, 2048, 1024, False),
    ModelShape("qwen3-30b-a3b", 128, 8, 2048, 768, True),
    ModelShape("deepseek-v2-lite", 64, 6, 2048, 1408, False),
    ModelShape("granite-3.0-1b-a400m", 32, 8, 1024, 512, True),
)}
