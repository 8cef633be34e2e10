"""One stream at growing prompt lengths: rivulet beside llama.cpp's llama-server on the same GGUF.

    python -m bench.long_context --peer-llama-cpp auto                 # 32, 512, 2048-token prompts
    python -m bench.long_context --input-lens 64,1024 --output-len 64 --repeats 2

At one stream a decode step reads the weights once and the request's whole KV cache once, so as
the context grows the attention's share of a step grows with it (SmolLM2: 92 KB of float32 KV per
token, 30 MB at 1024 tokens, against 97 MB of GGUF weights). bench/targets.py's one-stream target
has 32-token prompts and 64 new tokens; this measures the same workload past them.

Round r starts rivulet's server (``launcher.py --http-port P``) and, for each prompt length, runs
the random workload (bench/lib/workloads.py) at concurrency 1 through POST /v1/completions; then the same on
``llama-server -np 1`` (one slot, so it holds the whole context; targets' ``-np 32`` splits its 8192
tokens into 256-token slots). Decode tok/s = 1000 / TPOT p50; TTFT p50 is the prompt's prefill.
Cells are medians (min-max) of the rounds; the ratio is rivulet / llama.cpp of the same round.
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

from bench.lib import launch, llama_cpp, serving
from bench.lib.launch import free_port
from bench.lib.llama_cpp import Peer
from bench.lib.records import append_record, machine_info, make_record
from gpu_worker.backends.cpu import kind as cpu_kind

DEFAULT_RESULTS = Path(__file__).resolve().parent / "results" / "long_context.jsonl"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="one stream at growing prompt lengths, rivulet and llama.cpp")
    add = p.add_argument
    add("--model", default=None, help="model dir or GGUF (default: embedded SmolLM2; a peer needs a GGUF)")
    add("--input-lens", default="32,512,2048", help="comma list of prompt tokens")
    add("--output-len", type=int, default=128, help="new tokens of every request (EOS ignored)")
    add("--requests", type=int, default=3, help="requests per prompt length and round")
    add("--repeats", type=int, default=3, help="rounds, the engines interleaved")
    add("--engine-flags", default="", help="extra launcher flags for rivulet")
    add("--peer-llama-cpp", default=None, metavar="PATH|auto", help="llama-server; auto: bench.llama_cpp's")
    add("--result-file", type=Path, default=DEFAULT_RESULTS)
    add("--no-record", action="store_true")
    return p


def measure(
    args: argparse.Namespace, base_url: str, r: int, fields: dict[str, object] | None = None
) -> dict[str, Any]:
    """Per prompt length: decode tok/s and TTFT p50 of one stream through ``base_url`` (``fields``:
    more body fields on every request, the peer's own)."""
    out: dict[str, Any] = {}
    model = ["--model", args.model] if args.model else []
    for n in parse_lens(args.input_lens):
        argv = ["--backend", "openai", "--base-url", base_url, *model, "--workload", "random",
                "--num-requests", str(args.requests), "--input-len", str(n),
                "--output-len", str(args.output_len),
                "--range-ratio", "1.0", "--max-concurrency", "1", "--warmup-requests", "1",
                "--seed", str(5000 + 100 * r + n % 97), "--sampling", json.dumps(fields or {}),
                "--no-progress", "--no-record"]  # fmt: skip
        summary, _ = asyncio.run(serving.benchmark(serving.build_parser().parse_args(argv)))
        assert summary.num_failed == 0, f"{summary.num_failed} requests of {n} tokens to {base_url} failed"
        tpot = summary.tpot_ms.p50
        out[f"decode_tps_{n}"] = 1e3 / tpot if tpot else None
        out[f"ttft_ms_{n}"] = summary.ttft_ms.p50
    return out


def parse_lens(text: str) -> list[int]:
    lens = [int(x) for x in text.split(",") if x.strip()]
    assert lens and all(n > 0 for n in lens), f"--input-lens wants positive lengths, got {text!r}"
    return lens


def rivulet_round(args: argparse.Namespace, r: int) -> dict[str, Any]:
    port = free_port()
    flags = ["--http-port", str(port), *shlex.split(args.engine_flags)]
    with tempfile.TemporaryDirectory(prefix="rivulet-long-context-") as tmp:
        with launch.rivulet_server("long-context", flags, Path(tmp), args.model):
            return measure(args, f"http://127.0.0.1:{port}", r)


def peer_round(args: argparse.Namespace, peer: Peer, r: int) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="rivulet-long-context-llama-cpp-") as tmp:
        with launch.openai_server("llama.cpp", peer.command(port), url, Path(tmp)):
            return measure(args, url, r, peer.fields)


def cell(xs: list[float], digits: int = 0) -> str:
    if not xs:
        return "-"
    if len(xs) == 1:
        return f"{xs[0]:.{digits}f}"
    return f"{statistics.median(xs):.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


def table(args: argparse.Namespace, ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> str:
    """Markdown: one line per prompt length, rivulet and llama.cpp side by side."""
    lines = [
        "| prompt tokens | rivulet decode tok/s | llama.cpp decode tok/s | ratio "
        "| rivulet TTFT ms | llama.cpp TTFT ms |",
        "|---|---|---|---|---|---|",
    ]
    for n in parse_lens(args.input_lens):
        mine = [run[f"decode_tps_{n}"] for run in ours if run.get(f"decode_tps_{n}")]
        peer = [run[f"decode_tps_{n}"] for run in theirs if run.get(f"decode_tps_{n}")]
        ratios = [a[f"decode_tps_{n}"] / b[f"decode_tps_{n}"] for a, b in zip(ours, theirs, strict=False)
                  if a.get(f"decode_tps_{n}") and b.get(f"decode_tps_{n}")]  # fmt: skip
        ttft = [run[f"ttft_ms_{n}"] for run in ours]
        peer_ttft = [run[f"ttft_ms_{n}"] for run in theirs]
        lines.append(
            f"| {n} | {cell(mine)} | {cell(peer)} | {cell(ratios, 2)} | {cell(ttft)} | {cell(peer_ttft)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:  # before torch loads; the engines started below inherit the environment
        acting = cpu_kind.apply_to_environ()
    except cpu_kind.CpuKindError as exc:
        raise SystemExit(f"error: {exc}") from None
    peer = None
    if args.peer_llama_cpp:
        peer = llama_cpp.make_peer(args.peer_llama_cpp, acting, args.model, parallel=1)
        if peer.warning:
            print(peer.warning, file=sys.stderr, flush=True)
    from gpu_worker.weights.model_files import resolve_model

    resolve_model(args.model)  # the GGUF's conversion, once, before the first round
    ours: list[dict[str, Any]] = []
    theirs: list[dict[str, Any]] = []
    for r in range(args.repeats):
        ours.append(rivulet_round(args, r))
        print(f"round {r + 1}/{args.repeats} rivulet: {ours[-1]}", flush=True)
        if peer is not None:
            theirs.append(peer_round(args, peer, r))
            print(f"round {r + 1}/{args.repeats} llama.cpp: {theirs[-1]}", flush=True)
    shown = argv if argv is not None else sys.argv[1:]
    command = shlex.join(["python", "-m", "bench.long_context", *shown])
    print(f"\nCommand: `{command}`\n{cpu_kind.describe(acting)}\n")
    print(table(args, ours, theirs))
    if not args.no_record:
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        config["command"] = command
        metrics = {"rivulet": ours, "llama_cpp": theirs, "peer": None if peer is None else peer.shown()}
        append_record(args.result_file, make_record("long_context", config, metrics, machine=machine_info()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
