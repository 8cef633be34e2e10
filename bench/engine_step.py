"""The engine's decode step against the lone step, in one process: thread CPU time on one thread.

    python -m bench.engine_step --model ~/.cache/rivulet/bench-models/llama1b-shape-iq4_xs-v1.gguf --rows 32
    python -m bench.engine_step --model ~/.cache/rivulet/bench-models/llama1b-shape-bf16-v1.gguf --rows 1 \
        --output-len 96 --sections

The engine's step (``engine``): the scheduler core serving ``--rows`` greedy requests of ``--input-len``
prompt tokens and ``--output-len`` new ones with overlap (the next batch scheduled before the last
result is in, so its decode rows send PENDING, as the scheduler process does), each batch through
the codecs the processes use (the scheduler's encoder, the worker's ``Codec(ToWorker)``; the result
back through ``Codec(FromWorker)``) and the worker's ``ModelRunner.execute``. The lone step
(``lone``): bench.worker_step's repeated decode of ``--rows`` rows at the engine's mean context.
Rounds alternate the two. Per decode step of all ``--rows`` rows, medians: the runner's step, the
C kernels' calls in it (every ctypes function of the kernels library, timed around each call), the
runner's Python (the step less its C calls), the frame codecs, and the scheduler core's schedule,
``on_result`` and ``take_outputs``. What this leaves out, by design: sockets, the other processes,
and the second thread (bench.process_cpu and bench.step_timeline measure those in a served engine).

``--sections`` then runs one more engine pass with the runner's parts timed apart (C calls taken
off each): where the Python of a step goes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from _ctypes import CFuncPtr
from collections import defaultdict, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import torch

from bench.lib.worker_batches import GREEDY, prepare
from bench.worker_step import make_runner
from gpu_worker import model_runner
from gpu_worker.backends.cpu import kernels as cpu_kernels
from gpu_worker.backends.cpu.kind import requested_kind
from gpu_worker.model_runner import ModelRunner
from protocol.messages import ForwardBatch, FromWorker, TokenizedRequest, ToWorker
from protocol.transport import Codec
from scheduler_proc.config import SchedulerConfig
from scheduler_proc.scheduler import Scheduler

clock = time.thread_time


class CTimer:
    """Thread CPU seconds spent inside the kernels library's ctypes functions (its instance's
    attributes wrapped once)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        kernels = cpu_kernels.load(requested_kind())
        for name, value in list(vars(kernels).items()) if kernels is not None else []:
            if isinstance(value, CFuncPtr):
                setattr(kernels, name, self._timed(value))

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            started = clock()
            try:
                return fn(*args)
            finally:
                self.seconds += clock() - started

        return call


def _is_decode(batch: ForwardBatch, rows: int) -> bool:
    return len(batch.extend_lens) == rows and all(n == 1 for n in batch.extend_lens)


def engine_steps(
    runner: ModelRunner, args: argparse.Namespace, c: CTimer
) -> tuple[dict[str, list[float]], int]:
    """One served run through the scheduler core and the codecs; per full decode step, seconds by
    part; and the tokens the requests got."""
    config = runner.config
    sched = Scheduler(
        SchedulerConfig(
            num_pages=runner.num_pages,
            context_len=runner.context_len,
            page_size=config.page_size,
            max_running_requests=config.max_running_requests,
            max_prefill_tokens=max(4096, args.rows * args.input_len),
            chunked_prefill_size=max(4096, args.rows * args.input_len),
            enable_mixed_chunk=False,
            state_checkpoints=runner.state_checkpoints,
        )
    )
    for i in range(args.rows):
        prompt = [(13 * i + 7 * j) % 30000 + 100 for j in range(args.input_len)]
        req = TokenizedRequest(rid=i, input_ids=prompt, max_new_tokens=args.output_len, stop_token_ids=[],
                               sampler=GREEDY)  # fmt: skip
        assert sched.add(req) is None, f"request {i} rejected"
    encoder = msgspec.msgpack.Encoder()
    to_worker: Codec[ToWorker] = Codec(ToWorker)
    from_worker: Codec[FromWorker] = Codec(FromWorker)
    in_flight: deque[bytes] = deque()
    parts: dict[str, list[float]] = defaultdict(list)
    tokens = 0
    while sched.has_work or in_flight:
        started = clock()
        while len(in_flight) < 2 and (next_batch := sched.schedule()) is not None:
            in_flight.append(encoder.encode(next_batch))
        schedule_s = clock() - started
        started = clock()
        batch = to_worker.decode(in_flight.popleft())
        decode_s = clock() - started
        c_before, started = c.seconds, clock()
        result = runner.execute(batch)
        step_s, c_s = clock() - started, c.seconds - c_before
        started = clock()
        frame = to_worker.encode(msgspec.structs.replace(result, busy_s=1.0, clock_s=2.0))
        encode_s = clock() - started
        started = clock()
        sched.on_result(from_worker.decode(frame))
        for out in sched.take_outputs():
            encoder.encode(out)
            tokens += sum(1 for t in getattr(out, "token_ids", ()) if t >= 0)
        result_s = clock() - started
        assert isinstance(batch, ForwardBatch)
        if _is_decode(batch, args.rows):
            for name, value in (
                ("step", step_s),
                ("c", c_s),
                ("python", step_s - c_s),
                ("codecs", decode_s + encode_s),
                ("scheduler", schedule_s + result_s),
            ):
                parts[name].append(value)
    return parts, tokens


def lone_steps(runner: ModelRunner, args: argparse.Namespace, c: CTimer) -> dict[str, list[float]]:
    step = prepare(runner, args.rows, args.input_len + args.output_len // 2)
    parts: dict[str, list[float]] = defaultdict(list)
    for i in range(args.lone_iters):
        c_before, started = c.seconds, clock()
        step(i + 1)
        step_s, c_s = clock() - started, c.seconds - c_before
        for name, value in (("step", step_s), ("c", c_s), ("python", step_s - c_s)):
            parts[name].append(value)
    return parts


def sections(runner: ModelRunner, args: argparse.Namespace, c: CTimer) -> dict[str, float]:
    """Thread CPU seconds a full decode step of the runner's parts, each less its C calls, over one
    engine run (its full decode steps only). The runner's methods stay wrapped: call it last."""
    spent: dict[str, float] = defaultdict(float)
    decoding = [False]  # whether the step running is a full decode step (the only ones counted)

    def wrap(owner: Any, name: str, label: str = "") -> None:
        fn = getattr(owner, name)

        def timed(*a: Any, **k: Any) -> Any:
            c_before, started = c.seconds, clock()
            try:
                return fn(*a, **k)
            finally:
                if decoding[0]:
                    spent[label or name] += (clock() - started) - (c.seconds - c_before)

        setattr(owner, name, timed)

    for name in ("check_batch", "committed", "copy_pages", "prompt_logprobs", "BatchRows", "ForwardContext"):
        wrap(model_runner, name)
    wrap(runner.kv, "apply_page_deltas")
    for name in ("init_forward_metadata", "forward_decode", "before_batch", "after_batch"):
        wrap(runner.backend, name)
    for name in ("_sample", "_input_ids", "_greedy_in_head", "execute"):
        wrap(runner, name)
    for state in runner.draws.states:
        wrap(state, "on_batch", f"{type(state).__name__}.on_batch")
    timed_execute = runner.execute

    def execute(batch: ForwardBatch) -> Any:
        decoding[0] = _is_decode(batch, args.rows)
        return timed_execute(batch)

    runner.execute = execute  # type: ignore[method-assign]
    parts, _ = engine_steps(runner, args, c)
    steps = len(parts["step"])
    return {k: v / steps for k, v in sorted(spent.items(), key=lambda kv: -kv[1])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF dir or .gguf (default: embedded SmolLM2-135M)")
    p.add_argument("--dtype", default="float32:gguf", help="as bench.worker_step's (one)")
    p.add_argument("--rows", type=int, default=32, help="requests, all decoding together")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64, help="new tokens per request")
    p.add_argument("--lone-iters", type=int, default=15)
    p.add_argument("--rounds", type=int, default=2, help="engine and lone runs, alternating")
    p.add_argument("--sections", action="store_true", help="then the runner's parts, one engine run")
    p.add_argument("--json", type=Path, default=None, help="also write the medians here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # thread CPU time is the step's CPU only on one thread
    context = args.input_len + args.output_len + 16
    runner_args = argparse.Namespace(
        model=args.model, decode_batches=[args.rows], prefill=0, prefill_prompts=1, context=context,
        num_threads=1, compile=False,
    )  # fmt: skip
    runner = make_runner(runner_args, args.dtype)
    c = CTimer()
    engine: dict[str, list[float]] = defaultdict(list)
    lone: dict[str, list[float]] = defaultdict(list)
    tokens = []
    for _ in range(args.rounds):
        for name, values in lone_steps(runner, args, c).items():
            lone[name].extend(values)
        parts, got = engine_steps(runner, args, c)
        tokens.append(got)
        for name, values in parts.items():
            engine[name].extend(values)
    assert all(t == args.rows * args.output_len for t in tokens), f"tokens {tokens}"
    med = {f"{run}.{k}": 1e3 * statistics.median(v) for run, d in (("engine", engine), ("lone", lone))
           for k, v in d.items()}  # fmt: skip
    print(f"{args.rows} rows, context {args.input_len}-{args.input_len + args.output_len} (lone: its mean), "
          f"{len(engine['step'])} engine / {len(lone['step'])} lone decode steps; thread CPU ms a step, one "
          "thread, medians")  # fmt: skip
    print(f"{'part':<28} {'engine':>10} {'lone':>10}")
    for part, label in (("step", "runner step"), ("c", "its C calls"), ("python", "its Python (step - C)"),
                        ("codecs", "frame codecs (worker)"), ("scheduler", "scheduler core")):  # fmt: skip
        e, lo = med.get(f"engine.{part}"), med.get(f"lone.{part}")
        print(f"{label:<28} {e:>10.3f} {'-' if lo is None else f'{lo:.3f}':>10}")
    out: dict[str, Any] = {"medians_ms": med}
    if args.sections:
        per_step = sections(runner, args, c)
        out["sections_us"] = {k: 1e6 * v for k, v in per_step.items()}
        print("the runner's Python by part (C calls taken off), us a decode step:")
        for name, seconds in per_step.items():
            print(f"  {name:<40} {1e6 * seconds:8.1f}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
