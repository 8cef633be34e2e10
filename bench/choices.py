"""What n > 1 costs: one 512-token prompt with n = 8 choices against the same prompt length with n = 1.

    flock /tmp/rivulet-cpu.lock python -m bench.choices            # the embedded model
    python -m bench.choices --rounds 5 --n 8 --input-len 512

One engine is started with its HTTP API; each round sends a fresh random prompt of
``--input-len`` token ids once with n = 1 and once with n = ``--n`` (alternating which goes first),
streamed, temperature 1, EOS ignored, and measures the time to the first streamed chunk (TTFT)
and the prompt tokens the engine computed (``rivulet_prefill_tokens_total`` in /metrics, read
before and after: prefix-cache hits and forked choices skip it). The targets: prompt
tokens computed for n = 8 equal the prompt's length, TTFT within 1.5x of n = 1.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.lib import launch
from bench.lib.records import append_record, make_record

DEFAULT_RESULTS = Path(__file__).resolve().parent / "results" / "choices.jsonl"
VOCAB_FLOOR, VOCAB_CEIL = 100, 40000  # random prompt ids: ordinary tokens of the embedded model's vocab


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="TTFT and prompt tokens computed: n > 1 against n = 1")
    add = p.add_argument
    add("--model", default=None, help="model dir or GGUF (default: the embedded SmolLM2-135M)")
    add("--engine-flags", default="", help="extra launcher flags")
    add("--port", type=int, default=18541)
    add("--rounds", type=int, default=3)
    add("--n", type=int, default=8)
    add("--input-len", type=int, default=512)
    add("--output-len", type=int, default=16)
    add("--result-file", type=Path, default=DEFAULT_RESULTS)
    add("--no-record", action="store_true")
    return p


def prefill_tokens(base_url: str) -> int:
    """rivulet_prefill_tokens_total once the engine is idle and has published its last stats."""
    last = -1
    for _ in range(50):
        text = httpx.get(f"{base_url}/metrics", timeout=10.0).text
        values = [
            line.split()[-1] for line in text.splitlines() if line.startswith("rivulet_prefill_tokens_total")
        ]
        value = int(float(values[0])) if values else 0
        if value == last:
            return value
        last = value
        time.sleep(0.2)
    return last


def one_request(base_url: str, prompt: list[int], n: int, output_len: int, seed: int) -> dict[str, float]:
    before = prefill_tokens(base_url)
    model = httpx.get(f"{base_url}/v1/models", timeout=10.0).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "n": n, "max_tokens": output_len, "temperature": 1.0,
            "seed": seed, "ignore_eos": True, "stream": True}  # fmt: skip
    started, ttft_s, chunks = time.perf_counter(), None, 0
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=600.0) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                chunks += 1
                ttft_s = ttft_s if ttft_s is not None else time.perf_counter() - started
    assert ttft_s is not None and chunks >= n, f"n={n}: {chunks} chunks"
    return {"ttft_ms": ttft_s * 1e3, "prefill_tokens": prefill_tokens(base_url) - before}


def measure(args: argparse.Namespace) -> list[dict[str, dict[str, float]]]:
    rng = random.Random(0)
    rounds: list[dict[str, dict[str, float]]] = []
    flags = ["--http-port", str(args.port), *shlex.split(args.engine_flags)]
    with tempfile.TemporaryDirectory(prefix="rivulet-choices-") as tmp:
        with launch.rivulet_server("choices", flags, Path(tmp), args.model):
            base_url = f"http://127.0.0.1:{args.port}"
            one_request(
                base_url, [rng.randrange(VOCAB_FLOOR, VOCAB_CEIL) for _ in range(32)], 2, 4, 0
            )  # warm-up
            for r in range(args.rounds):
                order = [1, args.n] if r % 2 == 0 else [args.n, 1]
                run = {}
                for n in order:  # fresh prompts: no prefix-cache hit between runs
                    prompt = [rng.randrange(VOCAB_FLOOR, VOCAB_CEIL) for _ in range(args.input_len)]
                    run[f"n{n}"] = one_request(base_url, prompt, n, args.output_len, seed=r)
                rounds.append(run)
                print(f"round {r}: {json.dumps(run)}", file=sys.stderr, flush=True)
    return rounds


def format_table(rounds: list[dict[str, dict[str, float]]], n: int, input_len: int) -> str:
    lines = [
        f"| round | TTFT ms n=1 | TTFT ms n={n} | ratio | prompt tokens computed n=1 | n={n} |",
        "|---|---|---|---|---|---|",
    ]
    for r, run in enumerate(rounds):
        one, many = run["n1"], run[f"n{n}"]
        lines.append(
            f"| {r} | {one['ttft_ms']:.0f} | {many['ttft_ms']:.0f} | {many['ttft_ms'] / one['ttft_ms']:.2f} "
            f"| {one['prefill_tokens']:.0f} | {many['prefill_tokens']:.0f} |"
        )
    ratio = statistics.median(run[f"n{n}"]["ttft_ms"] / run["n1"]["ttft_ms"] for run in rounds)
    computed = {run[f"n{n}"]["prefill_tokens"] for run in rounds}
    lines.append(
        f"\nmedian TTFT n={n} / n=1: {ratio:.2f} (target <= 1.5); prompt tokens computed for n={n}: "
        f"{sorted(computed)} (target: {input_len})"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rounds = measure(args)
    print(format_table(rounds, args.n, args.input_len), flush=True)
    if not args.no_record:
        config: dict[str, Any] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        append_record(args.result_file, make_record("choices", config, {"rounds": rounds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
