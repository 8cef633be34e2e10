"""llama.cpp's ``llama-server``, built once per CPU kind, as the peer bench/targets.py measures.

The command is ``python -m bench.llama_cpp`` (bench/llama_cpp.py).

``build`` downloads the ``llama-cpp-python`` sdist from PyPI (``pip download --no-deps
--no-binary :all:``), extracts it and builds only the ``llama-server`` target of its
``vendor/llama.cpp`` with cmake: Release, static (no shared libs), ``LLAMA_CURL=OFF``, no
tests or examples, and the instruction set of one CPU kind switched on by hand
(``GGML_NATIVE=OFF``; ``native`` lets the compiler take this machine's). The binary goes to
``<cache root>/llama.cpp/<kind>/llama-server`` (the cache root is ``$RIVULET_CACHE_DIR`` or
``~/.cache/rivulet``, as for converted models) and is never part of the repository.

The kinds follow gpu_worker/backends/cpu/kind.py, so ``RIVULET_CPU_KIND=avx2`` on an AVX-512 machine
compares rivulet with a llama.cpp that has AVX2 only (``--peer-llama-cpp auto``).
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpu_worker.backends.cpu.kind import CpuKind, native_kind
from gpu_worker.weights.model_files import cache_root

SDIST = "llama-cpp-python"
BINARY = "llama-server"
BUILD_KINDS = ("avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx", "native")
PARALLEL = 32  # llama-server -np: parallel slots (continuous batching over them)
CONTEXT = 8192  # llama-server -c: KV cache tokens, shared by the slots
# Body fields every bench request to llama-server adds (rivulet refuses unknown fields, so only
# there): each streamed chunk then carries the tokens decoded so far (backends.decoded_count),
# since llama.cpp renders unused and control tokens as empty text, and a random model's stream
# can be all such tokens. ``ignore_eos`` (every request sends it) already masks every
# end-of-generation id of the vocabulary in this server, not only EOS.
REQUEST_FIELDS: dict[str, object] = {"timings_per_token": True}

COMMON_CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DGGML_BUILD_TESTS=OFF",
    "-DGGML_BUILD_EXAMPLES=OFF",
)
# Every x86 ISA switch of ggml's CPU backend, set explicitly so no default of a newer llama.cpp sneaks in.
ISA_SWITCHES = (
    "SSE42", "AVX", "AVX2", "FMA", "F16C", "BMI2", "AVX_VNNI",
    "AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16", "AMX_TILE", "AMX_INT8", "AMX_BF16",
)  # fmt: skip
_AVX2_ON = frozenset({"SSE42", "AVX", "AVX2", "FMA", "F16C", "BMI2"})
ISA_ON = {
    "avx2": _AVX2_ON,
    "avx512": _AVX2_ON | {"AVX512"},
    "avx512_vnni": _AVX2_ON | {"AVX512", "AVX512_VNNI"},
    "avx512_bf16": _AVX2_ON | {"AVX512", "AVX512_BF16", "AVX512_VNNI"},
    "amx": _AVX2_ON | {"AVX512", "AVX512_BF16", "AVX512_VNNI", "AMX_TILE", "AMX_INT8", "AMX_BF16"},
}
# The build ``--peer-llama-cpp auto`` takes for a kind rivulet acts as, where it is not the kind's own:
# llama.cpp's AMX path crashed (ggml_backend_amx_mul_mat) on the version measured, so an
# AMX CPU's peer is the avx512_bf16 build (AMX off); a later AMX build can be passed as a PATH.
PEER_BUILD = {"amx": "avx512_bf16"}


class LlamaCppError(RuntimeError):
    """No llama-server where one was asked for, or a build step failed; the message says what to do."""


def cmake_flags(kind: str) -> list[str]:
    """The cmake configure flags of ``kind``'s build (pure)."""
    if kind == "native":
        return [*COMMON_CMAKE_FLAGS, "-DGGML_NATIVE=ON"]
    if kind not in ISA_ON:
        raise ValueError(f"no llama.cpp build kind {kind!r}; one of {', '.join(BUILD_KINDS)}")
    on = ISA_ON[kind]
    return [
        *COMMON_CMAKE_FLAGS,
        "-DGGML_NATIVE=OFF",
        *(f"-DGGML_{s}={'ON' if s in on else 'OFF'}" for s in ISA_SWITCHES),
    ]


def binary_path(kind: str, root: Path | None = None) -> Path:
    """Where ``kind``'s llama-server lives (or will): <cache root>/llama.cpp/<kind>/llama-server."""
    return (cache_root() if root is None else root) / "llama.cpp" / kind / BINARY


def cached_binary(kind: str, root: Path | None = None) -> Path | None:
    path = binary_path(kind, root)
    return path if path.is_file() and os.access(path, os.X_OK) else None


def build_command(kind: str) -> str:
    return f"python -m bench.llama_cpp build --kind {kind}"


def server_command(
    binary: Path, gguf: Path, port: int, threads: int, parallel: int = PARALLEL, context: int = CONTEXT
) -> list[str]:
    """``llama-server -m GGUF --port P -np 32 -c 8192 -t THREADS`` (pure)."""
    return [str(binary), "-m", str(gguf), "--port", str(port), "-np", str(parallel), "-c", str(context),
            "-t", str(threads)]  # fmt: skip


def resolve_peer(
    spec: str, acting: CpuKind, native: CpuKind, root: Path | None = None
) -> tuple[Path, str | None]:
    """``--peer-llama-cpp SPEC`` -> (the llama-server to run, a warning line or None).

    ``auto``: the cached build of the kind rivulet acts as (also the ``native`` build when
    rivulet is not emulating a lesser kind; an AMX CPU's: ``PEER_BUILD``); LlamaCppError, with the
    build command, if none.
    A PATH is the user's choice; the warning says when rivulet emulates a kind and PATH is
    not that kind's cached build.
    """
    if spec == "auto":
        if acting is CpuKind.PORTABLE:
            raise LlamaCppError(
                "--peer-llama-cpp auto: rivulet acts as the portable kind and llama.cpp is built for "
                f"{', '.join(BUILD_KINDS)}; set RIVULET_CPU_KIND or pass --peer-llama-cpp PATH"
            )
        own = PEER_BUILD.get(acting.value)
        kinds = [own] if own else [acting.value, *(["native"] if acting == native else [])]
        for kind in kinds:
            if (found := cached_binary(kind, root)) is not None:
                return found, None
        raise LlamaCppError(
            f"--peer-llama-cpp auto: no llama-server built for {kinds[0]} (rivulet acts as "
            f"{acting.value}; looked for {' and '.join(str(binary_path(k, root)) for k in kinds)}). "
            f"Build it once with `{build_command(kinds[0])}` (~6-12 minutes on 2 cores)"
        )
    path = Path(spec).expanduser()
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise LlamaCppError(f"--peer-llama-cpp {spec}: not an executable file")
    warning = None
    expected = binary_path(acting.value, root)
    if acting != native and path.resolve() != expected.resolve():
        warning = (
            f"warning: rivulet acts as {acting.value} (emulated on {native.value}), but {path} is not "
            f"that kind's build ({expected}): llama.cpp may use instructions rivulet does not; "
            f"`--peer-llama-cpp auto` after `{build_command(acting.value)}` compares like with like"
        )
    return path, warning


# --------------------------------------------------------------------------
# the build
# --------------------------------------------------------------------------


def _run(cmd: Sequence[str | Path], cwd: Path | None = None) -> None:
    words = [str(c) for c in cmd]
    print(f"+ {shlex.join(words)}", flush=True)
    done = subprocess.run(words, cwd=cwd)
    if done.returncode != 0:
        raise LlamaCppError(f"`{shlex.join(words)}` exited with {done.returncode}")


def download_source(workdir: Path, version: str | None = None) -> tuple[Path, str]:
    """Download the llama-cpp-python sdist into ``workdir`` and extract it: (vendor/llama.cpp, sdist)."""
    download = workdir / "download"
    requirement = f"{SDIST}=={version}" if version else SDIST
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
          "--dest", download, requirement])  # fmt: skip
    sdists = sorted(download.glob("*.tar.gz"))
    if len(sdists) != 1:
        raise LlamaCppError(f"expected one sdist in {download}, found {[p.name for p in sdists]}")
    with tarfile.open(sdists[0]) as tar:
        tar.extractall(workdir / "src", filter="data")
    sources = sorted((workdir / "src").glob("*/vendor/llama.cpp"))
    if not sources or not (sources[0] / "CMakeLists.txt").is_file():
        raise LlamaCppError(f"{sdists[0].name} has no vendor/llama.cpp/CMakeLists.txt")
    return sources[0], sdists[0].name


def configure(source: Path, build_dir: Path, kind: str) -> None:
    _run(["cmake", "-S", source, "-B", build_dir, *cmake_flags(kind)])


def build(
    kind: str,
    force: bool = False,
    jobs: int | None = None,
    source: Path | None = None,
    version: str | None = None,
    root: Path | None = None,
) -> Path:
    """Build ``kind``'s llama-server into the cache (skipped when there already is one, unless ``force``)."""
    target = binary_path(kind, root)
    if not force and cached_binary(kind, root) is not None:
        print(f"{target} exists; not rebuilding (--force rebuilds)", flush=True)
        return target
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise LlamaCppError(f"building llama.cpp needs {tool} on PATH")
    jobs = jobs or os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix=f"rivulet-llama-cpp-{kind}-") as tmp:
        work = Path(tmp)
        if source is None:
            source, origin = download_source(work, version)
        else:
            origin = str(source)
        build_dir = work / "build"
        configure(source, build_dir, kind)
        _run(["cmake", "--build", build_dir, "--config", "Release", "--target", BINARY, "-j", str(jobs)])
        built = build_dir / "bin" / BINARY
        if not built.is_file():
            raise LlamaCppError(f"the build finished without {built}")
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.with_name(f".{BINARY}.{os.getpid()}")
        shutil.copy2(built, staging)
        staging.chmod(0o755)
        os.replace(staging, target)
    info = {
        "kind": kind, "source": origin, "cmake_flags": cmake_flags(kind),
        "built": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }  # fmt: skip
    (target.parent / "build.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"built {target}", flush=True)
    return target


@dataclass(frozen=True)
class Peer:
    """llama.cpp's server as this run starts it (``shown()``: its command with ``{port}`` for the port)."""

    binary: Path
    gguf: Path
    threads: int
    parallel: int
    warning: str | None = None
    fields: dict[str, object] = field(default_factory=lambda: dict(REQUEST_FIELDS))  # on every request

    def command(self, port: int) -> list[str]:
        return server_command(self.binary, self.gguf, port, self.threads, self.parallel)

    def shown(self) -> str:
        return shlex.join(self.command(0)).replace("--port 0", "--port {port}")


def make_peer(
    spec: str, acting: CpuKind, model: str | None, parallel: int = PARALLEL, threads: int = 0
) -> Peer:
    """The peer a bench's ``--peer-llama-cpp SPEC`` names, on ``model``'s GGUF, with ``threads``
    (0: every core this process may run on); exits with the reason where there is none. Its
    ``warning`` is for the caller to print."""
    try:
        binary, warning = resolve_peer(spec, acting, native_kind())
    except LlamaCppError as exc:
        raise SystemExit(f"error: {exc}") from None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return Peer(binary, peer_gguf(model), threads or cores, parallel, warning)


def peer_gguf(model: str | None) -> Path:
    """The GGUF llama.cpp serves: the embedded one (as the engine's default), or --model's if it is one."""
    from gpu_worker.weights.model_files import embedded_gguf_path

    if model is None:
        return embedded_gguf_path()
    path = Path(model).expanduser()
    if not (path.is_file() and path.suffix == ".gguf"):
        raise SystemExit(
            f"error: --peer-llama-cpp needs a GGUF model (no --model, or --model X.gguf), not {model}"
        )
    return path
