"""ZMQ sockets that speak one channel of protocol/: one encoder, one typed decoder each."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

import msgspec
import zmq

from protocol.utf8_paths import invalid_utf8_location

T = TypeVar("T")


class Codec(Generic[T]):
    """Encodes any protocol message; decodes only the channel's union ``T``.

    ``decode`` raises ``msgspec.ValidationError`` / ``msgspec.DecodeError`` on a
    malformed or unknown frame, and nothing else whatever the bytes; callers turn that into an
    error reply or a logged drop. Every string read here is valid UTF-8: invalid UTF-8 in any
    string field is a ValidationError naming the field.
    """

    def __init__(self, decode_type: Any) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(decode_type)

    def encode(self, msg: msgspec.Struct) -> bytes:
        return self._encoder.encode(msg)

    def decode(self, frame: bytes | memoryview) -> T:
        try:
            return self._decoder.decode(frame)
        except msgspec.DecodeError as exc:  # msgspec >= 0.23 says invalid UTF-8 this way, without a path
            if "UTF-8" not in str(exc):
                raise
            raise _invalid_utf8(frame, f" ({exc})") from None
        except UnicodeDecodeError as exc:  # msgspec < 0.23's for a string of invalid UTF-8: bare, no path
            raise _invalid_utf8(frame, f" ({exc.reason})") from None
        except Exception as exc:  # RecursionError (nesting deeper than msgspec decodes), and the like
            raise msgspec.DecodeError(f"cannot decode the frame: {exc!r}") from None


def _invalid_utf8(frame: bytes | memoryview, reason: str) -> msgspec.ValidationError:
    """The error for a frame whose strings hold invalid UTF-8, naming the first such field."""
    location = invalid_utf8_location(frame)
    where = f" - at {location}" if location else ""
    return msgspec.ValidationError(f"Invalid UTF-8 in a string{reason}{where}")


# ZMTP heartbeats on the sockets that may cross machines (the client socket, both ends; a worker
# node's batch socket): a connection whose peer stopped answering for this long (a dead host, which
# never closes it) is dropped; a dead process is seen at once.
HEARTBEAT_IVL_MS = 2000
HEARTBEAT_TIMEOUT_MS = 6000
# Options of such a connection (the client's DEALER, the tokenizer's ROUTER, a worker node's PULL);
# set before bind/connect, when libzmq copies them into the session.
HEARTBEAT_SOCKET_OPTIONS = (
    (zmq.LINGER, 0),
    (zmq.SNDHWM, 0),
    (zmq.RCVHWM, 0),
    (zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS),
    (zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS),
)


def make_socket(ctx: zmq.Context, kind: int, endpoint: str, *, bind: bool) -> zmq.Socket:
    """A socket that never blocks process exit (linger 0) and has no message cap."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock


def replica_name(process: str, replica: int, tp_rank: int = 0) -> str:
    """A process's name in the launcher's logs and Ready messages: ``scheduler``, ``scheduler.1``
    (data-parallel replica 1), ``gpu_worker.tp1`` (tensor-parallel rank 1), ..."""
    name = process if replica == 0 else f"{process}.{replica}"
    return name if tp_rank == 0 else f"{name}.tp{tp_rank}"


@dataclass(frozen=True)
class Endpoints:
    """Where each channel lives. The launcher picks them; every process gets the same set.

    ``client`` is bound by tokenizer_proc (ROUTER); every other channel is a
    PUSH/PULL pair bound by its receiver.
    """

    client: str
    to_scheduler: str  # tokenizer -> scheduler
    to_tokenizer: str  # scheduler -> tokenizer
    to_worker: str  # scheduler -> worker
    from_worker: str  # worker -> scheduler
    to_launcher: str  # every child -> launcher (Ready messages)

    def replica(self, index: int) -> Endpoints:
        """The channels of data-parallel replica ``index`` (--dp-size): its own tokenizer -> scheduler
        and scheduler <-> worker sockets; the client, to_tokenizer (every scheduler pushes to the one
        tokenizer) and to_launcher are shared. Replica 0's are the plain ones."""
        if index == 0:
            return self

        def own(endpoint: str) -> str:
            assert endpoint.endswith(".sock"), f"per-replica channels are ipc sockets, not {endpoint}"
            return f"{endpoint.removesuffix('.sock')}.{index}.sock"

        channels = ("to_scheduler", "to_worker", "from_worker")
        return replace(self, **{name: own(getattr(self, name)) for name in channels})

    def tp_rank(self, rank: int) -> Endpoints:
        """Tensor-parallel rank ``rank``'s endpoints: a to_worker socket of its own (the scheduler
        sends every batch to each rank); rank 0 alone sends results on from_worker."""
        if rank == 0:
            return self
        assert self.to_worker.endswith(".sock"), f"per-rank channels are ipc sockets, not {self.to_worker}"
        return replace(self, to_worker=f"{self.to_worker.removesuffix('.sock')}.tp{rank}.sock")

    @classmethod
    def in_dir(cls, run_dir: str, client: str | None = None) -> Endpoints:
        """ipc:// sockets in ``run_dir`` (a fresh private temp dir)."""

        def ipc(name: str) -> str:
            return f"ipc://{run_dir}/{name}.sock"

        return cls(
            client=client or ipc("client"),
            to_scheduler=ipc("to_scheduler"),
            to_tokenizer=ipc("to_tokenizer"),
            to_worker=ipc("to_worker"),
            from_worker=ipc("from_worker"),
            to_launcher=ipc("to_launcher"),
        )


def freeze_startup_heap() -> None:
    """Move what a process built before serving (modules, the model, tables) out of the cyclic
    collector's sight, once, as it announces itself ready. A full collection otherwise walks all of it
    (a visible pause between two decode steps: docs/benchmarks-history.md, "Numbers behind the code's
    choices"), and the younger ones its survivors;
    what serving allocates is still collected.

    Then the heap's free pages go back to the system (glibc's ``malloc_trim``): what loading freed (a
    GGUF's parsed metadata, a model's transient copies) stays resident otherwise, since the worker
    keeps freed memory for its steps (gpu_worker/backends/cpu/malloc.py)."""
    gc.collect()
    gc.freeze()
    trim_heap()


def trim_heap() -> None:
    """The heap's free pages given back to the system (glibc's malloc_trim(0)); nothing where the C
    library has none (musl, macOS). A block later served from a trimmed page is resident only once
    written: the worker trims before it allocates its KV pool, whose pages stay unresident until
    used (reusing pages loading had written would make the whole pool resident at start)."""
    trim = libc_function("malloc_trim")
    if trim is None:
        return
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)


def libc_function(name: str) -> Any:
    """The C library's function ``name``; None where it has none (glibc's malloc tunables on musl,
    macOS)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c")), name)
    except (OSError, AttributeError, TypeError):
        return None
