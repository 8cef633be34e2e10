"""Which kind of x86-64 CPU the worker runs on, and how to act as a lesser kind.

Every CPU decision of the worker (the C kernels' build, the matmul path per row
count, oneDNN weight packing, ``--dtype auto``) is taken from one ``CpuKind``,
read once: never from a timing taken at start. The kinds are nested, each one a
superset of the one before:

- ``portable``: anything else (and non-x86 CPUs): plain C, torch's kernels.
- ``avx2``: AVX2 + FMA (x86-64-v3): AMD Zen 1-3, Intel client CPUs before Ice Lake.
- ``avx512``: AVX-512 F/BW/CD/DQ/VL (x86-64-v4): Skylake Xeons.
- ``avx512_vnni``: AVX-512 with VNNI (vpdpwssd) but no BF16: Cascade Lake and Ice Lake Xeons.
- ``avx512_bf16``: AVX-512 with VNNI and vdpbf16ps: AMD Zen 4/5, Intel Cooper Lake.
- ``amx``: that, with AMX tiles (bf16 and int8): Intel Sapphire Rapids and later. rivulet has no
  tile code of its own; the kind tells oneDNN it may use them (its bf16 matmuls do).

``RIVULET_CPU_KIND=<kind>`` makes the worker act as a kind the CPU includes, so
one machine can test the paths of the others. No single switch reaches every
library: oneDNN reads ``ONEDNN_MAX_CPU_ISA`` (once per process), ATen its
element-wise kernels' ``ATEN_CPU_CAPABILITY``, MKL ``MKL_ENABLE_INSTRUCTIONS``.
``apply_to_environ`` sets all three from the override, so it must run before
torch is imported (the launcher and the test suite's conftest call it first;
spawned children inherit the environment).

This module imports nothing heavy: it runs before torch loads.
"""

from __future__ import annotations

import enum
import getpass
import os
import platform
import tempfile
from pathlib import Path

ENV_VAR = "RIVULET_CPU_KIND"


class CpuKind(enum.Enum):
    PORTABLE = "portable"
    AVX2 = "avx2"
    AVX512 = "avx512"
    AVX512_VNNI = "avx512_vnni"
    AVX512_BF16 = "avx512_bf16"
    AMX = "amx"

    @property
    def rank(self) -> int:
        return list(CpuKind).index(self)

    def includes(self, other: CpuKind) -> bool:
        """Whether code for ``other`` runs on this kind."""
        return other.rank <= self.rank


# The /proc/cpuinfo flags each kind needs on top of the kind before it (x86-64-v3, -v4, +vnni,
# +bf16, +amx). Every CPU with AVX512_BF16 so far has AVX512_VNNI too.
_NEEDS = {
    CpuKind.AVX2: ("avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"),
    CpuKind.AVX512: ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"),
    CpuKind.AVX512_VNNI: ("avx512_vnni",),
    CpuKind.AVX512_BF16: ("avx512_bf16",),
    CpuKind.AMX: ("amx_tile", "amx_bf16", "amx_int8"),
}

# What the libraries under torch are told when the worker acts as a kind: oneDNN's ISA cap,
# ATen's kernel capability, MKL's instruction set. None: leave the library as it is.
_LIBRARY_ENV: dict[CpuKind, dict[str, str]] = {
    CpuKind.PORTABLE: {
        "ONEDNN_MAX_CPU_ISA": "SSE41",
        "ATEN_CPU_CAPABILITY": "default",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
    },
    CpuKind.AVX2: {
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    },
    CpuKind.AVX512: {
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
        "ATEN_CPU_CAPABILITY": "avx512",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
    },
    CpuKind.AVX512_VNNI: {
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI",
        "ATEN_CPU_CAPABILITY": "avx512",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
    },
    CpuKind.AVX512_BF16: {
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
        "ATEN_CPU_CAPABILITY": "avx512",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
    },
    CpuKind.AMX: {
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX",
        "ATEN_CPU_CAPABILITY": "avx512",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
    },
}  # fmt: skip

REPORTED_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "avx_vnni")


def _cpuinfo(*keys: str) -> str:
    """The value of /proc/cpuinfo's first line that starts with one of ``keys`` ("" where none)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith(keys)), "")
    except OSError:
        return ""
    return line.partition(":")[2].strip()


def cpu_flags() -> frozenset[str]:
    """The flags line of /proc/cpuinfo (empty where there is none)."""
    return frozenset(_cpuinfo("flags", "Features").split())


def is_x86() -> bool:
    """Whether this machine is x86-64 (elsewhere every kind but portable is meaningless)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def native_kind(flags: frozenset[str] | None = None) -> CpuKind:
    """The largest kind this CPU (or these flags) has."""
    if flags is None and not is_x86():
        return CpuKind.PORTABLE
    have = cpu_flags() if flags is None else flags
    kind = CpuKind.PORTABLE
    for candidate in list(CpuKind)[1:]:
        if not set(_NEEDS[candidate]) <= have:
            break
        kind = candidate
    return kind


class CpuKindError(ValueError):
    """RIVULET_CPU_KIND names no kind, or one this CPU does not include."""


def requested_kind(native: CpuKind | None = None) -> CpuKind:
    """The kind to act as: RIVULET_CPU_KIND if set (checked against the CPU), else the native one."""
    native = native_kind() if native is None else native
    name = os.environ.get(ENV_VAR, "").strip().lower()
    if not name or name == "native":
        return native
    try:
        kind = CpuKind(name)
    except ValueError:
        names = ", ".join(k.value for k in CpuKind)
        raise CpuKindError(f"{ENV_VAR}={name!r} is not one of native, {names}") from None
    if not native.includes(kind):
        missing = [f for k in CpuKind if native.rank < k.rank <= kind.rank for f in _NEEDS[k]]
        have = cpu_flags()
        lacking = ", ".join(f for f in missing if f not in have) or "its instructions"
        raise CpuKindError(f"{ENV_VAR}={name}: this CPU ({native.value}) lacks {lacking}")
    return kind


def apply_to_environ() -> CpuKind:
    """Point oneDNN, ATen and MKL at the requested kind (before torch loads); return the kind.

    Without RIVULET_CPU_KIND the environment is left alone and the libraries see the whole CPU.
    A RIVULET_WEIGHT_PREFETCH that names no choice is refused here too, before anything starts.
    """
    kind = requested_kind()
    weight_prefetch_nta()
    if os.environ.get(ENV_VAR, "").strip().lower() not in ("", "native"):
        os.environ.update(_LIBRARY_ENV[kind])
        # torch.compile's cache keys do not hold ATen's capability: a kernel cached while acting as
        # another kind loads here and computes NaN (seen: avx512's graphs run as avx2). One cache
        # directory per kind, under the one the user would get.
        if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
            user = getpass.getuser().replace("/", "_")
            root = Path(tempfile.gettempdir()) / f"torchinductor_{user}"
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / f"rivulet-{kind.value}")
    return kind


PREFETCH_ENV_VAR = "RIVULET_WEIGHT_PREFETCH"


def cpu_vendor() -> str:
    """The vendor_id line of /proc/cpuinfo ("AuthenticAMD", "GenuineIntel"; empty where none)."""
    return _cpuinfo("vendor_id")


def weight_prefetch_nta(vendor: str | None = None) -> bool:
    """Whether the K-quants' few-row tiles prefetch the weights they stream non-temporally
    (rivulet_kernels.h's weight_prefetch_nta, read in csrc/common.h): on AMD, where it was measured faster;
    ``RIVULET_WEIGHT_PREFETCH=nta`` or ``=t0`` chooses either way (to measure a CPU that was not)."""
    chosen = os.environ.get(PREFETCH_ENV_VAR, "").strip().lower()
    if chosen in ("nta", "t0"):
        return chosen == "nta"
    if chosen:
        raise CpuKindError(f"{PREFETCH_ENV_VAR}={chosen!r} is not one of nta, t0")
    return is_x86() and (cpu_vendor() if vendor is None else vendor) == "AuthenticAMD"


def describe(kind: CpuKind) -> str:
    """One line for logs and benches: the kind acted as, the native one, and the CPU's key flags."""
    native = native_kind()
    have = cpu_flags()
    flags = " ".join(f"{f}={'yes' if f in have else 'no'}" for f in REPORTED_FLAGS)
    acting = kind.value if kind == native else f"{kind.value} (emulated on {native.value})"
    return f"cpu kind {acting}; {flags}"
