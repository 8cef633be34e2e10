"""The CPU kind: detection from flags, the RIVULET_CPU_KIND override, and what it tells the libraries."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_worker.backends.cpu import kind as cpu_kind
from gpu_worker.backends.cpu.kind import CpuKind, CpuKindError

ROOT = Path(__file__).resolve().parents[2]
V3 = {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm", "sse4_2"}
V4 = V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@pytest.mark.parametrize(
    ("flags", "kind"),
    [
        (set(), CpuKind.PORTABLE),
        (V3 - {"fma"}, CpuKind.PORTABLE),  # AVX2 without FMA: not x86-64-v3
        (V3, CpuKind.AVX2),  # EPYC Zen 2/3
        (V3 | {"avx512f"}, CpuKind.AVX2),  # AVX-512 F alone is not x86-64-v4
        (V4, CpuKind.AVX512),  # Skylake Xeon
        (V4 | {"avx512_vnni"}, CpuKind.AVX512_VNNI),  # Cascade Lake / Ice Lake Xeon
        (V4 | {"avx512_vnni", "avx512_bf16"}, CpuKind.AVX512_BF16),  # Zen 4/5
        (V4 | {"avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}, CpuKind.AMX),  # SPR
        (V4 | {"avx512_vnni", "avx512_bf16", "amx_tile"}, CpuKind.AVX512_BF16),  # AMX needs its three
        (V3 | {"avx512_bf16"}, CpuKind.AVX2),  # kinds are nested: bf16 needs the AVX-512 base
    ],
)
def test_native_kind_from_flags(flags: set[str], kind: CpuKind) -> None:
    assert cpu_kind.native_kind(frozenset(flags)) == kind


def test_override_acts_as_a_lesser_kind_and_refuses_a_greater_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_kind.ENV_VAR, "avx2")
    assert cpu_kind.requested_kind(CpuKind.AVX512_BF16) == CpuKind.AVX2
    monkeypatch.setenv(cpu_kind.ENV_VAR, "native")
    assert cpu_kind.requested_kind(CpuKind.AVX512) == CpuKind.AVX512
    for lesser in ("avx512_bf16", "avx512_vnni", "avx512"):  # an AMX CPU acts as each kind below it
        monkeypatch.setenv(cpu_kind.ENV_VAR, lesser)
        assert cpu_kind.requested_kind(CpuKind.AMX) == CpuKind(lesser)
    monkeypatch.setenv(cpu_kind.ENV_VAR, "amx")
    monkeypatch.setattr(cpu_kind, "cpu_flags", lambda: frozenset(V4 | {"avx512_vnni", "avx512_bf16"}))
    with pytest.raises(CpuKindError, match="lacks amx_tile, amx_bf16, amx_int8"):
        cpu_kind.requested_kind(CpuKind.AVX512_BF16)
    monkeypatch.setenv(cpu_kind.ENV_VAR, "avx512_bf16")
    # The message names the flags this CPU lacks: an AVX2 CPU's, whatever machine runs the test.
    monkeypatch.setattr(cpu_kind, "cpu_flags", lambda: frozenset(V3))
    with pytest.raises(CpuKindError, match="lacks.*avx512"):
        cpu_kind.requested_kind(CpuKind.AVX2)
    monkeypatch.setenv(cpu_kind.ENV_VAR, "sse9")
    with pytest.raises(CpuKindError, match="not one of native, portable, avx2"):
        cpu_kind.requested_kind(CpuKind.AVX2)


def test_override_sets_every_library_and_no_override_sets_none(monkeypatch: pytest.MonkeyPatch) -> None:
    names = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")
    for name in names:  # set, then removed: monkeypatch restores whatever was there after the test
        monkeypatch.setenv(name, "-")
        monkeypatch.delenv(name)
    monkeypatch.delenv(cpu_kind.ENV_VAR, raising=False)
    assert cpu_kind.apply_to_environ() == cpu_kind.native_kind()
    assert not any(name in os.environ for name in names)
    monkeypatch.setenv(cpu_kind.ENV_VAR, "portable")
    assert cpu_kind.apply_to_environ() == CpuKind.PORTABLE
    assert [os.environ[name] for name in names] == ["SSE41", "default", "SSE4_2"]


def test_torch_in_a_fresh_process_follows_the_override() -> None:
    """Set before torch loads, the override reaches ATen: a portable run sees no AVX2 kernels."""
    code = (
        "from gpu_worker.backends.cpu.kind import apply_to_environ; apply_to_environ(); import torch; "
        "print(torch.backends.cpu.get_cpu_capability())"
    )
    env = {**os.environ, cpu_kind.ENV_VAR: "portable"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "DEFAULT"


@pytest.mark.parametrize(
    ("var", "value", "message"),
    [
        (cpu_kind.ENV_VAR, "sse9", "RIVULET_CPU_KIND='sse9' is not one of"),
        (cpu_kind.PREFETCH_ENV_VAR, "l2", "RIVULET_WEIGHT_PREFETCH='l2' is not one of nta, t0"),
    ],
)
def test_launcher_refuses_an_unknown_setting_before_starting_anything(
    var: str, value: str, message: str
) -> None:
    env = {**os.environ, var: value}
    done = subprocess.run(
        [sys.executable, "launcher.py"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert message in done.stderr


def test_describe_names_the_kind_and_the_flags() -> None:
    line = cpu_kind.describe(CpuKind.PORTABLE)
    assert line.startswith("cpu kind portable") and "avx2=" in line and "avx512_bf16=" in line


def test_weights_prefetch_non_temporally_on_amd_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cpu_kind.PREFETCH_ENV_VAR, raising=False)
    monkeypatch.setattr(cpu_kind, "is_x86", lambda: True)
    assert cpu_kind.weight_prefetch_nta("AuthenticAMD") is True
    assert cpu_kind.weight_prefetch_nta("GenuineIntel") is False
    monkeypatch.setenv(cpu_kind.PREFETCH_ENV_VAR, "t0")
    assert cpu_kind.weight_prefetch_nta("AuthenticAMD") is False
    monkeypatch.setenv(cpu_kind.PREFETCH_ENV_VAR, "NTA")
    assert cpu_kind.weight_prefetch_nta("GenuineIntel") is True
    monkeypatch.setenv(cpu_kind.PREFETCH_ENV_VAR, "l2")
    with pytest.raises(CpuKindError, match="RIVULET_WEIGHT_PREFETCH"):
        cpu_kind.weight_prefetch_nta("AuthenticAMD")
    monkeypatch.delenv(cpu_kind.PREFETCH_ENV_VAR)
    monkeypatch.setattr(cpu_kind, "is_x86", lambda: False)
    assert cpu_kind.weight_prefetch_nta("AuthenticAMD") is False
