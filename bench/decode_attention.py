"""The C decode attention alone: ms per step of SmolLM2's 30 layers (9 query / 3 KV heads of 64; or
``--shape`` llama1b: 16 layers, 32 / 8 heads of 64; qwen3moe: 8 layers, 32 / 4 heads of 128, the
bench GGUFs' shapes) over a paged KV cache (float32 by default), at given contexts and decode rows.

    python -m bench.decode_attention                                   # this checkout's build
    python -m bench.decode_attention --against OLD.so --contexts 64,512,2048 --rows 1,2,3
    python -m bench.decode_attention --kv-dtypes float32,bfloat16,float16 --rows 1   # --kv-cache-dtype
    python -m bench.decode_attention --shape qwen3moe --kv-dtypes float16 --rows 1,32 --against OLD.so

Each layer has its own K and V pool (as in the worker), so a step reads every layer's
KV from memory. ``--against`` takes another build of the kernels library (e.g. an older commit's,
from ``python -c 'from gpu_worker.backends.cpu.build import build; ...'`` in that checkout) and times it
interleaved with this one, repetition by repetition, in one process (each repetition starts with
the next library in turn: the first of a repetition reads KV the others then find in cache): the
medians' ratio is the change. KV GB/s is the K and V bytes a step reads over its median time.
``--kv-dtypes`` times float32 queries over caches of each dtype, interleaved the same way (the first
is the baseline of the ratio).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from gpu_worker.backends.cpu import kind as cpu_kind
from gpu_worker.backends.cpu.kernels import CpuKernels, load

PAGE_SIZE = 16
SHAPES = {"smollm2": (30, 9, 3, 64), "llama1b": (16, 32, 8, 64), "qwen3moe": (8, 32, 4, 128)}  # layers, heads


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contexts", default="64,128,512,2048", help="comma list of KV positions per row")
    p.add_argument("--rows", default="1,2,32", help="comma list of decode rows per step")
    p.add_argument("--repeats", type=int, default=25, help="timed steps per library and shape")
    p.add_argument("--against", type=Path, default=None, help="another build of the kernels library")
    p.add_argument("--kv-dtypes", default="float32", help="comma list of KV cache dtypes (float32 queries)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2", help="layers and heads of a step")
    return p


def step_ms(
    kernels: CpuKernels,
    context: int,
    rows: int,
    repeats: int,
    others: list[CpuKernels],
    kv_dtypes: tuple[torch.dtype, ...] = (torch.float32,),
    shape: str = "smollm2",
) -> list[float]:
    """Median ms of one step (every layer's attention) for ``kernels`` and each of ``others`` over a
    cache of each of ``kv_dtypes`` (libraries x dtypes, in that order), interleaved, each repetition
    starting one run further on."""
    layers, heads, kv_heads, head_dim = SHAPES[shape]
    pages_per_row = -(-context // PAGE_SIZE)
    pool = pages_per_row * rows * PAGE_SIZE
    caches = {
        dtype: [
            (torch.randn(pool, kv_heads, head_dim).to(dtype), torch.randn(pool, kv_heads, head_dim).to(dtype))
            for _ in range(layers)
        ]
        for dtype in kv_dtypes
    }
    page_table = torch.arange(pages_per_row * rows).view(rows, pages_per_row).contiguous()
    q, out = torch.randn(rows, heads, head_dim), torch.empty(rows, heads, head_dim)
    ids = torch.arange(rows)
    runs = [(lib, dtype) for lib in [kernels, *others] for dtype in kv_dtypes]
    times: list[list[float]] = [[] for _ in runs]
    for rep in range(repeats):
        for i in range(len(runs)):
            (lib, dtype), ts = runs[(rep + i) % len(runs)], times[(rep + i) % len(runs)]
            decode = lib.decode_rows(ids, ids, torch.full((rows,), context), page_table, PAGE_SIZE)
            started = time.perf_counter()
            for k_cache, v_cache in caches[dtype]:
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
    kv_dtypes = tuple(getattr(torch, name) for name in args.kv_dtypes.split(","))
    print(f"# {cpu_kind.describe(acting)}; torch threads {torch.get_num_threads()}")
    if len(kv_dtypes) > 1:
        return kv_dtype_table(kernels, args, kv_dtypes)
    head = "| context | rows | this build ms | KV GB/s |" + (" --against ms | speed-up |" if others else "")
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    elem = kv_dtypes[0].itemsize
    layers, _, kv_heads, head_dim = SHAPES[args.shape]
    for context in [int(x) for x in args.contexts.split(",")]:
        for rows in [int(x) for x in args.rows.split(",")]:
            ms = step_ms(kernels, context, rows, args.repeats, others, kv_dtypes, args.shape)
            gbs = layers * 2 * context * kv_heads * head_dim * elem * rows / (ms[0] / 1e3) / 1e9
            line = f"| {context} | {rows} | {ms[0]:.3f} | {gbs:.1f} |"
            if others:
                line += f" {ms[1]:.3f} | {ms[1] / ms[0]:.2f}x |"
            print(line, flush=True)
    return 0


def kv_dtype_table(kernels: CpuKernels, args: argparse.Namespace, kv_dtypes: tuple[torch.dtype, ...]) -> int:
    """ms per step over each KV dtype, and its speed-up over the first."""
    names = [str(d).removeprefix("torch.") for d in kv_dtypes]
    head = "| context | rows | " + " | ".join(f"{n} ms" for n in names) + " | "
    head += " | ".join(f"{n} speed-up" for n in names[1:]) + " |"
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for context in [int(x) for x in args.contexts.split(",")]:
        for rows in [int(x) for x in args.rows.split(",")]:
            ms = step_ms(kernels, context, rows, args.repeats, [], kv_dtypes, args.shape)
            cells = (
                " | ".join(f"{m:.3f}" for m in ms) + " | " + " | ".join(f"{ms[0] / m:.2f}x" for m in ms[1:])
            )
            print(f"| {context} | {rows} | {cells} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
