"""PEFT LoRA adapters on one MoE block's routed experts, read into a `jax_nbx.LoRA` (`from_peft`).

What PEFT 0.21 writes (``save_pretrained``: ``adapter_config.json`` and
``adapter_model.safetensors``; tensor names are the model's module names
after ``base_model.model.``, the adapter's name removed), in the two forms it
adapts MoE experts:

* transformers 5's fused 3-D experts (``Qwen3MoeExperts.gate_up_proj``
  ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``; transformers'
  ``models/qwen3_moe/modeling_qwen3_moe.py``), targeted with
  ``LoraConfig(target_parameters=["mlp.experts.gate_up_proj",
  "mlp.experts.down_proj"])``: PEFT's ``ParamWrapper``
  (``peft/tuners/lora/layer.py``), one per parameter, nested -- the first
  parameter the experts module registers (gate_up_proj) innermost.  So the
  names do not say the parameter: ``<block>.experts.base_layer.lora_A.weight``
  is the inner wrapper's and ``<block>.experts.lora_A.weight`` the outer's (a
  single target is ``experts.lora_A.weight``).  Told apart here by their
  shapes, which never coincide: ``lora_A.weight`` ``[r*E, in]`` and
  ``lora_B.weight`` ``[out, r*E]`` with (in, out) = (H, 2I) for gate_up_proj
  and (I, H) for down_proj.  ``ParamWrapper.get_delta_factors`` /
  ``get_delta_weight``: expert e's ``A_e = lora_A.weight[e*r:(e+1)*r]``
  (``reshape(E, r, in)``: expert-major) but ``B_e = lora_B.weight[:, e::E]``
  (``reshape(out, r, E)``: rank-major), and the parameter becomes ``W_e + s *
  B_e @ A_e`` (``torch.baddbmm``; transformers' experts then compute
  ``linear(x, W_e)``).  As matrices (``x @ A @ B``): ``A = A_e.T [in, r]``,
  ``B = B_e.T [r, out]``; gate_up_proj's output is split as transformers
  splits it (``.chunk(2, dim=-1)``: gate the first I columns, up the last I),
  so gate and up share A and take B's first and last I columns.  ParamWrapper
  refuses dropout, ``fan_in_fan_out``, ``lora_bias`` and DoRA.
* per-expert ``nn.Linear`` modules (transformers 4's ``experts.{e}.gate_proj``
  / ``up_proj`` / ``down_proj``, Mixtral's ``w1`` / ``w3`` / ``w2``; remote-code
  models), targeted with ``target_modules``: PEFT's ``lora.Linear``,
  ``lora_A.weight [r, in]``, ``lora_B.weight [out, r]``, ``result +
  lora_B(lora_A(dropout(x))) * scaling``: ``A = lora_A.weight.T``, ``B =
  lora_B.weight.T``.  (PEFT loads such an adapter onto transformers 5's fused
  experts by concatenating gate's and up's A along r and placing their B
  block-diagonally, ``peft/utils/transformers_weight_conversion.py``: the same
  sums.)

The scale is PEFT's ``LoraLayer.update_layer``: ``lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``), r and lora_alpha per module
from ``rank_pattern`` / ``alpha_pattern`` as ``LoraModel._create_and_replace``
resolves them (``peft/utils/other.py`` ``get_pattern_key``: the first pattern
``p`` with ``re.match(rf"(.*\\.)?({p})$", key)``, the key being the module's
name, or ``<experts module>.gate_up_proj`` for a targeted parameter); the rank
of the stored tensors must be the resolved r.

Refused by name (`CheckpointError`, a ValueError, naming the file and the field
or tensor and its value; a malformed file likewise: not JSON, a value of the
wrong type, a bad safetensors header, a tensor that is not float): another
``peft_type``; DoRA and PEFT's other LoRA variants (the config fields PEFT
marks ``is_lora_variant``: ``use_dora``, ``alora_invocation_tokens``,
``arrow_config``, ``velora_config``, ``kasa_config``, ``monteclora_config``,
``use_bdlora``) and ``use_qalora``; ``lora_bias``; ``fan_in_fan_out`` (PEFT
writes it only for Conv1D targets); ``layer_replication``; the initialisations
that rewrite the base weights (``init_lora_weights`` pissa*, olora, corda,
loftq, lora_ga: the adapter then belongs to a residual base, not the
checkpoint's); tensors of the block that are not a routed expert's
projection (the router, shared experts: the result would silently differ);
missing, extra or mis-shaped tensors; per-expert ranks or scales that differ
within one projection; a layer without adapters; an adapter of gpt-oss (by its
``base_model_name_or_path``: its fused experts interleave gate and up).
"""
from __future__ import annotations

import math
import os
import re
from typing import Any

import jax.numpy as jnp
import numpy as np

from ..checkpoint_files import CheckpointError, SafetensorsFile, check_value, config_value, read_json
from ..experts import FLOAT_DTYPES
from ..lora import LoRA

__all__ = ["from_peft"]

_ROOT = "base_model.model."
# config fields of LoRA variants (PEFT's ``is_lora_variant`` metadata) and QALoRA: not plain LoRA
_VARIANT_FIELDS = ("use_dora", "alora_invocation_tokens", "arrow_config", "velora_config", "kasa_config",
                   "monteclora_config", "use_bdlora", "use_qalora")
# initialisations that rewrite the base weights (LoraLayer.pissa_init, olora_init, corda_init, loftq_init, lora_ga_init)
_RESIDUAL_INITS = re.compile(r"^(pissa.*|olora|corda|loftq|lora_ga)$", re.IGNORECASE)
# per-expert module names -> (gate, up, down)
_PER_EXPERT = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
_FUSED_PARAMS = ("gate_up_proj", "down_proj")


def _fail(msg: str):
    raise CheckpointError(f"from_peft: {msg}")


def _check_config(c: dict, where: str) -> None:
    if str(c.get("peft_type", "")).upper() != "LORA":
        _fail(f"{where}: peft_type={c.get('peft_type')!r} is not read; only LORA adapters are")
    for f in _VARIANT_FIELDS:
        if c.get(f):
            _fail(f"{where}: {f}={c[f]!r} is not read (a LoRA variant: its forward is not x @ W + s * (x @ A) @ B)")
    if c.get("lora_bias"):
        _fail(f"{where}: lora_bias={c['lora_bias']!r} is not read (jax_nbx.LoRA has no bias on lora_B)")
    if c.get("fan_in_fan_out"):
        _fail(f"{where}: fan_in_fan_out={c['fan_in_fan_out']!r} is not read (PEFT writes it for Conv1D targets; "
              "its ParamWrapper refuses it and nn.Linear experts reset it to false)")
    if c.get("layer_replication"):
        _fail(f"{where}: layer_replication={c['layer_replication']!r} is not read (the layers are not the "
              "checkpoint's)")
    base = str(c.get("base_model_name_or_path") or "").lower()
    if "gpt-oss" in base or "gpt_oss" in base:
        _fail(f"{where}: base_model_name_or_path={c.get('base_model_name_or_path')!r}: gpt-oss adapters are not "
              "read (its fused gate_up_proj interleaves gate and up columns; this reader splits them as "
              "concatenated, as transformers' Qwen3-MoE, Mixtral and OLMoE experts store them)")
    init = c.get("init_lora_weights")
    if isinstance(init, str) and _RESIDUAL_INITS.match(init):
        _fail(f"{where}: init_lora_weights={init!r} is not read: that initialisation rewrites the base weights, so "
              "the adapter applies to a residual base, not the checkpoint's (save it with PEFT's "
              "path_initial_model_for_weight_conversion to get a plain LoRA)")
    at = f"from_peft: {where}"
    config_value(c, "r", at, "int", minimum=1)
    config_value(c, "lora_alpha", at, "number")
    config_value(c, "target_parameters", at, "list", [], nullable=True)
    for f, kind in (("rank_pattern", "int"), ("alpha_pattern", "number")):
        for p, v in config_value(c, f, at, "dict", {}, nullable=True).items():
            check_value(v, f"{f}[{p!r}]", at, kind, minimum=1 if kind == "int" else None)
            try:
                re.compile(p)
            except re.error as err:
                raise CheckpointError(f"{at}: {f} key {p!r} is not a regular expression: {err}") from err


def _pattern(patterns: dict, key: str, default):
    """PEFT's ``get_pattern_key`` then ``.get(..., default)``: the first pattern p in the mapping's
    order with ``re.match(rf"(.*\\.)?({p})$", key)``."""
    for p, v in patterns.items():
        if re.match(rf"(.*\.)?({p})$", key):
            return v
    return default


def _scale_for(c: dict, module_key: str, stored_r: int, what: str, where: str) -> float:
    """alpha / r (alpha / sqrt(r) with use_rslora) of the module ``module_key`` (model-relative), its r
    and alpha from rank_pattern / alpha_pattern as PEFT resolves them; checked against the stored rank."""
    r = _pattern(c.get("rank_pattern") or {}, module_key, c["r"])
    alpha = _pattern(c.get("alpha_pattern") or {}, module_key, c["lora_alpha"])
    if r != stored_r:
        src = "rank_pattern" if r != c["r"] else "r"
        _fail(f"{where}: {what} has rank {stored_r} but the config's {src} gives r={r!r} for {module_key!r}")
    return float(alpha) / (math.sqrt(r) if c.get("use_rslora") else r)


def _block_prefix(names, layer: int, prefix: str | None) -> str:
    """The block's name prefix in the adapter's tensor names (``base_model.model.<...>.mlp.``)."""
    if prefix is not None:
        pfx = prefix if prefix.startswith("base_model.") else _ROOT + prefix
        pfx = pfx if pfx.endswith(".") else pfx + "."
        if not any(n.startswith(pfx) for n in names):
            _fail(f"no LoRA tensors under prefix {pfx!r} (layer={layer})")
        return pfx
    pat = re.compile(rf"^(.*?layers\.{int(layer)}\.(?:mlp|block_sparse_moe|feed_forward)\.)")
    found = sorted({m.group(1) for n in names if (m := pat.match(n))})
    if len(found) != 1:
        if found:
            _fail(f"several MoE blocks found for layer={layer} ({found}); pass prefix=")
        layers = sorted({int(m.group(1)) for n in names if (m := re.search(r"layers\.(\d+)\.", n))})
        _fail(f"layer={layer} has no LoRA adapters on its MoE block (looked for '...layers.{layer}.mlp.'); the "
              f"adapter's layers: {layers}")
    return found[0]


def _as(a: np.ndarray, name: str, dtype) -> jnp.ndarray:
    if not np.issubdtype(a.dtype, np.floating) and np.dtype(a.dtype) not in FLOAT_DTYPES:
        _fail(f"tensor {name!r} has dtype {a.dtype}; expected one of {', '.join(map(str, FLOAT_DTYPES))}")
    if dtype is None and np.dtype(a.dtype) not in FLOAT_DTYPES:
        _fail(f"tensor {name!r} has dtype {a.dtype}; expected one of {', '.join(map(str, FLOAT_DTYPES))} "
              "(or pass dtype=)")
    return jnp.asarray(a if dtype is None else a.astype(np.dtype(dtype)))


def _fused(t: dict, pfx: str, c: dict, E: int, H: int, I: int, dtype, where: str) -> tuple[dict, dict]:
    """transformers 5's fused experts adapted by PEFT's (nested) ParamWrappers."""
    base = pfx + "experts."
    depth: dict[int, dict[str, str]] = {}
    for n in t:
        m = re.fullmatch(re.escape(base) + r"((?:base_layer\.)*)(lora_A|lora_B)\.weight", n)
        if m is None:
            _fail(f"tensor {n!r} is not read (expected {base}[base_layer.]lora_A.weight / lora_B.weight)")
        depth.setdefault(m.group(1).count("base_layer."), {})[m.group(2)] = n
    targets = [str(p) for p in (c.get("target_parameters") or [])]

    def targeted(param: str) -> bool:  # BaseTuner._inject_parameters: key == target or key.endswith("." + target)
        key = base[len(_ROOT):] + param
        return any(key == p or key.endswith("." + p) for p in targets)

    dims = {"gate_up_proj": (H, 2 * I), "down_proj": (I, H)}
    pairs, scales = {}, {}
    found: dict[str, int] = {}
    for d, ab in sorted(depth.items()):
        for which in ("lora_A", "lora_B"):
            if which not in ab:
                _fail(f"tensor {base + 'base_layer.' * d + which + '.weight'!r} is missing (its pair "
                      f"{next(iter(ab.values()))!r} is there)")
        A, B = t[ab["lora_A"]], t[ab["lora_B"]]
        if A.ndim != 2 or B.ndim != 2 or A.shape[0] % E or B.shape[1] != A.shape[0]:
            _fail(f"tensors {ab['lora_A']!r} {tuple(A.shape)} and {ab['lora_B']!r} {tuple(B.shape)} are not "
                  f"[r*E, in] and [out, r*E] with E={E}")
        param = next((p for p, (fi, fo) in dims.items() if (A.shape[1], B.shape[0]) == (fi, fo)), None)
        if param is None:
            _fail(f"tensors {ab['lora_A']!r} {tuple(A.shape)} and {ab['lora_B']!r} {tuple(B.shape)} fit neither "
                  f"gate_up_proj ([r*{E}, {H}], [{2 * I}, r*{E}]) nor down_proj ([r*{E}, {I}], [{H}, r*{E}])")
        if param in found:
            _fail(f"two adapters of experts.{param} (wrapper depths {found[param]} and {d})")
        found[param] = d
        if not targeted(param):
            _fail(f"{where}: target_parameters={targets!r} does not name {param} of this block "
                  f"({base[len(_ROOT):]}{param}), whose adapter {ab['lora_A']!r} the file holds")
        r = A.shape[0] // E
        key = base[len(_ROOT):] + param
        s = _scale_for(c, key, r, f"{ab['lora_A']!r}", where)
        fi, fo = dims[param]
        a = np.ascontiguousarray(A.reshape(E, r, fi).transpose(0, 2, 1))       # [E, in, r]
        b = np.ascontiguousarray(B.reshape(fo, r, E).transpose(2, 1, 0))       # [E, r, out]
        if param == "down_proj":
            pairs["down"] = (_as(a, ab["lora_A"], dtype), _as(b, ab["lora_B"], dtype))
            scales["down"] = s
        else:
            aj = _as(a, ab["lora_A"], dtype)
            pairs["gate"] = (aj, _as(np.ascontiguousarray(b[:, :, :I]), ab["lora_B"], dtype))
            pairs["up"] = (aj, _as(np.ascontiguousarray(b[:, :, I:]), ab["lora_B"], dtype))
            scales["gate"] = scales["up"] = s
    missing = [p for p in _FUSED_PARAMS if p not in found and targeted(p)]
    if missing:
        _fail(f"{where}: target_parameters={targets!r} names {missing[0]}, but the file holds no adapter of "
              f"{base}{missing[0]}")
    other = [p for p in targets if re.search(r"experts\.[^.]+$", p) and not p.endswith(_FUSED_PARAMS)]
    if other:
        _fail(f"{where}: target_parameters={targets!r}: {other} are not read (the fused experts' "
              f"parameters read are {list(_FUSED_PARAMS)})")
    return pairs, scales


def _per_expert(t: dict, pfx: str, c: dict, E: int, H: int, I: int, dtype, where: str) -> tuple[dict, dict]:
    """Per-expert nn.Linear modules (``experts.{e}.<proj>``) adapted by PEFT's lora.Linear."""
    base = pfx + "experts."
    got: dict[str, dict[int, dict[str, str]]] = {}
    kinds: dict[str, str] = {}
    for n in t:
        m = re.fullmatch(re.escape(base) + r"(\d+)\.([A-Za-z0-9_]+)\.(lora_A|lora_B)\.weight", n)
        if m is None or m.group(2) not in _PER_EXPERT:
            _fail(f"tensor {n!r} is not read (expected {base}{{e}}.gate_proj|up_proj|down_proj (or w1|w3|w2)"
                  ".lora_A.weight / .lora_B.weight)")
        e, mod, which = int(m.group(1)), m.group(2), m.group(3)
        proj = _PER_EXPERT[mod]
        if kinds.setdefault(proj, mod) != mod:
            _fail(f"the {proj} projection is named both {kinds[proj]!r} and {mod!r}")
        if e >= E:
            _fail(f"tensor {n!r} is of expert {e}; num_experts={E}")
        got.setdefault(proj, {}).setdefault(e, {})[which] = n
    dims = {"gate": (H, I), "up": (H, I), "down": (I, H)}
    pairs, scales = {}, {}
    for proj in ("gate", "up", "down"):
        if proj not in got:
            continue
        mod = kinds[proj]
        fi, fo = dims[proj]
        As, Bs, rs = [], [], {}
        for e in range(E):
            names = {w: f"{base}{e}.{mod}.{w}.weight" for w in ("lora_A", "lora_B")}
            for n in names.values():
                if n not in t:
                    _fail(f"tensor {n!r} is missing (the adapter has {mod} of experts "
                          f"{sorted(got[proj])}; num_experts={E})")
            A, B = t[names["lora_A"]], t[names["lora_B"]]
            if A.ndim != 2 or A.shape[1] != fi or B.shape != (fo, A.shape[0]):
                _fail(f"tensors {names['lora_A']!r} {tuple(A.shape)} and {names['lora_B']!r} {tuple(B.shape)}: "
                      f"expected [r, {fi}] and [{fo}, r]")
            r = A.shape[0]
            key = f"{base[len(_ROOT):]}{e}.{mod}"
            rs[e] = (r, _scale_for(c, key, r, f"{names['lora_A']!r}", where))
            As.append(A.T)
            Bs.append(B.T)
        if len(set(rs.values())) != 1:
            _fail(f"{where}: the experts' {mod} adapters differ in rank or scale ({rs} as expert: "
                  "(r, scale), from rank_pattern / alpha_pattern): one rank and scale per projection")
        n0 = f"{base}0.{mod}."
        pairs[proj] = (_as(np.stack(As), n0 + "lora_A.weight", dtype), _as(np.stack(Bs), n0 + "lora_B.weight", dtype))
        scales[proj] = rs[0][1]
    return pairs, scales


def from_peft(path: str | os.PathLike, *, layer: int, num_experts: int, hidden_size: int, intermediate_size: int,
              prefix: str | None = None, dtype: Any = None) -> LoRA:
    """A PEFT LoRA adapter of one MoE block's routed experts as a `jax_nbx.LoRA`.

    Args:
      path: the adapter's folder, as PEFT's ``save_pretrained`` writes it
        (``adapter_config.json`` and ``adapter_model.safetensors``).
      layer: the decoder layer whose block to read (``...layers.{layer}.mlp.``,
        ``.block_sparse_moe.`` or ``.feed_forward.``); or give ``prefix``.
      num_experts, hidden_size, intermediate_size: the block's E, H and I
        (the expert's intermediate size), against which the shapes are checked.
      prefix: the block's name prefix, e.g. ``"model.layers.3.mlp."`` (as
        `load_moe` takes it; PEFT's ``base_model.model.`` is added).
      dtype: cast the adapters to it; default: as stored (float32, bfloat16
        or float16).

    Returns:
      `jax_nbx.LoRA` with stacked ``A [E, in, r]``, ``B [E, r, out]`` for each
      adapted projection and its scale (this module's docstring gives PEFT's
      layout and math: gate and up of a fused ``gate_up_proj`` adapter share
      ``A``).  For ``fused_moe(x, w, ids, experts, lora=...)`` with the
      block's base experts (`load_moe`).

    Raises:
      `CheckpointError` (a ValueError) naming the file and the config field
      and its value, or the tensor, for what is not read (the module
      docstring lists it) or is malformed; FileNotFoundError for a folder
      without the two files.
    """
    folder = os.fspath(path)
    cfg_path = os.path.join(folder, "adapter_config.json")
    st_path = os.path.join(folder, "adapter_model.safetensors")
    for p in (cfg_path, st_path):
        if not os.path.exists(p):
            raise FileNotFoundError(f"from_peft: {p} does not exist (a PEFT adapter folder holds "
                                    "adapter_config.json and adapter_model.safetensors)")
    c = read_json(cfg_path)
    E, H, I = int(num_experts), int(hidden_size), int(intermediate_size)
    _check_config(c, cfg_path)
    try:
        return _read(SafetensorsFile(st_path), c, cfg_path, layer, prefix, E, H, I, dtype)
    except CheckpointError as err:
        if st_path in str(err):
            raise
        raise CheckpointError(f"from_peft: {st_path}: {str(err).removeprefix('from_peft: ')}") from err


def _read(fh: SafetensorsFile, c: dict, cfg_path: str, layer: int, prefix: str | None, E: int, H: int, I: int,
          dtype) -> LoRA:
    """The block's adapters of file ``fh`` (only the block's tensors are read)."""
    names = fh.keys()
    pfx = _block_prefix(names, layer, prefix)
    block = {n: fh.get(n) for n in names if n.startswith(pfx)}
    if not block:
        _fail(f"layer={layer} has no LoRA adapters under {pfx!r}")
    outside = sorted(n for n in block if not n.startswith(pfx + "experts."))
    if outside:
        _fail(f"tensor {outside[0]!r} ({len(outside)} outside {pfx}experts.) is not read: jax_nbx.LoRA adapts the "
              "routed experts only, and the block's result would differ without it (the router, shared experts)")
    fused = {n: a for n, a in block.items() if re.match(re.escape(pfx + "experts.") + r"(base_layer\.)*lora_", n)}
    if fused and len(fused) != len(block):
        other = next(n for n in block if n not in fused)
        _fail(f"the adapter holds both fused-experts tensors ({next(iter(fused))!r}) and others ({other!r})")
    read = _fused if fused else _per_expert
    pairs, scales = read(block, pfx, c, E, H, I, dtype, cfg_path)
    return LoRA(**pairs, scale=scales)
