"""The serving targets in one run: every target measured, a markdown table printed.

    flock /tmp/rivulet-cpu.lock python -m bench.targets                  # the engine's default dtype
    flock /tmp/rivulet-cpu.lock python -m bench.targets --dtype float32,bfloat16 --repeats 3
    flock /tmp/rivulet-cpu.lock python -m bench.targets --peer-llama-cpp auto   # and llama.cpp beside it

Round r starts one fresh engine per dtype (``launcher.py --dtype D --http-port P``) and on it
measures, in order: start-up to the Ready line, 32 concurrent streams (with the worker's busy
counters sampled from GET /metrics while they decode), 1 stream, idle CPU of the whole process
tree, and ``python -m bench.offline``'s 256 prompts against HF generate of the same dtype in this process.
Every measurement of round r comes before round r+1; a cell is the median over rounds with
(min-max). Anchor columns are reference numbers from another machine, not measured here.

With ``--peer-llama-cpp PATH|auto`` (bench/llama_cpp.py builds and caches llama-server per CPU
kind) round r also measures rivulet's 32 streams and 1 stream over its HTTP API, then starts
llama.cpp's server on the same GGUF and measures the same two workloads (same prompts) through
the same client code, and the table gains rivulet / llama.cpp ratios of like with like (HTTP
both). The CPU kind rivulet acts as (``RIVULET_CPU_KIND``, applied here before torch loads and
inherited by every engine started) heads the table and is kept in the record.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.lib import launch, llama_cpp, offline, serving
from bench.lib.floor import decode_bytes, read_bandwidth
from bench.lib.launch import free_port
from bench.lib.llama_cpp import Peer
from bench.lib.metrics import RequestResult, Summary, summarize
from bench.lib.probes import (
    Sample,
    busy_share,
    cpu_percent,
    parse_prometheus,
    steady_window_s,
    tree_cpu_ticks,
)
from bench.lib.records import append_record, machine_info, make_record
from bench.lib.targets_table import PEER_COPIED, PEER_TARGETS, RATIOS, TARGETS, format_table, summarize_runs
from gpu_worker.backends.cpu import kind as cpu_kind

DEFAULT_RESULTS = Path(__file__).resolve().parent / "results" / "targets.jsonl"
METRICS_POLL_S = 0.2
HTTP_SEED = 3000  # the HTTP runs' prompts differ from the ZMQ runs', so rivulet's prefix cache has no hits


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="the serving targets, measured in one run")
    add = p.add_argument
    add(
        "--model",
        default=None,
        help="model dir, GGUF, or a bench model's name (bench/gguf_models.py: llama1b-q4_k_m, ...); "
        "default: the embedded SmolLM2-135M",
    )
    add("--dtype", default="auto", help="comma list of auto | float32 | bfloat16; auto: the engine's default")
    add("--repeats", type=int, default=3, help="rounds; every target is measured once per round and dtype")
    add("--engine-flags", default="", help="extra launcher flags for every engine")
    add("--streams", type=int, default=32, help="concurrent streams (the 32-stream targets)")
    add("--stream-requests", type=int, default=64, help="requests of the concurrent run")
    add("--single-requests", type=int, default=4, help="requests of the 1-stream run")
    add("--input-len", type=int, default=32, help="prompt tokens of every request")
    add("--output-len", type=int, default=64, help="new tokens of every request (EOS ignored)")
    add("--offline-prompts", type=int, default=256, help="0: no offline run (nor HF generate)")
    add(
        "--http-only",
        action="store_true",
        help="with --peer-llama-cpp: measure rivulet over HTTP only (no ZMQ streams, so no busy share)",
    )
    add("--hf-batch-sizes", default="32,64", help="HF generate's static batch sizes; the fastest is kept")
    add("--hf-threads", type=int, default=0, help="torch threads for HF; 0: torch's default")
    add("--hf-dtype", default="same", help="HF generate's dtype for the offline ratio; same: the engine's")
    add("--idle-s", type=float, default=10.0, help="how long idle CPU is measured")
    add("--result-file", type=Path, default=DEFAULT_RESULTS, help="JSON Lines file the record is appended to")
    add("--no-record", action="store_true")
    add(
        "--peer-llama-cpp",
        default=None,
        metavar="PATH|auto",
        help="also measure llama.cpp's llama-server (PATH, or auto: the build of the CPU kind rivulet acts "
        "as, from `python -m bench.llama_cpp build`) on the same GGUF, interleaved with rivulet",
    )
    add(
        "--paired-requests",
        type=int,
        default=8,
        help="with --peer-llama-cpp: 1-stream requests to each engine with both servers up, alternating "
        "(0: none)",
    )
    add(
        "--peer-threads",
        type=int,
        default=0,
        help="llama-server -t; 0: every core this process may use (like --num-threads 0)",
    )
    p.set_defaults(decode_bytes=None)  # set by main: the weight bytes a token reads (a GGUF), for the floor
    return p


# --------------------------------------------------------------------------
# one round on one engine
# --------------------------------------------------------------------------


def _serving_args(
    args: argparse.Namespace, address: str, n: int, concurrency: int, seed: int, http: bool = False
) -> Any:
    """``python -m bench.serving``'s arguments for one run: rivulet's ZMQ ``address``, or with ``http``
    a base URL."""
    model = ["--model", args.model] if args.model else []
    target = ["--backend", "openai", "--base-url", address] if http else ["--endpoint", address]
    argv = [*target, *model, "--workload", "random", "--num-requests", str(n),
            "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--max-concurrency", str(concurrency), "--warmup-requests", "2", "--seed", str(seed),
            "--no-progress", "--no-record"]  # fmt: skip
    return serving.build_parser().parse_args(argv)


async def _streams_with_metrics(
    bench_args: Any, metrics_url: str
) -> tuple[Summary, list[RequestResult], list[Sample]]:
    """serving.benchmark with GET /metrics polled beside it: (summary, results, [(time, metrics)])."""
    samples: list[Sample] = []
    done = asyncio.Event()

    async def poll() -> None:
        async with httpx.AsyncClient(timeout=5.0) as http:
            while not done.is_set():
                with contextlib.suppress(httpx.HTTPError):
                    text = (await http.get(metrics_url)).text
                    samples.append((time.perf_counter(), parse_prometheus(text)))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), METRICS_POLL_S)

    poller = asyncio.create_task(poll())
    try:
        summary, results = await serving.benchmark(bench_args)
    finally:
        done.set()
        await poller
    return summary, results, samples


def measure_streams(args: argparse.Namespace, server: launch.Server, port: int, r: int) -> dict[str, Any]:
    bench_args = _serving_args(args, server.address, args.stream_requests, args.streams, r)
    summary, results, samples = asyncio.run(
        _streams_with_metrics(bench_args, f"http://127.0.0.1:{port}/metrics")
    )
    assert summary.num_failed == 0, f"{summary.num_failed} of the concurrent requests failed"
    window = steady_window_s(results, args.streams)
    share = busy_share(samples, window) if window is not None else None
    return {
        "out32_tps": summary.output_throughput,
        "ttft32_ms": summary.ttft_ms.p50,
        "busy_pct": None if share is None else 100.0 * share,
    }


def measure_single(args: argparse.Namespace, server: launch.Server, r: int) -> dict[str, Any]:
    bench_args = _serving_args(args, server.address, args.single_requests, 1, 1000 + r)
    summary, _ = asyncio.run(serving.benchmark(bench_args))
    assert summary.num_failed == 0, f"{summary.num_failed} of the single-stream requests failed"
    tpot_ms = summary.tpot_ms.p50
    return {"decode1_tps": 1e3 / tpot_ms if tpot_ms else None, "out1_tps": summary.output_throughput}


def measure_http(args: argparse.Namespace, base_url: str, r: int) -> dict[str, Any]:
    """32 streams then 1 stream through POST /v1/completions (``python -m bench.serving --backend openai``).

    The same code and prompts measure rivulet's HTTP API and llama.cpp's server in round r.
    """
    out: dict[str, Any] = {}
    for name, n, concurrency, seed in (
        ("streams", args.stream_requests, args.streams, HTTP_SEED + r),
        ("single", args.single_requests, 1, HTTP_SEED + 1000 + r),
    ):
        bench_args = _serving_args(args, base_url, n, concurrency, seed, http=True)
        if name == "single" and args.decode_bytes:  # the memory's pace now, the engine idle
            out["read_gbps"] = read_bandwidth()
        summary, _ = asyncio.run(serving.benchmark(bench_args))
        assert summary.num_failed == 0, f"{summary.num_failed} of the {name} requests to {base_url} failed"
        if name == "streams":
            out |= {"out32_tps": summary.output_throughput, "ttft32_ms": summary.ttft_ms.p50}
        else:
            tpot_ms = summary.tpot_ms.p50
            out |= {"decode1_tps": 1e3 / tpot_ms if tpot_ms else None, "out1_tps": summary.output_throughput}
            if tpot_ms and args.decode_bytes:  # a token's time over its floor: weight bytes / read pace
                out["decode1_floor_x"] = tpot_ms / (args.decode_bytes / out["read_gbps"] / 1e6)
    return out


def measure_idle(server: launch.Server, seconds: float) -> float:
    """CPU % of the launcher and all its descendants over ``seconds`` with no request in flight."""
    time.sleep(1.0)  # the last reply's bookkeeping settles
    before, t0 = tree_cpu_ticks(server.proc.pid), time.perf_counter()
    time.sleep(seconds)
    after = tree_cpu_ticks(server.proc.pid)
    return cpu_percent(before, after, time.perf_counter() - t0)


def measure_offline(args: argparse.Namespace, server: launch.Server, dtype: str, r: int) -> dict[str, Any]:
    """``python -m bench.offline`` on this engine, HF generate (of --hf-dtype) beside it (one round)."""
    model = ["--model", args.model] if args.model else []
    argv = ["--endpoint", server.address, *model, "--dtype", dtype, "--seed", str(2000 + r),
            "--num-prompts", str(args.offline_prompts), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len),
            "--baseline", "hf", "--hf-batch-sizes", args.hf_batch_sizes, "--hf-threads", str(args.hf_threads),
            "--hf-dtype", args.hf_dtype,
            "--no-record"]  # fmt: skip
    off_args = offline.build_parser().parse_args(argv)
    res = offline.run_offline(off_args)
    return {
        "offline_ratio": res.ratio,
        "offline_tps": res.rivulet_output_tps,
        "offline_hf_tps": res.hf_output_tps,
        "offline_hf_batch_size": res.hf_batch_size,
    }


def _engine_flags(args: argparse.Namespace, dtype: str, port: int) -> list[str]:
    """launcher.py's flags for a rivulet engine of ``dtype`` serving HTTP on ``port``."""
    return ["--dtype", dtype, "--http-port", str(port), *shlex.split(args.engine_flags)]


def measure_round(args: argparse.Namespace, dtype: str, r: int, http: bool = False) -> dict[str, Any]:
    """Start an engine (timing its start-up), measure every target on it, stop it.

    ``http``: also 32 streams and 1 stream over its HTTP API (``http_*`` keys), the peer's terms.
    """
    port = free_port()
    flags = _engine_flags(args, dtype, port)
    with tempfile.TemporaryDirectory(prefix="rivulet-targets-") as tmp:
        t0 = time.perf_counter()
        with launch.rivulet_server(f"targets-{dtype}", flags, Path(tmp), args.model) as server:
            run: dict[str, Any] = {"startup_s": time.perf_counter() - t0}
            if not (http and args.http_only):
                run |= measure_streams(args, server, port, r)
                run |= measure_single(args, server, r)
            if http:
                over_http = measure_http(args, f"http://127.0.0.1:{port}", r)
                run |= {f"http_{k}": v for k, v in over_http.items()}
            run["idle_cpu_pct"] = measure_idle(server, args.idle_s)
            if args.offline_prompts > 0:
                run |= measure_offline(args, server, dtype, r)
    return run


def measure_peer(args: argparse.Namespace, peer: Peer, r: int) -> dict[str, Any]:
    """Start llama.cpp's server, measure what measure_http measures on rivulet, stop it."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="rivulet-targets-llama-cpp-") as tmp:
        t0 = time.perf_counter()
        url = f"http://127.0.0.1:{port}"
        with launch.openai_server("llama.cpp", peer.command(port), url, Path(tmp)):
            run: dict[str, Any] = {"startup_s": time.perf_counter() - t0}
            run |= measure_http(args, url, r)
    return run


def measure_paired(args: argparse.Namespace, peer: Peer, dtype: str, r: int) -> dict[str, Any]:
    """One stream on rivulet and llama.cpp with both servers up: ``--paired-requests`` requests each,
    sent in pairs (one to each engine, the pair's first alternating), the same prompt for both of
    a pair. A pair meets the machine a second apart, where measure_http's one-stream runs of a round
    come 20-30 s apart: on a shared host the memory's read pace can move by half in that time, and
    one engine's run lands on the fast pace while the other's lands on the slow one. Returns the
    medians of each engine's per-request TPOT as tok/s and the median of the pairs' ratios."""
    rport, lport = free_port(), free_port()
    flags = _engine_flags(args, dtype, rport)
    urls = {"rivulet": f"http://127.0.0.1:{rport}", "llama.cpp": f"http://127.0.0.1:{lport}"}
    with (
        tempfile.TemporaryDirectory(prefix="rivulet-targets-paired-") as tmp,
        launch.rivulet_server(f"targets-paired-{dtype}", flags, Path(tmp), args.model),
        launch.openai_server("llama.cpp", peer.command(lport), urls["llama.cpp"], Path(tmp)),
    ):
        tpot = asyncio.run(_paired_tpots(args, urls, HTTP_SEED + 2000 + r))
    ratios = [theirs / mine for mine, theirs in zip(tpot["rivulet"], tpot["llama.cpp"], strict=True)]
    return {
        "paired_decode1_tps": 1e3 / statistics.median(tpot["rivulet"]),
        "llama_paired_decode1_tps": 1e3 / statistics.median(tpot["llama.cpp"]),
        "paired_decode1_ratio": statistics.median(ratios),
    }


async def _paired_tpots(args: argparse.Namespace, urls: dict[str, str], seed: int) -> dict[str, list[float]]:
    """Each engine's TPOT (ms) per request of the paired run, in pair order."""
    bench_args = _serving_args(args, urls["rivulet"], args.paired_requests, 1, seed, http=True)
    items = serving.build_workload(bench_args)
    backends = {
        name: serving.make_backend(argparse.Namespace(**{**vars(bench_args), "base_url": url}))
        for name, url in urls.items()
    }
    tpot: dict[str, list[float]] = {name: [] for name in urls}
    try:
        for backend in backends.values():
            await serving.warm_up(backend, bench_args.warmup_requests)
        for i, item in enumerate(items):
            for name in list(urls)[:: 1 if i % 2 == 0 else -1]:
                (res,) = await serving.run_requests(backends[name], [item], [0.0], 1, False)
                assert not res.error, f"a paired request to {name} failed: {res.error}"
                ms = summarize([res]).tpot_ms.p50
                assert ms is not None, f"a paired request to {name} streamed fewer than 2 tokens"
                tpot[name].append(ms)
    finally:
        for backend in backends.values():
            await backend.close()
    return tpot


def peer_ratios(rivulet_run: dict[str, Any], peer_run: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's numbers of the same round beside rivulet's, and rivulet / llama.cpp (None: n/a)."""
    out: dict[str, Any] = {}
    for ratio, (ours, theirs) in RATIOS.items():
        mine, peer = rivulet_run.get(ours), peer_run.get(theirs)
        out[f"llama_{theirs}"] = peer
        out[ratio] = mine / peer if mine is not None and peer else None
    return out | {f"llama_{key}": peer_run.get(key) for key in PEER_COPIED}


# --------------------------------------------------------------------------
# the record
# --------------------------------------------------------------------------


def cpu_record(acting: cpu_kind.CpuKind) -> dict[str, Any]:
    """The CPU kind acted as, the native one, and the flags describe() reports, for the JSON record."""
    have = cpu_kind.cpu_flags()
    return {
        "cpu_kind": acting.value,
        "native_cpu_kind": cpu_kind.native_kind().value,
        "cpu_flags": {f: f in have for f in cpu_kind.REPORTED_FLAGS},
        "cpu_line": cpu_kind.describe(acting),
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:  # first, before anything imports torch; the engines started below inherit the environment
        acting = cpu_kind.apply_to_environ()
    except cpu_kind.CpuKindError as exc:
        raise SystemExit(f"error: {exc}") from None
    from bench.lib import gguf_models  # (numpy and gguf: after the kind is applied, to be safe)

    args.model = gguf_models.resolve(args.model)  # a bench model's name (llama1b-q4_k_m): made once
    from gpu_worker.weights.model_files import source_gguf

    gguf = source_gguf(args.model)
    args.decode_bytes = decode_bytes(gguf) if gguf is not None else None  # the one-stream floor's bytes
    peer = None
    if args.peer_llama_cpp:
        parallel = max(llama_cpp.PARALLEL, args.streams)
        peer = llama_cpp.make_peer(args.peer_llama_cpp, acting, args.model, parallel, args.peer_threads)
    if peer is not None and peer.warning:
        print(peer.warning, file=sys.stderr, flush=True)
    command = shlex.join(["python", "-m", "bench.targets", *(argv if argv is not None else sys.argv[1:])])
    dtypes = [offline.resolve_dtype(d.strip(), args.model) for d in args.dtype.split(",") if d.strip()]
    assert dtypes and len(set(dtypes)) == len(dtypes), f"--dtype wants distinct dtypes, got {args.dtype!r}"
    from gpu_worker.weights.model_files import resolve_model

    resolve_model(args.model)  # converts a GGUF once, so every start-up is timed with a warm cache
    launch.rejected_flags([])  # imports launcher here, outside the start-up timing
    runs: dict[str, list[dict[str, Any]]] = {d: [] for d in dtypes}
    peer_runs: list[dict[str, Any]] = []
    for r in range(args.repeats):
        for dtype in dtypes:
            runs[dtype].append(measure_round(args, dtype, r, http=peer is not None))
            print(f"round {r + 1}/{args.repeats} {dtype}: {_shown(runs[dtype][-1])}", flush=True)
        if peer is not None:  # after rivulet's round, before the next: interleaved
            peer_runs.append(measure_peer(args, peer, r))
            print(f"round {r + 1}/{args.repeats} llama.cpp: {_shown(peer_runs[-1])}", flush=True)
            for dtype in dtypes:
                runs[dtype][-1] |= peer_ratios(runs[dtype][-1], peer_runs[-1])
            if args.paired_requests > 0:  # both up, requests alternating: the one-stream ratio at one pace
                runs[dtypes[0]][-1] |= measure_paired(args, peer, dtypes[0], r)
                print(f"round {r + 1}/{args.repeats} paired: {_shown(runs[dtypes[0]][-1])}", flush=True)
    shown_targets = (*TARGETS, *PEER_TARGETS) if peer is not None else TARGETS
    by_dtype = {d: summarize_runs(rs, shown_targets) for d, rs in runs.items()}
    machine = machine_info() | cpu_record(acting)
    table = format_table(by_dtype, machine, args.repeats, machine["cpu_line"], peer)
    print(f"\nCommand: `{command}`" + table, flush=True)
    if not args.no_record:
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        config["command"] = command
        metrics: dict[str, Any] = {"targets": by_dtype, "runs": runs}
        if peer is not None:
            metrics["peer"] = {
                "name": "llama.cpp", "binary": str(peer.binary), "command": peer.shown(),
                "warning": peer.warning, "runs": peer_runs,
            }  # fmt: skip
        append_record(args.result_file, make_record("targets", config, metrics, machine=machine))
    return 0


def _shown(run: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in run.items())


if __name__ == "__main__":
    sys.exit(main())
