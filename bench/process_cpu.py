"""Where an engine's CPU goes at 32 streams: each process's CPU time per generated token.

    python -m bench.process_cpu --model ~/.cache/rivulet/bench-models/qwen35_4b-q4_k_m-shape-v1.gguf
    python -m bench.process_cpu --rounds 3 --variant "base:" --variant "x:RIVULET_X=1 --num-threads 1"
    python -m bench.process_cpu --variant "old:" --variant "new:" --worktree old=/tmp/wt-old

One engine per variant (``NAME:[KEY=VALUE ...] [FLAGS]``: environment words, then launcher flags;
``--worktree NAME=DIR`` runs that variant's launcher from another checkout) is started with its
HTTP API (the embedded model unless ``--model``) and kept up; each round sends every variant, in an
order rotating per round, the 32-stream phase of ``bench.targets`` (``--streams`` concurrent
streamed POST /v1/completions, random prompts of ``--input-len`` tokens, ``--output-len`` new
tokens each, EOS ignored) while /proc is read every 0.1 s. Per process (the launcher, tokenizer,
scheduler, worker, any other child, and this client's main thread) it prints the CPU milliseconds
spent per generated token in the steady window (every stream decoding: from the moment the last
of the first ``--streams`` requests has its first token to the first finish) and over the whole
run; the worker's CPU split into its Python thread (which also runs one share of the kernels) and
its other threads; and the worker's step: window / (tokens / streams). Medians over rounds
(min-max). The machine is shared: compare variants of one run, not runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.contention import Variant, parse_variant
from bench.lib import launch, serving
from bench.lib.metrics import RequestResult
from bench.lib.probes import steady_window_s
from bench.lib.proc_cpu import CpuSampler, cpu_between, ready_line_pids
from bench.lib.records import cpu_features, cpu_model, git_commit

ROLES = ("launcher", "tokenizer", "scheduler", "gpu_worker", "other", "client")
WORKER = "gpu_worker"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="each engine process's CPU time per token at 32 streams")
    add = p.add_argument
    add("--model", default=None, help="model dir, GGUF, or bench model name (default: the embedded model)")
    add("--variant", action="append", default=None, help="NAME:[ENV=V ...] [FLAGS] (default: one, 'engine:')")
    add("--worktree", action="append", default=[], help="NAME=DIR: run variant NAME's launcher from DIR")
    add("--rounds", type=int, default=3)
    add("--streams", type=int, default=32, help="concurrent streams")
    add("--requests", type=int, default=64, help="requests of a run")
    add("--input-len", type=int, default=32)
    add("--output-len", type=int, default=128, help="new tokens per request (EOS ignored)")
    add("--engine-flags", default="", help="more launcher flags for every variant")
    add("--json", type=Path, default=None, help="write every run's numbers here")
    add(
        "--py-spy",
        type=Path,
        default=None,
        metavar="DIR",
        help="py-spy each engine process through every variant's first run (collapsed stacks, "
        "--native, into DIR/VARIANT-PROCESS.txt); its sampling costs CPU: a profile, not a measurement",
    )
    return p


def _serving_args(args: argparse.Namespace, base_url: str, seed: int) -> argparse.Namespace:
    model = ["--model", args.model] if args.model else []
    argv = ["--backend", "openai", "--base-url", base_url, *model, "--workload", "random",
            "--num-requests", str(args.requests), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--max-concurrency", str(args.streams),
            "--warmup-requests", "2", "--seed", str(seed), "--no-progress", "--no-record"]  # fmt: skip
    return serving.build_parser().parse_args(argv)


def _tokens_between(results: list[RequestResult], start: float, end: float) -> int:
    return sum(1 for r in results for t in r.token_times_s if start <= t <= end)


def _per_token_ms(cpu: dict[str, float], pids: dict[str, int], tokens: int) -> dict[str, float]:
    """CPU ms per token by role; the worker's Python thread (tid = pid) and its other threads apart."""
    out = {role: 1e3 * cpu.get(role, 0.0) / tokens for role in ROLES if role in cpu}
    worker = pids.get(WORKER)
    if worker is not None:
        threads = {k: v for k, v in cpu.items() if k.startswith(f"{WORKER}/")}
        main = threads.pop(f"{WORKER}/{worker}", 0.0)
        out["worker_python_thread"] = 1e3 * main / tokens
        out["worker_other_threads"] = 1e3 * sum(threads.values()) / tokens
    return out


def measure_run(
    args: argparse.Namespace, server: launch.Server, url: str, seed: int, profile: Path | None = None
) -> dict[str, Any]:
    """One 32-stream run on a running engine, its processes' CPU read beside it (``profile``: py-spy
    its processes into files ``PROFILE-NAME.txt``)."""
    pids = ready_line_pids(_ready_line(server))
    named = set(pids.values()) | {server.proc.pid}
    others = [pid for pid in launch.descendants(server.proc.pid) if pid not in named]
    watched = {"launcher": server.proc.pid, **pids, **{f"other/{p}": p for p in others}}
    bench_args = _serving_args(args, url, seed)
    with (
        CpuSampler(watched, threads_of=(WORKER,)) as sampler,
        py_spy(pids if profile is not None else {}, profile),
    ):
        summary, results = asyncio.run(serving.benchmark(bench_args))
    assert summary.num_failed == 0, f"{summary.num_failed} requests failed"
    window = steady_window_s(results, args.streams)
    assert window is not None, "no steady window: fewer requests than streams, or none finished"
    snaps = sampler.snapshots
    for snap in snaps:  # every other child counted as one
        snap.process_s["other"] = sum(v for k, v in snap.process_s.items() if k.startswith("other/"))
    first = min(r.submit_s for r in results)
    last = max(r.finish_s for r in results if r.finish_s is not None)
    tokens = _tokens_between(results, *window)
    total = sum(r.output_tokens for r in results)
    return {
        "window_s": window[1] - window[0],
        "window_tokens": tokens,
        "step_ms": 1e3 * (window[1] - window[0]) * args.streams / tokens,
        "out_tps": summary.output_throughput,
        "steady": _per_token_ms(cpu_between(snaps, *window), pids, tokens),
        "whole": _per_token_ms(cpu_between(snaps, first, last), pids, total),
    }


@contextlib.contextmanager
def py_spy(pids: dict[str, int], prefix: Path | None) -> Iterator[None]:
    """``py-spy record`` on each of ``pids`` while the block runs, stopped by SIGINT (so it writes)."""
    procs = []
    for name, pid in pids.items():
        out = f"{prefix}-{name}.txt"
        cmd = ["py-spy", "record", "--pid", str(pid), "--native", "--format", "raw", "--rate", "100",
               "--output", out]  # fmt: skip
        with open(f"{prefix}-{name}.log", "wb") as log:
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
    try:
        time.sleep(1.0 if procs else 0.0)  # attached before the first request
        yield
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGINT)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _ready_line(server: launch.Server) -> str:
    stdout = server.log_path.with_name("engine.stdout").read_text(errors="replace")
    return next(line for line in stdout.splitlines() if line.startswith("rivulet ready:"))


@contextlib.contextmanager
def engines(
    args: argparse.Namespace, variants: list[Variant], worktrees: dict[str, Path], workdir: Path
) -> Iterator[dict[str, tuple[launch.Server, str]]]:
    """Every variant's engine up, as name -> (server, HTTP base URL); all stopped on exit."""
    with contextlib.ExitStack() as stack:
        up = {}
        for v in variants:
            port = launch.free_port()
            flags = [*args.engine_flags.split(), "--http-port", str(port), *v.flags]
            repo = worktrees.get(v.name, launch.REPO)
            server = stack.enter_context(
                launch.rivulet_server(v.name, flags, workdir / v.name, args.model, env=v.env, repo=repo)
            )
            up[v.name] = (server, f"http://127.0.0.1:{port}")
        yield up


def _cell(values: list[float]) -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    return f"{med:.3f} ({min(values):.3f}-{max(values):.3f})" if len(values) > 1 else f"{med:.3f}"


def format_table(runs: dict[str, list[dict[str, Any]]]) -> str:
    names = list(runs)
    lines = [
        f"# {cpu_model()}; {cpu_features()}; commit {git_commit()[:12]}; busy machine unless said",
        "CPU ms per generated token, steady window (every stream decoding) / whole run; median (min-max)",
        "| process | " + " | ".join(f"{n} steady | {n} whole" for n in names) + " |",
        "|---|" + "---|---|" * len(names),
    ]
    keys = [*ROLES, "worker_python_thread", "worker_other_threads"]
    for key in keys:
        cells = []
        for n in names:
            for part in ("steady", "whole"):
                cells.append(_cell([r[part][key] for r in runs[n] if key in r[part]]))
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    for key, label in (("step_ms", "worker step ms (steady)"), ("out_tps", "output tok/s (whole)")):
        cells = [f"{_cell([r[key] for r in runs[n]])} | -" for n in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from bench.lib import gguf_models

    args.model = gguf_models.resolve(args.model)
    variants = [parse_variant(s) for s in args.variant or ["engine:"]]
    worktrees = {k: Path(v).resolve() for k, _, v in (w.partition("=") for w in args.worktree)}
    runs: dict[str, list[dict[str, Any]]] = {v.name: [] for v in variants}
    if args.py_spy is not None:
        args.py_spy.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rivulet-process-cpu-") as tmp:
        with engines(args, variants, worktrees, Path(tmp)) as up:
            names = list(up)
            for r in range(args.rounds):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    server, url = up[name]
                    profile = args.py_spy / name if args.py_spy is not None and r == 0 else None
                    runs[name].append(measure_run(args, server, url, 4000 + r, profile))
                    run = runs[name][-1]
                    shown = ", ".join(f"{k} {v:.3f}" for k, v in run["steady"].items())
                    print(f"round {r + 1} {name}: step {run['step_ms']:.1f} ms; {shown}", file=sys.stderr)
    print(format_table(runs), flush=True)
    if args.json is not None:
        config = {k: str(v) for k, v in vars(args).items()}
        payload = {"commit": git_commit(), "cpu": cpu_model(), "config": config, "runs": runs}
        args.json.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
