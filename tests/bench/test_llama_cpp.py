"""bench/llama_cpp.py and bench/lib/llama_cpp.py without llama.cpp: cmake flags per kind, the cache,
the command, --peer resolution.

The one real build compiles a stand-in CMake project with a ``llama-server`` target (seconds),
so the download of the sdist and llama.cpp's own 6-12 minute build are never needed here.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from bench import llama_cpp as llama_cpp_script
from bench.lib import llama_cpp
from gpu_worker.backends.cpu.kind import CpuKind


def _switches(flags: list[str]) -> dict[str, str]:
    return dict(f.removeprefix("-D").split("=", 1) for f in flags)


def test_cmake_flags_switch_each_kinds_instruction_set_explicitly() -> None:
    avx2 = _switches(llama_cpp.cmake_flags("avx2"))
    for common in ("CMAKE_BUILD_TYPE=Release", "BUILD_SHARED_LIBS=OFF", "LLAMA_CURL=OFF",
                   "LLAMA_BUILD_TESTS=OFF", "LLAMA_BUILD_EXAMPLES=OFF"):  # fmt: skip
        key, value = common.split("=")
        for kind in llama_cpp.BUILD_KINDS:
            assert _switches(llama_cpp.cmake_flags(kind))[key] == value, (kind, key)
    assert avx2["GGML_NATIVE"] == "OFF"
    assert all(avx2[f"GGML_{s}"] == "ON" for s in ("AVX", "AVX2", "FMA", "F16C", "BMI2"))
    assert all(avx2[f"GGML_{s}"] == "OFF" for s in ("AVX512", "AVX512_BF16", "AVX512_VNNI", "AMX_BF16"))
    avx512 = _switches(llama_cpp.cmake_flags("avx512"))
    assert avx512["GGML_AVX512"] == "ON" and avx512["GGML_AVX2"] == "ON"
    assert avx512["GGML_AVX512_BF16"] == "OFF" and avx512["GGML_AVX512_VNNI"] == "OFF"
    bf16 = _switches(llama_cpp.cmake_flags("avx512_bf16"))
    assert bf16["GGML_AVX512"] == bf16["GGML_AVX512_BF16"] == bf16["GGML_AVX512_VNNI"] == "ON"
    assert bf16["GGML_NATIVE"] == "OFF" and bf16["GGML_AMX_BF16"] == "OFF"
    vnni = _switches(llama_cpp.cmake_flags("avx512_vnni"))
    assert vnni["GGML_AVX512_VNNI"] == "ON" and vnni["GGML_AVX512_BF16"] == "OFF"
    amx = _switches(llama_cpp.cmake_flags("amx"))
    assert all(amx[f"GGML_{s}"] == "ON" for s in ("AMX_TILE", "AMX_INT8", "AMX_BF16", "AVX512_BF16"))
    native = _switches(llama_cpp.cmake_flags("native"))
    assert native["GGML_NATIVE"] == "ON" and "GGML_AVX2" not in native
    with pytest.raises(ValueError, match="portable"):
        llama_cpp.cmake_flags("portable")


def test_server_command() -> None:
    cmd = llama_cpp.server_command(Path("/c/llama-server"), Path("/m/x.gguf"), 8123, threads=2)
    assert cmd == [
        "/c/llama-server",
        "-m",
        "/m/x.gguf",
        "--port",
        "8123",
        "-np",
        "32",
        "-c",
        "8192",
        "-t",
        "2",
    ]


def _fake_binary(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


def test_path_looks_in_the_cache_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RIVULET_CACHE_DIR", str(tmp_path))
    assert llama_cpp.binary_path("avx2") == tmp_path / "llama.cpp" / "avx2" / "llama-server"
    assert llama_cpp_script.main(["path", "--kind", "avx2"]) == 1
    assert "python -m bench.llama_cpp build --kind avx2" in capsys.readouterr().err
    built = _fake_binary(llama_cpp.binary_path("avx2"))
    assert llama_cpp_script.main(["path", "--kind", "avx2"]) == 0
    assert capsys.readouterr().out.strip() == str(built)
    assert llama_cpp_script.main(["path", "--kind", "avx512"]) == 1


def test_build_skips_a_cached_binary_unless_forced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built = _fake_binary(llama_cpp.binary_path("avx2", tmp_path))

    def no_run(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("nothing may run for a cached binary")

    monkeypatch.setattr(subprocess, "run", no_run)
    assert llama_cpp.build("avx2", root=tmp_path) == built


FAKE_PROJECT = """\
cmake_minimum_required(VERSION 3.14)
project(fake_llama CXX)
set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
add_executable(llama-server main.cpp)
add_executable(never-built main.cpp)
"""


@pytest.mark.skipif(
    shutil.which("cmake") is None or shutil.which("c++") is None, reason="needs cmake and c++"
)
def test_build_configures_builds_and_installs_into_the_cache(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    (source / "CMakeLists.txt").write_text(FAKE_PROJECT)
    (source / "main.cpp").write_text("int main() { return 0; }\n")
    root = tmp_path / "cache"
    target = llama_cpp.build("avx512", source=source, root=root, jobs=1)
    assert target == llama_cpp.binary_path("avx512", root) and llama_cpp.cached_binary("avx512", root)
    assert subprocess.run([str(target)]).returncode == 0
    info = json.loads((target.parent / "build.json").read_text())
    assert info["kind"] == "avx512" and info["cmake_flags"] == llama_cpp.cmake_flags("avx512")
    assert sorted(p.name for p in target.parent.iterdir()) == ["build.json", "llama-server"]


def test_auto_takes_the_build_of_the_kind_rivulet_acts_as(tmp_path: Path) -> None:
    bf16, avx2 = CpuKind.AVX512_BF16, CpuKind.AVX2
    with pytest.raises(llama_cpp.LlamaCppError, match="python -m bench.llama_cpp build --kind avx2"):
        llama_cpp.resolve_peer("auto", avx2, avx2, tmp_path)
    native = _fake_binary(llama_cpp.binary_path("native", tmp_path))
    assert llama_cpp.resolve_peer("auto", avx2, avx2, tmp_path) == (native, None)  # not emulating
    with pytest.raises(llama_cpp.LlamaCppError, match="no llama-server built for avx2"):
        llama_cpp.resolve_peer("auto", avx2, bf16, tmp_path)  # emulating avx2: the native build will not do
    own = _fake_binary(llama_cpp.binary_path("avx2", tmp_path))
    assert llama_cpp.resolve_peer("auto", avx2, bf16, tmp_path) == (own, None)
    assert llama_cpp.resolve_peer("auto", avx2, avx2, tmp_path) == (own, None)  # the kind's own first
    with pytest.raises(llama_cpp.LlamaCppError, match="portable"):
        llama_cpp.resolve_peer("auto", CpuKind.PORTABLE, CpuKind.PORTABLE, tmp_path)
    amx = CpuKind.AMX  # llama.cpp's AMX build crashed: the peer is its avx512_bf16 build, never native
    with pytest.raises(llama_cpp.LlamaCppError, match="python -m bench.llama_cpp build --kind avx512_bf16"):
        llama_cpp.resolve_peer("auto", amx, amx, tmp_path)
    peer = _fake_binary(llama_cpp.binary_path("avx512_bf16", tmp_path))
    assert llama_cpp.resolve_peer("auto", amx, amx, tmp_path) == (peer, None)


def test_a_path_by_hand_is_warned_about_only_when_emulating(tmp_path: Path) -> None:
    bf16, avx2 = CpuKind.AVX512_BF16, CpuKind.AVX2
    mine = _fake_binary(tmp_path / "elsewhere" / "llama-server")
    assert llama_cpp.resolve_peer(str(mine), bf16, bf16, tmp_path) == (mine, None)
    path, warning = llama_cpp.resolve_peer(str(mine), avx2, bf16, tmp_path)
    assert path == mine and warning is not None and "acts as avx2 (emulated on avx512_bf16)" in warning
    cached = _fake_binary(llama_cpp.binary_path("avx2", tmp_path))
    assert llama_cpp.resolve_peer(str(cached), avx2, bf16, tmp_path) == (cached, None)
    with pytest.raises(llama_cpp.LlamaCppError, match="not an executable"):
        llama_cpp.resolve_peer(str(tmp_path / "missing"), avx2, avx2, tmp_path)
