"""Start rivulet: the tokenizer, scheduler and GPU worker processes, then supervise them.

    python launcher.py --chunked-prefill-size 256

Order of start: the worker (loads weights, sizes the KV pool) and the tokenizer
start together; once the worker reports how many KV pages it allocated, the
scheduler starts with that number in its config. When all three said Ready the
launcher prints the client endpoint and waits. If any child dies, the others are
stopped and the launcher exits non-zero naming the child; SIGINT/SIGTERM stop
everything within a few seconds. Children also die with the launcher
(PR_SET_PDEATHSIG), so no process is ever orphaned.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import msgspec
import zmq

from client import DEFAULT_ENDPOINT
from gpu_worker.config import WEIGHT_DTYPES, WorkerConfig
from gpu_worker.cpu.kind import CpuKindError, apply_to_environ
from protocol import ToLauncher, WorkerReady
from protocol.transport import Codec, Endpoints, make_socket
from scheduler_proc.config import SCHEDULE_POLICIES, SchedulerConfig
from tokenizer_proc.config import TokenizerConfig

logger = logging.getLogger("rivulet.launcher")

READY_TIMEOUT_S = 600.0  # a first start converts the GGUF (~40 s on 2 cores)
STOP_GRACE_S = 4.0  # SIGTERM -> SIGKILL; the whole shutdown stays under 5 s
LOG_FORMAT = "[%(asctime)s %(processName)s] %(message)s"
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"  # the HTTP model id when --model is not given


class ChildDied(RuntimeError):
    """A child process exited while the engine was starting or serving."""

    def __init__(self, name: str, exitcode: int | None) -> None:
        super().__init__(f"{name} exited with code {exitcode}")
        self.name = name
        self.exitcode = exitcode


# --------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """Every flag's default comes from the config dataclass that owns it, but --enable-mixed-chunk's,
    which follows the worker's device (mixed_chunk)."""
    w, s = WorkerConfig(), SchedulerConfig()
    p = argparse.ArgumentParser(description="rivulet: a multi-process LLM serving engine")
    p.add_argument("--model", default=None, help="HF model dir or .gguf (default: embedded SmolLM2-135M)")
    p.add_argument(
        "--endpoint", default=DEFAULT_ENDPOINT, help="client socket: ipc://PATH or tcp://127.0.0.1:PORT"
    )
    p.add_argument("--chunked-prefill-size", type=int, default=s.chunked_prefill_size, help="-1 disables")
    p.add_argument("--max-prefill-tokens", type=int, default=s.max_prefill_tokens)
    p.add_argument("--max-running-requests", type=int, default=s.max_running_requests)
    p.add_argument("--page-size", type=int, default=s.page_size)
    p.add_argument("--kv-cache-tokens", type=int, default=w.kv_cache_tokens, help="0: use --kv-mem-fraction")
    p.add_argument("--kv-mem-fraction", type=float, default=w.kv_mem_fraction)
    p.add_argument(
        "--enable-mixed-chunk",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run a prefill chunk and the running decodes in one forward (default: on for a CPU worker, "
        "where every forward streams all weights and a separate prefill pass stalls each stream; off on GPU)",
    )
    p.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="send one batch at a time (default: the next batch is built while the worker runs one)",
    )
    _add_scheduling_flags(p, s)
    p.add_argument("--device", default=w.device, help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default=w.dtype, help="auto | float32 | bfloat16 | float16 | float64")
    p.add_argument(
        "--num-threads",
        type=int,
        default=w.num_threads,
        help="worker torch threads; 0: all cores",
    )
    p.add_argument(
        "--tune-threads",
        action=argparse.BooleanOptionalAction,
        default=w.tune_threads,
        help="with --num-threads 0: use all cores or half per batch shape, whichever measures faster "
        "(for a CPU shared with other busy processes; costs ~15%% on an idle one)",
    )
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=w.compile,
        help="torch.compile the worker's dense layer code (slower start; no oneDNN weight packing)",
    )
    p.add_argument(
        "--disable-cpu-kernels",
        dest="cpu_kernels",
        action="store_false",
        default=w.cpu_kernels,
        help="use torch instead of the worker's C kernels (decode attention, RMSNorm, rotary, silu * up, "
        "one-row matmul; "
        "built with the system C compiler on first start; without one the worker uses torch anyway)",
    )
    p.add_argument(
        "--weight-dtype",
        choices=WEIGHT_DTYPES,
        default=w.weight_dtype,
        help="a GGUF model's weights: auto keeps the blocks of every type with a CPU kernel (Q4_0, "
        "Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) quantized and uses --dtype for the rest; gguf the same, "
        "refusing to start where it cannot; bfloat16/float32 dequantize at load",
    )
    p.add_argument("--seed", type=int, default=w.seed)
    p.add_argument("--decode-log-interval", type=int, default=s.decode_log_interval)
    p.add_argument("--log-level", default="INFO")
    _add_http_flags(p, TokenizerConfig())
    return p


def _add_http_flags(p: argparse.ArgumentParser, t: TokenizerConfig) -> None:
    """The OpenAI HTTP API and graceful shutdown (README: HTTP API)."""
    p.add_argument("--http-port", type=int, default=t.http_port, help="HTTP API port (default: off)")
    p.add_argument("--host", default=t.http_host, help="HTTP bind address (default: loopback only)")
    p.add_argument("--api-key", default=t.api_key, help="require 'Authorization: Bearer KEY' on /v1")
    p.add_argument("--served-model-name", default=None, help="model id on /v1 (default: model name)")
    p.add_argument(
        "--shutdown-timeout", type=float, default=t.shutdown_timeout_s, help="SIGTERM drains for up to S s"
    )


def _add_scheduling_flags(p: argparse.ArgumentParser, s: SchedulerConfig) -> None:
    """Admission policy, prefill/decode interleaving and KV reservation (README: Scheduling)."""
    p.add_argument("--schedule-policy", choices=SCHEDULE_POLICIES, default=s.schedule_policy)
    p.add_argument("--disable-radix-cache", action="store_true", default=s.disable_radix_cache)
    p.add_argument("--admission-lookahead", type=int, default=s.admission_lookahead)
    p.add_argument("--force-fifo-every", type=int, default=s.force_fifo_every, help="0: never")
    p.add_argument("--prefill-max-requests", type=int, default=s.prefill_max_requests, help="0: no cap")
    p.add_argument("--max-overtakes", type=int, default=s.max_overtakes)
    p.add_argument("--decode-first", action="store_true", default=s.decode_first)
    p.add_argument("--max-consecutive-prefills", type=int, default=s.max_consecutive_prefills)
    p.add_argument("--schedule-conservativeness", type=float, default=s.schedule_conservativeness)
    p.add_argument("--new-token-ratio-decay-steps", type=int, default=s.new_token_ratio_decay_steps)


def check_endpoint(endpoint: str) -> str:
    """The client socket stays on this machine: an ipc:// path or a loopback tcp:// address."""
    if endpoint.startswith("ipc://"):
        return endpoint
    if endpoint.startswith("tcp://"):
        host = endpoint[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
        if host in ("127.0.0.1", "localhost", "::1") or host.startswith("127."):
            return endpoint
        raise SystemExit(f"--endpoint {endpoint}: rivulet binds loopback only (127.0.0.1), not {host}")
    raise SystemExit(f"--endpoint {endpoint}: expected ipc://PATH or tcp://127.0.0.1:PORT")


def tokenizer_config(args: argparse.Namespace, model_path: str) -> TokenizerConfig:
    if args.host not in ("127.0.0.1", "localhost", "::1") and args.http_port is not None:
        logger.warning("--host %s: the HTTP API is reachable from other machines", args.host)
    name = args.served_model_name or Path(args.model or EMBEDDED_MODEL_NAME).name.removesuffix(".gguf")
    return TokenizerConfig(
        model_path=model_path,
        seed=args.seed,
        http_host=args.host,
        http_port=args.http_port,
        api_key=args.api_key,
        served_model_name=name,
        shutdown_timeout_s=args.shutdown_timeout,
    )


def worker_config(args: argparse.Namespace, model_path: str, gguf_path: str = "") -> WorkerConfig:
    return WorkerConfig(
        model_path=model_path,
        gguf_path=gguf_path,
        weight_dtype=args.weight_dtype,
        device=args.device,
        dtype=args.dtype,
        page_size=args.page_size,
        kv_cache_tokens=args.kv_cache_tokens,
        kv_mem_fraction=args.kv_mem_fraction,
        max_running_requests=args.max_running_requests,
        num_threads=args.num_threads,
        tune_threads=args.tune_threads,
        compile=args.compile,
        cpu_kernels=args.cpu_kernels,
        seed=args.seed,
    )


def mixed_chunk(args: argparse.Namespace, device: str) -> bool:
    """--enable-mixed-chunk / --no-enable-mixed-chunk, else on where the worker runs on CPU."""
    return args.enable_mixed_chunk if args.enable_mixed_chunk is not None else device.startswith("cpu")


def scheduler_config(args: argparse.Namespace, ready: WorkerReady) -> SchedulerConfig:
    return SchedulerConfig(
        num_pages=ready.num_pages,
        context_len=ready.context_len,
        page_size=ready.page_size,
        max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_tokens,
        chunked_prefill_size=args.chunked_prefill_size,
        enable_mixed_chunk=mixed_chunk(args, ready.device),
        overlap_schedule=not args.disable_overlap_schedule,
        schedule_policy=args.schedule_policy,
        disable_radix_cache=args.disable_radix_cache,
        admission_lookahead=args.admission_lookahead,
        force_fifo_every=args.force_fifo_every,
        prefill_max_requests=args.prefill_max_requests,
        max_overtakes=args.max_overtakes,
        decode_first=args.decode_first,
        max_consecutive_prefills=args.max_consecutive_prefills,
        schedule_conservativeness=args.schedule_conservativeness,
        new_token_ratio_decay_steps=args.new_token_ratio_decay_steps,
        decode_log_interval=args.decode_log_interval,
    )


# --------------------------------------------------------------------------
# children
# --------------------------------------------------------------------------


def _child_main(entry: str, config: Any, endpoints: Endpoints, log_level: str) -> None:
    """Runs first in every child: die with the launcher, leave Ctrl-C to it, log alike.

    ``entry`` is "module:function", imported here so the launcher never loads torch.
    """
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=LOG_FORMAT, stream=sys.stderr, force=True)
    module_name, func_name = entry.split(":")
    run: Callable[[Any, Endpoints], None] = getattr(importlib.import_module(module_name), func_name)
    run(config, endpoints)


def _die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:  # the launcher died before prctl took effect
        os._exit(1)


ENTRIES = {
    "gpu_worker": "gpu_worker.process:run_worker",
    "tokenizer": "tokenizer_proc.process:run_tokenizer",
    "scheduler": "scheduler_proc.process:run_scheduler",
}


class Engine:
    """The launcher's view of the running processes."""

    def __init__(self, endpoints: Endpoints, log_level: str) -> None:
        self.endpoints = endpoints
        self.log_level = log_level
        self.children: dict[str, BaseProcess] = {}
        self._mp = multiprocessing.get_context("spawn")
        self._zmq = zmq.Context()
        self._ready_sock = make_socket(self._zmq, zmq.PULL, endpoints.to_launcher, bind=True)
        self._codec: Codec[ToLauncher] = Codec(ToLauncher)

    def start(self, name: str, config: Any) -> None:
        proc = self._mp.Process(
            target=_child_main,
            args=(ENTRIES[name], config, self.endpoints, self.log_level),
            name=name,
        )
        proc.start()
        self.children[name] = proc

    def wait_ready(self, names: set[str], timeout_s: float) -> dict[str, ToLauncher]:
        """Block until every child in ``names`` said Ready; raise ChildDied if one exits first."""
        got: dict[str, ToLauncher] = {}
        deadline = time.monotonic() + timeout_s
        while names - got.keys():
            self.raise_if_dead()
            if time.monotonic() > deadline:
                raise TimeoutError(f"no Ready from {sorted(names - got.keys())} in {timeout_s:.0f} s")
            if not self._ready_sock.poll(200):
                continue
            try:
                msg = self._codec.decode(self._ready_sock.recv())
            except msgspec.DecodeError as exc:
                logger.warning("dropped a malformed frame on the launcher socket: %s", exc)
                continue
            got["gpu_worker" if isinstance(msg, WorkerReady) else msg.proc] = msg
        return got

    def raise_if_dead(self) -> None:
        for name, proc in self.children.items():
            if proc.exitcode is not None:
                raise ChildDied(name, proc.exitcode)

    def supervise(self, wakeup: socket.socket) -> None:
        """Block until a child exits (raise ChildDied) or a signal byte arrives on ``wakeup``."""
        sentinels = {proc.sentinel: name for name, proc in self.children.items()}
        while True:
            ready = multiprocessing.connection.wait([*sentinels, wakeup])
            if wakeup in ready:
                return
            self.raise_if_dead()

    def stop(self, drain_s: float = 0.0) -> None:
        """Stop the tokenizer first (it tells waiting clients), then the rest; SIGKILL stragglers.

        ``drain_s`` > 0 (a graceful stop): the tokenizer gets SIGTERM and up to ``drain_s``
        to let running requests finish while the others keep serving them; if another
        child dies meanwhile, or on a stop after a failure, it gets SIGUSR1: fail all now.
        """
        self._stop_tokenizer(drain_s)
        order = [n for n in ("tokenizer", "scheduler", "gpu_worker") if n in self.children]
        for name in order:
            proc = self.children[name]
            if proc.exitcode is None:
                proc.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for name in order:
            proc = self.children[name]
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.exitcode is None:
                logger.warning("%s did not stop on SIGTERM; killing pid %s", name, proc.pid)
                proc.kill()
                proc.join(1.0)
        self._ready_sock.close()
        self._zmq.term()

    def _stop_tokenizer(self, drain_s: float) -> None:
        tokenizer = self.children.get("tokenizer")
        if tokenizer is None or tokenizer.exitcode is not None or tokenizer.pid is None:
            return
        os.kill(tokenizer.pid, signal.SIGTERM if drain_s > 0 else signal.SIGUSR1)
        if drain_s <= 0:
            return
        others = [p.sentinel for n, p in self.children.items() if n != "tokenizer" and p.exitcode is None]
        ready = multiprocessing.connection.wait([tokenizer.sentinel, *others], drain_s + STOP_GRACE_S)
        if tokenizer.sentinel not in ready and tokenizer.exitcode is None:
            os.kill(tokenizer.pid, signal.SIGUSR1)  # a sibling died or the drain overran: stop now


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------


def _signal_wakeup() -> tuple[socket.socket, socket.socket]:
    """SIGINT/SIGTERM write a byte to a socketpair whose read end supervise() blocks on.

    Both ends are returned: the write end must stay open while the handlers are installed.
    """
    rsock, wsock = socket.socketpair()
    rsock.setblocking(False)
    wsock.setblocking(False)
    signal.set_wakeup_fd(wsock.fileno(), warn_on_full_buffer=False)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)  # the wakeup byte does the work
    return rsock, wsock


def serve(args: argparse.Namespace) -> int:
    """Start the engine, print the endpoint, supervise until a signal or a child's death."""
    from gpu_worker.model_files import resolve_model, source_gguf

    endpoint = check_endpoint(args.endpoint)
    if endpoint.startswith("ipc://"):
        os.makedirs(os.path.dirname(endpoint[len("ipc://") :]) or ".", exist_ok=True)
    model_path = str(resolve_model(args.model))
    run_dir = tempfile.mkdtemp(prefix="rivulet-")
    wakeup, _wakeup_writer = _signal_wakeup()
    drain_s = 0.0  # only a stop by signal drains
    engine = Engine(Endpoints.in_dir(run_dir, client=endpoint), args.log_level)
    try:
        engine.start("gpu_worker", worker_config(args, model_path, str(source_gguf(args.model) or "")))
        engine.start("tokenizer", tokenizer_config(args, model_path))
        ready = engine.wait_ready({"gpu_worker", "tokenizer"}, READY_TIMEOUT_S)["gpu_worker"]
        assert isinstance(ready, WorkerReady), "the worker must report its KV pool"
        engine.start("scheduler", scheduler_config(args, ready))
        engine.wait_ready({"scheduler"}, READY_TIMEOUT_S)
        pids = " ".join(f"{n}={p.pid}" for n, p in engine.children.items())
        logger.info(
            "model %s on %s/%s: %d KV pages of %d tokens, context %d",
            model_path, ready.device, ready.dtype, ready.num_pages, ready.page_size, ready.context_len,
        )  # fmt: skip
        http = f" http=http://{args.host}:{args.http_port}" if args.http_port is not None else ""
        print(f"rivulet ready: endpoint={endpoint}{http} pids: {pids}", flush=True)
        engine.supervise(wakeup)
        logger.info("shutting down")
        drain_s = args.shutdown_timeout
        return 0
    except (ChildDied, TimeoutError) as exc:
        logger.error("%s; stopping the engine", exc)
        return 1
    finally:
        engine.stop(drain_s)
        shutil.rmtree(run_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format=LOG_FORMAT, stream=sys.stderr)
    try:  # before any child starts: they inherit the libraries' settings for the CPU kind
        apply_to_environ()
    except CpuKindError as exc:
        print(f"rivulet: {exc}", file=sys.stderr)
        return 2
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
