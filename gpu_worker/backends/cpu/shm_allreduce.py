"""The tensor-parallel all-reduce: through shared memory where every rank is on this machine (the C
kernels' ``shm_all_reduce``, csrc/shm_allreduce.c), else gloo.

gloo sums over loopback TCP, a round trip per call even for one decode row's floats, and a Llama
step makes two calls per layer. Ranks on one machine need no socket: each copies its
partial sums into a region they all map, waits on the others' counters, sums its slice of every
rank's values and copies the total back. ``python -m bench.tp_step`` measures both (docs/benchmarks.md,
"Tensor parallel on CPU"): shared memory is the faster, and the default.
``--tp-all-reduce gloo`` keeps gloo; ``shm`` refuses to start where the region cannot be used.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import tempfile
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from gpu_worker.backends.cpu import abi
from gpu_worker.backends.cpu import kernels as cpu_kernels
from gpu_worker.backends.cpu.kind import requested_kind
from gpu_worker.backends.torch.backend import gloo_all_reduce
from gpu_worker.config import WorkerConfig
from gpu_worker.tensor_parallel import AllReduce, agree_min, gather_strings

logger = logging.getLogger(__name__)

PIECE_BYTES = 1 << 20  # per rank and round: 256K float32 values (a 512-token chunk of hidden 512)
DTYPE_CODES = {torch.float32: 0, torch.float64: 2}  # csrc/shm_allreduce.c's


class ShmAllReduce:
    """Sums over the ranks through a region every rank maps; the file is gone once all mapped it."""

    def __init__(self, library: Path, rank: int, world: int) -> None:
        lib = ctypes.CDLL(str(library))  # the kernels' library, already loaded: the same handle
        i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        self._region_bytes = lib.shm_region_bytes
        self._region_bytes.restype = i64
        self._region_bytes.argtypes = [i32, i64]
        self._reduce = lib.shm_all_reduce
        self._reduce.restype = i32
        self._reduce.argtypes = [ptr, i32, i32, i64, ptr, i64, i32]
        abi.check(abi.bound_functions(self), {}, {})
        self.rank, self.world = rank, world
        size = int(self._region_bytes(world, PIECE_BYTES))
        names: list[str] = [f"rivulet-tp-{uuid.uuid4().hex}"]
        dist.broadcast_object_list(names, src=0)
        self.path = path = Path("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()) / names[0]
        if rank == 0:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, size)  # zeros: every counter starts at 0
            os.close(fd)
        dist.barrier()
        self.region = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        dist.barrier()
        if rank == 0:
            path.unlink()  # the mappings stay; nothing is left behind when the ranks exit

    def __call__(self, t: torch.Tensor) -> None:
        assert t.is_contiguous() and t.dtype in DTYPE_CODES, "a contiguous float32/float64 tensor"
        rc = self._reduce(
            self.region.data_ptr(),
            self.rank,
            self.world,
            PIECE_BYTES,
            t.data_ptr(),
            t.numel(),
            DTYPE_CODES[t.dtype],
        )
        if rc != abi.KernelStatus.RV_OK:
            raise RuntimeError(
                f"shm_all_reduce: {abi.status_text(rc)}: a tensor-parallel rank did not reach it in 300 s"
            )


def machine_id() -> str:
    """This machine: its host name and boot id (two containers may share a host name)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def pick_all_reduce(config: WorkerConfig) -> AllReduce:
    """--tp-all-reduce auto | shm | gloo: shared memory where the worker runs on CPU with the C
    kernels built and every rank is on this machine (all ranks decide alike), else gloo."""
    choice, rank, world = config.tp_all_reduce, config.tp_rank, config.tp_size
    kernels = cpu_kernels.load(requested_kind()) if config.cpu_kernels else None
    library = None if kernels is None else kernels.path
    same_machine = len(set(gather_strings(machine_id()))) == 1
    why_not = (
        "the ranks are on several machines" if not same_machine
        else "the C kernels are off or could not be built" if library is None
        else None
    )  # fmt: skip
    if agree_min(int(why_not is None)) == 0:  # every rank takes the same road
        why_not = why_not or "another rank cannot use it"
    if choice == "gloo" or (choice == "auto" and why_not is not None):
        logger.info(
            "tensor-parallel all-reduce: gloo%s", f" ({why_not})" if why_not and choice == "auto" else ""
        )
        return gloo_all_reduce
    if why_not is not None:
        raise ValueError(f"--tp-all-reduce shm: {why_not}")
    assert library is not None
    logger.info("tensor-parallel all-reduce: shared memory")
    return ShmAllReduce(library, rank, world)
