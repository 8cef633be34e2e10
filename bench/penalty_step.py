"""The worker's decode step at 32 rows with penalties on every row against the same step without.

    python -m bench.penalty_step                      # SmolLM2, the engine's dtype
    python -m bench.penalty_step --iters 60 --context 256

One ModelRunner, two groups of 32 requests with the same prompts: one greedy, one greedy
with presence, frequency and repetition penalties and a logit_bias. After each group's
prefill, decode steps of the two groups alternate (A B A B ...), so a noisy neighbour on
a shared CPU hits both alike; the median step time of each is reported, and their ratio
is the output tok/s with penalties over without (the target: at least 0.85).
``python -m bench.penalty_cost`` measures the same through the whole engine, where the CPU is quiet.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from gpu_worker.weights.model_files import resolve_model
from protocol.messages import ForwardBatch
from protocol.sampling import WorkerPenalties, WorkerSampling

PAGE_SIZE = 16


def sampler(penalties: WorkerPenalties | None) -> WorkerSampling:
    return WorkerSampling(temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0, seed=0, penalties=penalties)


def step_batch(
    step: int,
    req_pool_idx: list[int],
    ids: list[list[int]],
    prefix: int,
    first: WorkerSampling | None,
    pages_per_request: int,
) -> ForwardBatch:
    """Rows ``ids[i]`` at ``prefix`` for ``req_pool_idx``; ``first`` (the prefill) hands out each
    request's ``pages_per_request`` pages (enough for the whole run) and its sampler."""
    pages_per_request = pages_per_request if first is not None else 0
    return ForwardBatch(
        step=step, req_pool_idx=req_pool_idx, prefix_lens=[prefix] * len(req_pool_idx),
        extend_lens=[len(r) for r in ids], input_ids=[t for r in ids for t in r],
        page_starts=[0] * len(req_pool_idx), page_counts=[pages_per_request] * len(req_pool_idx),
        pages=[s * pages_per_request + p for s in req_pool_idx for p in range(pages_per_request)],
        sample=[True] * len(req_pool_idx), sampler=[first] * len(req_pool_idx),
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--context", type=int, default=128, help="prompt tokens per row")
    p.add_argument("--iters", type=int, default=40, help="decode steps per group")
    p.add_argument("--dtype", default="auto")
    args = p.parse_args(argv)
    rows = args.rows
    pages_per_request = -(-(args.context + args.iters + 1) // PAGE_SIZE)
    pages = 2 * rows * pages_per_request
    runner = ModelRunner(
        WorkerConfig(model_path=str(resolve_model(None)), dtype=args.dtype, page_size=PAGE_SIZE,
                     kv_cache_tokens=pages * PAGE_SIZE, max_running_requests=2 * rows)
    )  # fmt: skip
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.context)] for _ in range(rows)]
    pen = WorkerPenalties(prompt_len=args.context, presence=0.5, frequency=0.3, repetition=1.1,
                          bias_ids=[1000, 2000], bias_values=[2.0, -2.0])  # fmt: skip
    groups = {
        "without": (list(range(rows)), sampler(None)),
        "with": (list(range(rows, 2 * rows)), sampler(pen)),
    }
    last: dict[str, list[int]] = {}
    for name, (req_pool_idx, s) in groups.items():
        last[name] = runner.execute(step_batch(0, req_pool_idx, prompts, 0, s, pages_per_request)).token_ids
    times: dict[str, list[float]] = {name: [] for name in groups}
    for i in range(args.iters):
        for name, (req_pool_idx, _) in groups.items():
            b = step_batch(i + 1, req_pool_idx, [[t] for t in last[name]], args.context + i, None, 0)
            started = time.perf_counter()
            last[name] = runner.execute(b).token_ids
            times[name].append(time.perf_counter() - started)
    median_ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    print(f"| {rows}-row decode step, {args.context}-token prompts | median ms | tok/s |")
    print("|---|---|---|")
    for name, ms in median_ms.items():
        print(f"| {name} penalties | {ms:.2f} | {rows * 1e3 / ms:.0f} |")
    print(f"\nwith / without tok/s: {median_ms['without'] / median_ms['with']:.3f} (target >= 0.85)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
