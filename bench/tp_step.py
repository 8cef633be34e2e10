"""Tensor parallel on CPU: the all-reduce (gloo against shared memory), the worker's step time at
--tp-size 2 against 1, and whether a vocab-parallel LM head would pay.

    python -m bench.tp_step --rounds 3 --json tp_step.json

The model: a random Llama of SmolLM2-135M's size whose heads divide by 2 (30 layers, hidden 512,
8 heads, 4 KV heads, MLP 1536, vocab 49152), float32. Variants, each a set of live processes
built once and then run round-robin (A B C A B C ...), so a noisy neighbour hits each alike:

    tp1          one worker, ``--num-threads`` = the cores given (2 on a 2-core machine)
    tp2-shm      two ranks, one core each, all-reduce through shared memory (the default)
    tp2-gloo     the same through gloo

Rank 0 of each reports; ranks run in lockstep (each step's all-reduces meet). The all-reduce table
times one call at the hidden size for 1, 32 and 256 rows. The head table times, on one rank, the
replicated head (all the vocabulary's rows) against half of them plus the all-gather of the
logits a vocab-parallel head needs (done as an all-reduce of zero-padded logits, the way the
shared-memory path would).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

HIDDEN, VOCAB = 512, 49152
SHAPES = {"decode1": (1, 1), "decode32": (32, 1), "prefill256": (1, 256)}  # rows, tokens per row
CONTEXT = 96


def save_model(out: Path) -> None:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=VOCAB, tie_word_embeddings=True, max_position_embeddings=2048,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(out)


def _timed(fn: Any, iters: int) -> float:
    """Median seconds of ``fn()`` over ``iters`` calls, after one warm-up."""
    fn()
    times = []
    for _ in range(iters):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _serve(
    conn: Connection, model: str, rank: int, world: int, how: str, addr: str, cores: list[int]
) -> None:
    """One rank (or the TP=1 worker): build, then run what the parent asks until told to stop."""
    os.sched_setaffinity(0, cores)
    import torch

    from bench.lib.worker_batches import PAGE_SIZE, prepare, prepare_prefill
    from gpu_worker.backends.cpu.shm_allreduce import ShmAllReduce
    from gpu_worker.backends.torch.backend import gloo_all_reduce
    from gpu_worker.config import WorkerConfig
    from gpu_worker.model_runner import ModelRunner
    from gpu_worker.tensor_parallel import init_group

    extra: dict[str, Any] = {}
    if world > 1:
        init_group(rank, world, addr)
        extra = dict(tp_size=world, tp_rank=rank, dist_init_addr=addr, tp_all_reduce=how)
    runner = ModelRunner(
        WorkerConfig(
            model_path=model, dtype="float32", page_size=PAGE_SIZE, max_running_requests=32,
            kv_cache_tokens=32 * (CONTEXT + 2 * PAGE_SIZE) + 256 + PAGE_SIZE, num_threads=len(cores), **extra,
        )
    )  # fmt: skip
    steps = {
        name: prepare(runner, rows, CONTEXT) if tokens == 1 else prepare_prefill(runner, tokens)
        for name, (rows, tokens) in SHAPES.items()
    }
    reduce = None
    if world > 1:
        from gpu_worker.backends.cpu.backend import kernels_library

        library = kernels_library(True)
        reduce = ShmAllReduce(library, rank, world) if how == "shm" and library else gloo_all_reduce
    conn.send("ready")
    step_no = 1000
    while (ask := conn.recv()) != "stop":
        what, iters = ask
        out: dict[str, float] = {}
        if what == "steps":
            for name, step in steps.items():

                def one(step: Any = step) -> None:
                    nonlocal step_no
                    step_no += 1
                    step(step_no)

                out[name] = _timed(one, iters)
        elif what == "reduce" and reduce is not None:
            for rows in (1, 32, 256):
                t = torch.randn(rows, HIDDEN)
                out[f"rows{rows}"] = _timed(lambda t=t: reduce(t), iters * 20)
        elif what == "head" and reduce is not None:
            weight = torch.randn(VOCAB, HIDDEN)
            half = weight[: VOCAB // world].clone()
            for rows in (1, 32):
                x = torch.randn(rows, HIDDEN)
                out[f"replicated{rows}"] = _timed(
                    lambda x=x, w=weight: torch.nn.functional.linear(x, w), iters
                )

                def parallel(x: torch.Tensor = x, half: torch.Tensor = half) -> None:
                    logits = torch.zeros(x.shape[0], VOCAB)
                    start = rank * (VOCAB // world)
                    torch.matmul(x, half.t(), out=logits[:, start : start + VOCAB // world])
                    reduce(logits)

                out[f"vocab_parallel{rows}"] = _timed(parallel, iters)
        conn.send(out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(model: str, variant: str, cores: list[int]) -> list[tuple[Any, Connection]]:
    ctx = multiprocessing.get_context("spawn")
    world, how = (1, "") if variant == "tp1" else (2, variant.split("-")[1])
    addr = f"127.0.0.1:{_free_port()}"
    shares = [cores] if world == 1 else [[cores[r % len(cores)]] for r in range(world)]
    procs = []
    for rank in range(world):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_serve, args=(child, model, rank, world, how, addr, shares[rank]), daemon=True)
        p.start()
        child.close()  # the rank holds it now: a rank that dies is an EOFError here, not a hang
        procs.append((p, parent))
    for _, conn in procs:
        assert conn.recv() == "ready"
    return procs


def ask(procs: list[tuple[Any, Connection]], what: str, iters: int) -> dict[str, float]:
    for _, conn in procs:
        conn.send((what, iters))
    results = [conn.recv() for _, conn in procs]
    return results[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", default="")
    args = p.parse_args()
    cores = sorted(os.sched_getaffinity(0))[:2]
    from gpu_worker.backends.cpu.kind import describe, requested_kind

    print(describe(requested_kind()))
    with tempfile.TemporaryDirectory() as tmp:
        save_model(Path(tmp))
        variants = {v: start(tmp, v, cores) for v in ("tp1", "tp2-shm", "tp2-gloo")}
        try:
            steps: dict[str, dict[str, list[float]]] = {v: {} for v in variants}
            reduces: dict[str, dict[str, list[float]]] = {v: {} for v in variants if v != "tp1"}
            head: dict[str, list[float]] = {}
            for _ in range(args.rounds):
                for v, procs in variants.items():
                    for name, s in ask(procs, "steps", args.iters).items():
                        steps[v].setdefault(name, []).append(s)
                    if v != "tp1":
                        for name, s in ask(procs, "reduce", args.iters).items():
                            reduces[v].setdefault(name, []).append(s)
                for name, s in ask(variants["tp2-shm"], "head", args.iters).items():
                    head.setdefault(name, []).append(s)
        finally:
            for procs in variants.values():
                for proc, conn in procs:
                    conn.send("stop")
                    proc.join(30)
                    if proc.is_alive():  # stuck: stopped by its pid
                        proc.kill()
                        proc.join(5)
    report(steps, reduces, head, args)


def report(steps: dict, reduces: dict, head: dict, args: argparse.Namespace) -> None:
    def ms(ts: list[float]) -> float:
        return statistics.median(ts) * 1e3

    print(f"\nstep time, median ms over {args.rounds} rounds x {args.iters} steps (context {CONTEXT})")
    print(f"{'variant':<10}" + "".join(f"{s:>12}" for s in SHAPES) + "   vs tp1")
    base = {s: ms(steps["tp1"][s]) for s in SHAPES}
    for v, per in steps.items():
        vals = {s: ms(per[s]) for s in SHAPES}
        ratio = " ".join(f"{vals[s] / base[s]:.2f}" for s in SHAPES)
        print(f"{v:<10}" + "".join(f"{vals[s]:>12.2f}" for s in SHAPES) + f"   {ratio}")
    print(f"\nall-reduce of [rows, {HIDDEN}] float32, median us per call")
    for v, per in reduces.items():
        print(f"{v:<10}" + "".join(f"{name:>9} {ms(ts) * 1e3:>8.1f}" for name, ts in per.items()))
    print(f"\nLM head ({VOCAB} x {HIDDEN} float32) on one rank, median ms")
    for name, ts in head.items():
        print(f"{name:<18} {ms(ts):>8.2f}")
    if args.json:
        out = {"steps": steps, "reduces": reduces, "head": head}
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
