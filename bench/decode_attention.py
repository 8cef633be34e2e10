"""The C decode attention alone: ms per step of SmolLM2's 30 layers (9 query / 3 KV heads of 64)
over a float32 paged KV cache, at given contexts and decode rows.

    python -m bench.decode_attention                                   # this checkout's build
    python -m bench.decode_attention --against OLD.so --contexts 64,512,2048 --rows 1,2,3

Each layer has its own K and V pool (30 of each, as in the worker), so a step reads every layer's
KV from memory. ``--against`` takes another build of the kernels library (e.g. an older commit's,
from ``python -c 'from gpu_worker.backends.cpu.build import build; ...'`` in that checkout) and times it
interleaved with this one, repetition by repetition, in one process: the medians' ratio is the
change. KV GB/s is the K and V bytes a step reads over its median time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from gpu_worker.backends.cpu import kind as cpu_kind
from gpu_worker.backends.cpu.kernels import CpuKernels, load

LAYERS, HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 30, 9, 3, 64, 16


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contexts", default="64,128,512,2048", help="comma list of KV positions per row")
    p.add_argument("--rows", default="1,2,32", help="comma list of decode rows per step")
    p.add_argument("--repeats", type=int, default=25, help="timed steps per library and shape")
    p.add_argument("--against", type=Path, default=None, help="another build of the kernels library")
    return p


def step_ms(
    kernels: CpuKernels, context: int, rows: int, repeats: int, others: list[CpuKernels]
) -> list[float]:
    """Median ms of one step (every layer's attention) for ``kernels`` and each of ``others``, interleaved."""
    pages_per_row = -(-context // PAGE_SIZE)
    pool = pages_per_row * rows * PAGE_SIZE
    caches = [
        (torch.randn(pool, KV_HEADS, HEAD_DIM), torch.randn(pool, KV_HEADS, HEAD_DIM)) for _ in range(LAYERS)
    ]
    page_table = torch.arange(pages_per_row * rows).view(rows, pages_per_row).contiguous()
    q, out = torch.randn(rows, HEADS, HEAD_DIM), torch.empty(rows, HEADS, HEAD_DIM)
    ids = torch.arange(rows)
    libs = [kernels, *others]
    times: list[list[float]] = [[] for _ in libs]
    for _ in range(repeats):
        for lib, ts in zip(libs, times, strict=True):
            decode = lib.decode_rows(ids, ids, torch.full((rows,), context), page_table, PAGE_SIZE)
            started = time.perf_counter()
            for k_cache, v_cache in caches:
                lib.attend(q, k_cache, v_cache, out, decode)
            ts.append(1e3 * (time.perf_counter() - started))
    return [statistics.median(ts) for ts in times]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    acting = cpu_kind.apply_to_environ()
    kernels = load(acting)
    if kernels is None:
        raise SystemExit("error: the C kernels did not build (see the log line above)")
    others = [CpuKernels(args.against, acting)] if args.against else []
    print(f"# {cpu_kind.describe(acting)}; torch threads {torch.get_num_threads()}")
    head = "| context | rows | this build ms | KV GB/s |" + (" --against ms | speed-up |" if others else "")
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for context in [int(x) for x in args.contexts.split(",")]:
        for rows in [int(x) for x in args.rows.split(",")]:
            ms = step_ms(kernels, context, rows, args.repeats, others)
            gbs = LAYERS * 2 * context * KV_HEADS * HEAD_DIM * 4 * rows / (ms[0] / 1e3) / 1e9
            line = f"| {context} | {rows} | {ms[0]:.3f} | {gbs:.1f} |"
            if others:
                line += f" {ms[1]:.3f} | {ms[1] / ms[0]:.2f}x |"
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
