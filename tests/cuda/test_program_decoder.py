"""The CUDA handler's launch-program decoder (xla_ffi/cuda/program.h), run
without a GPU through `_ffi_testing.decode_program`: it reads back exactly the
launches `plan.py` encodes, and names what is wrong with a malformed program.
Then the Triton side of the contract: plan, compile and kernels take their
shared values from `jax_nbx.contract` (xla_ffi/abi.h)."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from jax_nbx import contract  # noqa: E402
from jax_nbx.backends.cuda import compile as C  # noqa: E402
from jax_nbx.backends.cuda import plan  # noqa: E402

from support import ffi_testing  # noqa: E402

ffi = ffi_testing.load()  # jax_nbx._ffi_testing: the decoder's test bindings
pytestmark = pytest.mark.fast
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype("float32")

# T, band, k, E, H, I, x dtype, w dtype (the scales' when quantized), activation, quant
PROGRAMS = {
    "decode-dense-f32": (1, 1, 2, 4, 33, 20, F32, F32, 0, None),
    "decode-dense-bands": (6, 2, 2, 5, 40, 24, BF16, BF16, 1, None),
    "decode-split-k": (1, 1, 2, 8, 300, 200, F32, F32, 0, None),
    "prefill-dense-bf16": (40, 40, 2, 6, 40, 24, BF16, BF16, 1, None),
    "prefill-dense-bands": (50, 16, 2, 6, 40, 24, F32, F32, 0, None),
    "decode-int8": (2, 2, 2, 5, 128, 256, F32, F32, 0, ("int8", 0)),
    "prefill-int8-bands": (40, 16, 2, 5, 128, 256, F32, BF16, 0, ("int8", 0)),
    "decode-int4": (2, 2, 2, 5, 128, 128, F32, BF16, 1, ("int4", 128)),
    "prefill-int4": (40, 40, 2, 5, 128, 256, F32, F32, 0, ("int4", 32)),
    "prefill-int4-bands": (70, 24, 2, 5, 128, 256, F32, BF16, 0, ("int4", 64)),
}


def _build(name):
    T, band, k, E, H, I, xd, wd, act, quant = PROGRAMS[name]
    prog = plan.build(T, band, k, E, H, I, xd, wd, act, quant=quant)
    groups = len(contract.parts_of(quant[0] if quant else None)) * len(contract.PROJECTIONS)
    return prog, groups


def _expected(prog):
    index = {key: i for i, key in enumerate(prog.kernels())}
    return [(index[ln.compile_key()], tuple(ln.grid), [(a.kind, a.index, a.offset) for a in ln.args])
            for ln in prog.launches]


def _decode(prog, groups, program=None, n_tables=None):
    return ffi.decode_program(prog.encode() if program is None else program, len(prog.kernels()),
                              contract.IN_GROUP0 + groups, groups if n_tables is None else n_tables,
                              prog.workspace_bytes)


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_decoder_reads_back_the_plans_launches(name):
    prog, groups = _build(name)
    got = _decode(prog, groups)
    assert got == _expected(prog)
    # the paths and bands the case is named for really are in the program
    kernels = {ln.kernel.name for ln in prog.launches}
    assert ("decode1" if name.startswith("decode") else "gemm1") in kernels
    combines = sum(ln.kernel.name in ("combine", "combine_slots") for ln in prog.launches)
    T, band = PROGRAMS[name][:2]
    assert combines == -(-T // band)
    if "bands" in name:
        assert combines > 1


def test_decoder_takes_a_list_and_an_empty_program():
    prog, groups = _build("decode-dense-f32")
    assert _decode(prog, groups, program=prog.encode().tolist()) == _expected(prog)
    assert ffi.decode_program(np.zeros(0, np.int64), 0, 3, 3, 0) == []


@pytest.mark.parametrize("name", ["decode-dense-f32", "prefill-int8-bands", "prefill-int4"])
def test_program_needs_every_group_of_its_format(name):
    """The tables a program reads are its format's groups (3 per part, abi.h order)."""
    prog, groups = _build(name)
    used = {a.index for ln in prog.launches for a in ln.args if a.kind == contract.ARG_TABLE}
    assert used == set(range(groups))
    with pytest.raises(ValueError, match="bad table index"):
        _decode(prog, groups, n_tables=groups - 1)


def test_backward_program_decodes_with_its_outputs_and_tables():
    """The backward's program (plan.build_backward) reads inputs up to dy
    (after the weight groups), outputs dx and d(topk_weights) only, and the
    weights' tables then their gradients' (3 + 3); the decoder refuses it
    with fewer of any."""
    from jax_nbx.backends.cuda import plan as P

    prog = P.build_backward(70, 40, 2, 5, 48, 40, np.float32, np.float32, 0)
    n_in = P.backward_inputs(3) + 1
    assert n_in == contract.IN_GROUP0 + 4
    got = ffi.decode_program(prog.encode(), len(prog.kernels()), n_in, 6, prog.workspace_bytes, 2)
    assert got == _expected(prog)
    outs = {a.index for ln in prog.launches for a in ln.args if a.kind == contract.ARG_OUTPUT}
    assert outs == {contract.OUT_DX, contract.OUT_DTOPK_WEIGHTS}
    tables = {a.index for ln in prog.launches for a in ln.args if a.kind == contract.ARG_TABLE}
    assert tables == set(range(6))
    with pytest.raises(ValueError, match="bad output index 1"):
        ffi.decode_program(prog.encode(), len(prog.kernels()), n_in, 6, prog.workspace_bytes)
    with pytest.raises(ValueError, match="bad table index 5"):
        ffi.decode_program(prog.encode(), len(prog.kernels()), n_in, 5, prog.workspace_bytes, 2)
    with pytest.raises(ValueError, match="bad input index"):
        ffi.decode_program(prog.encode(), len(prog.kernels()), n_in - 1, 6, prog.workspace_bytes, 2)


def test_encoding_layout_is_the_abis():
    prog, _ = _build("prefill-dense-bands")
    enc = prog.encode()
    assert enc.dtype == np.int64
    assert len(enc) == sum(contract.LAUNCH_HEADER + contract.ARG_FIELDS * len(ln.args) for ln in prog.launches)


# --------------------------------------------------------------------------- malformed programs

N_KERNELS, N_INPUTS, N_TABLES, WS_BYTES = 2, contract.IN_GROUP0 + 3, 3, 512


def _launch(kernel=0, grid=(1, 1, 1), args=(), nargs=None):
    out = [kernel, *grid, len(args) if nargs is None else nargs]
    for a in args:
        out += list(a)
    return out


GOOD = _launch(1, (4, 2, 1), [(contract.ARG_INPUT, contract.IN_X, 64), (contract.ARG_WORKSPACE, 0, 256),
                              (contract.ARG_TABLE, 2, 0), (contract.ARG_OUTPUT, 0, 8), (contract.ARG_I32, 0, -5)])


def _decode_raw(program):
    return ffi.decode_program(np.asarray(program, np.int64), N_KERNELS, N_INPUTS, N_TABLES, WS_BYTES)


def test_good_hand_written_program():
    got = _decode_raw(GOOD + _launch(0, (0, 1, 1)))
    assert got == [(1, (4, 2, 1), [(0, 0, 64), (2, 0, 256), (3, 2, 0), (1, 0, 8), (4, 0, -5)]),
                   (0, (0, 1, 1), [])]


BAD = {
    "truncated header": (GOOD + [0, 1, 1], r"truncated launch program: launch 1 .*header"),
    "truncated args": (GOOD + _launch(0, args=[(contract.ARG_I32, 0, 1)], nargs=2),
                       r"truncated launch program: launch 1 .*2 arguments"),
    "huge nargs": (_launch(0, nargs=2**62), r"truncated launch program: launch 0 .*arguments"),
    "kernel past the table": (GOOD + _launch(N_KERNELS), rf"launch 1 .*names kernel {N_KERNELS}\b"),
    "negative kernel": (_launch(-1), r"names kernel -1"),
    "negative nargs": (_launch(0, nargs=-1), r"negative argument count"),
    "unknown kind": (_launch(0, args=[(5, 0, 0)]), r"unknown argument kind 5 in launch 0 .*argument 0"),
    "negative kind": (GOOD + _launch(0, args=[(contract.ARG_I32, 0, 1), (-1, 0, 0)]),
                      r"unknown argument kind -1 in launch 1 .*argument 1"),
    "input index past the inputs": (_launch(0, args=[(contract.ARG_INPUT, N_INPUTS, 0)]),
                                    rf"bad input index {N_INPUTS}\b"),
    "negative input index": (_launch(0, args=[(contract.ARG_INPUT, -1, 0)]), r"bad input index -1"),
    "table index past the groups": (_launch(0, args=[(contract.ARG_TABLE, N_TABLES, 0)]),
                                    rf"bad table index {N_TABLES}\b"),
    "workspace offset past the end": (_launch(0, args=[(contract.ARG_WORKSPACE, 0, WS_BYTES)]),
                                      rf"workspace offset {WS_BYTES} .*outside the workspace"),
    "negative workspace offset": (_launch(0, args=[(contract.ARG_WORKSPACE, 0, -8)]),
                                  r"workspace offset -8 .*outside the workspace"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_malformed_program_is_refused_with_its_problem(case):
    program, pattern = BAD[case]
    with pytest.raises(ValueError, match=pattern):
        _decode_raw(program)


def test_truncated_plan_program_is_refused():
    prog, groups = _build("prefill-int4-bands")
    enc = prog.encode()
    for cut in (1, 2, 3, len(enc) - 1):
        with pytest.raises(ValueError, match="truncated launch program"):
            _decode(prog, groups, program=enc[:cut])


def test_kernel_table_rows_are_checked_against_the_blob():
    row = [0, 4, 4, 96, 4, 1024, -7]  # name [0, 4), cubin [4, 100)
    assert ffi.decode_kernel_table(row * 2, 100) == [tuple(row)] * 2
    with pytest.raises(ValueError, match=f"expected a multiple of {len(contract.KERNEL_FIELDS)}"):
        ffi.decode_kernel_table(row[:-1], 100)
    for bad in ([0, 4, 4, 97], [-1, 4, 4, 96], [0, -1, 4, 96], [0, 4, 4, -1], [2**62, 2**62, 0, 1]):
        with pytest.raises(ValueError, match="outside the cubin blob"):
            ffi.decode_kernel_table(bad + row[4:], 100)


# --------------------------------------------------------------------------- the Triton side

def test_plan_and_compile_read_the_abi():
    assert (plan.ARG_INPUT, plan.ARG_OUTPUT, plan.ARG_WORKSPACE, plan.ARG_TABLE, plan.ARG_I32) == (
        contract.ARG_INPUT, contract.ARG_OUTPUT, contract.ARG_WORKSPACE, contract.ARG_TABLE, contract.ARG_I32)
    assert (plan.IN_X, plan.IN_W, plan.IN_IDS, plan.IN_GROUP0) == (
        contract.IN_X, contract.IN_W, contract.IN_IDS, contract.IN_GROUP0)
    assert [plan.IN_GATE, plan.IN_UP, plan.IN_DOWN] == [
        contract.IN_GROUP0 + contract.group_index(contract.PARTS.index("q"), p) for p in range(3)]
    assert plan.ERR_NONE == contract.ERR_NONE
    assert plan.WS_ALIGN == contract.WORKSPACE_ALIGN
    assert plan.QUANT_CODES == contract.FORMAT_CODES
    assert C.KERNEL_FIELDS == contract.KERNEL_FIELDS


def test_kernels_constexprs_are_the_abis():
    pytest.importorskip("triton", reason="the CUDA path's kernels need Triton")
    from jax_nbx.backends.cuda import kernels

    def value(c):
        return getattr(c, "value", c)

    assert value(kernels.ERR_NONE) == contract.ERR_NONE
    assert value(kernels.ACT_GEGLU) == contract.ACT_GEGLU
    assert value(kernels.GELU_C) == contract.GELU_C
    assert value(kernels.GELU_B) == contract.GELU_B
    assert value(kernels.QUANT_DENSE) == contract.FORMAT_CODES["dense"]
    assert value(kernels.QUANT_INT8) == contract.FORMAT_CODES["int8"]


def test_no_hand_copied_contract_values():
    """The contract's numbers appear in the Triton modules only through contract."""
    import jax_nbx.backends.cuda as pkg

    root = os.path.dirname(pkg.__file__)
    here = os.path.join(os.path.dirname(os.path.dirname(__file__)), "support")
    for f in ("plan.py", "compile.py", "kernels.py", "kernels_backward.py", "calls.py",
              os.path.join(here, "triton_interpret.py")):
        src = open(os.path.join(root, f)).read()
        for literal in ("0.79788456", "0.044715", "2**31", "0x7fffffff", "2147483647", '"name_off"'):
            assert literal not in src, f"{f} hand-copies {literal}"
