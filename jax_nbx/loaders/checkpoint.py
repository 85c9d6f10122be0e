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

import os
import re
from collections.abc import Sequence

import numpy as np

from ..checkpoint_files import CheckpointError, CheckpointFiles, check_value, config_value, read_json
from ..experts import Experts, SharedExperts
from ..nn.block import MoEConfig, MoEParams
from . import fp8_import
from . import quant_import as qi
from .gpt_oss import from_gpt_oss_mxfp4
from .nvfp4_import import from_nvfp4, is_compressed_tensors_nvfp4

__all__ = ["load_moe", "load_experts", "CheckpointError", "safetensors_files"]

_PROJ_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
_SHARED = ("shared_expert.", "shared_experts.")


def safetensors_files(checkpoint) -> tuple[list[str], dict | None, str | None]:
    """(safetensors files, name -> file map or None, the folder's config.json or None).

    A folder's ``model.safetensors.index.json`` is checked: its ``weight_map``
    must map names to files of the folder that exist (CheckpointError naming
    the index and the entry); FileNotFoundError for a checkpoint that does not
    exist or a folder without ``*.safetensors`` files."""
    if isinstance(checkpoint, (list, tuple)):
        return [os.fspath(f) for f in checkpoint], None, None
    path = os.fspath(checkpoint)
    if os.path.isdir(path):
        cfg = os.path.join(path, "config.json")
        cfg = cfg if os.path.exists(cfg) else None
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            wmap = _weight_map(index, path)
            return sorted(set(wmap.values())), wmap, cfg
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"checkpoint: no *.safetensors files in {path}")
        return files, None, cfg
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint: {path} does not exist")
    return [path], None, None


def _weight_map(index: str, folder: str) -> dict[str, str]:
    """The index's weight_map as name -> path, each file checked to be one of the folder's."""
    where = f"checkpoint: {index}"
    wmap = config_value(read_json(index), "weight_map", where, "dict")
    if not wmap:
        raise CheckpointError(f"{where}: weight_map is empty")
    paths: dict[str, str] = {}
    out = {}
    for name, f in wmap.items():
        if f not in paths:
            check_value(f, f"weight_map[{name!r}]", where, "str")
            full = os.path.normpath(os.path.join(folder, f))
            if os.path.isabs(f) or os.path.relpath(full, folder).split(os.sep)[0] == os.pardir:
                raise CheckpointError(f"{where}: weight_map[{name!r}]={f!r} is not a file of the folder {folder}")
            if not os.path.isfile(full):
                raise CheckpointError(f"{where}: weight_map[{name!r}]={f!r}: no such file in {folder}")
            paths[f] = full
        out[name] = paths[f]
    return out


class _Reader(CheckpointFiles):
    """The checkpoint's tensors (`files.CheckpointFiles`) with a progress bar over those read."""

    def __init__(self, files: list[str], wmap: dict | None, progress: bool | None, source: str | None):
        super().__init__(files, wmap, source, framework="flax")
        self.progress = len(files) > 1 if progress is None else progress
        self._bar = None

    def start(self, total: int) -> None:
        if self.progress:
            try:
                from tqdm.auto import tqdm
            except ModuleNotFoundError:
                return
            self._bar = tqdm(total=total, desc="tensors", unit="tensor")

    def get(self, name: str, **checks):
        t = super().get(name, **checks)
        if self._bar is not None:
            self._bar.update(1)
        return t

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        super().close()


def _find_prefix(reader: _Reader, layer: int) -> str:
    pat = re.compile(rf"^(.*?layers\.{layer}\.(?:mlp|block_sparse_moe|feed_forward)\.)"
                     r"(?:experts\.|switch_mlp\.|gate\.weight|router\.|input_linear\.)")
    found = sorted({m.group(1) for n in reader.wmap if (m := pat.match(n))})
    if len(found) != 1:
        what = "no" if not found else f"several ({found})"
        raise CheckpointError(f"checkpoint: {what} MoE block found for layer={layer} in {reader.source}; pass "
                              "prefix= (e.g. 'model.layers.0.mlp.')")
    return found[0]


# What each quantizer's checkpoint may say of its packing, and what converts: GPTQ v1 (AutoGPTQ,
# GPTQModel's "gptq": zeros stored minus one) and AWQ GEMM (AutoAWQ's "version", GPTQModel 7.6's
# "format"/"checkpoint_format"/"version" = "gemm"; tests/data/gptqmodel/).
_READ_FORMATS = {"gptq": ("gptq",), "awq": ("gemm",)}
_FORMAT_KEYS = {"gptq": ("checkpoint_format", "format"), "awq": ("checkpoint_format", "format", "version")}
# transformers' fine-grained FP8, compressed-tensors' FP8, gpt-oss's MXFP4 (loaders/gpt_oss.py)
_FP8_METHODS = ("fp8", "compressed-tensors", "mxfp4")
_QC = "quantization_config"


class _Quant:
    """config.json's quantization settings (transformers' ``quantization_config``, of the config or
    its ``text_config``; mlx-lm's ``quantization``), each value's type checked where it is read:
    CheckpointError naming the file and the key."""

    def __init__(self, hf_config: dict | None, path: str | None):
        c = hf_config or {}
        self.where = f"checkpoint: {path or 'config.json'}"
        text = config_value(c, "text_config", self.where, "dict", {}, nullable=True)
        self.qc = (config_value(c, _QC, self.where, "dict", {}, nullable=True)
                   or config_value(text, _QC, self.where, "dict", {}, section="text_config", nullable=True))
        method = config_value(self.qc, "quant_method", self.where, "str", None, section=_QC, nullable=True)
        self.method = None if method is None else method.lower()
        self.mlx = config_value(c, "quantization", self.where, "dict", None, nullable=True)
        self.mlx_key = "quantization"
        if self.mlx is None and method is None and "bits" in self.qc:  # mlx-lm's copy of it
            self.mlx, self.mlx_key = self.qc, _QC

    def check(self) -> None:
        """Refuse, naming it, a ``quant_method`` whose tensors jax_nbx does not read (mlx-lm's copy
        of its ``quantization`` dict, which has no quant_method, is read elsewhere)."""
        if self.method is not None and self.method not in (*_READ_FORMATS, *_FP8_METHODS):
            raise CheckpointError(f"{self.where}: quantization_config.quant_method={self.qc['quant_method']!r} is "
                                  "not read: jax_nbx converts GPTQ (v1) and AWQ (GEMM) 4-bit checkpoints, FP8 ones "
                                  "(fine-grained 'fp8', compressed-tensors float-quantized) and MLX's; dequantize "
                                  "it first")
        if self.method == "compressed-tensors" and not is_compressed_tensors_nvfp4(self.qc, self.where):
            self.fp8_block(False)

    def fp8_block(self, scale_inv: bool) -> tuple[int, int] | None:
        return fp8_import.checkpoint_block(self.qc, scale_inv, self.where)

    def gptq_awq(self, method: str) -> dict:
        """bits and group_size of ``method`` ('gptq' or 'awq'); its packing fields refused by name
        when they say a layout other than the one its importer reads."""
        qc, where = self.qc, self.where
        for key in _FORMAT_KEYS[method]:
            v = config_value(qc, key, where, "str", None, section=_QC, nullable=True)
            if v is not None and v.lower() not in _READ_FORMATS[method]:
                raise CheckpointError(f"{where}: quantization_config.{key}={v!r} ({method.upper()}) is not read; "
                                      f"only {' / '.join(map(repr, _READ_FORMATS[method]))} converts"
                                      + (" (v1: zeros stored minus one)" if method == "gptq"
                                         else " (AutoAWQ's GEMM packing)"))
        if config_value(qc, "pack_dtype", where, "str", "int32", section=_QC, nullable=True) != "int32":
            raise CheckpointError(f"{where}: quantization_config.pack_dtype={qc['pack_dtype']!r} (GPTQModel's) is "
                                  "not read; only int32 words convert")
        if qc.get("dynamic"):
            raise CheckpointError(f"{where}: quantization_config.dynamic={qc['dynamic']!r} (GPTQModel's per-module "
                                  "bits and group sizes) is not read")
        return dict(bits=config_value(qc, "bits", where, "int", 4, section=_QC, minimum=1),
                    group_size=config_value(qc, "group_size", where, "int", None, section=_QC, minimum=-1,
                                            nullable=True))

    def mlx_params(self, module: str) -> dict:
        """bits, group_size, mode of MLX module ``module`` (e.g. 'model.layers.0.mlp.gate'), as
        mlx-lm 0.32's load_model reads them: config.json's ``quantization`` (or mlx-lm's copy of
        it, ``quantization_config``), its entry for the module (missing keys: ``to_quantized``'s
        defaults, mode "affine") before the top level.  No such config: 4 bits, affine, G from
        the shapes."""
        q = self.mlx
        if q is None:
            return dict(bits=4, group_size=None, mode="affine")
        per = q.get(module)
        if per is not None and not isinstance(per, (dict, bool)):
            check_value(per, f"{self.mlx_key}.{module}", self.where, "dict")
        src, label = (per, f"{self.mlx_key}.{module}") if isinstance(per, dict) else (q, self.mlx_key)
        mode = config_value(src, "mode", self.where, "str", "affine", section=label)
        try:
            qi.check_mlx_mode(mode)
        except ValueError as err:
            raise CheckpointError(f"{self.where}: {label}.{err}") from err
        g_default, b_default = qi.MLX_MODES.get(mode, (None, None))
        return dict(bits=config_value(src, "bits", self.where, "int", b_default or 4, section=label, minimum=1),
                    group_size=config_value(src, "group_size", self.where, "int", g_default, section=label,
                                            minimum=1),
                    mode=mode)


def _shape(reader: _Reader, name: str, ndim: int = 2) -> tuple[int, ...]:
    """The shape of tensor ``name`` (from its file's header), which must have ``ndim`` axes."""
    shape = reader.info(name).shape
    if len(shape) != ndim:
        reader.fail(name, f"tensor {name!r} has shape {shape}; expected {ndim} axes")
    return shape


def _quant_method(reader: _Reader, base: str, quant: _Quant) -> str | None:
    """'gptq', 'awq', 'mlx', 'nvfp4', 'fp8' or None (dense) for the projection stored under ``base``."""
    if reader.has(base + "qweight"):
        method = quant.method
        if method not in _READ_FORMATS:
            qw, sc = _shape(reader, base + "qweight"), _shape(reader, base + "scales")
            if qw[1] == sc[1]:
                method = "gptq"
            elif qw[1] * 8 == sc[1]:
                method = "awq"
            else:
                reader.fail(base + "qweight", f"{base}qweight {qw} and {base}scales {sc} match neither GPTQ "
                                              "(packed along K) nor AWQ (packed along N)")
        quant.gptq_awq(method)
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


def _fp8_scale(reader: _Reader, base: str, quant: _Quant, rows: int):
    """(scale, block) of the FP8 projection under ``base`` (``rows``: its out_features): its own
    ``weight_scale_inv`` (block scales) or ``weight_scale`` (compressed-tensors), or its slice of
    the fused stacked scales (`_fused_fp8_scale_name`) expanded to one row block per row."""
    if reader.has(base + "weight_scale_inv"):
        return reader.get(base + "weight_scale_inv"), quant.fp8_block(True)
    if reader.has(base + "weight_scale"):
        return reader.get(base + "weight_scale"), quant.fp8_block(False)
    name = _fused_fp8_scale_name(reader, base)
    bn, bk = quant.fp8_block(True)
    m = _EXPERT_BASE.match(base)
    fused = np.asarray(reader.get(name))
    e, first = int(m.group(2)), rows if m.group(3) == "up_proj" else 0
    if fused.ndim != 3 or e >= fused.shape[0] or -(-(first + rows) // bn) > fused.shape[1]:
        reader.fail(name, f"tensor {name!r} has shape {fused.shape}; expected [E, row blocks, column blocks] "
                          f"covering expert {e}'s {m.group(3)} rows {first}..{first + rows}")
    return fused[e][np.arange(first, first + rows) // bn], (1, bk)  # each row its block's scales


def _mlx_tensors(reader: _Reader, base: str) -> list:
    return [np.asarray(reader.get(base + p)) if reader.has(base + p) else None for p in ("weight", "scales", "biases")]


def _quantized(reader: _Reader, base: str, method: str, quant: _Quant):
    """One projection: (QuantizedWeight in jax_nbx's int4 format [K/2, N], act-order row permutation or None)."""
    try:
        if method == "mlx":
            return qi.from_mlx(*_mlx_tensors(reader, base), **quant.mlx_params(base[:-1])), None
        if method == "nvfp4":
            return from_nvfp4(reader.get(base + "weight_packed"), reader.get(base + "weight_scale"),
                              global_scale=reader.get(base + "weight_global_scale")), None
        if method == "fp8":
            rows = _shape(reader, base + "weight")[0]
            scale, block = _fp8_scale(reader, base, quant, rows)
            return fp8_import.from_fp8(reader.get(base + "weight"), scale, block=block), None
        args = [np.asarray(reader.get(base + p)) for p in ("qweight", "qzeros", "scales")]
        kw = quant.gptq_awq(method)
        if method == "awq":
            return qi.from_awq(*args, **kw), None
        g_idx = np.asarray(reader.get(base + "g_idx")) if reader.has(base + "g_idx") else None
        return qi.from_gptq(*args, g_idx=g_idx, **kw, allow_row_permutation=True)
    except CheckpointError:
        raise
    except (ValueError, TypeError) as err:
        reader.fail(base + ("qweight" if method in _READ_FORMATS else "weight"), f"{base}*: {err}")


def _switch_mlp(reader: _Reader, pfx: str, E: int, H: int, quant: _Quant) -> Experts:
    """mlx-lm's SwitchGLU (``switch_mlp.{gate,up,down}_proj``): stacked ``[E, out, in]`` weights,
    MLX-quantized (uint32 ``weight``, ``scales``, ``biases``: stacked int4) or dense."""
    bases = [f"{pfx}switch_mlp.{n}." for n in _PROJ_NAMES[0]]
    if not reader.has(bases[0] + "scales"):  # an unquantized mlx-lm model: [E, out, in] as stored
        g, u, d = (reader.get(b + "weight", float_only=True) for b in bases)
        I = int(g.shape[1]) if g.ndim == 3 else -1
        for b, t, want in zip(bases, (g, u, d), ((E, I, H), (E, I, H), (E, H, I))):
            reader.expect(b + "weight", t, want)
        return Experts(g, u, d, layout="out_in")
    projs = [_quantized(reader, b, "mlx", quant)[0] for b in bases]
    I = int(projs[0].shape[-1])
    for b, w, want in zip(bases, projs, ((E, H, I), (E, H, I), (E, I, H))):
        if tuple(w.shape) != want:
            reader.fail(b + "weight", f"{b}* dequantize to {tuple(w.shape[:1] + w.shape[:0:-1])} (E, out, in); "
                                      f"expected {(want[0],) + want[:0:-1]}")
    return Experts(*projs)


def _mlx_router(reader: _Reader, base: str, quant: _Quant):
    """An MLX-quantized router (mlx-lm keeps Qwen3-MoE's at 8 bits) as float32 ``[E, H]``."""
    try:
        return qi.dequantize_mlx(*_mlx_tensors(reader, base), **quant.mlx_params(base[:-1]))
    except CheckpointError:
        raise
    except (ValueError, TypeError) as err:
        reader.fail(base + "weight", f"{base}* (a quantized router): {err}")


def one_expert(reader: CheckpointFiles, pfx: str, e: int, names: tuple[str, str, str], method: str | None,
               quant: _Quant) -> tuple:
    """Expert ``e``'s (gate, up, down) of a per-expert checkpoint: dense
    ``[out, in]`` tensors as stored, or quantized ones (``method``: see
    `_quant_method`) converted to jax_nbx's formats ``[K, N]``."""
    if method is None:
        return tuple(reader.get(f"{pfx}experts.{e}.{n}.weight", float_only=True) for n in names)
    g, u, d = (_quantized(reader, f"{pfx}experts.{e}.{n}.", method, quant) for n in names)
    if g[1] is not None or u[1] is not None:
        reader.fail(f"{pfx}experts.{e}.{names[0]}.qweight",
                    f"{pfx}experts.{e}.{names[0]}/{names[1]} are act-order GPTQ (g_idx permutes the hidden "
                    "rows): not absorbable, since every expert would need its own permutation of x; "
                    "re-quantize without desc_act")
    gw, uw, dw = g[0], u[0], d[0]
    if d[1] is not None:  # act-order down: its rows (the intermediate) permuted, gate/up's columns alike
        gw, uw = qi.permute_columns(gw, d[1]), qi.permute_columns(uw, d[1])
    return gw, uw, dw


def expert_names(reader: CheckpointFiles, pfx: str) -> tuple[str, str, str]:
    """The projection names of a per-expert checkpoint (``gate_proj``... or ``w1``...)."""
    names = next((n for n in _PROJ_NAMES if any(reader.has(f"{pfx}experts.0.{n[0]}.{t}")
                                                for t in ("weight", "qweight", "weight_packed"))), None)
    if names is None:
        raise CheckpointError(f"checkpoint: no experts under {pfx!r} in {reader.source}: expected "
                              f"{pfx}experts.0.gate_proj.weight (or .w1.weight, experts.gate_up_proj, "
                              "input_linear.weight)")
    return names


def _per_expert(reader: _Reader, pfx: str, E: int, H: int, quant: _Quant) -> Experts:
    names = expert_names(reader, pfx)
    method = _quant_method(reader, f"{pfx}experts.0.{names[0]}.", quant)
    projs: list[list] = [[], [], []]
    for e in range(E):
        for j, w in enumerate(one_expert(reader, pfx, e, names, method, quant)):
            projs[j].append(w)
    if method is None:
        I = _shape(reader, f"{pfx}experts.0.{names[0]}.weight")[0]
        for j, n in enumerate(names):  # nn.Linear [out, in]
            want = (H, I) if j == 2 else (I, H)
            for e, t in enumerate(projs[j]):
                reader.expect(f"{pfx}experts.{e}.{n}.weight", t, want)
        return Experts(*projs, layout="out_in")
    I = int(projs[0][0].shape[-1])
    for j, n in enumerate(names):  # quantized: converted to [K, N]
        want = (I, H) if j == 2 else (H, I)
        for e, t in enumerate(projs[j]):
            if tuple(t.shape) != want:
                reader.fail(f"{pfx}experts.{e}.{n}.qweight", f"{pfx}experts.{e}.{n}.* dequantize to "
                                                            f"{tuple(t.shape)[::-1]} (out, in); expected {want[::-1]}")
    return Experts(*projs)


def _fused(reader: _Reader, pfx: str, E: int, H: int, config: MoEConfig | None) -> Experts:
    if reader.has(pfx + "input_linear.weight"):  # Granite: [E, 2I, H] concat, out x in
        gu_name, d_name, gub, db = pfx + "input_linear.weight", pfx + "output_linear.weight", None, None
    else:
        gu_name, d_name = pfx + "experts.gate_up_proj", pfx + "experts.down_proj"
        gub, db = gu_name + "_bias", d_name + "_bias"
    gu, down = reader.get(gu_name, float_only=True), reader.get(d_name, float_only=True)
    if gu.ndim != 3 or gu.shape[0] != E or H not in gu.shape[1:]:
        reader.fail(gu_name, f"tensor {gu_name!r} has shape {tuple(gu.shape)}; expected [{E}, 2I, {H}] or "
                             f"[{E}, {H}, 2I]")
    layout = config.layout if config is not None and config.fusion else ("out_in" if gu.shape[2] == H else "in_out")
    fusion = config.fusion if config is not None and config.fusion else "concat"
    two_i = gu.shape[1] if layout == "out_in" else gu.shape[2]
    I = two_i // 2
    reader.expect(gu_name, gu, (E, 2 * I, H) if layout == "out_in" else (E, H, 2 * I))
    reader.expect(d_name, down, (E, H, I) if layout == "out_in" else (E, I, H))
    biases = {}
    if gub and reader.has(gub):
        biases["gate_up_bias"] = reader.get(gub, float_only=True, shape=(E, 2 * I))
    if db and reader.has(db):
        biases["down_bias"] = reader.get(db, float_only=True, shape=(E, H))
    return Experts.fused(gu, down, fusion=fusion, layout=layout, **biases)


def _shared(reader: _Reader, pfx: str, H: int) -> SharedExperts | None:
    sp = next((pfx + s for s in _SHARED if reader.has(pfx + s + "gate_proj.weight")), None)
    if sp is None:
        return None
    Is = _shape(reader, sp + "gate_proj.weight")[0]
    g, u, d = (reader.get(f"{sp}{n}.weight", float_only=True, shape=want)
               for n, want in zip(_PROJ_NAMES[0], ((Is, H), (Is, H), (H, Is))))
    gate = None
    if reader.has(pfx + "shared_expert_gate.weight"):
        gate = reader.get(pfx + "shared_expert_gate.weight", float_only=True, shape=(1, H))
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
      CheckpointError (a ValueError) naming the file and the missing,
      mis-shaped or mis-typed tensor, the config.json or index key that
      cannot be read (a value of the wrong type), the byte offset where a
      file stops being JSON or safetensors (`jax_nbx.checkpoint_files`: every
      header is checked against its file's size before anything is read),
      or the format, mode or checkpoint_format that is not read.
      FileNotFoundError for a checkpoint that is not there.
    """
    return read_block(checkpoint, layer, prefix, config, "load_moe",
                      lambda files, wmap, source: _Reader(files, wmap, progress, source), _experts)


def stacked_experts(reader: CheckpointFiles, pfx: str) -> bool:
    """Whether the block under ``pfx`` stores its experts stacked ``[E, ...]``
    (gpt-oss's MXFP4 blocks, transformers 5's fused tensors or Granite's,
    mlx-lm's ``switch_mlp``), not per expert."""
    return any(reader.has(pfx + n) for n in ("experts.gate_up_proj_blocks", "experts.gate_up_proj",
                                             "input_linear.weight", "switch_mlp.gate_proj.weight"))


def _experts(reader: _Reader, pfx: str, E: int, H: int, quant: _Quant, config: MoEConfig | None,
             rname: str) -> Experts:
    """The routed experts of the block under ``pfx``, read whole (`load_moe`)."""
    if not stacked_experts(reader, pfx):
        return _per_expert(reader, pfx, E, H, quant)
    if reader.has(pfx + "experts.gate_up_proj_blocks"):  # gpt-oss's MXFP4 (loaders/gpt_oss.py)
        names = [pfx + "experts." + n for n in ("gate_up_proj_blocks", "gate_up_proj_scales",
                                                 "down_proj_blocks", "down_proj_scales")]
        biases = [pfx + "experts." + n for n in ("gate_up_proj_bias", "down_proj_bias")]
        tensors = [np.asarray(reader.get(n)) for n in names]
        tensors += [reader.get(n, float_only=True) if reader.has(n) else None for n in biases]
        try:
            experts = from_gpt_oss_mxfp4(*tensors)
        except (ValueError, TypeError) as err:
            reader.fail(names[0], f"{pfx}experts.*_blocks: {err}")
        if experts.hidden != H:
            reader.fail(names[0], f"{names[0]} has H={experts.hidden}; the router {rname!r} has H={H}")
        return experts
    if reader.has(pfx + "experts.gate_up_proj") or reader.has(pfx + "input_linear.weight"):
        return _fused(reader, pfx, E, H, config)
    return _switch_mlp(reader, pfx, E, H, quant)


def read_block(checkpoint, layer: int | None, prefix: str | None, config: MoEConfig | None, who: str,
               open_reader, experts_fn) -> MoEParams:
    """One block's `MoEParams` (`load_moe`'s work): the files, config.json and
    quantization settings resolved, the router, biases and shared experts
    read; the routed experts are ``experts_fn(reader, pfx, E, H, quant,
    config, router_name)``; ``open_reader(files, wmap, source)`` gives the
    reader (closed at the end unless ``experts_fn`` keeps it: `map_moe`)."""
    if layer is None and prefix is None:
        raise ValueError(f"{who}: pass layer= (an int) or prefix= (e.g. 'model.layers.0.mlp.')")
    files, wmap, cfg_path = safetensors_files(checkpoint)
    hf_config = None
    if cfg_path is not None:
        hf_config = read_json(cfg_path)
        if config is None:
            try:
                config = MoEConfig.from_hf(hf_config)
            except ValueError as err:
                raise CheckpointError(f"checkpoint: {cfg_path}: {err}; pass config= (a jax_nbx.nn.MoEConfig) "
                                      "to load the block without reading it") from err
    quant = _Quant(hf_config, cfg_path)
    quant.check()
    source = None  # what a missing tensor is missing from: the index, the folder or file, or the list
    if wmap is not None:
        source = os.path.join(os.fspath(checkpoint), "model.safetensors.index.json")
    elif not isinstance(checkpoint, (list, tuple)):
        source = os.fspath(checkpoint)
    reader = open_reader(files, wmap, source)
    try:
        pfx = prefix if prefix is not None else _find_prefix(reader, int(layer))
        if isinstance(reader, _Reader):
            reader.start(sum(1 for n in reader.wmap if n.startswith(pfx)))
        rname = next((pfx + n for n in ("gate.weight", "router.weight", "router.layer.weight")
                      if reader.has(pfx + n)), None)
        if rname is None:
            raise CheckpointError(f"checkpoint: the router of {pfx!r} is missing from {reader.source}: expected "
                                  f"{pfx}gate.weight, {pfx}router.weight or {pfx}router.layer.weight")
        if reader.has(rname[:-len("weight")] + "scales"):  # MLX-quantized (mlx-lm): float32
            router = _mlx_router(reader, rname[:-len("weight")], quant)
        else:
            router = reader.get(rname, float_only=True)
        if router.ndim != 2:
            reader.fail(rname, f"tensor {rname!r} has shape {tuple(router.shape)}; expected [E, H]")
        E, H = (int(s) for s in router.shape)
        if config is not None:
            reader.expect(rname, router, (config.num_experts, config.hidden_size))
        experts = experts_fn(reader, pfx, E, H, quant, config, rname)
        if config is not None and experts.intermediate != config.intermediate_size:
            raise CheckpointError(f"checkpoint: the experts of {pfx!r} in {reader.source} have intermediate size "
                                  f"{experts.intermediate}; the config says {config.intermediate_size}")
        rb_name, cb_name = pfx + "router.bias", pfx + "gate.e_score_correction_bias"
        rb = reader.get(rb_name, float_only=True, shape=(E,)) if reader.has(rb_name) else None
        cb = reader.get(cb_name, float_only=True, shape=(E,)) if reader.has(cb_name) else None
        shared = _shared(reader, pfx, H)
        return MoEParams(router, experts, router_bias=rb, correction_bias=cb, shared=shared)
    finally:
        reader.close()


def load_experts(checkpoint, layer: int | None = None, **kwargs) -> Experts:
    """The routed experts of one block (`load_moe`'s ``.experts``)."""
    return load_moe(checkpoint, layer, **kwargs).experts
