"""A long shared prefix (a system prompt), then requests that extend it: their TTFT with the prefix
cached against the same requests with the cache flushed before each one (a cold prefill).

    python -m bench.shared_prefix --model qwen35_4b-q4_k_m --prefix-len 2048 --requests 16 --rounds 3

``--model`` takes a path or a hybrid bench model's name (bench/lib/gguf_hybrid_model.py). One engine
per round: the prefix is sent once (with one token of answer) to fill the cache, then each request
(the prefix and ``--suffix-len`` tokens of its own) is sent one at a time, and then each again after
``flush_cache``. TTFT is the first streamed token through the ZMQ client. Prints the p50 TTFTs and
their ratio per round and the median ratio (issue 53's target: <= 0.25). On a hybrid model a hit
resumes from the recurrent-state checkpoint the scheduler kept at the deepest chunk boundary inside
the prefix, so the ratio measures the checkpoints as well as the KV pages.
"""

from __future__ import annotations

import argparse
import random
import shlex
import statistics
import tempfile
from pathlib import Path

from bench.chat_turns import model_path, ttft, word_pool
from bench.lib import launch
from bench.lib.workloads import WordPool
from client import Client


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="TTFT of requests extending a cached prefix against cold")
    add = p.add_argument
    add("--model", default="qwen35_4b-q4_k_m", help="a GGUF path or a hybrid bench model's name")
    add("--prefix-len", type=int, default=2048, help="tokens of the shared prefix")
    add("--suffix-len", type=int, default=64, help="tokens each request adds to the prefix")
    add("--requests", type=int, default=16)
    add("--output-len", type=int, default=4, help="tokens each request generates (EOS ignored)")
    add("--rounds", type=int, default=3)
    add("--engine-flags", default="", help="more launcher flags, one string")
    return p


def one_round(args: argparse.Namespace, model: str, pool: WordPool, r: int) -> tuple[list[float], ...]:
    """(TTFT ms of each request with the prefix cached, of each with the cache flushed)."""
    rng = random.Random(2000 + r)
    prefix = pool.sample(rng, args.prefix_len)[1]
    prompts = [prefix + pool.sample(rng, args.suffix_len)[1] for _ in range(args.requests)]
    warm, cold = [], []
    with tempfile.TemporaryDirectory(prefix="rivulet-shared-prefix-") as tmp:
        flags = shlex.split(args.engine_flags)
        with launch.rivulet_server("shared-prefix", flags, Path(tmp), model) as server:
            with Client(server.address, timeout_s=600) as client:
                ttft(client, prefix, 1)
                for prompt in prompts:
                    ms, cached, _ = ttft(client, prompt, args.output_len)
                    warm.append(ms)
                    print(f"  warm: {len(prompt)} tokens, {cached} cached, {ms:.1f} ms", flush=True)
                for prompt in prompts:
                    client.flush_cache()
                    ms, cached, _ = ttft(client, prompt, args.output_len)
                    assert cached == 0, f"{cached} tokens cached after a flush"
                    cold.append(ms)
    return warm, cold


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    model = model_path(args.model)
    pool = word_pool(model)
    ratios = []
    for r in range(args.rounds):
        warm, cold = one_round(args, model, pool, r)
        hit, flushed = statistics.median(warm), statistics.median(cold)
        ratios.append(hit / flushed)
        print(f"round {r}: TTFT p50 cached {hit:.1f} ms, flushed {flushed:.1f} ms, ratio {hit / flushed:.3f}")
    print(f"cached / flushed TTFT p50, median of {args.rounds} rounds: {statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
