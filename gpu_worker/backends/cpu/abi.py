"""The C kernels' ABI as csrc/rivulet_kernels.h declares it, and the Python side checked against it.

The header is the one place the ABI is written; the ctypes bindings (kernels.py, quant_kernels.py),
the ctypes structs (decode_layers.py, experts.py) and the mirrored constants (dtype and ISA codes,
X8/A8, MAX_PARTS, ...) are checked against it each time a library is loaded, and a mismatch raises
``AbiMismatch`` naming the function, struct or constant. Checked rather than generated: the bindings
stay plain Python a reader (and mypy) can follow, and the check costs one parse of a small file.

The parser reads only the header's own plain style (its first comment lists the forms) and refuses
anything else, so a declaration it cannot read fails the load too rather than going unchecked.
"""

from __future__ import annotations

import ctypes
import dataclasses
import enum
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

_FUNCTION_TYPE = ctypes.CFUNCTYPE(None).__mro__[1]  # ctypes._CFuncPtr: what a library's functions are
HEADER = Path(__file__).resolve().parent / "csrc" / "rivulet_kernels.h"


class AbiMismatch(Exception):
    """The Python side of the kernels disagrees with csrc/rivulet_kernels.h (a programming error:
    not caught by ``kernels.load``, so the worker does not fall back to torch silently)."""


class KernelStatus(enum.IntEnum):
    """What a kernel returns (rivulet_kernels.h's enum rv_status, checked at load)."""

    RV_OK = 0
    RV_ERR_TYPE = 1
    RV_ERR_K = 2
    RV_ERR_DTYPE = 3
    RV_ERR_NO_MEMORY = 4
    RV_ERR_X8_ROWS = 5
    RV_ERR_PARTS = 6
    RV_ERR_EXPERT_SIZE = 7
    RV_ERR_EXPERT_FORMATS = 8
    RV_ERR_TOP_K = 9
    RV_ERR_HEADS = 10
    RV_ERR_TIMEOUT = 11


def status_text(status: int) -> str:
    """A kernel's status as its name and number: ``RV_ERR_K (2)``."""
    try:
        return f"{KernelStatus(status).name} ({status})"
    except ValueError:
        return f"status {status} (not in rivulet_kernels.h)"


@dataclasses.dataclass(frozen=True)
class Header:
    """The declarations of rivulet_kernels.h, each type as ``c_type`` spells it."""

    constants: dict[str, int]
    statuses: dict[str, int]
    structs: dict[str, list[tuple[str, str]]]  # name -> its fields (name, type) in order
    functions: dict[str, tuple[str, list[str]]]  # name -> (return type, argument types)
    variables: dict[str, str]


_SCALARS = {"int", "int64_t", "float", "void", "uint8_t", "uint16_t"}
_DEFINE = re.compile(r"#define (\w+)(?: (0x[0-9a-fA-F]+|-?\d+))?")
_ENUM = re.compile(r"enum rv_status \{(.*?)\};", re.S)
_STATUS = re.compile(r"(\w+) = (\d+)")
_STRUCT = re.compile(r"typedef struct \{(.*?)\} (\w+);", re.S)
_DECL = re.compile(r"(?:const )?(\w+) (\**)(\w+)(?:\[(\w+)\])?")
_FUNCTION = re.compile(r"(\w+) (\**)(\w+)\((.*)\)")


def parse(text: str) -> Header:
    """The declarations of a header in rivulet_kernels.h's style; AbiMismatch on anything else."""
    constants, rest = _preprocessed(text)
    statuses = {}
    for block in _ENUM.findall(rest):
        for entry in (e.strip() for e in block.split(",") if e.strip()):
            match = _STATUS.fullmatch(entry)
            if match is None:
                raise AbiMismatch(f"rivulet_kernels.h: cannot read the status {entry!r}")
            statuses[match[1]] = int(match[2])
    rest = _ENUM.sub(" ", rest)
    structs: dict[str, list[tuple[str, str]]] = {}
    for fields, name in _STRUCT.findall(rest):  # in order: a struct may hold one declared before it
        structs[name] = _fields(fields, constants, structs)
    functions: dict[str, tuple[str, list[str]]] = {}
    variables = {}
    for statement in (s.strip() for s in _STRUCT.sub(" ", rest).split(";")):
        if statement.startswith("extern "):
            kind, name, _ = _declared(statement.removeprefix("extern "), constants, structs)
            variables[name] = kind
        elif statement:
            functions.update([_function(statement, constants, structs)])
    return Header(constants, statuses, structs, functions, variables)


def _preprocessed(text: str) -> tuple[dict[str, int], str]:
    """The header's #define constants, and the rest on one line, without comments."""
    constants: dict[str, int] = {}
    body = []
    for line in re.sub(r"/\*.*?\*/", " ", text, flags=re.S).splitlines():
        if not line.startswith("#"):
            body.append(line)
            continue
        match = _DEFINE.fullmatch(line.strip())
        if match is not None and match[2] is not None:
            constants[match[1]] = int(match[2], 0)
        elif match is None and not re.fullmatch(r"#(ifndef \w+|include <\w+\.h>|endif)", line.strip()):
            raise AbiMismatch(f"rivulet_kernels.h: cannot read {line.strip()!r}")
    return constants, " ".join(" ".join(body).split())


def _declared(text: str, constants: Mapping[str, int], structs: Mapping[str, Any]) -> tuple[str, str, int]:
    """(type, name, array length or 0) of one declarator: ``const int64_t *n[MAX_PARTS]``."""
    match = _DECL.fullmatch(text.strip())
    if match is None or (match[1] not in _SCALARS and match[1] not in structs):
        raise AbiMismatch(f"rivulet_kernels.h: cannot read the declaration {text.strip()!r}")
    kind = "ptr" if match[2] else match[1]
    if match[4] is None:
        return kind, match[3], 0
    length = constants.get(match[4], None) if not match[4].isdigit() else int(match[4])
    if length is None:
        raise AbiMismatch(f"rivulet_kernels.h: {match[3]}'s length {match[4]} is no #define")
    return kind, match[3], length


def _fields(text: str, constants: Mapping[str, int], structs: Mapping[str, Any]) -> list[tuple[str, str]]:
    fields = []
    for field in (f for f in text.split(";") if f.strip()):
        kind, name, length = _declared(field, constants, structs)
        fields.append((name, f"{kind}[{length}]" if length else kind))
    return fields


def _function(
    text: str, constants: Mapping[str, int], structs: Mapping[str, Any]
) -> tuple[str, tuple[str, list[str]]]:
    match = _FUNCTION.fullmatch(text)
    if match is None or (match[1] not in _SCALARS and match[1] not in structs):
        raise AbiMismatch(f"rivulet_kernels.h: cannot read {text!r}")
    params = [] if match[4].strip() == "void" else match[4].split(",")
    return match[3], ("ptr" if match[2] else match[1], [_declared(p, constants, structs)[0] for p in params])


def read_header(path: Path = HEADER) -> Header:
    return parse(path.read_text())


_CTYPES: dict[Any, str] = {
    ctypes.c_int: "int", ctypes.c_int64: "int64_t", ctypes.c_float: "float", ctypes.c_void_p: "ptr",
    ctypes.c_uint8: "uint8_t", ctypes.c_uint16: "uint16_t", None: "void",
}  # fmt: skip


def c_type(t: Any, struct_names: Mapping[type, str]) -> str:
    """A ctypes type as the header's type: a pointer of any kind is ``ptr`` (ctypes passes all alike)."""
    if t in _CTYPES:
        return _CTYPES[t]
    if isinstance(t, type) and issubclass(t, ctypes._Pointer):
        return "ptr"
    if isinstance(t, type) and issubclass(t, ctypes.Array):
        return f"{c_type(t._type_, struct_names)}[{t._length_}]"
    return struct_names.get(t, getattr(t, "__name__", repr(t)))


def function_problems(functions: Iterable[Any], header: Header) -> list[str]:
    """Each bound function (a ctypes function of the library) whose argtypes or restype disagree."""
    problems = []
    for fn in functions:
        name = fn.__name__
        if name not in header.functions:
            problems.append(f"{name}: bound but not declared in rivulet_kernels.h")
            continue
        ret, args = header.functions[name]
        bound = [c_type(t, {}) for t in fn.argtypes or ()]
        if fn.argtypes is None:
            problems.append(f"{name}: no argtypes (the header: {', '.join(args) or 'void'})")
        elif bound != args:
            problems.append(f"{name}: arguments ({', '.join(bound)}), the header's ({', '.join(args)})")
        if c_type(fn.restype, {}) != ret:
            problems.append(f"{name}: returns {c_type(fn.restype, {})}, the header's {ret}")
    return problems


def struct_problems(structs: Mapping[str, type[ctypes.Structure]], header: Header) -> list[str]:
    """Each mirrored struct (C name -> ctypes class) whose fields differ in name, type or order."""
    names = {cls: name for name, cls in structs.items()}
    problems = []
    for name, cls in structs.items():
        fields = [(f[0], c_type(f[1], names)) for f in cls._fields_]
        if name not in header.structs:
            problems.append(f"struct {name}: not declared in rivulet_kernels.h")
        elif fields != header.structs[name]:
            problems.append(f"struct {name}: fields {fields}, the header's {header.structs[name]}")
    return problems


def constant_problems(constants: Mapping[str, int], header: Header) -> list[str]:
    """Each mirrored constant (header name -> the Python value) that the header gives otherwise."""
    return [
        f"{name}: {value} in Python, {header.constants.get(name, 'undeclared')} in rivulet_kernels.h"
        for name, value in constants.items()
        if header.constants.get(name) != value
    ]


def status_problems(header: Header) -> list[str]:
    mirrored = {s.name: s.value for s in KernelStatus}
    if mirrored == header.statuses:
        return []
    return [f"KernelStatus {mirrored}, rivulet_kernels.h's enum rv_status {header.statuses}"]


def check(
    functions: Iterable[Any], structs: Mapping[str, type[ctypes.Structure]], constants: Mapping[str, int]
) -> None:
    """Raise AbiMismatch, naming each, where the bindings, structs or constants disagree with the header."""
    header = read_header()
    problems = [
        *function_problems(functions, header),
        *struct_problems(structs, header),
        *constant_problems(constants, header),
        *status_problems(header),
    ]
    if problems:
        raise AbiMismatch(
            "the C kernels' Python side disagrees with csrc/rivulet_kernels.h: " + "; ".join(problems)
        )


def python_side() -> tuple[dict[str, type[ctypes.Structure]], dict[str, int]]:
    """The Python mirrors of the header's structs (C name -> ctypes class) and constants."""
    import torch

    # Imported here: they import kernels.py, which calls check_kernels.
    from gpu_worker.backends.cpu import build, decode_structs, experts, kernels, layouts

    structs: dict[str, type[ctypes.Structure]] = {
        "moe_projection": experts.MoeProjection,
        "decode_linear": decode_structs.DecodeLinear,
        "decode_layer": decode_structs.DecodeLayer,
        "decode_dims": decode_structs.DecodeDims,
    }
    constants = {
        "ISA_PORTABLE": build.ISA_PORTABLE,
        "ISA_AVX2": build.ISA_AVX2,
        "ISA_AVX512_BF16": build.ISA_AVX512_BF16,
        "DTYPE_F32": build.DTYPE_CODES[torch.float32],
        "DTYPE_BF16": build.DTYPE_CODES[torch.bfloat16],
        "DTYPE_F16": build.KV_DTYPE_CODES[torch.float16],
        "DTYPE_F8E4M3": build.LATENT_KV_DTYPE_CODES[torch.float8_e4m3fn],
        "MAX_HEADS": kernels.MAX_HEADS,
        "MAX_HEAD_DIM": kernels.MAX_HEAD_DIM,
        "QTYPE_X8": layouts.X8,
        "QTYPE_A8": layouts.A8,
        "MAX_PARTS": decode_structs.MAX_PARTS,
        "DECODE_LINEARS": len(decode_structs.LINEARS),
    }
    return structs, constants


def bound_functions(kernels: object) -> list[Any]:
    """The library functions an object holds as attributes (CpuKernels' bindings)."""
    return [v for v in vars(kernels).values() if isinstance(v, _FUNCTION_TYPE)]


def check_kernels(kernels: object) -> None:
    """``check`` of a CpuKernels' bindings and the Python mirrors: AbiMismatch naming what differs."""
    structs, constants = python_side()
    check(bound_functions(kernels), structs, constants)
