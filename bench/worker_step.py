"""Per-step cost of the model runner alone: no sockets, no scheduler, one process.

    python -m bench.worker_step                       # SmolLM2, auto dtype
    python -m bench.worker_step --dtype float32,bfloat16 --rounds 3 --json out.json
    python -m bench.worker_step --profile decode32    # torch.profiler table of one shape
    python -m bench.worker_step --dtype bfloat16,bfloat16:torch --rounds 3   # C kernels vs torch
    python -m bench.worker_step --dtype bfloat16,bfloat16:gguf --rounds 3    # bf16 vs GGUF blocks
    python -m bench.worker_step --dtype float32:gguf,float32:gguf-modules --rounds 3  # one call vs modules
    python -m bench.worker_step --dtype float32:gguf --kv-cache-dtypes float32,bfloat16,float16 \
        --decode-batches 1 --context 2048 --prefill 0 --rounds 3      # the KV pool's dtype
    python -m bench.worker_step --model M --dtype float32:gguf --toggle weight_prefetch_nta \
        --decode-batches 1,2,4 --prefill 0 --iters 100 --rounds 2     # a C switch, 0 / 1 on alternate steps

``--toggle NAME`` takes an int the kernels library exports (a C global such as common.h's
``weight_prefetch_nta``) and sets it to 0 and 1 on alternate steps (0 1 1 0 ...), for the ratio of
its two settings in one process, where the machine's pace moves minute to minute. ``--toggle
one_call`` does so with the one-call decode (0: the modules), one model held for both, where
``float32:gguf,float32:gguf-modules`` holds two; ``--toggle head_argmax`` with a greedy batch's
argmax from the head's kernel (0: the logits, then their argmax; sampling/head_argmax.py).

Shapes: decode at batch 1 / 8 / 32 (every row with ``--context`` tokens of KV
already written) and one prefill step of ``--prefill-prompts`` fresh prompts (1 unless given) of
``--prefill`` tokens each (``prefill16x32``: 16 prompts of 32 tokens, as a 32-stream run's first
steps). Each shape runs ``--iters`` steps after ``--warmup``; the median step time is reported. With
several dtypes the runners are built once and the shapes run round-robin
(A B A B ...), so a noisy neighbour hits every configuration alike.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.lib.worker_batches import PAGE_SIZE, prepare, prepare_prefill
from gpu_worker.backends.cpu.backend import CpuBackend
from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from gpu_worker.weights.model_files import resolve_model, source_gguf
from protocol.transport import freeze_startup_heap


def shapes(args: argparse.Namespace) -> dict[str, tuple[int, int]]:
    """name -> (rows, tokens per row); decode rows have ``args.context`` tokens of history."""
    out = {f"decode{b}": (b, 1) for b in args.decode_batches}
    if args.prefill > 0:
        prompts = args.prefill_prompts
        name = f"prefill{args.prefill}" if prompts == 1 else f"prefill{prompts}x{args.prefill}"
        out[name] = (prompts, args.prefill)
    return out


def time_steps(
    step: Callable[[int], None], iters: int, warmup: int, clock: Callable[[], float] = time.perf_counter
) -> list[float]:
    for i in range(warmup):
        step(i + 1)
    times = []
    for i in range(iters):
        started = clock()
        step(warmup + i + 1)
        times.append(clock() - started)
    return times


def make_runner(args: argparse.Namespace, variant: str) -> ModelRunner:
    """``variant``: a dtype, with ``:torch`` appended for torch paths instead of the C kernels,
    ``:gguf`` for a GGUF's weights computed in their blocks (--weight-dtype gguf), or
    ``:gguf-modules`` for those without the one-call decode (every layer through its modules); then
    ``/kv=DTYPE`` for the KV pool's dtype (--kv-cache-dtype); last ``/latent=FORM`` for a latent-attention
    model's form (--latent-attention: absorbed, expanded)."""
    variant, _, latent = variant.partition("/latent=")
    variant, _, kv = variant.partition("/kv=")
    dtype, _, attention = variant.partition(":")
    rows, prompts = max(args.decode_batches), args.prefill_prompts
    kv_tokens = rows * (args.context + 2 * PAGE_SIZE) + prompts * (args.prefill + PAGE_SIZE) + PAGE_SIZE
    extra: dict[str, Any] = {"compile": True} if args.compile else {}  # older configs lack the field
    if kv:
        extra["kv_cache_dtype"] = kv
    if latent:
        extra["latent_attention"] = latent
    if attention == "torch":
        extra["cpu_kernels"] = False
    elif attention in ("gguf", "gguf-modules"):
        extra.update(weight_dtype="gguf", gguf_path=str(source_gguf(args.model)))
    runner = ModelRunner(
        WorkerConfig(
            model_path=str(resolve_model(args.model)),
            dtype=dtype,
            page_size=PAGE_SIZE,
            kv_cache_tokens=kv_tokens,
            max_running_requests=max(rows, prompts, 1),
            num_threads=args.num_threads,
            **extra,
        )
    )
    if attention == "gguf-modules":
        assert isinstance(runner.backend, CpuBackend), "gguf-modules: the CPU backend's modules"
        runner.backend.fused_decode = None
    freeze_startup_heap()  # as the worker does once loaded: no full collection walks the model mid-step
    return runner


def steppers(runner: ModelRunner, args: argparse.Namespace) -> dict[str, Callable[[int], None]]:
    out = {}
    for name, (rows, tokens) in shapes(args).items():
        out[name] = (
            prepare(runner, rows, args.context) if tokens == 1 else prepare_prefill(runner, tokens, rows)
        )
    return out


def profile(runner: ModelRunner, step: Callable[[int], None], args: argparse.Namespace) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    time_steps(step, 3, args.warmup)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        time_steps(step, args.iters, 0)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile_rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF dir or .gguf (default: embedded SmolLM2-135M)")
    p.add_argument(
        "--dtype",
        default="auto",
        help="comma-separated: auto,float32,bfloat16; DTYPE:torch = no C kernels, DTYPE:gguf = GGUF blocks, "
        "DTYPE:gguf-modules = GGUF blocks without the one-call decode; a /latent=absorbed or "
        "/latent=expanded suffix: a latent-attention model's form",
    )
    p.add_argument("--kv-cache-dtypes", default="", help="comma-separated KV pool dtypes, each per --dtype")
    p.add_argument("--decode-batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    p.add_argument("--context", type=int, default=96, help="KV tokens per decode row")
    p.add_argument("--prefill", type=int, default=256, help="prefill chunk tokens (of each prompt); 0: skip")
    p.add_argument(
        "--prefill-prompts",
        type=int,
        default=1,
        help="prompts of --prefill tokens each in the one prefill step (16: a 32-stream run's first steps)",
    )
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1, help="round-robin passes over dtypes x shapes")
    p.add_argument("--num-threads", type=int, default=0)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--profile", default="", help="a shape name: print a torch.profiler table instead")
    p.add_argument("--profile-rows", type=int, default=30)
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: this process's CPU time (with --num-threads 1, steadier on a shared machine)",
    )
    p.add_argument("--json", default="", help="also write the results here")
    p.add_argument(
        "--toggle",
        default="",
        help="an int the kernels library exports, one_call (the one-call decode) or head_argmax (the "
        "greedy draw in the head): 0, 1 by turns",
    )
    args = p.parse_args()
    dtypes = args.dtype.split(",")
    if args.kv_cache_dtypes:
        dtypes = [f"{d}/kv={kv}" for d in dtypes for kv in args.kv_cache_dtypes.split(",")]
    runners = {d: make_runner(args, d) for d in dtypes}
    if args.profile:
        for d, runner in runners.items():
            print(f"== {d} {args.profile}")
            profile(runner, steppers(runner, args)[args.profile], args)
        return
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.toggle:
        for d, runner in runners.items():
            toggled(runner, d, args, clock)
        return
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for d, runner in runners.items():
            for name, step in steppers(runner, args).items():
                times.setdefault((d, name), []).extend(time_steps(step, args.iters, args.warmup, clock))
    report(times, args)
    for d, runner in runners.items():
        kv = runner.kv
        pools = 1 if kv.v is kv.k else 2  # a latent pool's one row a token is its K and V
        per_token = pools * len(kv.k) * kv.k[0].shape[1] * kv.k[0].shape[2] * kv.k[0].element_size()
        print(
            f"{d}: KV {str(runner.kv_dtype).removeprefix('torch.')}, {per_token} bytes a token, "
            f"{2**30 // per_token} tokens per GiB of pool"
        )


ONE_CALL = "one_call"  # --toggle's name for the one-call decode
HEAD_ARGMAX = "head_argmax"  # --toggle's name for the greedy draw in the head (ModelRunner.head_argmax)


class OneCallSwitch:
    """The runner's one-call decode as --toggle's switch: 1 on, 0 off (the modules run)."""

    def __init__(self, backend: CpuBackend) -> None:
        self.backend, self.fused = backend, backend.fused_decode

    @property
    def value(self) -> int:
        return int(self.backend.fused_decode is not None)

    @value.setter
    def value(self, value: int) -> None:
        self.backend.fused_decode = self.fused if value else None


class HeadArgmaxSwitch:
    """The runner's greedy draw in the head as --toggle's switch: 1 on, 0 off (the logits)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    @property
    def value(self) -> int:
        return int(self.runner.head_argmax)

    @value.setter
    def value(self, value: int) -> None:
        self.runner.head_argmax = bool(value)


def switch_of(runner: ModelRunner, dtype: str, name: str) -> ctypes.c_int | OneCallSwitch | HeadArgmaxSwitch:
    """--toggle's switch: the library's int ``name``, the one-call decode, or the greedy draw in the head."""
    kernels = getattr(runner.backend, "kernels", None)
    if kernels is None:
        raise SystemExit(f"--toggle: {dtype} runs without the C kernels")
    if name == HEAD_ARGMAX:
        if not runner.head_argmax:
            raise SystemExit(f"--toggle {HEAD_ARGMAX}: {dtype}'s model has no compute_argmax")
        return HeadArgmaxSwitch(runner)
    if name != ONE_CALL:
        return ctypes.c_int.in_dll(ctypes.CDLL(str(kernels.path)), name)
    if not isinstance(runner.backend, CpuBackend) or runner.backend.fused_decode is None:
        raise SystemExit(f"--toggle {ONE_CALL}: {dtype} has no one-call decode (its log says why)")
    return OneCallSwitch(runner.backend)


def toggled(runner: ModelRunner, dtype: str, args: argparse.Namespace, clock: Callable[[], float]) -> None:
    """Every shape's steps with the library's int ``args.toggle`` (or the one-call decode) at 0 and 1
    in turn (0 1 1 0 ...): the median ms of each setting and their ratio."""
    switch = switch_of(runner, dtype, args.toggle)
    kept = switch.value
    times: dict[tuple[str, int], list[float]] = {}
    try:
        for _ in range(args.rounds):
            for name, step in steppers(runner, args).items():
                time_steps(step, args.warmup, 0, clock)
                for i in range(args.iters):
                    for value in (0, 1) if i % 2 == 0 else (1, 0):
                        switch.value = value
                        times.setdefault((name, value), []).extend(time_steps(step, 1, 0, clock))
    finally:
        switch.value = kept
    print(f"{dtype}: {args.toggle} 0 and 1 on alternate steps, {args.iters} pairs x {args.rounds} rounds, "
          f"context {args.context}, median {args.clock} ms/step")  # fmt: skip
    for name in shapes(args):
        off, on = (statistics.median(times[(name, v)]) * 1e3 for v in (0, 1))
        print(f"{name:<12} {args.toggle}=0 {off:9.2f}  {args.toggle}=1 {on:9.2f}  1 / 0 {on / off:.3f}")


def report(times: dict[tuple[str, str], list[float]], args: argparse.Namespace) -> None:
    print(
        f"context {args.context} tokens/row, {args.iters} iters x {args.rounds} rounds, "
        f"median {args.clock} ms/step, {args.num_threads or 'all'} threads"
    )
    print(f"{'dtype':<10} {'shape':<12} {'ms/step':>9} {'min ms':>9} {'tok/s':>9}")
    rows = []
    for (d, name), ts in times.items():
        shape_rows, tokens = shapes(args)[name]
        ms, min_ms = statistics.median(ts) * 1e3, min(ts) * 1e3
        rate = shape_rows * tokens / (ms / 1e3)
        rows.append({"dtype": d, "shape": name, "ms_per_step": ms, "min_ms": min_ms, "tokens_per_s": rate})
        print(f"{d:<10} {name:<12} {ms:>9.2f} {min_ms:>9.2f} {rate:>9.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
