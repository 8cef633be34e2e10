"""The scheduling knobs, before/after on roseinfer's workload, plus recovery after retraction.

    python -m bench.policy_ab                        # every group, 2 interleaved repeats
    python -m bench.policy_ab --groups admission --repeats 3
    python -m bench.policy_ab --groups recovery

Each group starts one engine per configuration (bench/lib/sweep_runner.py: its own
launcher each, stopped by pid), runs the same workload against each A B C A B C,
and prints a table of medians (min-max over repeats) and deltas against the first
row. ``recovery`` runs one engine with a KV pool too small for its load and prints
output tokens/s per time window next to the retractions the scheduler logged in it:
throughput must come back after each burst of retractions, not collapse for good.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import re
import shlex
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.lib import launch, report, serving, sweep_runner, sweeps
from bench.lib.metrics import RequestResult

# Every engine: float32 (bf16 matmuls are slow on CPUs without native bf16), a fixed KV pool
# (kv-mem-fraction would give each of several engines a fifth of the RAM), roseinfer's budget.
COMMON = ("--dtype", "float32", "--kv-cache-tokens", "16384", "--max-prefill-tokens", "256")
HOL = ("--prompt", "Hello", "--prompt-repeats", "512,1,1,1", "--unique-prompts", "--no-stop-on-eos")
# roseinfer's burst: all requests at once, scaled down (12 requests, 16 new tokens) so that a run of the
# embedded model on a small shared CPU stays short.
BURST = (*HOL, "--num-requests", "12", "--max-new-tokens", "16")
# Arrivals spread out, so prefills keep landing between decode steps of running requests.
STREAM = (*HOL, "--num-requests", "12", "--max-new-tokens", "16", "--submit-interval-ms", "2000")
RECOVERY_FLAGS = ("--dtype", "float32", "--kv-cache-tokens", "1024", "--schedule-conservativeness", "0.3")
RECOVERY_LOAD = ("--workload", "random", "--input-len", "48", "--output-len", "96", "--range-ratio", "0.9",
                 "--num-requests", "16")  # fmt: skip
WINDOW_S = 5.0
# The prefix cache's case: one 1024-token system prompt, 8 short unique questions, 4 in flight.
SHARED_PREFIX = ("--workload", "shared-prefix", "--groups", "1", "--questions", "8", "--system-len", "1024",
                 "--question-len", "16", "--max-new-tokens", "8", "--max-concurrency", "4")  # fmt: skip


def _sweep(
    name: str, title: str, workload: tuple[str, ...], engines: list[tuple[str, tuple[str, ...]]]
) -> sweeps.Sweep:
    variants = tuple(
        sweeps.Variant(label, sweeps.EngineSpec(label, (*COMMON, *flags)), workload)
        for label, flags in engines
    )
    return sweeps.Sweep(name, title, "", variants)


def groups() -> dict[str, sweeps.Sweep]:
    return {
        "admission": _sweep("admission", "admission knobs, burst of 12 (3 x 515-token prompts)", BURST, [
            ("fcfs", ()),
            ("pack", ("--schedule-policy", "pack")),
            ("max-running-requests 4", ("--max-running-requests", "4")),
        ]),
        "interleave": _sweep("interleave", "prefill vs decode, a request every 2 s", STREAM, [
            ("prefill streak 1 (default)", ()),
            ("prefill streak 4", ("--max-consecutive-prefills", "4")),
            ("prefill streak 4, decode-first", ("--max-consecutive-prefills", "4", "--decode-first")),
        ]),
        "prefix": _sweep("prefix", "prefix cache on vs off, 8 requests sharing 1024 tokens", SHARED_PREFIX, [
            ("radix cache (default)", ()),
            ("cache off", ("--disable-radix-cache",)),
        ]),
        "reservation": _sweep("reservation", "conservativeness, KV pool of 1536 tokens", RECOVERY_LOAD, [
            ("conservativeness 1.0 (default)", ("--kv-cache-tokens", "1536")),
            ("conservativeness 0.3", ("--kv-cache-tokens", "1536", "--schedule-conservativeness", "0.3")),
            ("conservativeness 3.0", ("--kv-cache-tokens", "1536", "--schedule-conservativeness", "3.0")),
        ]),
    }  # fmt: skip


LOG_TIME = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) scheduler\] KV pool exhausted")


def retraction_times(log: str, wall0: float, perf0: float) -> list[float]:
    """perf_counter times of the scheduler's retraction lines (its log stamps are local wall time)."""
    out = []
    for line in log.splitlines():
        if m := LOG_TIME.match(line):
            wall = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append(perf0 + wall - wall0)
    return out


def timeline(results: list[RequestResult], retractions: list[float]) -> list[dict[str, float]]:
    """Output tokens/s and retractions per WINDOW_S window from the first submit."""
    start = min(r.submit_s for r in results)
    end = max(t for r in results for t in r.token_times_s)
    rows = []
    t = start
    while t < end:
        tokens = sum(1 for r in results for x in r.token_times_s if t <= x < t + WINDOW_S)
        rows.append({"from_s": t - start, "tok_per_s": tokens / WINDOW_S,
                     "retractions": sum(1 for x in retractions if t <= x < t + WINDOW_S)})  # fmt: skip
        t += WINDOW_S
    return rows


def run_recovery(workdir: Path) -> dict[str, Any]:
    """One engine, a pool too small for the load: throughput per window next to its retractions."""
    with launch.rivulet_server("recovery", list(RECOVERY_FLAGS), workdir / "recovery") as server:
        args = serving.build_parser().parse_args(
            [*RECOVERY_LOAD, "--endpoint", server.address, "--no-progress"]
        )
        wall0, perf0 = time.time(), time.perf_counter()
        summary, results = asyncio.run(serving.benchmark(args))
        retractions = retraction_times(server.log_path.read_text(errors="replace"), wall0, perf0)
    rows = timeline(results, retractions)
    print(f"== recovery: {shlex.join(RECOVERY_FLAGS)} | {shlex.join(RECOVERY_LOAD)}")
    print(f"{len(retractions)} retractions, {summary.output_throughput:.1f} output tok/s overall, "
          f"{summary.num_failed} failed")  # fmt: skip
    print("| window from s | output tok/s | retractions |\n|---|---|---|")
    for row in rows:
        print(f"| {row['from_s']:.0f} | {row['tok_per_s']:.1f} | {row['retractions']:.0f} |")
    return {
        "flags": list(RECOVERY_FLAGS),
        "workload": list(RECOVERY_LOAD),
        "summary": asdict(summary),
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", default="admission,interleave,reservation,recovery")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "policy-ab.json")
    args = p.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="rivulet-policy-ab-"))
    opts = sweep_runner.SweepOptions(repeats=args.repeats, workdir=workdir)
    command = shlex.join(["python", "-m", "bench.policy_ab", *(argv or sys.argv[1:])])
    out: dict[str, Any] = {"command": command, "sweeps": []}
    for name in args.groups.split(","):
        if name == "recovery":
            out["recovery"] = run_recovery(workdir)
            continue
        group = groups()[name]
        print(f"== {group.title}", flush=True)
        result = asdict(sweep_runner.run_sweep(group, opts))
        result.pop("pids", None)
        out["sweeps"].append(result)
        print(report.pair_table(result))
        for v in result["variants"]:
            hits = [r["cached_tokens"] / max(r["prompt_tokens"], 1) for r in v["runs"]]
            print(f"{v['label']}: cache hit rate per run " + ", ".join(f"{100 * h:.1f}%" for h in hits))
        print("\n".join(report.deltas(result)), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
