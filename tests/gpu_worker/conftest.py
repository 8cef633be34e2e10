"""Fixtures of the worker's tests."""

from __future__ import annotations

import pytest

from gpu_worker.backends.cpu import kernels as cpu_kernels
from gpu_worker.backends.cpu.kind import CpuKind
from tests.gpu_worker.helpers import KINDS


@pytest.fixture(scope="module", params=KINDS, ids=[kind.value for kind in KINDS])
def kernels(request: pytest.FixtureRequest) -> cpu_kernels.CpuKernels:
    """The C kernels' library of each kind this CPU runs (the worker's own is the last)."""
    kind: CpuKind = request.param
    return cpu_kernels.CpuKernels(cpu_kernels.build(kind), kind)
