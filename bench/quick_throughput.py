"""A first rough throughput number: N concurrent streaming requests against a running engine.

    python launcher.py &            # wait for "rivulet ready"
    python bench/quick_throughput.py --num-requests 32 --max-new-tokens 64

Prints aggregate output tokens/s, TTFT and ITL percentiles measured at the
client as each chunk arrives. (The full streaming benchmark lives in a later issue.)
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client import AsyncClient, default_endpoint  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about rivers.",
    "Explain how a bicycle works.",
    "Give me three tips for learning Python.",
]


async def one_request(client: AsyncClient, i: int, max_new_tokens: int) -> tuple[float, list[float], int]:
    """(TTFT s, token arrival times, completion tokens) of one streamed request."""
    start = time.perf_counter()
    stamps: list[float] = []
    completion = 0
    stream = await client.generate(
        messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
        max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True, stream=True,
    )  # fmt: skip
    async for chunk in stream:
        now = time.perf_counter()
        stamps.extend([now] * len(chunk.token_ids))
        if chunk.usage is not None:
            completion = chunk.usage.completion_tokens
    return stamps[0] - start, stamps, completion


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run(args: argparse.Namespace) -> None:
    async with AsyncClient(args.endpoint, timeout_s=600) as client:
        started = time.perf_counter()
        results = await asyncio.gather(
            *(one_request(client, i, args.max_new_tokens) for i in range(args.num_requests))
        )
        wall_s = time.perf_counter() - started
    ttfts = [r[0] for r in results]
    itls = [b - a for _, stamps, _ in results for a, b in zip(stamps, stamps[1:], strict=False)]
    tokens = sum(r[2] for r in results)
    print(f"requests: {args.num_requests}, max_new_tokens: {args.max_new_tokens}, wall: {wall_s:.2f} s")
    print(f"output throughput: {tokens / wall_s:.1f} tok/s ({tokens} tokens)")
    print(f"TTFT p50/p99: {statistics.median(ttfts) * 1e3:.0f} / {pct(ttfts, 0.99) * 1e3:.0f} ms")
    print(f"ITL  p50/p99: {statistics.median(itls) * 1e3:.1f} / {pct(itls, 0.99) * 1e3:.1f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--endpoint", default=default_endpoint())
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
