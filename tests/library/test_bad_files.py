"""Malformed checkpoint files (issue #53): every loader entry point -- load_moe,
load_experts, safetensors_files, MoEConfig.from_hf, Qwen3MoeConfig.from_hf,
qwen3_moe.load_hf, from_peft, and through load_moe the GPTQ, AWQ, MLX, FP8,
NVFP4 and gpt-oss readers -- raises CheckpointError whose message names the
file (its path) and the key, tensor or byte offset, never a raw library
exception.  One table: each case a copy of a valid fixture (tests/data/) with
one thing broken, the entry point, the file and what the message must name."""
from __future__ import annotations

import json
import pathlib
import shutil
import struct

import pytest

pytest.importorskip("safetensors")
import ml_dtypes  # noqa: E402, F401  (bfloat16 for safetensors.numpy)
import numpy as np  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

from jax_nbx import nn  # noqa: E402
from jax_nbx.loaders import CheckpointError, from_peft, load_experts, load_moe, safetensors_files  # noqa: E402

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
BASES = {"tiny": DATA / "transformers" / "qwen3_moe_tiny",   # a whole transformers 5.24 Qwen3-MoE, bf16
         "awq": DATA / "gptqmodel" / "qwen3_moe_awq", "fp8": DATA / "fp8" / "qwen3_moe_fp8_block",
         "fp8_ct": DATA / "fp8" / "qwen3_moe_fp8_channel", "nvfp4": DATA / "nvfp4" / "qwen3_moe_nvfp4",
         "mlx": DATA / "mlx_lm" / "qwen3_moe_q4_g32", "gpt_oss": DATA / "gpt_oss" / "gpt_oss_mxfp4",
         "peft": DATA / "peft" / "qwen3_moe_lora"}
CFG, ST, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
ACFG, AST = "adapter_config.json", "adapter_model.safetensors"
PFX = "model.layers.0.mlp."
DROP = object()  # a config edit's value: remove the key


# --- writers --------------------------------------------------------------------------------------

def st_bytes(header, data: bytes = b"", length: int | None = None) -> bytes:
    """A safetensors file: the 8-byte length (``length`` to lie), the header (a dict or raw bytes), the data."""
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(h) if length is None else length) + h + data


def f32(shape, begin, end):
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}


def setting(*path_and_value):
    """A config edit: ``setting("quantization_config", "bits", "4")`` sets that nested key (DROP: removes it)."""
    *path, value = path_and_value

    def edit(c):
        for k in path[:-1]:
            c = c[k]
        if value is DROP:
            c.pop(path[-1])
        else:
            c[path[-1]] = value
    return edit


def fixture(base="tiny", config=None, tensors=None, raw=None, index=None):
    """A writer of a copy of fixture ``base`` under tmp_path/ckpt: ``config`` an edit of its
    config.json (adapter_config.json for PEFT) or the file's new bytes/text; ``tensors`` an edit of
    its tensors (dict -> dict); ``raw`` its safetensors file's bytes -> new bytes; ``index`` a
    model.safetensors.index.json (text, or a dict: names -> file, or callable(names) -> its JSON)."""
    def write(tmp: pathlib.Path) -> pathlib.Path:
        dst = tmp / "ckpt"
        if base == "gptq":
            from test_checkpoint import _quant_checkpoint
            _quant_checkpoint(dst, "gptq")
        else:
            shutil.copytree(BASES[base], dst)
        cfg, st = (dst / ACFG, dst / AST) if base == "peft" else (dst / CFG, dst / ST)
        if isinstance(config, (str, bytes)):
            cfg.write_bytes(config.encode() if isinstance(config, str) else config)
        elif config is not None:
            c = json.loads(cfg.read_text())
            config(c)
            cfg.write_text(json.dumps(c))
        if tensors is not None:
            save_file(tensors(load_file(str(st))), str(st))
        if raw is not None:
            st.write_bytes(raw(st.read_bytes()))
        if index is not None:
            if callable(index):
                with open(st, "rb") as fh:
                    n = int.from_bytes(fh.read(8), "little")
                    names = [k for k in json.loads(fh.read(n)) if k != "__metadata__"]
                index_json = index(names)
            else:
                index_json = index
            (dst / INDEX).write_text(index_json if isinstance(index_json, str) else json.dumps(index_json))
        return dst
    return write


def tensor(name, value):
    """A tensor edit: set ``name`` (DROP: remove it)."""
    def edit(t):
        if value is DROP:
            t.pop(name)
        else:
            t[name] = value
        return t
    return edit


# --- entry points ---------------------------------------------------------------------------------

def _q3():
    pytest.importorskip("flax")
    from jax_nbx.models import qwen3_moe
    return qwen3_moe


ENTRIES = {
    "load_moe": lambda p: load_moe(p, layer=0),
    "load_experts": lambda p: load_experts(p, layer=0),
    "load_moe[files]": lambda p: load_moe([p / ST], layer=0),
    "safetensors_files": safetensors_files,
    "MoEConfig.from_hf": nn.MoEConfig.from_hf,
    "Qwen3MoeConfig.from_hf": lambda p: _q3().Qwen3MoeConfig.from_hf(p),
    "load_hf": lambda p: _q3().load_hf(p),
    "from_peft": lambda p: from_peft(p, layer=0, num_experts=4, hidden_size=32, intermediate_size=16),
}


# --- the table: (id, writer, entry point, file named, fragments named) ------------------------------

CASES = []


def case(id_, writer, entries, file, *fragments):
    for e in entries.split():
        CASES.append(pytest.param(writer, e, file, fragments, id=f"{id_}-{e}"))


# safetensors files: header length, header JSON, each tensor's dtype/shape/offsets against the file
case("st-empty", fixture(raw=lambda b: b""), "load_moe", ST, "0 bytes", "too short")
case("st-7-bytes", fixture(raw=lambda b: b[:7]), "load_moe", ST, "7 bytes", "too short")
case("st-truncated-header", fixture(raw=lambda b: b[:100]), "load_moe load_hf", ST, "header length",
     "runs past the end")
case("st-truncated-shard", fixture(raw=lambda b: b[:len(b) * 6 // 10]), "load_moe load_experts load_hf "
     "load_moe[files]", ST, "data_offsets", "run past the end")
case("st-header-2^62", fixture(raw=lambda b: st_bytes({}, length=2 ** 62)), "load_moe load_hf load_moe[files]", ST,
     "header length 4611686018427387904", "runs past the end")
case("st-header-past-eof", fixture(raw=lambda b: st_bytes({}, b"", length=40)), "load_moe", ST, "header length 40")


def _sparse_header(tmp):  # a header length over safetensors' 100 MB limit, the file that long (sparse)
    folder = fixture()(tmp)
    with open(folder / ST, "wb") as f:
        f.write(struct.pack("<Q", 100_000_001))
        f.truncate(8 + 100_000_001)
    return folder


case("st-header-over-100MB", _sparse_header, "load_moe", ST, "exceeds safetensors' limit")
case("st-header-not-json", fixture(raw=lambda b: st_bytes(b"{not json")), "load_moe", ST, "not valid JSON at byte 9")
case("st-header-not-utf8", fixture(raw=lambda b: st_bytes(b'{"\xff": 1}')), "load_moe", ST, "not UTF-8 (byte 10)")
case("st-header-array", fixture(raw=lambda b: st_bytes([])), "load_moe", ST, "header (bytes 8..10) is a JSON array")
case("st-header-too-deep", fixture(raw=lambda b: st_bytes(b"[" * 100_000)), "load_moe", ST, "RecursionError")
case("st-info-not-object", fixture(raw=lambda b: st_bytes({"t": [1, 2]}, bytes(8))), "load_moe", ST, "tensor 't'",
     "not an object")
case("st-dtype-unknown", fixture(raw=lambda b: st_bytes({"t": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 1]}},
                                                        bytes(1))), "load_moe", ST, "tensor 't' has dtype 'Q4'")
case("st-dtype-missing", fixture(raw=lambda b: st_bytes({"t": {"shape": [2], "data_offsets": [0, 8]}}, bytes(8))),
     "load_moe", ST, "tensor 't' has dtype None")
for bad in (["2"], [-1], [True], [2.0], 2, None):
    case(f"st-shape-{bad}", fixture(raw=lambda b, bad=bad: st_bytes({"t": f32(bad, 0, 8)}, bytes(8))), "load_moe", ST,
         "tensor 't' has shape", "non-negative integers")
for bad in ([-8, 0], [8, 0], [0, 8, 8], [0], ["0", "8"], [0.0, 8.0], None):
    case(f"st-offsets-{bad}", fixture(raw=lambda b, bad=bad: st_bytes(
        {"t": {"dtype": "F32", "shape": [2], "data_offsets": bad}}, bytes(8))), "load_moe", ST,
        "tensor 't' has data_offsets", "0 <= begin <= end")
case("st-offsets-past-eof", fixture(raw=lambda b: st_bytes({"t": f32([2], 0, 8)}, bytes(4))), "load_moe", ST,
     "tensor 't' data_offsets [0, 8] run past the end of the file", "4 bytes")
case("st-1TiB-shape", fixture(raw=lambda b: st_bytes({"t": f32([2 ** 20, 2 ** 18], 0, 8)}, bytes(8))), "load_moe",
     ST, "tensor 't' (F32 [1048576, 262144]: 1099511627776 bytes) does not fit its data_offsets [0, 8]")
case("st-1TiB-offsets", fixture(raw=lambda b: st_bytes({"t": f32([2 ** 20, 2 ** 18], 0, 2 ** 40)}, bytes(8))),
     "load_moe load_hf", ST, "tensor 't' data_offsets [0, 1099511627776] run past the end")
case("st-overlap", fixture(raw=lambda b: st_bytes({"a": f32([2], 0, 8), "b": f32([2], 4, 12)}, bytes(12))),
     "load_moe", ST, "tensor 'b' data_offsets begin at 4", "overlapping")
case("st-gap", fixture(raw=lambda b: st_bytes({"a": f32([2], 0, 8), "b": f32([2], 12, 20)}, bytes(20))),
     "load_moe", ST, "tensor 'b' data_offsets begin at 12", "gap")
case("st-trailing-bytes", fixture(raw=lambda b: st_bytes({"a": f32([2], 0, 8)}, bytes(12))), "load_moe", ST,
     "cover 8 bytes of data but the file holds 12")
case("st-subbyte-misaligned", fixture(raw=lambda b: st_bytes(
    {"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, bytes(2))), "load_moe", ST, "'a' (F4 [3]: 12 bits)")
case("st-metadata", fixture(raw=lambda b: st_bytes({"__metadata__": {"format": 1}})), "load_moe", ST,
     "__metadata__={'format': 1}")
case("st-unreadable-dtype", fixture(raw=lambda b: st_bytes(
    {PFX + "gate.weight": {"dtype": "F4", "shape": [4, 32], "data_offsets": [0, 64]}}, bytes(64))), "load_moe", ST,
    f"tensor '{PFX}gate.weight'", "F4")

# model.safetensors.index.json
case("index-not-json", fixture(index="{"), "load_moe safetensors_files load_hf", INDEX, "not valid JSON at byte 1")
case("index-array", fixture(index="[]"), "load_moe safetensors_files", INDEX, "top level is a JSON array")
case("index-string", fixture(index='"model.safetensors"'), "safetensors_files", INDEX, "top level is a JSON string")
case("index-no-weight_map", fixture(index={"metadata": {}}), "load_moe safetensors_files load_hf", INDEX,
     "weight_map is missing")
for bad in ([], "model.safetensors", None, 3):
    case(f"index-weight_map-{bad}", fixture(index={"weight_map": bad}), "safetensors_files", INDEX,
         f"weight_map={bad!r} is not a JSON object")
case("index-weight_map-empty", fixture(index={"weight_map": {}}), "safetensors_files", INDEX, "weight_map is empty")
case("index-missing-file", fixture(index=lambda names: {"weight_map": {n: "model-00002-of-00002.safetensors"
                                                                       for n in names}}),
     "load_moe safetensors_files load_hf", INDEX, "'model-00002-of-00002.safetensors': no such file")
case("index-not-a-name", fixture(index=lambda names: {"weight_map": {n: 2 for n in names}}), "safetensors_files",
     INDEX, "]=2 is not a string")
case("index-outside-folder", fixture(index=lambda names: {"weight_map": {n: "../model.safetensors"
                                                                         for n in names}}),
     "safetensors_files", INDEX, "is not a file of the folder")
case("index-names-what-file-lacks", fixture(index=lambda names: {"weight_map": {**{n: ST for n in names},
                                                                                PFX + "gate.weight": ST}},
                                            tensors=tensor(PFX + "gate.weight", DROP)),
     "load_moe", INDEX, f"maps tensor '{PFX}gate.weight' to", "which does not hold it")

# config.json: the file, then each key the loaders read
for id_, text, what in (("not-json", "{not json", "not valid JSON at byte 1"),
                        ("array", "[1, 2]", "top level is a JSON array"),
                        ("string", '"Qwen3-30B-A3B"', "top level is a JSON string"),
                        ("null", "null", "top level is a JSON null"),
                        ("not-utf8", b'{"model_type": "\xff"}', "not UTF-8 (byte 16)"),
                        ("empty", "", "not valid JSON at byte 0")):
    case(f"config-{id_}", fixture(config=text),
         "load_moe MoEConfig.from_hf Qwen3MoeConfig.from_hf load_hf", CFG, what)
for bad in ("Qwen3", [], 3):
    case(f"config-text_config-{bad}", fixture(config=setting("text_config", bad)), "load_moe MoEConfig.from_hf", CFG,
         f"text_config={bad!r}")
case("config-model_type-list", fixture(config=setting("model_type", ["qwen3_moe"])), "load_moe MoEConfig.from_hf "
     "Qwen3MoeConfig.from_hf", CFG, "model_type")
BAD_INTS = ("8", -1, 0, True, [8], None, 2.5)
for key in ("num_local_experts", "hidden_size", "moe_intermediate_size", "num_experts_per_tok"):
    for bad in BAD_INTS:
        case(f"config-{key}-{bad!r}", fixture(config=setting(key, bad)), "load_moe MoEConfig.from_hf", CFG,
             f"{key}={bad!r}")
case("config-num_experts-alias", fixture(config=setting("num_experts", "4")), "load_moe MoEConfig.from_hf", CFG,
     "num_experts='4'", "disagree")
for key, bads in (("norm_topk_prob", ("yes", 1, None, [True])), ("hidden_act", (["silu"], None, 1, "relu")),
                  ("initializer_range", ("0.02", None, True, 10 ** 400, [0.02]))):
    for bad in bads:
        case(f"config-{key}-{bad!r}"[:60], fixture(config=setting(key, bad)), "load_moe MoEConfig.from_hf", CFG,
             f"{key}=")
for key in ("vocab_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "head_dim",
            "max_position_embeddings", "num_local_experts", "moe_intermediate_size"):
    for bad in ("4", -2, True, [4], 1.5):
        case(f"q3config-{key}-{bad!r}", fixture(config=setting(key, bad)), "Qwen3MoeConfig.from_hf load_hf", CFG,
             f"{key}={bad!r}")
for key, bad in (("rms_norm_eps", "1e-6"), ("rms_norm_eps", 0), ("rope_parameters", "default"),
                 ("tie_word_embeddings", "yes"), ("norm_topk_prob", None), ("num_local_experts", None)):
    case(f"q3config-{key}-{bad!r}", fixture(config=setting(key, bad)), "Qwen3MoeConfig.from_hf load_hf", CFG,
         f"{key}=")
case("q3config-rope_theta", fixture(config=setting("rope_parameters", "rope_theta", -1.0)),
     "Qwen3MoeConfig.from_hf", CFG, "rope_theta=-1.0")
case("q3config-no-head_dim-heads-over-width", fixture(config=lambda c: c.update(head_dim=None, num_attention_heads=64)),
     "Qwen3MoeConfig.from_hf", CFG, "head_dim")
case("q3config-layers-lie", fixture(config=setting("num_hidden_layers", 10 ** 6)), "load_hf", "",
     "tensor 'model.layers.1.input_layernorm.weight' is missing")
case("q3config-vocab-lie", fixture(config=setting("vocab_size", 10 ** 9)), "load_hf", ST,
     "tensor 'model.embed_tokens.weight' has shape (32, 32); expected (1000000000, 32)")

# tensors: missing, mis-shaped, of the wrong dtype (extra tensors: test below)
case("tensor-missing-expert", fixture(tensors=tensor(PFX + "experts.3.up_proj.weight", DROP)),
     "load_moe load_experts load_hf", "", f"tensor '{PFX}experts.3.up_proj.weight' is missing from")
case("tensor-missing-router", fixture(tensors=tensor(PFX + "gate.weight", DROP)), "load_moe", "",
     f"the router of '{PFX}' is missing from")
case("tensor-missing-attention", fixture(tensors=tensor("model.layers.0.self_attn.k_norm.weight", DROP)), "load_hf",
     "", "tensor 'model.layers.0.self_attn.k_norm.weight' is missing")
case("tensor-misshaped-expert", fixture(tensors=tensor(PFX + "experts.1.down_proj.weight",
                                                       np.zeros((32, 15), np.float32))),
     "load_moe load_hf", ST, f"'{PFX}experts.1.down_proj.weight' has shape (32, 15); expected (32, 16)")
case("tensor-scalar-expert", fixture(tensors=tensor(PFX + "experts.0.gate_proj.weight", np.zeros((), np.float32))),
     "load_moe", ST, f"'{PFX}experts.0.gate_proj.weight' has shape ()", "2 axes")
case("tensor-router-1d", fixture(tensors=tensor(PFX + "gate.weight", np.zeros(4, np.float32))), "load_moe", ST,
     f"'{PFX}gate.weight' has shape (4,)")
case("tensor-router-lies", fixture(config=setting("num_local_experts", 3)), "load_moe", ST,
     f"'{PFX}gate.weight' has shape (4, 32); expected (3, 32)")
for name in (PFX + "gate.weight", PFX + "experts.2.down_proj.weight", "model.layers.0.self_attn.q_proj.weight"):
    case(f"tensor-int-{name.split('.')[-2]}", fixture(tensors=lambda t, name=name: tensor(name, t[name].astype(
        np.int32))(t)), "load_hf" if "self_attn" in name else "load_moe load_hf", ST, f"'{name}' has dtype I32")

# quantization_config (AWQ, GPTQ), through load_moe
QC = "quantization_config"
for bad in ("awq", [], 4):
    case(f"qc-{bad!r}", fixture("awq", config=setting(QC, bad)), "load_moe", CFG, f"quantization_config={bad!r}")
case("qc-text_config", fixture("awq", config=lambda c: c.update(text_config={**c, QC: "awq"}, **{QC: None})),
     "load_moe", CFG, "text_config.quantization_config='awq'")
for key, bads in (("quant_method", (["awq"], 5)), ("bits", ("4", True, 0, None, [4], 4.0)),
                  ("group_size", ("32", True, [32], -2, 32.0)), ("format", (5, ["gemm"])),
                  ("checkpoint_format", (True,)), ("version", ({"v": "gemm"},)), ("pack_dtype", (32,))):
    for bad in bads:
        case(f"qc-{key}-{bad!r}", fixture("awq", config=setting(QC, key, bad)), "load_moe", CFG,
             f"quantization_config.{key}={bad!r}")
case("awq-group_size-vs-shapes", fixture("awq", config=setting(QC, "group_size", 64)), "load_moe", ST,
     "group_size=64 does not match the shapes")
case("gptq-qweight-float", fixture("gptq", tensors=lambda t: tensor(
    PFX + "experts.1.up_proj.qweight", t[PFX + "experts.1.up_proj.qweight"].view(np.float32))(t)), "load_moe", ST,
    f"{PFX}experts.1.up_proj.*", "qweight has dtype float32")
case("gptq-g_idx-short", fixture("gptq", tensors=lambda t: tensor(
    PFX + "experts.0.down_proj.g_idx", t[PFX + "experts.0.down_proj.g_idx"][:-1])(t)), "load_moe", ST,
    "g_idx has shape (63,)")
case("gptq-qweight-1d", fixture("gptq", tensors=lambda t: tensor(
    PFX + "experts.0.gate_proj.qweight", t[PFX + "experts.0.gate_proj.qweight"].ravel())(t)), "load_moe", ST,
    "qweight has shape (1024,)")
case("gptq-inferred-1d", fixture("gptq", config=setting(QC, "quant_method", DROP), tensors=lambda t: tensor(
    PFX + "experts.0.gate_proj.qweight", t[PFX + "experts.0.gate_proj.qweight"].ravel())(t)), "load_moe", ST,
    f"'{PFX}experts.0.gate_proj.qweight' has shape (1024,); expected 2 axes")

# FP8 (transformers' block, compressed-tensors'), NVFP4
for bad in ([0, 128], 128, [128], ["128", 128], [True, 128], [128, 128, 128], None, "128x128", [128, 48]):
    case(f"fp8-weight_block_size-{bad!r}", fixture("fp8", config=setting(QC, "weight_block_size", bad)), "load_moe",
         CFG, f"quantization_config.weight_block_size={bad!r}")
for path, bad, named in ((("config_groups",), "group_0", "quantization_config.config_groups='group_0'"),
                         (("config_groups", "group_0"), 5, "quantization_config.config_groups.group_0=5"),
                         (("config_groups", "group_0", "weights"), [], "config_groups.group_0.weights=[]"),
                         (("format",), 7, "quantization_config.format=7")):
    case(f"fp8ct-{'.'.join(path)}", fixture("fp8_ct", config=setting(QC, *path, bad)), "load_moe", CFG, named)
case("fp8ct-block_structure", fixture("fp8_ct", config=lambda c: c[QC]["config_groups"]["group_0"]["weights"].update(
    strategy="block", block_structure=128)), "load_moe", CFG, "weights.block_structure=128")
case("nvfp4-group-format", fixture("nvfp4", config=setting(QC, "config_groups", "group_0", "format", ["x"])),
     "load_moe", CFG, "quantization_config.config_groups.group_0.format=['x']")
case("nvfp4-groups-list", fixture("nvfp4", config=setting(QC, "config_groups", [])), "load_moe", CFG,
     "quantization_config.config_groups=[]")

# MLX's quantization
Q, GATE = "quantization", "model.layers.0.mlp.gate"
for bad in ("affine", [], 4):
    case(f"mlx-quantization-{bad!r}", fixture("mlx", config=setting(Q, bad)), "load_moe", CFG, f"quantization={bad!r}")
for key, bads in (("bits", ("4", True, 0, None, [4])), ("group_size", ("32", [32], -1, None, 32.0)),
                  ("mode", (4, None, "fp3", "int4"))):
    for bad in bads:
        case(f"mlx-{key}-{bad!r}", fixture("mlx", config=setting(Q, key, bad)), "load_moe", CFG,
             f"quantization.{key}={bad!r}")
    case(f"mlx-router-{key}", fixture("mlx", config=setting(Q, GATE, key, bads[0])), "load_moe", CFG,
         f"quantization.{GATE}.{key}={bads[0]!r}")
case("mlx-module-entry", fixture("mlx", config=setting(Q, GATE, "8 bits")), "load_moe", CFG,
     f"quantization.{GATE}='8 bits'")

# gpt-oss's MXFP4 tensors
case("gpt_oss-scales-1d", fixture("gpt_oss", tensors=tensor(PFX + "experts.gate_up_proj_scales",
                                                            np.zeros(8, np.uint8))), "load_moe", ST,
     "gate_up_proj_scales has shape (8,)")
case("gpt_oss-blocks-float", fixture("gpt_oss", tensors=lambda t: tensor(
    PFX + "experts.down_proj_blocks", t[PFX + "experts.down_proj_blocks"].astype(np.float32))(t)), "load_moe", ST,
    "down_proj_blocks / down_proj_scales have dtypes float32 / uint8")
case("gpt_oss-bias-int", fixture("gpt_oss", tensors=lambda t: tensor(
    PFX + "experts.down_proj_bias", t[PFX + "experts.down_proj_bias"].astype(np.int16))(t)), "load_moe", ST,
    f"'{PFX}experts.down_proj_bias' has dtype I16")

# PEFT: adapter_config.json and adapter_model.safetensors
for text, what in (("{", "not valid JSON at byte 1"), ("[]", "top level is a JSON array"),
                   ('"lora"', "top level is a JSON string")):
    case(f"peft-config-{what.split()[-1]}", fixture("peft", config=text), "from_peft", ACFG, what)
for key, bads in (("r", ("4", -1, 0, True, None, [4])), ("lora_alpha", ("8", None, True, [8], float("nan"))),
                  ("target_parameters", ("mlp.experts.down_proj", 5)), ("rank_pattern", ("x", [])),
                  ("alpha_pattern", (3,))):
    for bad in bads:
        case(f"peft-{key}-{bad!r}", fixture("peft", config=setting(key, bad)), "from_peft", ACFG, f"{key}=")
for key, bad, named in (("rank_pattern", {"gate_up_proj": "8"}, "rank_pattern['gate_up_proj']='8'"),
                        ("rank_pattern", {"gate_up_proj": 0}, "rank_pattern['gate_up_proj']=0"),
                        ("alpha_pattern", {"down_proj": [2]}, "alpha_pattern['down_proj']=[2]"),
                        ("rank_pattern", {"[": 4}, "rank_pattern key '[' is not a regular expression")):
    case(f"peft-{key}-{named[-12:]}", fixture("peft", config=setting(key, bad)), "from_peft", ACFG, named)
case("peft-st-truncated", fixture("peft", raw=lambda b: b[:len(b) // 2]), "from_peft", AST, "run past the end")
case("peft-st-2^62", fixture("peft", raw=lambda b: st_bytes({}, length=2 ** 62)), "from_peft", AST,
     "header length 4611686018427387904")
A, B = (f"base_model.model.model.layers.0.mlp.experts.lora_{x}.weight" for x in "AB")
case("peft-tensor-int", fixture("peft", tensors=lambda t: tensor(A, t[A].astype(np.int32))(t)), "from_peft", AST,
     f"'{A}' has dtype int32")
case("peft-tensor-rank0", fixture("peft", tensors=lambda t: {**t, A: t[A][:0], B: t[B][:, :0]}), "from_peft", AST,
     "has rank 0 but the config's r gives r=4")
case("peft-tensor-unreadable", fixture("peft", raw=lambda b: st_bytes(
    {A: {"dtype": "F4", "shape": [16, 16], "data_offsets": [0, 128]}}, bytes(128))), "from_peft", AST,
    f"tensor '{A}' (F4 [16, 16]) cannot be read")


@pytest.mark.parametrize("writer, entry, file, fragments", CASES)
def test_malformed_file_is_a_checkpoint_error_naming_the_file(tmp_path, writer, entry, file, fragments):
    folder = writer(tmp_path)
    with pytest.raises(CheckpointError) as info:
        ENTRIES[entry](folder)
    msg = str(info.value)
    path = str(folder / file) if file else str(folder)
    assert path in msg, f"{path} not named in: {msg}"
    for f in fragments:
        assert f in msg, f"{f!r} not in: {msg}"


@pytest.mark.parametrize("base, entries", [("tiny", "load_moe load_experts load_moe[files] safetensors_files "
                                                    "MoEConfig.from_hf Qwen3MoeConfig.from_hf load_hf"),
                                           ("awq", "load_moe"), ("fp8", "load_moe"), ("fp8_ct", "load_moe"),
                                           ("nvfp4", "load_moe"), ("mlx", "load_moe"), ("gpt_oss", "load_moe"),
                                           ("gptq", "load_moe"), ("peft", "from_peft")])
def test_the_fixtures_read(tmp_path, base, entries):
    """The table's fixtures, unbroken (and with an index naming their one file), load: each case's
    error is its edit's."""
    folder = fixture(base)(tmp_path)
    for e in entries.split():
        ENTRIES[e](folder)
    if base == "tiny":
        fixture(index=lambda names: {"weight_map": dict.fromkeys(names, ST)})(tmp_path / "index")
        load_moe(tmp_path / "index" / "ckpt", layer=0)


def test_extra_tensors_are_ignored_by_load_moe(tmp_path):
    """Tensors load_moe does not read (another layer's, unknown names) are ignored; from_peft
    refuses them (tests/library/test_lora_peft.py)."""
    folder = fixture(tensors=lambda t: {**t, PFX + "experts.9.extra.weight": np.zeros(3, np.float32),
                                        "unrelated": np.zeros((2, 2), np.float32)})(tmp_path)
    assert len(load_moe(folder, layer=0).experts.gate) == 4
