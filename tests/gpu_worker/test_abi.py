"""The C kernels' one header (csrc/rivulet_kernels.h) and the check of the Python side against it."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from gpu_worker.backends.cpu import abi
from gpu_worker.backends.cpu import kernels as cpu_kernels
from gpu_worker.backends.cpu.build import CSRC
from tests.gpu_worker.helpers import KINDS

# A function declared (not defined) at the top level of a .c file: a copy of another file's prototype.
PROTOTYPE = re.compile(r"^(?:const )?\w+ \**\w+\([^;{]*\);", re.M)


@pytest.fixture(scope="module")
def kernels() -> cpu_kernels.CpuKernels:
    """The worker's own kind only: the check is the same for every kind."""
    return cpu_kernels.CpuKernels(cpu_kernels.build(KINDS[-1]), KINDS[-1])


def header_with(old: str, new: str) -> abi.Header:
    text = abi.HEADER.read_text()
    assert text.count(old) == 1, old
    return abi.parse(text.replace(old, new))


def test_every_c_file_takes_the_one_header_and_redeclares_nothing() -> None:
    for path in sorted(CSRC.glob("*.c")):
        text = re.sub(r"/\*.*?\*/", "", path.read_text(), flags=re.S)
        assert '#include "rivulet_kernels.h"' in text, path.name
        assert PROTOTYPE.findall(text) == [], f"{path.name} re-declares a function"


def test_the_bindings_match_the_header(kernels: cpu_kernels.CpuKernels) -> None:
    """Loading checked them; what was checked covers every function the Python side calls."""
    bound = {fn.__name__ for fn in abi.bound_functions(kernels)}
    assert {"kernel_isa", "paged_decode_attention", "quant_matmul", "decode_layers", "moe_experts"} <= bound
    assert bound <= set(abi.read_header().functions)
    abi.check_kernels(kernels)


def test_a_changed_argtype_fails_naming_the_function(kernels: cpu_kernels.CpuKernels) -> None:
    copy = ctypes.CDLL(str(kernels.path)).quant_matmul
    copy.argtypes = list(kernels._quant_matmul.argtypes)
    copy.argtypes[3] = ctypes.c_int  # k is int64_t
    copy.restype = ctypes.c_int
    structs, constants = abi.python_side()
    with pytest.raises(abi.AbiMismatch, match=r"quant_matmul: arguments \(int, ptr, int64_t, int, "):
        abi.check([copy], structs, constants)
    copy.argtypes[3] = ctypes.c_int64
    copy.restype = None
    with pytest.raises(abi.AbiMismatch, match="quant_matmul: returns void, the header's int"):
        abi.check([copy], structs, constants)


def test_a_changed_struct_field_or_constant_is_named() -> None:
    structs, constants = abi.python_side()
    assert abi.struct_problems(structs, abi.read_header()) == []
    changed = header_with("    int64_t row_bytes;      /* bytes of one row */", "    int row_bytes;")
    assert [p.split(":")[0] for p in abi.struct_problems(structs, changed)] == ["struct moe_projection"]
    swapped = header_with(
        "    float eps;   /* RMSNorm's epsilon */\n    float scale;", "    float scale;\n    float eps;"
    )
    assert [p.split(":")[0] for p in abi.struct_problems(structs, swapped)] == ["struct decode_dims"]
    parts = header_with("#define MAX_PARTS 3 ", "#define MAX_PARTS 4 ")
    assert [p.split(":")[0] for p in abi.constant_problems(constants, parts)] == ["MAX_PARTS"]
    assert [p.split(":")[0] for p in abi.struct_problems(structs, parts)] == ["struct decode_linear"]
    x8 = header_with("#define QTYPE_X8 0x100 ", "#define QTYPE_X8 0x400 ")
    assert abi.constant_problems(constants, x8) == ["QTYPE_X8: 256 in Python, 1024 in rivulet_kernels.h"]


def test_statuses_are_named_on_both_sides() -> None:
    assert abi.status_problems(abi.read_header()) == []
    renumbered = header_with("RV_ERR_TOP_K = 9,", "RV_ERR_TOP_K = 12,")
    assert abi.status_problems(renumbered) != []
    assert abi.status_text(2) == "RV_ERR_K (2)"
    assert abi.status_text(99) == "status 99 (not in rivulet_kernels.h)"


def test_a_declaration_out_of_the_header_style_is_refused() -> None:
    with pytest.raises(abi.AbiMismatch, match="cannot read"):
        header_with("int quant_supported(int type);", "long quant_supported(int type);")
    with pytest.raises(abi.AbiMismatch, match="cannot read"):
        header_with("    int64_t n;              /* an expert's rows */", "    int64_t n, m;")


def test_a_refused_call_names_its_status(kernels: cpu_kernels.CpuKernels) -> None:
    x, router = torch.randn(2, 64), torch.randn(4, 64)
    with pytest.raises(RuntimeError, match=r"moe_route failed: RV_ERR_TOP_K \(9\)"):
        kernels.moe_route(x, router, 5, True)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_the_compiler_checks_a_definition_against_the_header(tmp_path: Path) -> None:
    """What each .c gains from including the header: a definition that drifts does not compile."""
    source = tmp_path / "drift.c"
    source.write_text(
        '#include "rivulet_kernels.h"\nint quant_supported(int64_t type) { return type > 0; }\n'
    )
    done = subprocess.run(
        ["cc", "-std=c11", "-fsyntax-only", "-I", str(CSRC), str(source)], capture_output=True, text=True
    )
    assert done.returncode != 0 and "quant_supported" in done.stderr
