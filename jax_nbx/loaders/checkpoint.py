"""Loading one MoE block from a Hugging Face safetensors checkpoint.

`load_moe` reads one layer's router, experts and shared experts with the
``safetensors`` library (``pip install 'jax_nbx[hf]'``) and returns
`jax_nbx.nn.MoEParams` whose experts are in the checkpoint's own layout:
per-expert tensors stay a list of arrays (never stacked), ``nn.Linear``
weights stay ``[out, in]`` (``layout="out_in"``, never transposed), fused
tensors stay fused.  The handlers read them in place.

Names understood, after the layer's prefix (``model.layers.{i}.mlp.`` or
``model.layers.{i}.block_sparse_moe.``, found automatically):

=====================  ==============================================================
Mixtral                ``gate.weight``, ``experts.{e}.w1/w3/w2.weight`` (gate/up/down)
OLMoE, Qwen2/3-MoE,    ``gate.weight``, ``experts.{e}.gate_proj/up_proj/down_proj.weight``,
DeepSeek-V2/V3         ``shared_expert(s).*_proj.weight``, ``shared_expert_gate.weight``,
                       ``gate.e_score_correction_bias``
transformers v5 fused  ``experts.gate_up_proj`` ``[E, 2I, H]``, ``experts.down_proj`` ``[E, H, I]``
gpt-oss                ``router.weight/bias``, ``experts.gate_up_proj[_bias]`` ``[E, H, 2I]``
                       (interleaved), ``experts.down_proj[_bias]``
Granite-MoE            ``router.layer.weight``, ``input_linear.weight``, ``output_linear.weight``
Llama-4                ``feed_forward.router.weight``, ``experts.gate_up_proj`` ``[E, H, 2I]``
                       (concatenated), ``experts.down_proj``, ``shared_expert.*_proj.weight``
mlx-lm                 ``gate.weight`` (MLX-quantized: ``.scales``, ``.biases``),
                       ``switch_mlp.gate_proj/up_proj/down_proj.weight`` ``[E, out, in]``
=====================  ==============================================================

Quantized projections convert losslessly to jax_nbx's formats
(`jax_nbx.loaders`): GPTQ v1 and AWQ GEMM to int4 (``.qweight``,
``.qzeros``, ``.scales``, GPTQ's ``.g_idx``; AutoGPTQ's, AutoAWQ's and
GPTQModel's config.json), MLX's affine 4-bit to int4 (a uint32 ``.weight``
with ``.scales`` and ``.biases``) and MLX's float modes to the formats of
their names (mxfp4, nvfp4, mxfp8: uint32 ``.weight``, uint8 ``.scales``),
per expert or mlx-lm's stacked ``switch_mlp``, the bits, group size and mode
of each module from config.json's ``quantization`` as mlx-lm writes it;
FP8 E4M3 experts to fp8 (``.weight`` float8_e4m3fn with transformers'
block ``.weight_scale_inv`` and ``weight_block_size``, or compressed-tensors'
per-channel / per-tensor ``.weight_scale``; `fp8_import`), compressed-tensors'
NVFP4 (``nvfp4-pack-quantized``: ``.weight_packed``, ``.weight_scale``,
``.weight_global_scale``) to nvfp4 with a tensor scale (`nvfp4_import`).  An MLX-quantized
router (mlx-lm keeps Qwen3-MoE's at 8 bits) is dequantized to float32.  What
is not read is refused naming it: a ``quant_method``, a GPTQ/AWQ
``checkpoint_format``/``format``/``version`` other than v1 GPTQ and GEMM
AWQ, GPTQModel's ``pack_dtype`` and ``dynamic``, other widths than 4 bits,
compressed-tensors formats other than FP8 ``float-quantized`` and NVFP4.  gpt-oss's
MXFP4 experts (``experts.gate_up_proj_blocks``/``_scales``, ``down_proj_*``,
biases) load as stacked mxfp4 experts with biases (`gpt_oss`).
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

from ..experts import Experts, SharedExperts
from ..nn.block import MoEConfig, MoEParams, read_hf_config
from . import fp8_import
from . import quant_import as qi
from .gpt_oss import from_gpt_oss_mxfp4
from .nvfp4_import import from_nvfp4, is_compressed_tensors_nvfp4

__all__ = ["load_moe", "load_experts", "CheckpointError"]

_PROJ_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
_SHARED = ("shared_expert.", "shared_experts.")


class CheckpointError(ValueError):
    """A tensor the block needs is missing from the checkpoint or has the wrong shape."""


def safetensors_files(checkpoint) -> tuple[list[str], dict | None, str | None]:
    """(safetensors files, name -> file map or None, the folder's config.json or None)."""
    if isinstance(checkpoint, (list, tuple)):
        return [os.fspath(f) for f in checkpoint], None, None
    path = os.fspath(checkpoint)
    if os.path.isdir(path):
        cfg = os.path.join(path, "config.json")
        cfg = cfg if os.path.exists(cfg) else None
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                wmap = json.load(f)["weight_map"]
            return ([os.path.join(path, f) for f in sorted(set(wmap.values()))],
                    {k: os.path.join(path, v) for k, v in wmap.items()}, cfg)
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"checkpoint: no *.safetensors files in {path}")
        return files, None, cfg
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint: {path} does not exist")
    return [path], None, None


# safetensors dtypes its numpy/flax readers (0.8) cannot build (they look for numpy.float8_*):
# read here from the file's own header (8-byte length, JSON of dtype, shape, data_offsets).
_RAW_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
               "F8_E8M0": ml_dtypes.float8_e8m0fnu}


def _raw_tensor(path: str, name: str, dtype) -> np.ndarray:
    """Tensor ``name`` of safetensors file ``path`` read from its bytes as ``dtype``."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        info = json.loads(fh.read(n))[name]
        start, end = info["data_offsets"]
        fh.seek(8 + n + start)
        buf = fh.read(end - start)
    return np.frombuffer(buf, dtype=dtype).reshape(info["shape"])


class _Reader:
    """Names and tensors of a set of safetensors files (opened lazily, once each)."""

    def __init__(self, files: list[str], wmap: dict | None, progress: bool | None):
        try:
            from safetensors import safe_open
        except ModuleNotFoundError as err:
            raise ImportError("jax_nbx.loaders needs safetensors: pip install 'jax_nbx[hf]'") from err
        self._open = safe_open
        self.files = files
        self._handles: dict[str, Any] = {}
        if wmap is None:
            wmap = {}
            for f in files:
                for k in self._handle(f).keys():
                    wmap[k] = f
        self.wmap = wmap
        self.progress = len(files) > 1 if progress is None else progress
        self._bar = None

    def _handle(self, f: str):
        if f not in self._handles:
            self._handles[f] = self._open(f, framework="flax")
        return self._handles[f]

    def has(self, name: str) -> bool:
        return name in self.wmap

    def start(self, total: int) -> None:
        if self.progress:
            try:
                from tqdm.auto import tqdm
            except ModuleNotFoundError:
                return
            self._bar = tqdm(total=total, desc="tensors", unit="tensor")

    def get(self, name: str):
        if name not in self.wmap:
            raise CheckpointError(f"checkpoint: tensor {name!r} is missing (looked in {len(self.files)} file(s))")
        f = self.wmap[name]
        h = self._handle(f)
        dtype = h.get_slice(name).get_dtype()
        t = _raw_tensor(f, name, _RAW_DTYPES[dtype]) if dtype in _RAW_DTYPES else h.get_tensor(name)
        if self._bar is not None:
            self._bar.update(1)
        return t

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self._handles.clear()


def _find_prefix(names, layer: int) -> str:
    pat = re.compile(rf"^(.*?layers\.{layer}\.(?:mlp|block_sparse_moe|feed_forward)\.)"
                     r"(?:experts\.|switch_mlp\.|gate\.weight|router\.|input_linear\.)")
    found = sorted({m.group(1) for n in names if (m := pat.match(n))})
    if len(found) != 1:
        what = "no" if not found else f"several ({found})"
        raise CheckpointError(f"checkpoint: {what} MoE block found for layer={layer}; pass prefix= "
                              "(e.g. 'model.layers.0.mlp.')")
    return found[0]


def _expect(name: str, t, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise CheckpointError(f"checkpoint: tensor {name!r} has shape {tuple(t.shape)}; expected {tuple(shape)}")


# What each quantizer's checkpoint may say of its packing, and what converts: GPTQ v1 (AutoGPTQ,
# GPTQModel's "gptq": zeros stored minus one) and AWQ GEMM (AutoAWQ's "version", GPTQModel 7.6's
# "format"/"checkpoint_format"/"version" = "gemm"; tests/data/gptqmodel/).
_READ_FORMATS = {"gptq": ("gptq",), "awq": ("gemm",)}
_FORMAT_KEYS = {"gptq": ("checkpoint_format", "format"), "awq": ("checkpoint_format", "format", "version")}


def _quantization_config(hf_config: dict | None) -> dict:
    """transformers' ``quantization_config`` (of the config or its text_config), or {}."""
    c = hf_config or {}
    qc = c.get("quantization_config") or (c.get("text_config") or {}).get("quantization_config") or {}
    return qc if isinstance(qc, dict) else {}


# transformers' fine-grained FP8, compressed-tensors' FP8, gpt-oss's MXFP4 (loaders/gpt_oss.py)
_FP8_METHODS = ("fp8", "compressed-tensors", "mxfp4")


def _check_quantization_config(hf_config: dict | None) -> None:
    """Refuse, naming it, a ``quant_method`` whose tensors jax_nbx does not read (mlx-lm's copy of
    its ``quantization`` dict, which has no quant_method, is read elsewhere)."""
    qc = _quantization_config(hf_config)
    method = qc.get("quant_method")
    if method is not None and str(method).lower() not in (*_READ_FORMATS, *_FP8_METHODS):
        raise CheckpointError(f"checkpoint: config.json's quantization_config.quant_method={method!r} is not "
                              "read: jax_nbx converts GPTQ (v1) and AWQ (GEMM) 4-bit checkpoints, FP8 ones "
                              "(fine-grained 'fp8', compressed-tensors float-quantized) and MLX's; dequantize "
                              "it first")
    if str(method).lower() == "compressed-tensors":
        try:
            nvfp4 = is_compressed_tensors_nvfp4(qc)
        except ValueError as err:
            raise CheckpointError(f"checkpoint: {err}") from err
        if not nvfp4:
            _fp8_block(hf_config, False)


def _fp8_block(hf_config: dict | None, scale_inv: bool) -> tuple[int, int] | None:
    """`fp8_import.checkpoint_block` of the config's quantization_config, as a CheckpointError."""
    try:
        return fp8_import.checkpoint_block(_quantization_config(hf_config), scale_inv)
    except ValueError as err:
        raise CheckpointError(f"checkpoint: {err}") from err


def _check_gptq_awq(method: str, qc: dict) -> None:
    """quantization_config's packing fields for ``method`` ('gptq' or 'awq'): refused by name when
    they say a layout other than the one its importer reads."""
    for key in _FORMAT_KEYS[method]:
        v = qc.get(key)
        if v is not None and str(v).lower() not in _READ_FORMATS[method]:
            raise CheckpointError(f"checkpoint: quantization_config.{key}={v!r} ({method.upper()}) is not read; "
                                  f"only {' / '.join(map(repr, _READ_FORMATS[method]))} converts"
                                  + (" (v1: zeros stored minus one)" if method == "gptq" else " (AutoAWQ's GEMM "
                                                                                              "packing)"))
    if qc.get("pack_dtype") not in (None, "int32"):
        raise CheckpointError(f"checkpoint: quantization_config.pack_dtype={qc['pack_dtype']!r} (GPTQModel's) is "
                              "not read; only int32 words convert")
    if qc.get("dynamic"):
        raise CheckpointError(f"checkpoint: quantization_config.dynamic={qc['dynamic']!r} (GPTQModel's per-module "
                              "bits and group sizes) is not read")


def _quant_method(reader: _Reader, base: str, hf_config: dict | None) -> str | None:
    """'gptq', 'awq', 'mlx', 'nvfp4', 'fp8' or None (dense) for the projection stored under ``base``."""
    if reader.has(base + "qweight"):
        qc = _quantization_config(hf_config)
        method = str(qc.get("quant_method", "")).lower()
        if method not in _READ_FORMATS:
            qw = reader.get(base + "qweight")
            sc = reader.get(base + "scales")
            if qw.shape[1] == sc.shape[1]:
                method = "gptq"
            elif qw.shape[1] * 8 == sc.shape[1]:
                method = "awq"
            else:
                raise CheckpointError(f"checkpoint: {base}qweight {tuple(qw.shape)} and {base}scales "
                                      f"{tuple(sc.shape)} match neither GPTQ (packed along K) nor AWQ (packed "
                                      "along N)")
        _check_gptq_awq(method, qc)
        return method
    if reader.has(base + "weight") and reader.has(base + "scales"):
        return "mlx"
    if reader.has(base + "weight_packed") and reader.has(base + "weight_global_scale"):
        return "nvfp4"
    if reader.has(base + "weight") and (reader.has(base + "weight_scale_inv") or reader.has(base + "weight_scale")
                                        or _fused_fp8_scale_name(reader, base) is not None):
        return "fp8"
    return None


_EXPERT_BASE = re.compile(r"^(.*experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.$")


def _fused_fp8_scale_name(reader: _Reader, base: str) -> str | None:
    """transformers 5.24's save of fine-grained FP8 experts keeps each expert's weight but the
    scales fused and stacked: ``experts.gate_up_proj_scale_inv`` [E, ceil(2I/bn), ceil(H/bk)]
    (gate's rows, then up's) and ``experts.down_proj_scale_inv``; the name for ``base``, if held."""
    m = _EXPERT_BASE.match(base)
    if m is None:
        return None
    name = m.group(1) + ("down_proj" if m.group(3) == "down_proj" else "gate_up_proj") + "_scale_inv"
    return name if reader.has(name) else None


def _fp8_scale(reader: _Reader, base: str, hf_config: dict | None, rows: int):
    """(scale, block) of the FP8 projection under ``base`` (``rows``: its out_features): its own
    ``weight_scale_inv`` (block scales) or ``weight_scale`` (compressed-tensors), or its slice of
    the fused stacked scales (`_fused_fp8_scale_name`) expanded to one row block per row."""
    if reader.has(base + "weight_scale_inv"):
        return reader.get(base + "weight_scale_inv"), _fp8_block(hf_config, True)
    if reader.has(base + "weight_scale"):
        return reader.get(base + "weight_scale"), _fp8_block(hf_config, False)
    name = _fused_fp8_scale_name(reader, base)
    bn, bk = _fp8_block(hf_config, True)
    m = _EXPERT_BASE.match(base)
    fused = np.asarray(reader.get(name))
    e, first = int(m.group(2)), rows if m.group(3) == "up_proj" else 0
    if fused.ndim != 3 or e >= fused.shape[0] or -(-(first + rows) // bn) > fused.shape[1]:
        raise CheckpointError(f"checkpoint: tensor {name!r} has shape {fused.shape}; expected [E, row blocks, "
                              f"column blocks] covering expert {e}'s {m.group(3)} rows {first}..{first + rows}")
    return np.repeat(fused[e], bn, axis=0)[first:first + rows], (1, bk)


def _mlx_params(hf_config: dict | None, module: str) -> dict:
    """bits, group_size, mode of MLX module ``module`` (e.g. 'model.layers.0.mlp.gate'), as mlx-lm
    0.32's load_model reads them: config.json's ``quantization`` (or mlx-lm's copy of it,
    ``quantization_config``), its entry for the module (missing keys: ``to_quantized``'s
    defaults, mode "affine") before the top level.  No such config: 4 bits, affine, G from the
    shapes."""
    c = hf_config or {}
    q = c.get("quantization")
    if q is None:
        qc = _quantization_config(c)
        q = qc if "quant_method" not in qc and "bits" in qc else None
    if not isinstance(q, dict):
        return dict(bits=4, group_size=None, mode="affine")
    per = q.get(module)
    src = per if isinstance(per, dict) else q
    mode = src.get("mode", "affine")
    g_default, b_default = qi.MLX_MODES.get(mode, (None, None))
    return dict(bits=int(src.get("bits") or b_default or 4), group_size=src.get("group_size") or g_default,
                mode=mode)


def _mlx_tensors(reader: _Reader, base: str) -> list:
    return [np.asarray(reader.get(base + p)) if reader.has(base + p) else None for p in ("weight", "scales", "biases")]


def _quantized(reader: _Reader, base: str, method: str, hf_config: dict | None):
    """One projection: (QuantizedWeight in jax_nbx's int4 format [K/2, N], act-order row permutation or None)."""
    if method == "mlx":
        try:
            return qi.from_mlx(*_mlx_tensors(reader, base), **_mlx_params(hf_config, base[:-1])), None
        except (ValueError, TypeError) as err:
            raise CheckpointError(f"checkpoint: {base}*: {err}") from err
    if method == "nvfp4":
        try:
            return from_nvfp4(reader.get(base + "weight_packed"), reader.get(base + "weight_scale"),
                              global_scale=reader.get(base + "weight_global_scale")), None
        except (ValueError, TypeError) as err:
            raise CheckpointError(f"checkpoint: {base}*: {err}") from err
    if method == "fp8":
        weight = reader.get(base + "weight")
        scale, block = _fp8_scale(reader, base, hf_config, int(weight.shape[-2]))
        try:
            return fp8_import.from_fp8(weight, scale, block=block), None
        except (ValueError, TypeError) as err:
            raise CheckpointError(f"checkpoint: {base}*: {err}") from err
    args = [np.asarray(reader.get(base + p)) for p in ("qweight", "qzeros", "scales")]
    bits = int(_quantization_config(hf_config).get("bits", 4))
    try:
        if method == "awq":
            return qi.from_awq(*args, bits=bits), None
        g_idx = np.asarray(reader.get(base + "g_idx")) if reader.has(base + "g_idx") else None
        return qi.from_gptq(*args, g_idx=g_idx, bits=bits, allow_row_permutation=True)
    except ValueError as err:
        raise CheckpointError(f"checkpoint: {base}*: {err}") from err


def _switch_mlp(reader: _Reader, pfx: str, E: int, H: int, hf_config: dict | None) -> Experts:
    """mlx-lm's SwitchGLU (``switch_mlp.{gate,up,down}_proj``): stacked ``[E, out, in]`` weights,
    MLX-quantized (uint32 ``weight``, ``scales``, ``biases``: stacked int4) or dense."""
    bases = [f"{pfx}switch_mlp.{n}." for n in _PROJ_NAMES[0]]
    if not reader.has(bases[0] + "scales"):  # an unquantized mlx-lm model: [E, out, in] as stored
        g, u, d = (reader.get(b + "weight") for b in bases)
        I = int(g.shape[1]) if g.ndim == 3 else -1
        for b, t, want in zip(bases, (g, u, d), ((E, I, H), (E, I, H), (E, H, I))):
            _expect(b + "weight", t, want)
        return Experts(g, u, d, layout="out_in")
    projs = [_quantized(reader, b, "mlx", hf_config)[0] for b in bases]
    I = int(projs[0].shape[-1])
    for b, w, want in zip(bases, projs, ((E, H, I), (E, H, I), (E, I, H))):
        if tuple(w.shape) != want:
            raise CheckpointError(f"checkpoint: {b}* dequantize to {tuple(w.shape[:1] + w.shape[:0:-1])} "
                                  f"(E, out, in); expected {(want[0],) + want[:0:-1]}")
    return Experts(*projs)


def _mlx_router(reader: _Reader, base: str, hf_config: dict | None):
    """An MLX-quantized router (mlx-lm keeps Qwen3-MoE's at 8 bits) as float32 ``[E, H]``."""
    try:
        return qi.dequantize_mlx(*_mlx_tensors(reader, base), **_mlx_params(hf_config, base[:-1]))
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"checkpoint: {base}* (a quantized router): {err}") from err


def _per_expert(reader: _Reader, pfx: str, E: int, H: int, hf_config: dict | None) -> Experts:
    names = next((n for n in _PROJ_NAMES if any(reader.has(f"{pfx}experts.0.{n[0]}.{t}")
                                                for t in ("weight", "qweight", "weight_packed"))), None)
    if names is None:
        raise CheckpointError(f"checkpoint: no experts under {pfx!r}: expected {pfx}experts.0.gate_proj.weight "
                              f"(or .w1.weight, experts.gate_up_proj, input_linear.weight)")
    method = _quant_method(reader, f"{pfx}experts.0.{names[0]}.", hf_config)
    projs: list[list] = [[], [], []]
    for e in range(E):
        if method is None:
            for j, n in enumerate(names):
                projs[j].append(reader.get(f"{pfx}experts.{e}.{n}.weight"))
            continue
        g, u, d = (_quantized(reader, f"{pfx}experts.{e}.{n}.", method, hf_config) for n in names)
        if g[1] is not None or u[1] is not None:
            raise CheckpointError(f"checkpoint: {pfx}experts.{e}.{names[0]}/{names[1]} are act-order GPTQ "
                                  "(g_idx permutes the hidden rows): not absorbable, since every expert would "
                                  "need its own permutation of x; re-quantize without desc_act")
        gw, uw, dw = g[0], u[0], d[0]
        if d[1] is not None:  # act-order down: its rows (the intermediate) permuted, gate/up's columns alike
            gw, uw = qi.permute_columns(gw, d[1]), qi.permute_columns(uw, d[1])
        for j, w in enumerate((gw, uw, dw)):
            projs[j].append(w)
    if method is None:
        I = int(projs[0][0].shape[0])
        for j, n in enumerate(names):  # nn.Linear [out, in]
            want = (H, I) if j == 2 else (I, H)
            for e, t in enumerate(projs[j]):
                _expect(f"{pfx}experts.{e}.{n}.weight", t, want)
        return Experts(*projs, layout="out_in")
    I = int(projs[0][0].shape[-1])
    for j, n in enumerate(names):  # quantized: converted to [K, N]
        want = (I, H) if j == 2 else (H, I)
        for e, t in enumerate(projs[j]):
            if tuple(t.shape) != want:
                raise CheckpointError(f"checkpoint: {pfx}experts.{e}.{n}.* dequantize to {tuple(t.shape)[::-1]} "
                                      f"(out, in); expected {want[::-1]}")
    return Experts(*projs)


def _fused(reader: _Reader, pfx: str, E: int, H: int, config: MoEConfig | None) -> Experts:
    if reader.has(pfx + "input_linear.weight"):  # Granite: [E, 2I, H] concat, out x in
        gu_name, d_name, gub, db = pfx + "input_linear.weight", pfx + "output_linear.weight", None, None
    else:
        gu_name, d_name = pfx + "experts.gate_up_proj", pfx + "experts.down_proj"
        gub, db = gu_name + "_bias", d_name + "_bias"
    gu, down = reader.get(gu_name), reader.get(d_name)
    if gu.ndim != 3 or gu.shape[0] != E or H not in gu.shape[1:]:
        raise CheckpointError(f"checkpoint: tensor {gu_name!r} has shape {tuple(gu.shape)}; expected "
                              f"[{E}, 2I, {H}] or [{E}, {H}, 2I]")
    layout = config.layout if config is not None and config.fusion else ("out_in" if gu.shape[2] == H else "in_out")
    fusion = config.fusion if config is not None and config.fusion else "concat"
    two_i = gu.shape[1] if layout == "out_in" else gu.shape[2]
    I = two_i // 2
    _expect(gu_name, gu, (E, 2 * I, H) if layout == "out_in" else (E, H, 2 * I))
    _expect(d_name, down, (E, H, I) if layout == "out_in" else (E, I, H))
    biases = {}
    if gub and reader.has(gub):
        biases["gate_up_bias"] = reader.get(gub)
        _expect(gub, biases["gate_up_bias"], (E, 2 * I))
    if db and reader.has(db):
        biases["down_bias"] = reader.get(db)
        _expect(db, biases["down_bias"], (E, H))
    return Experts.fused(gu, down, fusion=fusion, layout=layout, **biases)


def _shared(reader: _Reader, pfx: str, H: int) -> SharedExperts | None:
    sp = next((pfx + s for s in _SHARED if reader.has(pfx + s + "gate_proj.weight")), None)
    if sp is None:
        return None
    g, u, d = (reader.get(f"{sp}{n}.weight") for n in _PROJ_NAMES[0])
    Is = int(g.shape[0])
    for n, t, want in zip(_PROJ_NAMES[0], (g, u, d), ((Is, H), (Is, H), (H, Is))):
        _expect(f"{sp}{n}.weight", t, want)
    gate = None
    if reader.has(pfx + "shared_expert_gate.weight"):
        gate = reader.get(pfx + "shared_expert_gate.weight")
        _expect(pfx + "shared_expert_gate.weight", gate, (1, H))
    return SharedExperts(Experts([g], [u], [d], layout="out_in"), gate)


def load_moe(checkpoint: str | os.PathLike | Sequence[str | os.PathLike], layer: int | None = None, *,
             prefix: str | None = None, config: MoEConfig | None = None,
             progress: bool | None = None) -> MoEParams:
    """One MoE block's parameters from a safetensors checkpoint, read in place.

    Args:
      checkpoint: a folder (``model.safetensors`` or the shards of
        ``model.safetensors.index.json``, and ``config.json``), one
        ``.safetensors`` file, or a list of them.
      layer: the decoder layer whose block to read (its prefix is found
        among the names: ``...layers.{layer}.mlp.`` or
        ``...layers.{layer}.block_sparse_moe.``); or give ``prefix``.
      prefix: the block's name prefix, e.g. ``"model.layers.3.mlp."``.
      config: the block's `jax_nbx.nn.MoEConfig`; default: from the folder's
        ``config.json`` when there is one (`MoEConfig.from_hf`: a
        config.json it cannot read -- a bad value, a model_type it does not
        know -- raises `CheckpointError` naming the key; pass ``config=`` to
        load the block without reading it).  It fixes the layout of fused
        gate||up tensors (gpt-oss's interleaved ``[E, H, 2I]``); without it
        (no config.json: a file or a list of files), fused tensors are told
        apart by their shapes.  Quantization settings are read from the
        folder's config.json either way.
      progress: a progress bar over the tensors read (default: when the
        checkpoint has several files; needs ``tqdm``).

    Returns:
      `jax_nbx.nn.MoEParams`: ``router [E, H]`` as stored (an MLX-quantized
      one dequantized to float32), per-expert checkpoints as per-expert
      lists in ``layout="out_in"`` (dense) or as int4
      `jax_nbx.QuantizedWeight` lists (GPTQ/AWQ/MLX), fused ones as stacked
      `Experts.fused`, mlx-lm's ``switch_mlp`` as stacked experts (int4, or
      dense ``out_in``), biases, the correction bias and the shared expert
      when the checkpoint has them.

    Raises:
      CheckpointError (a ValueError) naming the missing or mis-shaped
      tensor, the config.json key that cannot be read, or the format, mode
      or checkpoint_format that is not read.
    """
    if layer is None and prefix is None:
        raise ValueError("load_moe: pass layer= (an int) or prefix= (e.g. 'model.layers.0.mlp.')")
    files, wmap, cfg_path = safetensors_files(checkpoint)
    hf_config = None
    if cfg_path is not None:
        try:
            hf_config = read_hf_config(cfg_path)
        except (OSError, ValueError) as err:
            raise CheckpointError(f"checkpoint: {cfg_path} cannot be read: {err}") from err
        if config is None:
            try:
                config = MoEConfig.from_hf(hf_config)
            except ValueError as err:
                raise CheckpointError(f"checkpoint: {cfg_path}: {err}; pass config= (a jax_nbx.nn.MoEConfig) "
                                      "to load the block without reading it") from err
        _check_quantization_config(hf_config)
    reader = _Reader(files, wmap, progress)
    try:
        pfx = prefix if prefix is not None else _find_prefix(reader.wmap, int(layer))
        reader.start(sum(1 for n in reader.wmap if n.startswith(pfx)))
        rname = next((pfx + n for n in ("gate.weight", "router.weight", "router.layer.weight")
                      if reader.has(pfx + n)), None)
        if rname is None:
            raise CheckpointError(f"checkpoint: the router of {pfx!r} is missing: expected {pfx}gate.weight, "
                                  f"{pfx}router.weight or {pfx}router.layer.weight")
        router = reader.get(rname)
        if reader.has(rname[:-len("weight")] + "scales"):  # MLX-quantized (mlx-lm): float32
            router = _mlx_router(reader, rname[:-len("weight")], hf_config)
        if router.ndim != 2:
            raise CheckpointError(f"checkpoint: tensor {rname!r} has shape {tuple(router.shape)}; expected [E, H]")
        E, H = (int(s) for s in router.shape)
        if config is not None:
            _expect(rname, router, (config.num_experts, config.hidden_size))
        if reader.has(pfx + "experts.gate_up_proj_blocks"):  # gpt-oss's MXFP4 (loaders/gpt_oss.py)
            names = [pfx + "experts." + n for n in ("gate_up_proj_blocks", "gate_up_proj_scales",
                                                     "down_proj_blocks", "down_proj_scales")]
            biases = [pfx + "experts." + n for n in ("gate_up_proj_bias", "down_proj_bias")]
            try:
                experts = from_gpt_oss_mxfp4(*(np.asarray(reader.get(n)) for n in names),
                                             *(reader.get(n) if reader.has(n) else None for n in biases))
            except (ValueError, TypeError) as err:
                raise CheckpointError(f"checkpoint: {pfx}experts.*_blocks: {err}") from err
            if experts.hidden != H:
                raise CheckpointError(f"checkpoint: {pfx}experts.gate_up_proj_blocks has H={experts.hidden}; the "
                                      f"router {rname!r} has H={H}")
        elif reader.has(pfx + "experts.gate_up_proj") or reader.has(pfx + "input_linear.weight"):
            experts = _fused(reader, pfx, E, H, config)
        elif reader.has(pfx + "switch_mlp.gate_proj.weight"):
            experts = _switch_mlp(reader, pfx, E, H, hf_config)
        else:
            experts = _per_expert(reader, pfx, E, H, hf_config)
        if config is not None and experts.intermediate != config.intermediate_size:
            raise CheckpointError(f"checkpoint: the experts of {pfx!r} have intermediate size "
                                  f"{experts.intermediate}; the config says {config.intermediate_size}")
        rb = reader.get(pfx + "router.bias") if reader.has(pfx + "router.bias") else None
        if rb is not None:
            _expect(pfx + "router.bias", rb, (E,))
        cb_name = pfx + "gate.e_score_correction_bias"
        cb = reader.get(cb_name) if reader.has(cb_name) else None
        if cb is not None:
            _expect(cb_name, cb, (E,))
        shared = _shared(reader, pfx, H)
        return MoEParams(router, experts, router_bias=rb, correction_bias=cb, shared=shared)
    finally:
        reader.close()


def load_experts(checkpoint, layer: int | None = None, **kwargs) -> Experts:
    """The routed experts of one block (`load_moe`'s ``.experts``)."""
    return load_moe(checkpoint, layer, **kwargs).experts
