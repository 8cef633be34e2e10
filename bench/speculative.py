"""Speculative decoding by n-gram lookup against none: output tok/s per workload and concurrency.

    python -m bench.speculative                                   # rewrite and compose, 1 stream
    python -m bench.speculative --workloads compose --concurrency 1,32 --rounds 3
    python -m bench.speculative --spec-flags "--speculative-num-draft-tokens 5"

Two engines run side by side (the same flags but ``--speculative-algorithm ngram`` and
``--spec-flags`` on one), each started once; each round runs every (workload, concurrency) on one,
then the other, in alternating order, so a noisy neighbour hits both alike. Workloads are
bench.serving's ``rewrite`` (chat prompts whose answers repeat the prompt: a list to number, code
to rewrite with one name changed) and ``compose`` (short stories); greedy, each request ending at
EOS or ``--max-new-tokens``. A cell is the median (min-max) output tok/s over the rounds, and the
ratio is speculative / plain of the same round; the acceptance rate is the speculative engine's
own count (its log), over the whole run. Equal completion-token counts on both engines show the
outputs kept their lengths (greedy outputs are the same tokens: tests/exactness/test_speculative.py).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import launch, serving
from bench.records import machine_info

ACCEPT = re.compile(r"#drafted-token: (\d+), #accepted-token: (\d+)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = p.add_argument
    add("--model", default=None, help="model dir or GGUF (default: the embedded SmolLM2)")
    add("--workloads", default="rewrite,compose", help="comma list of bench.serving workloads")
    add("--concurrency", default="1", help="comma list of streams")
    add("--num-requests", type=int, default=8, help="requests per run (at least the concurrency)")
    add("--max-new-tokens", type=int, default=256)
    add("--rounds", type=int, default=3)
    add("--engine-flags", default="", help="flags of both engines")
    add("--spec-flags", default="", help="more flags of the speculative engine")
    return p


def run(args: argparse.Namespace, server: launch.Server, workload: str, streams: int) -> dict[str, Any]:
    argv = ["--endpoint", server.address, "--workload", workload, "--num-requests",
            str(max(args.num_requests, streams)), "--max-new-tokens", str(args.max_new_tokens),
            "--max-concurrency", str(streams), "--no-record", "--no-progress"]  # fmt: skip
    if args.model:
        argv += ["--model", args.model]
    summary, _ = asyncio.run(serving.benchmark(serving.build_parser().parse_args(argv)))
    assert summary.num_failed == 0, f"{summary.num_failed} requests failed"
    return {"tok_s": summary.output_throughput, "tokens": summary.completion_tokens}


def acceptance(server: launch.Server) -> str:
    found = ACCEPT.findall(server.log_path.read_text(errors="replace"))
    if not found:
        return "-"
    drafted, accepted = (int(x) for x in found[-1])
    return f"{100 * accepted / max(drafted, 1):.0f}% of {drafted}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    base = shlex.split(args.engine_flags) + ["--decode-log-interval", "8"]
    spec = base + ["--speculative-algorithm", "ngram", *shlex.split(args.spec_flags)]
    cells = [(w, int(c)) for w in args.workloads.split(",") for c in args.concurrency.split(",")]
    results: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="rivulet-spec-") as tmp:
        with (
            launch.rivulet_server("plain", base, Path(tmp, "plain"), args.model) as plain,
            launch.rivulet_server("ngram", spec, Path(tmp, "ngram"), args.model) as ngram,
        ):
            servers = {"plain": plain, "ngram": ngram}
            for r in range(args.rounds):
                order = ["plain", "ngram"] if r % 2 == 0 else ["ngram", "plain"]
                for workload, streams in cells:
                    for name in order:
                        res = run(args, servers[name], workload, streams)
                        results.setdefault((workload, streams, name), []).append(res)
                        print(f"round {r} {workload} x{streams} {name}: {res['tok_s']:.1f} tok/s", flush=True)
            accepted = acceptance(ngram)
    info = machine_info()
    print(f"\n# {info.get('cpu', '')}: {info.get('cpu_features', '')}; {info.get('cores')} cores")
    print(f"# engine flags: {' '.join(base)}; speculative: {' '.join(spec)}")
    print("| workload | streams | plain tok/s | ngram tok/s | ngram / plain | tokens (plain, ngram) |")
    print("|---|---|---|---|---|---|")
    for workload, streams in cells:
        a, b = results[(workload, streams, "plain")], results[(workload, streams, "ngram")]
        ratios = [y["tok_s"] / x["tok_s"] for x, y in zip(a, b, strict=True)]
        print(f"| {workload} | {streams} | {cell(a)} | {cell(b)} | {statistics.median(ratios):.2f}x "
              f"({min(ratios):.2f}-{max(ratios):.2f}) | {a[0]['tokens']}, {b[0]['tokens']} |")  # fmt: skip
    print(f"\nacceptance (the speculative engine, whole run): {accepted}")
    return 0


def cell(runs: list[dict[str, Any]]) -> str:
    values = [r["tok_s"] for r in runs]
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


if __name__ == "__main__":
    sys.exit(main())
