"""The online streaming benchmark's run (roseinfer's benchmark_streaming), against rivulet over ZMQ
or any OpenAI-compatible server: the parser its flags come from, the workload they build, and the
requests sent at their arrival times with a concurrency cap. Every request streams; TTFT, ITL, TPOT
and latency are taken at the client as each chunk arrives (bench/lib/metrics.py). The command is
``python -m bench.serving``; other benches call ``benchmark(build_parser().parse_args(argv))``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from bench.lib.backends import Backend, BackendError, OpenAIBackend, ZmqBackend
from bench.lib.metrics import RequestResult, Summary, summarize
from bench.lib.workloads import (
    WordPool,
    WorkItem,
    arrival_offsets_s,
    compose_workload,
    parse_repeats,
    random_workload,
    repeated_prompt_workload,
    rewrite_workload,
    shared_prefix_workload,
)  # fmt: skip
from client import EngineError, default_endpoint

DEFAULT_RESULTS = Path(__file__).resolve().parents[1] / "results" / "serving.jsonl"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="rivulet streaming benchmark (roseinfer's benchmark_streaming)")
    add = p.add_argument
    add("--backend", choices=("zmq", "openai"), default="zmq")
    add("--endpoint", default=None, help="zmq: the engine's client socket (default: $RIVULET_ENDPOINT)")
    add("--base-url", default="http://127.0.0.1:8080", help="openai: the server's base URL")
    add("--served-model", default=None, help="openai: the request's model field (default: GET /v1/models)")
    add("--model", default=None, help="rivulet model dir/GGUF whose tokenizer builds exact prompts")
    add("--tokenizer", default=None, help="a tokenizer.json (or its dir) instead of --model's")
    add("--workload", choices=("repeated-prompt", "random", "shared-prefix", "rewrite", "compose"),
        default="repeated-prompt",
        help="repeated-prompt: --prompt repeated per request, cycling --prompt-repeats; "
             "rewrite: chat prompts whose answers repeat the prompt (a list, code with one name changed); "
             "compose: chat prompts whose answers are new text (--model's chat template)")  # fmt: skip
    add("--prompt", default="Hello", help="repeated-prompt: the prompt text that is repeated")
    add("--prompt-repeats", default="1", help='repeated-prompt: repeats per request, cycled: "512,1,1,1"')
    add("--unique-prompts", action="store_true", help="repeated-prompt: prefix each prompt with its number")
    add("--num-requests", type=int, default=32)
    add("--max-new-tokens", type=int, default=32, help="tokens per request (all but random)")
    add("--no-stop-on-eos", action="store_true",
        help="repeated-prompt: ignore EOS (random workloads always do)")  # fmt: skip
    add("--input-len", type=int, default=32, help="random: prompt tokens (upper bound)")
    add("--output-len", type=int, default=32, help="random: new tokens (upper bound)")
    add("--range-ratio", type=float, default=1.0, help="random: lengths uniform in [len*ratio, len]")
    add("--groups", type=int, default=4, help="shared-prefix: groups sharing one system prompt")
    add("--questions", type=int, default=8, help="shared-prefix: questions per group")
    add("--system-len", type=int, default=256, help="shared-prefix: system prompt tokens")
    add("--question-len", type=int, default=16, help="shared-prefix: question tokens")
    add("--submit-interval-ms", type=float, default=0.0, help="fixed gap between submissions")
    add("--request-rate", type=float, default=float("inf"), help="Poisson arrivals, requests/s")
    add("--max-concurrency", type=int, default=0, help="cap on requests in flight; 0: none")
    add("--temperature", type=float, default=0.0)
    add("--sampling", type=json.loads, default={}, metavar="JSON",
        help='more options on every request, e.g. \'{"presence_penalty": 0.5, "logit_bias": {"5": 2}}\' '
             "(zmq: generate()'s names, openai: the body's)")  # fmt: skip
    add("--seed", type=int, default=0, help="seeds the workload and the arrivals")
    add("--warmup-requests", type=int, default=1, help="short untimed requests sent first")
    add("--timeout-s", type=float, default=600.0)
    add("--label", default="", help="names this configuration in the record")
    add("--result-file", type=Path, default=DEFAULT_RESULTS, help="JSON Lines file records are appended to")
    add("--no-record", action="store_true", help="do not append a record")
    add("--no-progress", action="store_true", help="no progress bar (also off when CI is set or no tty)")
    return p


def tokenizer_json(args: argparse.Namespace) -> Path:
    if args.tokenizer:
        path = Path(args.tokenizer)
        return path / "tokenizer.json" if path.is_dir() else path
    from gpu_worker.weights.model_files import resolve_model

    return resolve_model(args.model) / "tokenizer.json"


def build_workload(args: argparse.Namespace) -> list[WorkItem]:
    if args.workload == "repeated-prompt":
        return repeated_prompt_workload(
            args.prompt, parse_repeats(args.prompt_repeats), args.num_requests, args.unique_prompts,
            args.max_new_tokens, args.no_stop_on_eos, args.seed,
        )  # fmt: skip
    pool = WordPool(tokenizer_json(args))
    if args.workload in ("rewrite", "compose"):
        make = rewrite_workload if args.workload == "rewrite" else compose_workload
        return make(pool, tokenizer_json(args).parent, args.num_requests, args.max_new_tokens, args.seed)
    if args.workload == "random":
        return random_workload(
            pool, args.num_requests, args.input_len, args.output_len, args.range_ratio, args.seed
        )
    return shared_prefix_workload(
        pool, args.groups, args.questions, args.system_len, args.question_len, args.max_new_tokens, args.seed
    )


def make_backend(args: argparse.Namespace, stream: bool = True) -> Backend:
    if args.backend == "zmq":
        sampling = dict(args.sampling)
        if "logit_bias" in sampling:  # JSON keys are strings; the ZMQ client takes token ids
            sampling["logit_bias"] = {int(k): v for k, v in sampling["logit_bias"].items()}
        endpoint = args.endpoint or default_endpoint()
        return ZmqBackend(endpoint, args.temperature, stream, args.timeout_s, sampling)
    assert stream, "the openai backend always streams"
    return OpenAIBackend(args.base_url, args.served_model, args.temperature, args.timeout_s, args.sampling)


async def run_one(backend: Backend, item: WorkItem) -> RequestResult:
    """Send one request and timestamp every chunk as it arrives; failures end up in ``error``."""
    res = RequestResult(submit_s=time.perf_counter())
    try:
        async for delta in backend.stream(item):
            now = time.perf_counter()
            res.token_times_s.extend([now] * delta.num_tokens)
            res.prompt_tokens = delta.prompt_tokens or res.prompt_tokens
            res.completion_tokens = delta.completion_tokens or res.completion_tokens
            res.cached_tokens = delta.cached_tokens or res.cached_tokens
            if delta.finished:
                res.finish_s = now
        if res.finish_s is None:
            res.error = "the stream ended without a final reply"
    except (EngineError, BackendError, TimeoutError, httpx.HTTPError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def run_requests(
    backend: Backend, items: list[WorkItem], offsets_s: list[float], max_concurrency: int, progress: bool
) -> list[RequestResult]:
    """Send ``items[i]`` at ``offsets_s[i]`` after the start, at most ``max_concurrency`` in flight."""
    assert len(items) == len(offsets_s), "one arrival time per request"
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency > 0 else None
    bar = tqdm(total=len(items), unit="req", disable=not progress, file=sys.stderr, leave=False)
    start = time.perf_counter()

    async def arrive(item: WorkItem, offset_s: float) -> RequestResult:
        await asyncio.sleep(max(0.0, start + offset_s - time.perf_counter()))
        async with slots or contextlib.nullcontext():
            res = await run_one(backend, item)
        bar.update(1)
        return res

    try:
        return list(await asyncio.gather(*(arrive(i, t) for i, t in zip(items, offsets_s, strict=True))))
    finally:
        bar.close()


async def warm_up(backend: Backend, n: int) -> None:
    """Untimed short requests, so the first measured request does not pay for lazy start-up."""
    for _ in range(n):
        res = await run_one(backend, WorkItem("Hello", None, 4, True))
        if res.error:
            raise BackendError(f"warm-up request failed: {res.error}")


def show_progress(args: argparse.Namespace) -> bool:
    return not args.no_progress and not os.environ.get("CI") and sys.stderr.isatty()


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    """What the record says about this run: the workload and backend flags that shape it."""
    skip = {"result_file", "no_record", "no_progress", "timeout_s"}
    return {k: (str(v) if isinstance(v, Path | float) else v) for k, v in vars(args).items() if k not in skip}


async def benchmark(args: argparse.Namespace) -> tuple[Summary, list[RequestResult]]:
    """Build the workload, warm up, run it, summarize. No printing, no files."""
    items = build_workload(args)
    offsets = arrival_offsets_s(len(items), args.submit_interval_ms, args.request_rate, args.seed)
    backend = make_backend(args)
    try:
        await warm_up(backend, args.warmup_requests)
        results = await run_requests(backend, items, offsets, args.max_concurrency, show_progress(args))
    finally:
        await backend.close()
    return summarize(results), results
