"""What penalties cost: 32 streams with penalties on every request against the same run without.

    flock /tmp/rivulet-cpu.lock python -m bench.penalty_cost                 # the embedded model
    python -m bench.penalty_cost --rounds 3 --engine-flags "--dtype float32"

One engine is started; each round runs the random workload (bench/lib/workloads.py; 32 requests at
32 in flight, greedy, EOS ignored) once without penalties and once with presence, frequency
and repetition penalties plus a logit_bias on every request, alternating which goes first,
each on fresh prompts of the same lengths (so no run hits the other's prefix cache). Prints
a table (output tok/s, TPOT p50, with / without per round; the target is a ratio of
at least 0.85) and appends one record.
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

from bench.lib import launch, serving
from bench.lib.records import append_record, make_record

DEFAULT_RESULTS = Path(__file__).resolve().parent / "results" / "penalty_cost.jsonl"
PENALTIES = {
    "presence_penalty": 0.5,
    "frequency_penalty": 0.3,
    "repetition_penalty": 1.1,
    "logit_bias": {"1000": 2.0, "2000": -2.0},
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="32 streams with and without penalties on one engine")
    add = p.add_argument
    add("--model", default=None, help="model dir or GGUF (default: the embedded SmolLM2-135M)")
    add("--engine-flags", default="", help="extra launcher flags")
    add("--rounds", type=int, default=2, help="rounds of (without, with), alternating the order")
    add("--streams", type=int, default=32)
    add("--input-len", type=int, default=128)
    add("--output-len", type=int, default=128)
    add("--penalties", type=json.loads, default=PENALTIES, metavar="JSON", help="the options sent")
    add("--result-file", type=Path, default=DEFAULT_RESULTS)
    add("--no-record", action="store_true")
    return p


def run_streams(
    args: argparse.Namespace, endpoint: str, sampling: dict[str, Any], seed: int
) -> dict[str, float]:
    model = ["--model", args.model] if args.model else []
    argv = ["--endpoint", endpoint, *model, "--workload", "random", "--num-requests", str(args.streams),
            "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--max-concurrency", str(args.streams), "--warmup-requests", "2", "--seed", str(seed),
            "--sampling", json.dumps(sampling), "--no-progress", "--no-record"]  # fmt: skip
    summary, _ = asyncio.run(serving.benchmark(serving.build_parser().parse_args(argv)))
    assert summary.num_failed == 0, f"{summary.num_failed} requests failed"
    return {"out_tps": summary.output_throughput, "tpot_ms": summary.tpot_ms.p50 or 0.0}


def measure(args: argparse.Namespace) -> list[dict[str, dict[str, float]]]:
    rounds: list[dict[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="rivulet-penalties-") as tmp:
        flags = shlex.split(args.engine_flags)
        with launch.rivulet_server("penalty-cost", flags, Path(tmp), args.model) as server:
            for r in range(args.rounds):
                order = [("off", {}), ("on", args.penalties)]
                # Fresh prompts for every run (seeds differ), of the same lengths: no prefix-cache hits.
                run = {
                    name: run_streams(args, server.address, s, seed=2 * r + i)
                    for i, (name, s) in enumerate(order[:: 1 - 2 * (r % 2)])
                }
                rounds.append(run)
                print(f"round {r}: {json.dumps(run)}", file=sys.stderr, flush=True)
    return rounds


def format_table(rounds: list[dict[str, dict[str, float]]]) -> str:
    lines = [
        "| round | out tok/s without | with penalties | with / without | TPOT p50 ms without | with |",
        "|---|---|---|---|---|---|",
    ]
    for r, run in enumerate(rounds):
        off, on = run["off"], run["on"]
        lines.append(
            f"| {r} | {off['out_tps']:.1f} | {on['out_tps']:.1f} | {on['out_tps'] / off['out_tps']:.3f} "
            f"| {off['tpot_ms']:.1f} | {on['tpot_ms']:.1f} |"
        )
    ratio = statistics.median(run["on"]["out_tps"] / run["off"]["out_tps"] for run in rounds)
    lines.append(f"\nmedian with / without: {ratio:.3f} (target >= 0.85)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rounds = measure(args)
    print(format_table(rounds), flush=True)
    if not args.no_record:
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        append_record(args.result_file, make_record("penalty_cost", config, {"rounds": rounds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
