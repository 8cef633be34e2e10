"""bench/targets.py's measurements: one round on one engine (rivulet's targets over ZMQ and HTTP,
its idle cost and the offline run) and llama.cpp's server measured the same way beside it."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.lib import launch, offline, serving
from bench.lib.floor import floor_x, read_bandwidth
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
from bench.lib.targets_table import PEER_COPIED, RATIOS

METRICS_POLL_S = 0.2
HTTP_SEED = 3000  # the HTTP runs' prompts differ from the ZMQ runs', so rivulet's prefix cache has no hits


def _serving_args(
    args: argparse.Namespace,
    address: str,
    n: int,
    concurrency: int,
    seed: int,
    http: bool = False,
    fields: dict[str, object] | None = None,
) -> Any:
    """``python -m bench.serving``'s arguments for one run: rivulet's ZMQ ``address``, or with ``http``
    a base URL; ``fields``: more body fields on every request (llama_cpp.REQUEST_FIELDS)."""
    model = ["--model", args.model] if args.model else []
    target = ["--backend", "openai", "--base-url", address] if http else ["--endpoint", address]
    extra = ["--sampling", json.dumps(fields)] if fields else []
    argv = [*target, *model, "--workload", "random", "--num-requests", str(n),
            "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--max-concurrency", str(concurrency), "--warmup-requests", "2", "--seed", str(seed),
            *extra, "--no-progress", "--no-record"]  # fmt: skip
    return serving.build_parser().parse_args(argv)


def _check_lengths(results: list[RequestResult], want: int, who: str) -> None:
    """Every request decoded ``want`` tokens (EOS ignored): rates of unequal counts do not compare."""
    got = sorted({r.completion_tokens for r in results})
    assert got == [want], f"{who}: completion tokens {got}, not {want} each (did it stop at an EOS?)"


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


def measure_http(
    args: argparse.Namespace, base_url: str, r: int, fields: dict[str, object] | None = None
) -> dict[str, Any]:
    """32 streams then 1 stream through POST /v1/completions (``python -m bench.serving --backend openai``).

    The same code and prompts measure rivulet's HTTP API and llama.cpp's server (with its
    ``fields``) in round r.
    """
    out: dict[str, Any] = {}
    for name, n, concurrency, seed in (
        ("streams", args.stream_requests, args.streams, HTTP_SEED + r),
        ("single", args.single_requests, 1, HTTP_SEED + 1000 + r),
    ):
        bench_args = _serving_args(args, base_url, n, concurrency, seed, http=True, fields=fields)
        if name == "single" and args.decode_bytes:  # the memory's pace now, the engine idle
            out["read_gbps"] = read_bandwidth()
        summary, results = asyncio.run(serving.benchmark(bench_args))
        assert summary.num_failed == 0, f"{summary.num_failed} of the {name} requests to {base_url} failed"
        _check_lengths(results, args.output_len, f"the {name} requests to {base_url}")
        if name == "streams":
            out |= {"out32_tps": summary.output_throughput, "ttft32_ms": summary.ttft_ms.p50}
        else:
            tpot_ms = summary.tpot_ms.p50
            out |= {"decode1_tps": 1e3 / tpot_ms if tpot_ms else None, "out1_tps": summary.output_throughput}
            if tpot_ms and args.decode_bytes:  # a token's time over its floor: weight bytes / read pace
                out["decode1_floor_x"] = floor_x(tpot_ms, args.decode_bytes, out["read_gbps"])
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
            run |= measure_http(args, url, r, peer.fields)
    return run


def measure_paired(args: argparse.Namespace, peer: Peer, dtype: str, r: int) -> dict[str, Any]:
    """One stream on rivulet and llama.cpp with both servers up: ``--paired-requests`` requests each,
    sent in pairs (one to each engine, the pair's first alternating), the same prompt for both of
    a pair. A pair meets the machine a second apart, where measure_http's one-stream runs of a round
    come 20-30 s apart: on a shared host the memory's read pace can move by half in that time, and
    one engine's run lands on the fast pace while the other's lands on the slow one. Returns the
    medians of each engine's per-request TPOT as tok/s and the median of the pairs' ratios; for a GGUF
    (``args.decode_bytes``) also each engine's median of its requests' time a token over the floor,
    the read pace probed right before and right after each request (both engines idle then)."""
    rport, lport = free_port(), free_port()
    flags = _engine_flags(args, dtype, rport)
    urls = {"rivulet": f"http://127.0.0.1:{rport}", "llama.cpp": f"http://127.0.0.1:{lport}"}
    with (
        tempfile.TemporaryDirectory(prefix="rivulet-targets-paired-") as tmp,
        launch.rivulet_server(f"targets-paired-{dtype}", flags, Path(tmp), args.model),
        launch.openai_server("llama.cpp", peer.command(lport), urls["llama.cpp"], Path(tmp)),
    ):
        tpot, paces = asyncio.run(_paired_tpots(args, urls, HTTP_SEED + 2000 + r, peer.fields))
    ratios = [theirs / mine for mine, theirs in zip(tpot["rivulet"], tpot["llama.cpp"], strict=True)]
    out = {
        "paired_decode1_tps": 1e3 / statistics.median(tpot["rivulet"]),
        "llama_paired_decode1_tps": 1e3 / statistics.median(tpot["llama.cpp"]),
        "paired_decode1_ratio": statistics.median(ratios),
    }
    for name, key in (("rivulet", "paired_decode1_floor_x"), ("llama.cpp", "llama_paired_decode1_floor_x")):
        if paces[name]:  # a request's ms a token over its floor: weight bytes / the pace around it
            pairs = zip(tpot[name], paces[name], strict=True)
            out[key] = statistics.median(floor_x(ms, args.decode_bytes, gbps) for ms, gbps in pairs)
    return out


async def _paired_tpots(
    args: argparse.Namespace, urls: dict[str, str], seed: int, fields: dict[str, object]
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each engine's TPOT (ms) per request of the paired run, in pair order (``fields``: the
    peer's own body fields), and with ``args.decode_bytes`` the read pace (GB/s) around each request:
    the mean of the probes right before and right after it (empty lists without)."""
    bench_args = _serving_args(args, urls["rivulet"], args.paired_requests, 1, seed, http=True)
    items = serving.build_workload(bench_args)
    sampling = {"rivulet": {}, "llama.cpp": fields}
    backends = {
        name: serving.make_backend(
            argparse.Namespace(**{**vars(bench_args), "base_url": url, "sampling": sampling[name]})
        )
        for name, url in urls.items()
    }
    tpot: dict[str, list[float]] = {name: [] for name in urls}
    paces: dict[str, list[float]] = {name: [] for name in urls}
    try:
        for backend in backends.values():
            await serving.warm_up(backend, bench_args.warmup_requests)
        probe = read_bandwidth() if args.decode_bytes else None  # the pace before the first request
        for i, item in enumerate(items):
            for name in list(urls)[:: 1 if i % 2 == 0 else -1]:
                (res,) = await serving.run_requests(backends[name], [item], [0.0], 1, False)
                if probe is not None:
                    before, probe = probe, read_bandwidth()  # after this request: the next one's before
                    paces[name].append((before + probe) / 2)
                assert not res.error, f"a paired request to {name} failed: {res.error}"
                _check_lengths([res], item.max_new_tokens, f"a paired request to {name}")
                ms = summarize([res]).tpot_ms.p50
                assert ms is not None, f"a paired request to {name} streamed fewer than 2 tokens"
                tpot[name].append(ms)
    finally:
        for backend in backends.values():
            await backend.close()
    return tpot, paces


def peer_ratios(rivulet_run: dict[str, Any], peer_run: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's numbers of the same round beside rivulet's, and rivulet / llama.cpp (None: n/a)."""
    out: dict[str, Any] = {}
    for ratio, (ours, theirs) in RATIOS.items():
        mine, peer = rivulet_run.get(ours), peer_run.get(theirs)
        out[f"llama_{theirs}"] = peer
        out[ratio] = mine / peer if mine is not None and peer else None
    return out | {f"llama_{key}": peer_run.get(key) for key in PEER_COPIED}
