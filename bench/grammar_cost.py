"""What structured output costs: throughput with a JSON schema on every stream, and the time a
schema adds to the first token.

    flock /tmp/rivulet-cpu.lock python -m bench.grammar_cost                 # the embedded model
    python -m bench.grammar_cost --rounds 3 --engine-flags "--dtype float32"

One engine is started (ZMQ client). Throughput: each round runs ``--streams`` chat requests at
once, greedy, the same prompts every run (the prefix cache flushed before each), once with a JSON
schema on every request (four schemas in turn, compiled before timing; ``--output-len`` tokens at
most, a request ends at EOS when its JSON closes) and once free, each request generating exactly
as many tokens as in the schema run (EOS ignored), so both runs do the same work but the mask;
alternating which goes first (round 0 starts with schemas, to learn the lengths). Output tok/s is
all output tokens over the run's wall time (target: with / without >= 0.85).
TTFT on the idle engine, one request at a time: the same prompt without a schema, with a schema
never seen before (compile included; each a distinct schema), and with a cached one; the table
gives each one's p50 and the two differences (targets: new < 200 ms, cached < 10 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.lib import launch
from bench.lib.records import append_record, make_record
from client import AsyncClient, Client, Grammar

DEFAULT_RESULTS = Path(__file__).resolve().parent / "results" / "grammar_cost.jsonl"
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                      "hobbies": {"type": "array", "items": {"type": "string"}}},
     "required": ["name", "age", "hobbies"]},
    {"type": "object", "properties": {"city": {"type": "string"}, "facts": {"type": "array",
                                      "items": {"type": "string"}}}, "required": ["city", "facts"]},
    {"type": "object", "properties": {"title": {"type": "string"}, "year": {"type": "integer"},
                                      "genre": {"enum": ["drama", "comedy", "horror"]},
                                      "plot": {"type": "string"}},
     "required": ["title", "year", "genre", "plot"]},
    {"type": "object", "properties": {"steps": {"type": "array", "items": {"type": "object", "properties": {
        "action": {"type": "string"}, "minutes": {"type": "integer"}}, "required": ["action", "minutes"]}}},
     "required": ["steps"]},
]  # fmt: skip
PROMPT = "Write a detailed JSON record about topic number {i}: a person, a city, a film or a recipe."


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="structured output: throughput and TTFT cost of JSON schemas")
    add = p.add_argument
    add("--model", default=None, help="model dir or GGUF (default: the embedded SmolLM2-135M)")
    add("--engine-flags", default="", help="extra launcher flags")
    add("--rounds", type=int, default=2, help="rounds of (without, with), alternating the order")
    add("--streams", type=int, default=32)
    add("--output-len", type=int, default=128)
    add("--ttft-requests", type=int, default=10, help="TTFT samples per kind (new, cached, none)")
    add("--result-file", type=Path, default=DEFAULT_RESULTS)
    add("--no-record", action="store_true")
    return p


def schema_grammar(schema: dict[str, Any]) -> Grammar:
    return Grammar(kind="json_schema", spec=json.dumps(schema))


async def run_streams(
    c: AsyncClient, args: argparse.Namespace, lengths: list[int] | None
) -> tuple[dict[str, float], list[int]]:
    """One run of ``--streams`` requests at once: with a schema each when ``lengths`` is None, else
    free, request i generating exactly ``lengths[i]`` tokens (EOS ignored), as many as its schema
    run did. Returns (out tok/s and the run's numbers, each request's output tokens)."""

    async def one(i: int) -> int:
        messages = [{"role": "user", "content": PROMPT.format(i=i)}]
        options: dict[str, Any] = (
            {"grammar": schema_grammar(SCHEMAS[i % len(SCHEMAS)]), "max_new_tokens": args.output_len}
            if lengths is None
            else {"ignore_eos": True, "max_new_tokens": lengths[i]}
        )
        out = await c.generate(messages=messages, temperature=0, **options)
        return len(out.token_ids)

    started = time.perf_counter()
    tokens = await asyncio.gather(*(one(i) for i in range(args.streams)))
    wall_s = time.perf_counter() - started
    return {
        "out_tps": sum(tokens) / wall_s,
        "mean_tokens": statistics.fmean(tokens),
        "wall_s": wall_s,
    }, tokens


async def ttft_s(c: AsyncClient, grammar: Grammar | None) -> float:
    options: dict[str, Any] = {"grammar": grammar} if grammar is not None else {}
    messages = [{"role": "user", "content": "Describe a person."}]
    started = time.perf_counter()
    stream = await c.generate(messages=messages, max_new_tokens=2, temperature=0, stream=True, **options)
    first = None
    async for delta in stream:
        if first is None and delta.token_ids:
            first = time.perf_counter() - started
    assert first is not None, "no token came back"
    return first


async def measure_ttft(c: AsyncClient, n: int) -> dict[str, list[float]]:
    """p50-able samples: no schema, a never-seen schema (a distinct property name each time), cached."""
    cached = schema_grammar(SCHEMAS[0])
    await ttft_s(c, cached)  # compiled once before timing
    samples: dict[str, list[float]] = {"none": [], "new": [], "cached": []}
    for k in range(n):
        fresh = {
            **SCHEMAS[2],
            "properties": {**SCHEMAS[2]["properties"], f"note_{time.time_ns()}_{k}": {"type": "string"}},
        }
        samples["none"].append(await ttft_s(c, None))
        samples["new"].append(await ttft_s(c, schema_grammar(fresh)))
        samples["cached"].append(await ttft_s(c, cached))
    return samples


async def measure(args: argparse.Namespace, endpoint: str) -> dict[str, Any]:
    async with AsyncClient(endpoint, timeout_s=600) as c:
        await asyncio.gather(
            *(c.generate("warm up", max_new_tokens=2, grammar=schema_grammar(s)) for s in SCHEMAS)
        )
        rounds = []
        lengths: list[int] | None = None  # the schema run's output lengths, which the free run repeats
        for r in range(args.rounds):
            run: dict[str, dict[str, float]] = {}
            for name in ("on", "off") if r % 2 == 0 else ("off", "on"):  # round 0 learns the lengths
                with Client(endpoint) as sync_client:
                    sync_client.flush_cache()  # the same prompts every run: no run hits another's KV
                run[name], tokens = await run_streams(c, args, None if name == "on" else lengths)
                if name == "on":
                    lengths = tokens
            rounds.append(run)
            print(f"round {r}: {json.dumps(run)}", file=sys.stderr, flush=True)
        return {"rounds": rounds, "ttft_s": await measure_ttft(c, args.ttft_requests)}


def format_table(result: dict[str, Any]) -> str:
    lines = ["| round | out tok/s without | with schemas | with / without | mean tokens without | with |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r, run in enumerate(result["rounds"]):
        off, on = run["off"], run["on"]
        ratio = on["out_tps"] / off["out_tps"]
        lines.append(f"| {r} | {off['out_tps']:.1f} | {on['out_tps']:.1f} | {ratio:.3f} "
                     f"| {off['mean_tokens']:.1f} | {on['mean_tokens']:.1f} |")  # fmt: skip
    ratio = statistics.median(run["on"]["out_tps"] / run["off"]["out_tps"] for run in result["rounds"])
    p50 = {k: statistics.median(v) * 1000 for k, v in result["ttft_s"].items()}
    lines += [
        f"\nmedian with / without: {ratio:.3f} (target >= 0.85)",
        f"TTFT p50 ms: no schema {p50['none']:.1f}, new schema {p50['new']:.1f}, cached {p50['cached']:.1f}",
        f"added by a new schema: {p50['new'] - p50['none']:.1f} ms (target < 200); "
        f"by a cached one: {p50['cached'] - p50['none']:.1f} ms (target < 10)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rivulet-grammar-") as tmp:
        flags = shlex.split(args.engine_flags)
        with launch.rivulet_server("grammar-cost", flags, Path(tmp), args.model) as server:
            result = asyncio.run(measure(args, server.address))
    print(format_table(result), flush=True)
    if not args.no_record:
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        append_record(args.result_file, make_record("grammar_cost", config, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
