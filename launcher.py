"""Start rivulet: the tokenizer, scheduler and GPU worker processes, then supervise them.

    python launcher.py --chunked-prefill-size 256

Order of start: the worker (loads weights, sizes the KV pool) and the tokenizer
start together; once the worker reports how many KV pages it allocated, the
scheduler starts with that number in its config. When all three said Ready the
launcher prints the client endpoint and waits. If any child dies, the others are
stopped and the launcher exits non-zero naming the child; SIGINT/SIGTERM stop
everything within a few seconds. Children also die with the launcher
(PR_SET_PDEATHSIG), so no process is ever orphaned.

Before any child starts, whatever the flags, the model's config and this machine rule out (a
--tp-size that does not split the heads, a busy endpoint or port, a CUDA device torch cannot use)
is refused in one line with exit status 2 (launcher_checks.py). The command line comes from the
process configs' fields (launcher_flags.py); the children and their supervision live in
launcher_engine.py.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from pathlib import Path

from gpu_worker.backends.cpu.kind import CpuKindError, apply_to_environ
from gpu_worker.weights.gguf_file import GgufFormatError
from gpu_worker.weights.model_files import ModelNotFoundError, ModelNotSupportedError
from launcher_checks import StartRefused, check_device, check_endpoints_free, check_flags, check_model
from launcher_engine import LOG_FORMAT, ChildDied, Engine
from launcher_flags import (
    build_parser,
    check_endpoint,
    check_nodes,
    node_address,
    replica_cpus,
    scheduler_config,
    tokenizer_config,
    warn_deprecated,
    worker_config,
)
from protocol import Ready, WorkerReady
from protocol.transport import Endpoints, replica_name

__all__ = [
    "build_parser",
    "check_endpoint",
    "check_nodes",
    "main",
    "node_address",
    "scheduler_config",
    "tokenizer_config",
    "worker_config",
]

logger = logging.getLogger("rivulet.launcher")

READY_TIMEOUT_S = 600.0  # generous: a first start builds the C kernels; big weights may load from slow disks


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


def _start(
    engine: Engine, args: argparse.Namespace, endpoints: Endpoints, model_path: str
) -> tuple[WorkerReady, Ready]:
    """Start every child of the head node: the workers (one per data-parallel replica and this
    node's tensor-parallel ranks, each on its share of the cores) and the tokenizer, then each
    replica's scheduler once its worker reported its KV pool. Returns replica 0's WorkerReady and
    the tokenizer's Ready (with the HTTP port it bound)."""
    from gpu_worker.weights.model_files import source_gguf

    replicas, ranks = range(args.dp_size), range(args.tp_size // args.nnodes)  # this node's ranks
    gguf = str(source_gguf(args.model) or "")
    cpus = replica_cpus(args.dp_size * len(ranks))  # one share of the cores per worker process
    for i in replicas:
        store = _store_address(args, i)
        for rank in ranks:
            config = worker_config(args, model_path, gguf, replica=i, cpu_ids=cpus[i * len(ranks) + rank],
                                   tp_rank=rank, dist_init_addr=store)  # fmt: skip
            engine.start(replica_name("gpu_worker", i, rank), config, endpoints.replica(i))
    engine.start("tokenizer", tokenizer_config(args, model_path))
    workers = [replica_name("gpu_worker", i) for i in replicas]
    ranked = [replica_name("gpu_worker", i, rank) for i in replicas for rank in ranks]
    readies = engine.wait_ready({*ranked, "tokenizer"}, READY_TIMEOUT_S)
    for i, worker in enumerate(workers):
        ready = readies[worker]
        assert isinstance(ready, WorkerReady), "the worker must report its KV pool"
        engine.start(replica_name("scheduler", i), scheduler_config(args, ready, i), endpoints.replica(i))
    engine.wait_ready({replica_name("scheduler", i) for i in replicas}, READY_TIMEOUT_S)
    first, tokenizer = readies[workers[0]], readies["tokenizer"]
    assert isinstance(first, WorkerReady) and isinstance(tokenizer, Ready)
    return first, tokenizer


def _start_worker_node(
    engine: Engine, args: argparse.Namespace, endpoints: Endpoints, model_path: str
) -> None:
    """A worker node (--node-rank > 0): only its tensor-parallel ranks, taking batches over tcp
    from the head node's scheduler; they stop when it goes."""
    from gpu_worker.weights.model_files import source_gguf

    per_node = args.tp_size // args.nnodes
    ranks = range(args.node_rank * per_node, (args.node_rank + 1) * per_node)
    host = node_address(args.dist_init_addr)
    gguf = str(source_gguf(args.model) or "")
    for rank, cpu_ids in zip(ranks, replica_cpus(per_node), strict=True):
        config = worker_config(args, model_path, gguf, cpu_ids=cpu_ids, tp_rank=rank,
                               dist_init_addr=args.dist_init_addr, node_host=host)  # fmt: skip
        engine.start(replica_name("gpu_worker", 0, rank), config, endpoints)
    engine.wait_ready({replica_name("gpu_worker", 0, rank) for rank in ranks}, READY_TIMEOUT_S)


def _store_address(args: argparse.Namespace, replica: int) -> str:
    """The TCP store of data-parallel replica ``replica``'s tensor-parallel ranks (each replica is a
    process group of its own): --dist-init-addr's port + replica, else a free local port."""
    if args.tp_size == 1:
        return ""
    if args.dist_init_addr is None:
        return f"127.0.0.1:{_free_port()}"
    host, _, port = args.dist_init_addr.rpartition(":")
    return f"{host}:{int(port) + replica}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve(args: argparse.Namespace, model_path: str) -> int:
    """Start the engine, print the endpoint, supervise until a signal or a child's death."""
    endpoint = args.endpoint
    if endpoint.startswith("ipc://"):
        os.makedirs(os.path.dirname(endpoint[len("ipc://") :]) or ".", exist_ok=True)
    run_dir = tempfile.mkdtemp(prefix="rivulet-")
    wakeup, _wakeup_writer = _signal_wakeup()
    drain_s = 0.0  # only a stop by signal drains
    endpoints = Endpoints.in_dir(run_dir, client=endpoint)
    engine = Engine(endpoints, args.log_level)
    try:
        ready, tokenizer = _start(engine, args, endpoints, model_path)
        pids = " ".join(f"{n}={p.pid}" for n, p in engine.children.items())
        logger.info(
            "model %s on %s/%s: %d KV pages of %d tokens, context %d",
            model_path, ready.device, ready.dtype, ready.num_pages, ready.page_size, ready.context_len,
        )  # fmt: skip
        port = tokenizer.http_port  # the one bound: --http-port 0 takes any free port
        http = f" http=http://{args.http_host}:{port}" if port is not None else ""
        print(f"rivulet ready: endpoint={endpoint}{http} pids: {pids}", flush=True)
        engine.supervise(wakeup)
        logger.info("shutting down")
        drain_s = args.shutdown_timeout_s
        return 0
    except (ChildDied, TimeoutError) as exc:
        logger.error("%s; stopping the engine", exc)
        return 1
    finally:
        engine.stop(drain_s)
        shutil.rmtree(run_dir, ignore_errors=True)


def serve_worker_node(args: argparse.Namespace, model_path: str) -> int:
    """Start this node's ranks, supervise them; 0 when they stopped because the head node did."""
    run_dir = tempfile.mkdtemp(prefix="rivulet-")
    wakeup, _wakeup_writer = _signal_wakeup()
    engine = Engine(Endpoints.in_dir(run_dir), args.log_level)
    try:
        _start_worker_node(engine, args, engine.endpoints, model_path)
        pids = " ".join(f"{n}={p.pid}" for n, p in engine.children.items())
        print(f"rivulet ready: node {args.node_rank} of {args.nnodes} pids: {pids}", flush=True)
        engine.supervise(wakeup)
        return 0
    except ChildDied as exc:
        if exc.exitcode == 0:  # a rank saw the head node's scheduler go
            logger.info("the head node stopped; stopping node %d", args.node_rank)
            return 0
        logger.error("%s; stopping node %d", exc, args.node_rank)
        return 1
    except TimeoutError as exc:
        logger.error("%s; stopping node %d", exc, args.node_rank)
        return 1
    finally:
        engine.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:  # every refusal before any child starts: one line, exit 2
        logging.basicConfig(level=args.log_level, format=LOG_FORMAT, stream=sys.stderr)
    except ValueError as exc:
        print(f"rivulet: --log-level {args.log_level}: {exc}", file=sys.stderr)
        return 2
    warn_deprecated(args)
    try:
        model_dir = _check_start(args)
    except (StartRefused, CpuKindError, ModelNotFoundError, ModelNotSupportedError, GgufFormatError) as exc:
        print(f"rivulet: {exc}", file=sys.stderr)
        return 2
    if args.node_rank > 0:
        return serve_worker_node(args, str(model_dir))
    return serve(args, str(model_dir))


def _check_start(args: argparse.Namespace) -> Path:
    """The checks of launcher_checks.py, cheapest first; the model's HF-layout directory."""
    from gpu_worker.weights.model_files import resolve_model

    check_flags(args)
    apply_to_environ()  # before any child starts: they inherit the libraries' settings for the CPU kind
    model_dir = resolve_model(args.model)
    check_model(args, model_dir)
    if args.node_rank == 0:
        check_endpoints_free(args)
    check_device(args)  # last: a CUDA device costs a probe that imports torch
    return model_dir


if __name__ == "__main__":
    sys.exit(main())
