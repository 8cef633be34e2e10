"""A multi-turn chat on one engine: each turn extends the last turn's prompt and answer (bench/lib/
workloads.py's ``ChatTurns``), so an exact prefix cache resumes every turn where the last one ended;
then the last turn again with the cache flushed (a cold prefill of the whole conversation).

    python -m bench.chat_turns --model qwen35_4b-q4_k_m --turns 10 --rounds 3
    python -m bench.chat_turns --model qwen35moe_35b-q4_k_m --first-len 2048 --turn-len 64

``--model`` takes a path or a hybrid bench model's name (bench/lib/gguf_hybrid_model.py). Prints each
turn's prompt tokens, cached tokens and TTFT (the first streamed token, through the ZMQ client), and
the last turn's TTFT over the cold one's, per round and as the median of the rounds (issue 53's target:
<= 0.25). Start rivulet's engine per round with ``--engine-flags``.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import tempfile
import time
from pathlib import Path

from bench.lib import launch
from bench.lib.gguf_hybrid_model import SHAPES, ensure_model
from bench.lib.workloads import ChatTurns, WordPool
from client import Client
from gpu_worker.weights.model_files import resolve_model
from tokenizer_proc.gguf_tokenizer import ensure_tokenizer


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="a multi-turn chat: each turn's TTFT, and the last one cold")
    add = p.add_argument
    add("--model", default="qwen35_4b-q4_k_m", help="a GGUF path or a hybrid bench model's name")
    add("--turns", type=int, default=10)
    add("--first-len", type=int, default=512, help="tokens of the first turn's prompt")
    add("--turn-len", type=int, default=64, help="new tokens each later turn adds")
    add("--output-len", type=int, default=64, help="tokens each answer takes (EOS ignored)")
    add("--rounds", type=int, default=3)
    add("--engine-flags", default="", help="more launcher flags, one string")
    return p


def model_path(name: str) -> str:
    return str(ensure_model(name)) if name.partition("-")[0] in SHAPES else name


def word_pool(model: str) -> WordPool:
    """The single-token words of ``model``'s tokenizer (made from its GGUF first where needed)."""
    meta = resolve_model(model)
    ensure_tokenizer(meta)
    return WordPool(meta / "tokenizer.json")


def ttft(client: Client, prompt: list[int], output_len: int) -> tuple[float, int, list[int]]:
    """(TTFT in ms, cached prompt tokens, the answer's token ids) of one greedy request."""
    start, first, answer, cached = time.perf_counter(), 0.0, [], 0
    for delta in client.generate(input_ids=prompt, max_new_tokens=output_len, temperature=0, ignore_eos=True,
                                 stream=True):  # fmt: skip
        if delta.token_ids and not first:
            first = time.perf_counter()
        answer.extend(delta.token_ids)
        cached = delta.usage.cached_tokens if delta.usage is not None else cached
    return (first - start) * 1e3, cached, answer


def one_round(args: argparse.Namespace, model: str, pool: WordPool, r: int) -> list[tuple[int, int, float]]:
    """Per turn (prompt tokens, cached tokens, TTFT ms), then the last prompt cold."""
    rows: list[tuple[int, int, float]] = []
    chat = ChatTurns(pool, args.first_len, args.turn_len, seed=1000 + r)
    with tempfile.TemporaryDirectory(prefix="rivulet-chat-turns-") as tmp:
        with launch.rivulet_server("chat-turns", shlex.split(args.engine_flags), Path(tmp), model) as server:
            with Client(server.address, timeout_s=600) as client:
                prompt = chat.first
                for turn in range(args.turns):
                    ms, cached, answer = ttft(client, prompt, args.output_len)
                    rows.append((len(prompt), cached, ms))
                    if turn + 1 < args.turns:
                        prompt = chat.next_prompt(prompt, answer)
                client.flush_cache()
                ms, cached, _ = ttft(client, prompt, args.output_len)
                rows.append((len(prompt), cached, ms))
    return rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    model = model_path(args.model)
    pool = word_pool(model)
    ratios = []
    for r in range(args.rounds):
        rows = one_round(args, model, pool, r)
        print(f"round {r}: | turn | prompt tokens | cached | TTFT ms |")
        for turn, (n, cached, ms) in enumerate(rows):
            print(f"| {'cold' if turn == args.turns else turn} | {n} | {cached} | {ms:.1f} |")
        ratios.append(rows[-2][2] / rows[-1][2])
        print(f"last turn / cold: {ratios[-1]:.3f}")
    print(f"last turn / cold, median of {args.rounds} rounds: {statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
