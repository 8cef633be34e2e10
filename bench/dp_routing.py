"""Data parallel (--dp-size): how routing policies keep shared prefixes cached, and what a second
replica is worth on this machine.

    flock /tmp/rivulet-cpu.lock python -m bench.dp_routing                  # both parts
    python -m bench.dp_routing --part routing --rounds 2
    python -m bench.dp_routing --part streams --rounds 3

``routing``: ``--dp-size 2`` with each routing policy in turn (a fresh engine each, rounds
interleaved), on the shared-prefix workload (bench/lib/workloads.py): ``--groups`` groups of
``--questions`` questions behind ``--system-len``-token system prompts, ``--concurrency`` in
flight, each replica's KV pool (``--kv-cache-tokens``) holding about half of the prefixes. It
reports the prefix-cache hit rate (cached / prompt tokens, from /metrics) and TTFT p50; the
target is cache_aware's hit rate >= 1.8x round_robin's, with a lower TTFT p50.

``streams``: 32 streams of the random workload on ``--dp-size 1`` (every core to one worker)
and ``--dp-size 2`` (a core each), interleaved; it reports output tok/s and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from bench.lib import launch, serving
from bench.lib.records import append_record, make_record

DEFAULT_RESULTS = Path(__file__).resolve().parent / "results" / "dp_routing.jsonl"
POLICIES = ("cache_aware", "round_robin", "least_load")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="--dp-size: routing policies and a second replica")
    add = p.add_argument
    add("--model", default=None, help="model dir or GGUF (default: the embedded SmolLM2-135M)")
    add("--engine-flags", default="", help="extra launcher flags")
    add("--part", choices=("routing", "streams", "both"), default="both")
    add("--rounds", type=int, default=2)
    add("--port", type=int, default=18561)
    add("--groups", type=int, default=16)
    add("--questions", type=int, default=4)
    add("--system-len", type=int, default=1024)
    add("--question-len", type=int, default=32)
    add("--output-len", type=int, default=16)
    add("--concurrency", type=int, default=8)
    add("--kv-cache-tokens", type=int, default=10240, help="each replica's pool: about half the prefixes")
    add("--streams", type=int, default=32)
    add("--stream-requests", type=int, default=64)
    add("--result-file", type=Path, default=DEFAULT_RESULTS)
    add("--no-record", action="store_true")
    return p


def _metrics(base_url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=10.0).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _serve(args: argparse.Namespace, address: str, extra: list[str], seed: int) -> serving.Summary:
    model = ["--model", args.model] if args.model else []
    argv = ["--endpoint", address, *model, *extra, "--seed", str(seed), "--no-progress", "--no-record"]
    summary, _ = asyncio.run(serving.benchmark(serving.build_parser().parse_args(argv)))
    assert summary.num_failed == 0, f"{summary.num_failed} requests failed"
    return summary


def routing_round(args: argparse.Namespace, policy: str, seed: int) -> dict[str, float]:
    flags = ["--dp-size", "2", "--dp-routing", policy, "--kv-cache-tokens", str(args.kv_cache_tokens),
             "--http-port", str(args.port), *shlex.split(args.engine_flags)]  # fmt: skip
    workload = ["--workload", "shared-prefix", "--groups", str(args.groups),
                "--questions", str(args.questions), "--system-len", str(args.system_len),
                "--question-len", str(args.question_len),
                "--max-new-tokens", str(args.output_len), "--max-concurrency", str(args.concurrency),
                "--num-requests", str(args.groups * args.questions)]  # fmt: skip
    base_url = f"http://127.0.0.1:{args.port}"
    with tempfile.TemporaryDirectory(prefix="rivulet-dp-") as tmp:
        with launch.rivulet_server(f"dp2-{policy}", flags, Path(tmp), args.model) as server:
            before = _metrics(base_url)
            summary = _serve(args, server.address, workload, seed)
            after = _metrics(base_url)
    cached = after["rivulet_cached_prompt_tokens_total"] - before["rivulet_cached_prompt_tokens_total"]
    prompt = after["rivulet_prompt_tokens_total"] - before["rivulet_prompt_tokens_total"]
    return {"hit_rate": cached / max(prompt, 1.0), "ttft_p50_ms": summary.ttft_ms.p50 or 0.0,
            "out_tps": summary.output_throughput}  # fmt: skip


def streams_round(args: argparse.Namespace, dp_size: int, seed: int) -> dict[str, float]:
    flags = ["--dp-size", str(dp_size), *shlex.split(args.engine_flags)]
    workload = ["--workload", "random", "--num-requests", str(args.stream_requests), "--input-len", "32",
                "--output-len", "64", "--max-concurrency", str(args.streams),
                "--warmup-requests", "2"]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="rivulet-dp-") as tmp:
        with launch.rivulet_server(f"dp{dp_size}", flags, Path(tmp), args.model) as server:
            summary = _serve(args, server.address, workload, seed)
    return {"out_tps": summary.output_throughput, "ttft_p50_ms": summary.ttft_ms.p50 or 0.0}


def measure(args: argparse.Namespace) -> dict[str, list[dict[str, dict[str, float]]]]:
    out: dict[str, list[dict[str, dict[str, float]]]] = {"routing": [], "streams": []}
    for r in range(args.rounds):
        if args.part in ("routing", "both"):
            order = POLICIES if r % 2 == 0 else POLICIES[::-1]
            out["routing"].append({p: routing_round(args, p, seed=100 + r) for p in order})
            print(f"routing round {r}: {json.dumps(out['routing'][-1])}", file=sys.stderr, flush=True)
        if args.part in ("streams", "both"):
            sizes = (1, 2) if r % 2 == 0 else (2, 1)
            out["streams"].append({f"dp{d}": streams_round(args, d, seed=200 + r) for d in sizes})
            print(f"streams round {r}: {json.dumps(out['streams'][-1])}", file=sys.stderr, flush=True)
    return out


def format_tables(results: dict[str, list[dict[str, dict[str, float]]]], args: argparse.Namespace) -> str:
    lines = []
    if results["routing"]:
        lines += [f"shared prefix: {args.groups} groups x {args.questions} questions, "
                  f"{args.system_len}-token system prompts, {args.concurrency} in flight, "
                  f"--kv-cache-tokens {args.kv_cache_tokens} "
                  "per replica, --dp-size 2", "",
                  "| round | policy | hit rate | TTFT p50 ms | out tok/s |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for r, run in enumerate(results["routing"]):
            for policy in POLICIES:
                m = run[policy]
                lines.append(
                    f"| {r} | {policy} | {m['hit_rate']:.3f} | {m['ttft_p50_ms']:.0f} | {m['out_tps']:.1f} |"
                )
        ratio = statistics.median(
            run["cache_aware"]["hit_rate"] / max(run["round_robin"]["hit_rate"], 1e-9)
            for run in results["routing"]
        )
        lines.append(f"\nmedian hit rate cache_aware / round_robin: {ratio:.2f} (target >= 1.8)\n")
    if results["streams"]:
        lines += [f"{args.streams} streams, random workload (32 in, 64 out)", "",
                  "| round | dp1 out tok/s | dp2 out tok/s | dp2 / dp1 |", "|---|---|---|---|"]  # fmt: skip
        for r, run in enumerate(results["streams"]):
            one, two = run["dp1"]["out_tps"], run["dp2"]["out_tps"]
            lines.append(f"| {r} | {one:.1f} | {two:.1f} | {two / one:.2f} |")
        ratio = statistics.median(run["dp2"]["out_tps"] / run["dp1"]["out_tps"] for run in results["streams"])
        lines.append(f"\nmedian dp2 / dp1: {ratio:.2f} (goal >= 1.0)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    results = measure(args)
    print(format_tables(results, args), flush=True)
    if not args.no_record:
        config: dict[str, Any] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        append_record(args.result_file, make_record("dp_routing", config, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
