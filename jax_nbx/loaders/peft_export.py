"""`jax_nbx.LoRA` adapters of the routed experts written as a PEFT LoRA adapter (`to_peft`): the inverse of
`from_peft` (``peft_import.py``, whose docstring gives PEFT 0.21's layouts and the PEFT and transformers functions
they follow).

What is written, into ``folder``: ``adapter_config.json`` (``json.dumps(..., indent=2, sort_keys=True)``, every
field of PEFT 0.21.2's ``LoraConfig.to_dict()`` at its default but those below) and ``adapter_model.safetensors``
(``safetensors.numpy.save_file``, metadata ``{"format": "pt"}`` as PEFT's ``save_pretrained``; tensors in the
LoRA's dtype: float32, bfloat16 or float16), in one of PEFT's two forms for MoE experts:

* ``form="fused"``: transformers 5's fused 3-D experts (``<block>.experts.gate_up_proj`` ``[E, 2I, H]`` and
  ``down_proj`` ``[E, H, I]``), PEFT's ``ParamWrapper``: ``target_modules=[]`` (PEFT would otherwise add the model
  type's default targets) and ``target_parameters`` the parameters' full names (``model.layers.3.mlp.experts
  .gate_up_proj``: only the exported layers).  Per parameter ``lora_A.weight [r*E, in]`` (expert e's ``A_e.T`` in
  rows ``e*r:(e+1)*r``) and ``lora_B.weight [out, r*E]`` (expert e's ``B_e.T`` in columns ``e::E``), as
  ``ParamWrapper.get_delta_factors`` reads them.  The wrappers nest in the order the experts module registers its
  parameters (``BaseTuner._inject_parameters``: ``named_parameters(recurse=False)``; transformers' experts register
  gate_up_proj first), so gate_up_proj's tensors are ``<block>.experts.base_layer.lora_A.weight`` when down_proj is
  adapted too and ``<block>.experts.lora_A.weight`` when alone.  gate_up_proj has one A and one scale for gate and
  up (its output is split ``.chunk(2, dim=-1)``: gate the first I columns):

  - gate and up with the same A (bit for bit, as `from_peft` reads a fused adapter) and scale: rank r, B the
    concatenation ``[B_gate | B_up]`` -- `from_peft` reads back the same LoRA, bit for bit;
  - gate and up with their own A (`LoRA.init`, a per-expert adapter) and one scale: rank ``r_gate + r_up``,
    ``A = [A_gate | A_up]`` and ``B`` block-diagonal (what PEFT's own v4 -> v5 conversion does,
    ``peft/utils/transformers_weight_conversion.py``), the other blocks zeros: the same sums (adding exact zeros);
    read back as gate and up adapters of that rank;
  - gate or up alone: the other's columns of ``lora_B`` are zeros (read back as an adapter of zeros on it);
  - gate and up with different scales: refused (one ``lora_alpha / r`` per parameter): use ``form="per_expert"``.

* ``form="per_expert"``: per-expert ``nn.Linear`` modules (transformers 4's ``experts.{e}.gate_proj`` / ``up_proj``
  / ``down_proj``, Mixtral's ``w1`` / ``w3`` / ``w2`` with ``model_type="mixtral"``), PEFT's ``lora.Linear``:
  ``<block>.experts.{e}.<proj>.lora_A.weight [r, in]`` (``A_e.T``) and ``.lora_B.weight [out, r]`` (``B_e.T``);
  ``target_modules`` a regular expression (PEFT ``re.fullmatch``-es a string) naming the exported layers' adapted
  projections, ``experts\\.(?:\\d+\\.)?<proj>``: the expert index optional so that PEFT's conversion of a
  per-expert adapter onto transformers 5's fused experts (``_resolve_string_target_modules``, which probes
  ``<experts>.gate_proj``) finds them.  That conversion gives gate_up_proj ``r * 2`` and ``lora_alpha * 2`` (the
  config's, whatever the patterns say), so it loads such an adapter right only where gate and up are adapted at the
  config's r and lora_alpha (the first layer's gate sets them here) and ``use_rslora`` is off (it is, here).

The scale: PEFT's ``lora_alpha / r`` (``use_rslora`` is written false), r the stored rank; lora_alpha chosen so that
``lora_alpha / r`` is the projection's scale in float64 (an int where one is exact).  Where no float alpha gives
it (about one scale in ten at odd ranks; never a scale that is some ``alpha / r``, as `LoRA.init` and `from_peft`
make them), the nearest alpha, equal in float32 (in which PEFT and every jax_nbx backend apply it).  The config's
``r`` and ``lora_alpha`` are the first layer's first adapted parameter's; ``rank_pattern`` / ``alpha_pattern`` give
the others, keyed by the parameter's or module's escaped full name (matched as ``get_pattern_key`` does,
``re.match(rf"(.*\\.)?({p})$", key)``).

Refused by name (TypeError / ValueError naming the argument and its value): what is not a `LoRA`; ``layers`` that
do not match the adapters given (count, duplicates, not ints >= 0); an unknown ``form``; a ``prefix`` without
``{layer}`` for several layers; gpt-oss (``model_type`` or ``base_model_name_or_path``: its fused gate_up_proj
interleaves gate and up); in the fused form gate and up of different scales or dtypes; a scale no alpha gives even
in float32; adapters that fail `validate_lora`; a non-empty ``folder`` unless ``overwrite=True``
(FileExistsError).  Per-expert lists are stacked.
"""
from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..lora import PROJECTIONS, LoRA, validate_lora

__all__ = ["to_peft"]

_ROOT = "base_model.model."
_FORMS = ("fused", "per_expert")
_NAMES = {"mixtral": ("w1", "w3", "w2")}
_DEFAULT_NAMES = ("gate_proj", "up_proj", "down_proj")
# PEFT 0.21.2's LoraConfig().to_dict() (peft/tuners/lora/config.py; peft/config.py), the fields written at default
_CONFIG_DEFAULTS: dict[str, Any] = {
    "alora_invocation_tokens": None, "alpha_pattern": {}, "arrow_config": None, "auto_mapping": None,
    "base_model_name_or_path": None, "bias": "none", "corda_config": None, "ensure_weight_tying": False,
    "eva_config": None, "exclude_modules": None, "fan_in_fan_out": False, "inference_mode": True,
    "init_lora_weights": True, "kasa_config": None, "layer_replication": None, "layers_pattern": None,
    "layers_to_transform": None, "loftq_config": {}, "lora_alpha": 8, "lora_bias": False, "lora_dropout": 0.0,
    "lora_ga_config": None, "megatron_config": None, "megatron_core": "megatron.core", "modules_to_save": None,
    "monteclora_config": None, "peft_type": "LORA", "peft_version": "0.21.2", "qalora_group_size": 16, "r": 8,
    "rank_pattern": {}, "revision": None, "target_modules": None, "target_parameters": None, "task_type": None,
    "trainable_token_indices": None, "use_bdlora": None, "use_dora": False, "use_qalora": False,
    "use_rslora": False, "velora_config": None,
}


def _alpha(scale: float, r: int, where: str) -> float | int:
    """A lora_alpha with ``alpha / r == scale`` (float64), an int where one is; else the nearest with the same
    float32 quotient."""
    a = scale * r
    if a == round(a) and abs(a) < 2 ** 53 and round(a) / r == scale:
        return int(round(a))
    cands = [a]
    up = dn = a
    for _ in range(4):
        up, dn = math.nextafter(up, math.inf), math.nextafter(dn, -math.inf)
        cands += [up, dn]
    exact = [c for c in cands if c / r == scale]
    if exact:
        return min(exact, key=lambda c: abs(c - a))
    best = min(cands, key=lambda c: abs(c / r - scale))
    if np.float32(best / r) != np.float32(scale):
        raise ValueError(f"to_peft: {where}: scale={scale!r} at rank {r} is lora_alpha / r for no lora_alpha, "
                         "even in float32")
    return best


def _layers(lora, layers) -> list[tuple[int, LoRA]]:
    """(layer, LoRA) pairs, by layer, from a LoRA, a {layer: LoRA} mapping or a sequence of LoRAs."""
    if isinstance(lora, LoRA):
        if layers is None:
            raise ValueError("to_peft: layers=None with a single LoRA: give its decoder layer (layers=3)")
        if isinstance(layers, (int, np.integer)) and not isinstance(layers, bool):
            layers = [layers]
        items = [lora]
    elif isinstance(lora, Mapping):
        if layers is not None:
            raise ValueError(f"to_peft: layers={layers!r} with a mapping of LoRAs: the mapping's keys are the layers")
        layers, items = list(lora.keys()), list(lora.values())
    elif isinstance(lora, Sequence) and not isinstance(lora, (str, bytes)):
        items = list(lora)
        if layers is None:
            layers = list(range(len(items)))
    else:
        raise TypeError(f"to_peft: lora must be a jax_nbx.LoRA, a {{layer: LoRA}} mapping or a sequence of LoRAs; "
                        f"got {type(lora).__name__}")
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
        raise TypeError(f"to_peft: layers={layers!r} must be an int or a sequence of ints")
    layers = list(layers)
    if len(layers) != len(items):
        raise ValueError(f"to_peft: layers={layers!r} names {len(layers)} layers for {len(items)} LoRAs")
    if not items:
        raise ValueError("to_peft: lora holds no adapters (an empty mapping or sequence)")
    for n in layers:
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
            raise TypeError(f"to_peft: layers={layers!r}: {n!r} is not a layer index (an int >= 0)")
    if len(set(map(int, layers))) != len(layers):
        raise ValueError(f"to_peft: layers={layers!r} names a layer twice")
    for n, lo in zip(layers, items):
        if not isinstance(lo, LoRA):
            raise TypeError(f"to_peft: the adapters of layer {n} are a {type(lo).__name__}, not a jax_nbx.LoRA")
    return sorted(((int(n), lo) for n, lo in zip(layers, items)), key=lambda p: p[0])


def _prefix(prefix: str | None, model_type: str | None, form: str, several: bool) -> str:
    """The block's model-relative prefix template (``model.layers.{layer}.mlp.``)."""
    if prefix is None:
        mixtral_v4 = form == "per_expert" and model_type == "mixtral"
        return "model.layers.{layer}." + ("block_sparse_moe." if mixtral_v4 else "mlp.")
    if not isinstance(prefix, str):
        raise TypeError(f"to_peft: prefix={prefix!r} must be a str such as 'model.layers.{{layer}}.mlp.'")
    p = prefix.removeprefix(_ROOT).rstrip(".")
    p = (p.removesuffix(".experts") if p.endswith(".experts") else p) + "."
    try:
        p.format(layer=0)
    except (KeyError, IndexError, ValueError) as err:
        raise ValueError(f"to_peft: prefix={prefix!r}: the only field it may hold is {{layer}} ({err!r})") from err
    if several and "{layer}" not in p:
        raise ValueError(f"to_peft: prefix={prefix!r} has no {{layer}} field, and several layers are written")
    return p


def _np(a) -> np.ndarray:
    return np.asarray(a)


def _experts_T(a: np.ndarray) -> np.ndarray:
    """[E, x, y] -> [E, y, x], contiguous."""
    return np.ascontiguousarray(np.swapaxes(a, 1, 2))


def _fused_tensors(lo: LoRA, layer: int) -> dict[str, tuple[np.ndarray, np.ndarray, float, int]]:
    """Per fused parameter (``gate_up_proj``, ``down_proj``): (lora_A.weight, lora_B.weight, scale, r)."""
    out = {}
    gate, up = lo.pair("gate"), lo.pair("up")
    if gate is not None or up is not None:
        pairs = {n: (_np(p[0]), _np(p[1])) for n, p in (("gate", gate), ("up", up)) if p is not None}
        if len(pairs) == 2:
            if lo.scale("gate") != lo.scale("up"):
                raise ValueError(f"to_peft: layer {layer}: form='fused': gate's scale {lo.scale('gate')!r} and up's "
                                 f"{lo.scale('up')!r} differ, and gate_up_proj has one lora_alpha / r; write "
                                 "form='per_expert'")
            for i, m in enumerate(("A", "B")):
                dg, du = pairs["gate"][i].dtype, pairs["up"][i].dtype
                if dg != du:
                    raise ValueError(f"to_peft: layer {layer}: form='fused': gate's {m} is {dg} and up's {du}, "
                                     f"and gate_up_proj has one lora_{m} tensor: cast them to one dtype")
        s = lo.scale("gate" if gate is not None else "up")
        (gA, gB), (uA, uB) = pairs.get("gate", (None, None)), pairs.get("up", (None, None))
        if gA is not None and uA is not None and gA.shape == uA.shape and np.array_equal(gA, uA):
            A, B = gA, np.concatenate([gB, uB], axis=2)       # shared A: rank r
        else:
            like = gA if gA is not None else uA
            ref_b = gB if gB is not None else uB
            E, I = ref_b.shape[0], ref_b.shape[2]
            parts_a, cols = [], []
            for a, b, first in ((gA, gB, True), (uA, uB, False)):
                if a is None:
                    continue
                z = np.zeros((E, b.shape[1], I), b.dtype)
                parts_a.append(a)
                cols.append(np.concatenate([b, z] if first else [z, b], axis=2))
            A = np.concatenate(parts_a, axis=2) if len(parts_a) > 1 else like
            B = np.concatenate(cols, axis=1)                   # block-diagonal [E, r_g + r_u, 2I]
        out["gate_up_proj"] = (A, B, s)
    if lo.pair("down") is not None:
        A, B = lo.pair("down")
        out["down_proj"] = (_np(A), _np(B), lo.scale("down"))
    tensors = {}
    for param, (A, B, s) in out.items():
        E, fi, r = A.shape
        fo = B.shape[2]
        wa = _experts_T(A).reshape(E * r, fi)                                   # rows e*r..(e+1)*r: A_e.T
        wb = np.ascontiguousarray(B.transpose(2, 1, 0)).reshape(fo, r * E)    # columns e::E: B_e.T
        tensors[param] = (wa, wb, s, r)
    return tensors


def to_peft(lora: LoRA | Mapping[int, LoRA] | Sequence[LoRA], folder: str | os.PathLike, *,
            layers: int | Sequence[int] | None = None, form: str = "fused", prefix: str | None = None,
            model_type: str | None = None, base_model_name_or_path: str | None = None,
            task_type: str | None = "CAUSAL_LM", overwrite: bool = False) -> str:
    """Write `jax_nbx.LoRA` adapters of the routed experts as a PEFT LoRA adapter (the inverse of `from_peft`).

    Args:
      lora: one LoRA per decoder layer: a ``{layer: LoRA}`` mapping, a sequence of LoRAs (layers 0, 1, ... or
        ``layers``), or one LoRA (``layers`` its layer).  Stacked or per-expert lists (stacked here).
      folder: the adapter's folder (created); ``adapter_config.json`` and ``adapter_model.safetensors`` go there.
      layers: the decoder layers of a sequence of LoRAs, or of a single one.
      form: ``"fused"`` (transformers 5's fused 3-D experts, PEFT's ``target_parameters``) or ``"per_expert"``
        (per-expert ``nn.Linear`` modules, ``target_modules``: transformers 4 and remote-code models; PEFT converts
        it onto transformers 5's fused experts when loading, with the limits the module docstring says).
      prefix: each block's module prefix, ``{layer}`` for the layer (as `from_peft` and `load_moe` take it;
        PEFT's ``base_model.model.`` and a trailing ``experts`` may be given); default
        ``"model.layers.{layer}.mlp."`` (Mixtral's per-expert form: ``...block_sparse_moe.``).
      model_type: the Hugging Face model type, for its defaults: ``"mixtral"``'s per-expert modules are
        ``w1`` / ``w3`` / ``w2``; ``"gpt_oss"`` is refused.
      base_model_name_or_path, task_type: written into the config (PEFT's ``PeftModel.from_pretrained`` wraps a
        ``"CAUSAL_LM"`` adapter in ``PeftModelForCausalLM``; None for a model that is no transformers model).
      overwrite: replace the two files of a folder that is not empty (others in it are left).

    Returns:
      the folder's path.

    Raises:
      TypeError / ValueError naming the argument and its value for what PEFT cannot express or does not match
      (the module docstring lists them); FileExistsError for a non-empty folder without ``overwrite=True``.
    """
    from safetensors.numpy import save_file

    if form not in _FORMS:
        raise ValueError(f"to_peft: form={form!r}; expected one of {_FORMS}")
    for arg, v in (("model_type", model_type), ("base_model_name_or_path", base_model_name_or_path),
                   ("task_type", task_type)):
        if v is not None and not isinstance(v, str):
            raise TypeError(f"to_peft: {arg}={v!r} must be a str or None")
    for arg, v in (("model_type", model_type), ("base_model_name_or_path", base_model_name_or_path)):
        if v is not None and ("gpt-oss" in v.lower() or "gpt_oss" in v.lower()):
            raise ValueError(f"to_peft: {arg}={v!r}: gpt-oss is not written (its fused gate_up_proj interleaves "
                             "gate and up columns; these adapters split it as concatenated)")
    items = _layers(lora, layers)
    tmpl = _prefix(prefix, model_type, form, len(items) > 1)
    names = dict(zip(PROJECTIONS, _NAMES.get(model_type or "", _DEFAULT_NAMES)))

    tensors: dict[str, np.ndarray] = {}
    entries: list[tuple[str, int, float]] = []     # (pattern, r, scale), in layer then parameter order
    targets: list[str] = []
    for layer, lo in items:
        try:
            lo = lo.stacked()
            A0, B0 = lo.pair(lo.projections[0])
            if np.ndim(A0) != 3 or np.ndim(B0) != 3:
                raise ValueError(f"{lo.projections[0]}'s A and B have shapes {np.shape(A0)} and {np.shape(B0)}; "
                                 "expected [E, in, r] and [E, r, out]")
            fin, fout = A0.shape[1], B0.shape[2]
            validate_lora(lo, A0.shape[0], *((fin, fout) if lo.projections[0] != "down" else (fout, fin)))
        except (TypeError, ValueError) as err:
            raise type(err)(f"to_peft: the adapters of layer {layer}: {err}") from err
        pfx = tmpl.format(layer=layer)
        base = f"{_ROOT}{pfx}experts."
        if form == "fused":
            fused = _fused_tensors(lo, layer)
            for param, (wa, wb, s, r) in fused.items():
                nested = param == "gate_up_proj" and len(fused) == 2   # the inner wrapper
                stem = base + ("base_layer." if nested else "")
                tensors[stem + "lora_A.weight"], tensors[stem + "lora_B.weight"] = wa, wb
                key = f"{pfx}experts.{param}"
                targets.append(key)
                entries.append((re.escape(key), r, s))
        else:
            mods = []
            for proj in lo.projections:
                A, B = (_np(m) for m in lo.pair(proj))
                mod = names[proj]
                mods.append(mod)
                for e in range(A.shape[0]):
                    tensors[f"{base}{e}.{mod}.lora_A.weight"] = np.ascontiguousarray(A[e].T)
                    tensors[f"{base}{e}.{mod}.lora_B.weight"] = np.ascontiguousarray(B[e].T)
                entries.append((re.escape(f"{pfx}experts.") + r"(?:\d+\.)?" + re.escape(mod), A.shape[2],
                                lo.scale(proj)))
            targets.append(re.escape(f"{pfx}experts.") + r"(?:\d+\.)?(?:" + "|".join(map(re.escape, mods)) + ")")

    alphas = [(p, r, _alpha(s, r, f"{p!r}")) for p, r, s in entries]
    r0, a0 = alphas[0][1], alphas[0][2]
    config = dict(_CONFIG_DEFAULTS)
    config.update(
        r=r0, lora_alpha=a0, rank_pattern={p: r for p, r, _ in alphas if r != r0},
        alpha_pattern={p: a for p, _, a in alphas if a != a0}, task_type=task_type,
        base_model_name_or_path=base_model_name_or_path,
        target_modules=[] if form == "fused" else (targets[0] if len(targets) == 1
                                                   else "(?:" + ")|(?:".join(targets) + ")"),
        target_parameters=sorted(targets) if form == "fused" else None)

    path = os.fspath(folder)
    if os.path.isdir(path) and os.listdir(path) and not overwrite:
        raise FileExistsError(f"to_peft: folder={path!r} is not empty ({sorted(os.listdir(path))[:4]}); pass "
                              "overwrite=True to replace its adapter_config.json and adapter_model.safetensors")
    if os.path.exists(path) and not os.path.isdir(path):
        raise FileExistsError(f"to_peft: folder={path!r} is a file")
    os.makedirs(path, exist_ok=True)
    st, cfg = os.path.join(path, "adapter_model.safetensors"), os.path.join(path, "adapter_config.json")
    save_file(tensors, st + ".tmp", metadata={"format": "pt"})
    with open(cfg + ".tmp", "w") as f:
        f.write(json.dumps(config, indent=2, sort_keys=True))
    os.replace(st + ".tmp", st)
    os.replace(cfg + ".tmp", cfg)
    return path
