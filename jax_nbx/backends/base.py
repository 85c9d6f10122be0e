"""The backend interface: what every implementation of `fused_moe` answers.

A `Problem` is the static description of one pass of the op (everything but
the arrays and the token count, which vmap may change): sizes, dtypes, the
experts' format and layout, the activation and the options.  A `Backend`
says whether it can run a problem (`why_not`: "" or the reason, worded to
follow "cannot run this call: "), gets ready for its first call
(`initialise`: "" or why it failed), plans its bands for T tokens (`plan`),
and runs the raw forward (`forward`) and, where it has one, the fused
backward (`backward`; None: the reference's VJP is used).  The registry
(`jax_nbx.backends`) chooses among them; `jax_nbx.transforms` wraps a
backend's raw calls with a batching rule and a derivative.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from ..activations import Activation
from ..expert_store import store_of
from ..experts import Experts, WeightLayout
from ..lora import LoRA, LoRASpec


@dataclasses.dataclass(frozen=True)
class Problem:
    """One pass of the op, as the backends see it (hashable: part of the
    op's static key).  ``quant``: (format, group_size) of quantized experts,
    None for dense ones; ``layout``: the handlers' views of the experts
    (`Experts.weight_layout`); ``layout_name``/``fusion``: the experts' named
    layout; ``bf16_dot``: the CPU handler's bfloat16 dot-product arithmetic
    (``precision="bfloat16"``); ``int8_dot``: its int8 arithmetic on int8 and
    int4 experts (``precision="int8"``); ``skip_outside``: ids outside [0, E) are
    skipped, not an error."""

    E: int
    H: int
    I: int
    k: int
    x_dtype: np.dtype
    w_dtype: np.dtype
    quant: tuple[str, int] | None
    lists: bool
    layout: WeightLayout
    layout_name: str
    fusion: str | None
    activation: Activation
    skip_outside: bool = False
    bf16_dot: bool = False
    int8_dot: bool = False
    max_workspace_bytes: int | str | None = None
    tensor_scales: bool = False  # a quantized matrix carries a tensor scale (nvfp4)
    lora: LoRASpec | None = None  # LoRA adapters on the projections (`jax_nbx.LoRA`)
    prepacked: bool = False  # the forward reads `jax_nbx.prepack`'s words (`PackedExperts`)
    expert_store: int = 0  # the experts are this expert store's (`jax_nbx.loaders.map_moe`), or 0
    settings: tuple = ()  # `_env.trace_settings()` when the call was traced: a changed one is another problem

    @classmethod
    def of(cls, experts: Experts, x_dtype, E: int, H: int, I: int, k: int, activation: Activation,
           **options) -> Problem:
        from ..quantization import has_tensor_scale, quant_format

        return cls(E=E, H=H, I=I, k=k, x_dtype=np.dtype(x_dtype), w_dtype=np.dtype(experts.dtype),
                   quant=quant_format(experts), lists=experts.is_list, layout=experts.weight_layout(),
                   layout_name=experts.layout, fusion=experts.fusion, activation=activation,
                   tensor_scales=has_tensor_scale(experts), expert_store=store_of(experts), **options)

    @property
    def plain(self) -> bool:
        """gate, up [E, H, I] and down [E, I, H] (stacked or lists), no biases."""
        return self.layout.native

    @property
    def has_bias(self) -> bool:
        return self.layout.bias

    @property
    def handler_precision(self) -> str | None:
        """The CPU handler's own arithmetic this pass asks for (``"bfloat16"``,
        ``"int8"``), or None: float32, which every backend runs."""
        return "bfloat16" if self.bf16_dot else "int8" if self.int8_dot else None

    def replace(self, **changes) -> Problem:
        return dataclasses.replace(self, **changes)

    def describe_layout(self) -> str:
        """The named layout, for messages (``layout='out_in', fusion='concat', biases``)."""
        out = [f"layout={self.layout_name!r}"]
        if self.fusion:
            out.append(f"fusion={self.fusion!r}")
        if self.has_bias:
            out.append("biases")
        return ", ".join(out)


class Backend:
    """One implementation of the op (subclassed once per backend)."""

    #: the name ``implementation=`` takes
    name: str = ""
    #: whether JAX differentiates and batches `forward` itself (the reference)
    traced_by_jax: bool = False
    #: whether `forward` takes LoRA adapters (``lora=``); the registry refuses
    #: a problem with adapters on a backend that does not
    takes_lora: bool = False
    #: whether `forward` takes prepacked experts (``packed=``, `jax_nbx.prepack`);
    #: the registry refuses a ``problem.prepacked`` on a backend that does not
    takes_prepacked: bool = False
    #: whether `forward` takes mapped experts (an expert store's,
    #: ``problem.expert_store``); the registry refuses them on one that does not
    takes_mapped: bool = False
    #: whose kernels run the experts' formats ("cpu", "metal", "cuda": a
    #: format's `Format.kernels` names them); the registry refuses a format
    #: those kernels do not read.  None: every registered format (the
    #: reference dequantizes it)
    kernels: str | None = None

    def why_not(self, problem: Problem) -> str:
        """"" when this backend can run ``problem`` in this process, else why not."""
        raise NotImplementedError

    def why_not_by_default(self, problem: Problem) -> str:
        """Why ``implementation=None`` does not take this backend ("" when it may)."""
        return self.why_not(problem)

    def initialise(self) -> str:
        """Readies the backend for its first call (Metal: compiles its kernels'
        library, once): "" when it is ready, else why it failed.  The registry
        calls it on the backend it chooses: a named backend's failure is an
        error, ``implementation=None`` warns and goes on to the next backend."""
        return ""

    #: the account's platform its workspace is counted on ("cpu", "cuda",
    #: "metal"); None: no workspace of its own (the reference)
    device: str | None = None

    def workspace_bytes(self, problem: Problem, tokens: int, call_tokens: int | None = None) -> int:
        """Bytes of workspace one band of ``tokens`` tokens takes in a call of
        ``call_tokens`` tokens (default ``tokens``; 0 tokens: the part that
        does not shrink with the band): the formula the handler allocates by."""
        return 0

    def plan(self, problem: Problem, T: int) -> int:
        """Tokens per band for a call of T tokens, so that one band's
        `workspace_bytes` fits the budget of `device`:0 or
        ``problem.max_workspace_bytes`` (0: no workspace, no bands); raises
        `jax_nbx.DeviceOOMError` with the advice when one token does not fit."""
        if self.device is None:
            return 0
        from ..planning import plan_bands

        p = problem
        return plan_bands(lambda t: self.workspace_bytes(p, t, T), T, p.H, self.device, p.max_workspace_bytes,
                          f"({self.name}, E={p.E} k={p.k} H={p.H} I={p.I})")

    def forward(self, problem: Problem, band_tokens: int, x: jax.Array, w: jax.Array, ids: jax.Array,
                experts: Experts, lora: LoRA | None = None, packed=None) -> jax.Array:
        """y [T, H] of the raw pass on 2-D, validated inputs (ids int32);
        ``lora`` only where `takes_lora` (validated: ``problem.lora``);
        ``packed`` (the `PackedExperts` of ``experts``) only where
        `takes_prepacked` (``problem.prepacked``)."""
        raise NotImplementedError

    def backward(self, problem: Problem, dy: jax.Array, x: jax.Array, w: jax.Array, ids: jax.Array,
                 experts: Experts, lora: LoRA | None = None, weight_grads: bool = True) -> tuple | None:
        """``(dx, d(topk_weights), dexperts, dlora)`` from a fused backward, or
        None where this backend has none for ``problem`` (the reference's VJP
        runs).  ``dexperts``: the handlers' gradients of `Experts.flat` then
        `Experts.handler_biases`, or None when ``weight_grads`` is False (frozen
        experts: a backend may skip them); ``dlora``: a `LoRA` cotangent, or
        None without ``lora`` (only where `takes_lora`)."""
        return None

    def __repr__(self) -> str:
        return f"<jax_nbx backend {self.name!r}>"
