"""The C kernels' library per CPU kind (csrc/*.c), built on first use.

One library per CPU kind (kind.py), built with the system C compiler on first
use into the rivulet cache folder, with that kind's -march (x86-64-v3 for AVX2,
never -march=native: a Zen 5 with AVX-512 disabled still has AVX-VNNI, and such
a build is no AVX2 build). The name is keyed by the sources, flags and compiler.
No compiler, or a failed build: ``load()`` returns None, the reason is logged
once, and the worker keeps its torch paths.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from gpu_worker.backends.cpu.kind import CpuKind, is_x86
from gpu_worker.weights.model_files import cache_root

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (
    "attention.c", "matmul.c", "small_ops.c", "quant.c", "quant_dense.c", "quant_legacy.c", "quant_k.c",
    "quant_x8.c", "quant_kx8.c", "quant_sub32.c", "quant_f16.c", "quant_k23.c", "decode_layers.c",
    "quant_sub32x8.c", "quant_k23x8.c",
    "moe.c", "shm_allreduce.c", "gated_delta.c", "mla.c", "quant_mxfp4.c", "decode_hybrid.c",
    "decode_mla.c", "quant_bf16x.c", "decode_gemma4.c", "head_screen.c",
)  # fmt: skip
HEADERS = ("rivulet_kernels.h", "common.h", "quant.h")
# -std=c11 alone turns FMA contraction off, and trapping math keeps float selects as branches: both
# leave the inner loops scalar. The kernels read no FP exception flags and no errno. A function
# defined without a prototype before it (not declared in rivulet_kernels.h or quant.h) fails the
# build: each definition is checked against the one declaration the other files and abi.py read.
# Loops and functions start on 64-byte lines: unaligned, a tile's pace moved with unrelated code
# elsewhere in its file (docs/benchmarks-history.md, "Hot loops on 64-byte lines").
CFLAGS = (
    "-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11",
    "-ffp-contract=fast", "-fno-trapping-math", "-fno-math-errno", "-Werror=missing-prototypes",
    "-falign-loops=64", "-falign-functions=64",
)  # fmt: skip
# Per kind: the -march it is built with and the ISA code the build must report (csrc/common.h).
# AVX-512 without BF16 runs the AVX2 code of every kernel (ISA_AVX2) but the GGUF-block ones, which
# read the compiler's own macros: zmm tiles there, with vpdpwssd where VNNI is (csrc/quant_kx8.c).
# The bf16 kernels' AVX-512 gain is vdpbf16ps, which those kinds lack. AMX: the avx512_bf16 code
# (no tile code of our own; oneDNN uses the tiles for bf16 matmuls).
ISA_PORTABLE, ISA_AVX2, ISA_AVX512_BF16 = 0, 1, 2  # csrc/rivulet_kernels.h's (abi.py checks)
_V4_BF16 = ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16")
BUILDS: dict[CpuKind, tuple[tuple[str, ...], int]] = {
    CpuKind.PORTABLE: (("-march=x86-64",), ISA_PORTABLE),
    CpuKind.AVX2: (("-march=x86-64-v3",), ISA_AVX2),
    CpuKind.AVX512: (("-march=x86-64-v4",), ISA_AVX2),
    CpuKind.AVX512_VNNI: (("-march=x86-64-v4", "-mavx512vnni"), ISA_AVX2),
    CpuKind.AVX512_BF16: (_V4_BF16, ISA_AVX512_BF16),
    CpuKind.AMX: (_V4_BF16, ISA_AVX512_BF16),
}
# A build compiles every source in one compiler call: on a 2-core machine with other builds and tests
# running it has taken over 120 s.
BUILD_TIMEOUT_S = 300
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # csrc/rivulet_kernels.h's (abi.py checks)
KV_DTYPE_CODES = {**DTYPE_CODES, torch.float16: 2}  # a KV cache may also be float16
LATENT_KV_DTYPE_CODES = {**KV_DTYPE_CODES, torch.float8_e4m3fn: 3}  # a latent pool also float8 (mla.c)


def build(kind: CpuKind) -> Path:
    """Path of the library for ``kind``, compiling it unless these sources/flags/compiler have one."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    flags = CFLAGS + (BUILDS[kind][0] if is_x86() else ())
    texts = [(CSRC / name).read_text() for name in SOURCES + HEADERS]
    key = hashlib.sha256("\n".join([*texts, " ".join(flags), version]).encode()).hexdigest()[:16]
    out_dir = cache_root() / "kernels"
    target = out_dir / f"cpu_kernels-{kind.value}-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    logger.info("compiling the CPU kernels for %s (first start only, about a minute)", kind.value)
    started = time.perf_counter()
    # Build beside the target and rename: a concurrent builder never sees half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        sources = [str(CSRC / name) for name in SOURCES]
        done = subprocess.run(
            [compiler, *flags, "-o", tmp, *sources, "-lm"],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info(
        "built the CPU kernels for %s in %.0f s: %s", kind.value, time.perf_counter() - started, target
    )
    return target
