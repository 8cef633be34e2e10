"""What top-N logprobs cost the model runner: a 32-stream greedy decode step where one request
asks for ``top_logprobs=20``, against the same step where nobody asks (and where that one asks
only for its chosen token's logprob).

    python -m bench.logprobs_cost                      # SmolLM2, auto dtype, 32 rows
    python -m bench.logprobs_cost --rows 32 --rounds 5 --json out.json
    python -m bench.logprobs_cost --num-threads 1 --clock cpu   # steadier on a shared machine

The configurations run round-robin on one runner (A B C A B C ...), so a noisy neighbour hits
each alike; every step re-sends req_pool_idx 0's sampler, in every configuration, so they differ only
in what req_pool_idx 0 asks. The median step time is reported, and each configuration's ratio to the
plain one (the target: top_logprobs=20 within 10%).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import msgspec

from bench.lib.worker_batches import GREEDY, PAGE_SIZE, batch
from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from gpu_worker.weights.model_files import resolve_model
from protocol.sampling import WorkerSampling

CONFIGS = {
    "none": GREEDY,
    "logprobs": msgspec.structs.replace(GREEDY, logprobs=True),
    "top20": msgspec.structs.replace(GREEDY, logprobs=True, top_logprobs=20),
}


def run(args: argparse.Namespace) -> dict[str, list[float]]:
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    runner = ModelRunner(
        WorkerConfig(
            model_path=str(resolve_model(args.model)),
            dtype=args.dtype,
            page_size=PAGE_SIZE,
            kv_cache_tokens=args.rows * (args.context + 2 * PAGE_SIZE),
            max_running_requests=args.rows,
            num_threads=args.num_threads,
        )
    )
    runner.execute(batch(0, args.rows, 0, args.context, first=True))
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    step = 0
    for _ in range(args.rounds):
        for name, first_row in CONFIGS.items():
            sampler: list[WorkerSampling | None] = [first_row] + [None] * (args.rows - 1)
            for i in range(args.warmup + args.iters):
                step += 1
                b = msgspec.structs.replace(
                    batch(step, args.rows, args.context, 1, first=False), sampler=sampler
                )
                started = clock()
                runner.execute(b)
                if i >= args.warmup:
                    times[name].append(clock() - started)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF dir or .gguf (default: embedded SmolLM2-135M)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--context", type=int, default=96, help="KV tokens per decode row")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-threads", type=int, default=0)
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: this process's CPU time (with --num-threads 1, steadier on a shared machine)",
    )
    p.add_argument("--json", default="", help="also write the results here")
    args = p.parse_args()
    times = run(args)
    base, base_min = statistics.median(times["none"]), min(times["none"])
    print(
        f"{args.rows} greedy decode rows, context {args.context}, {args.iters} iters x {args.rounds} rounds, "
        f"{args.clock} clock, {args.num_threads or 'all'} threads"
    )
    print(f"{'row 0 asks':<12} {'ms/step':>9} {'min ms':>9} {'vs none':>9} {'min vs none':>12}")
    rows = []
    for name, ts in times.items():
        ms = statistics.median(ts)
        rows.append({"config": name, "ms_per_step": ms * 1e3, "min_ms": min(ts) * 1e3, "ratio": ms / base})
        print(
            f"{name:<12} {ms * 1e3:>9.2f} {min(ts) * 1e3:>9.2f} {ms / base:>9.3f} {min(ts) / base_min:>12.3f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
