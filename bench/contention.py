"""32-token requests on a CPU shared with busy processes: engine variants side by side, with and without load.

    python -m bench.contention                                   # default threads against --num-threads 1
    python -m bench.contention --load-procs 4 --requests 10 --variant "passive:OMP_WAIT_POLICY=passive"

One engine per variant (``NAME:FLAGS``; ``KEY=VALUE`` words before the first flag go into that
engine's environment) is started with its HTTP API on the embedded SmolLM2-135M unless ``--model``
says otherwise. Each phase sends ``--requests`` rounds of one 32-token completion (greedy, EOS
ignored, a fresh prompt each) to every variant in turn, the order rotating per round, so a
neighbour's burst falls on all of them alike. The loaded phase first starts ``--load-procs``
busy-loop processes (stopped by pid when it ends). Phases alternate, idle first, for
``--rounds``. Each row prints request latency p50 / p90 / max and the 1-minute load average
(/proc/loadavg) sampled after every request of that row. ``--json FILE`` writes every latency.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.lib import launch
from bench.lib.records import cpu_features, cpu_model, git_commit

DEFAULT_VARIANTS = ("default:", "one-thread:--num-threads 1")
BASE_FLAGS = ["--kv-cache-tokens", "4096"]
LOAD_SETTLE_S = 5.0  # the busy loops run this long before the first timed request


@dataclass(frozen=True)
class Variant:
    name: str
    env: dict[str, str]
    flags: list[str]


@dataclass
class Row:
    variant: str
    phase: str
    latencies_s: list[float] = field(default_factory=list)
    loadavgs: list[float] = field(default_factory=list)


def parse_variant(spec: str) -> Variant:
    """``NAME:[KEY=VALUE ...] [FLAGS ...]``."""
    name, _, rest = spec.partition(":")
    words = shlex.split(rest)
    env_words = []
    while words and "=" in words[0] and not words[0].startswith("-"):
        env_words.append(words.pop(0))
    return Variant(name, dict(w.split("=", 1) for w in env_words), words)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="32-token request latency under CPU contention, per engine variant"
    )
    add = p.add_argument
    add("--model", default=None, help="model dir or GGUF (default: the embedded SmolLM2-135M)")
    add(
        "--variant",
        action="append",
        default=None,
        help=f"NAME:[ENV=V ...] [FLAGS] (default: {DEFAULT_VARIANTS})",
    )
    add("--load-procs", type=int, default=4, help="busy-loop processes in the loaded phase")
    add("--requests", type=int, default=8, help="requests per variant per phase")
    add("--rounds", type=int, default=1, help="(idle, loaded) phase pairs")
    add("--phases", default="idle,loaded", help="which phases each round runs, in order")
    add("--max-tokens", type=int, default=32)
    add("--json", type=Path, default=None, help="write every latency and load sample here")
    return p


def loadavg_1min() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


@contextlib.contextmanager
def busy_load(procs: int) -> Iterator[list[int]]:
    """``procs`` pure-Python busy loops, killed by pid on exit."""
    started = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(procs)]
    try:
        time.sleep(LOAD_SETTLE_S if procs else 0.0)
        yield [p.pid for p in started]
    finally:
        for p in started:
            p.send_signal(signal.SIGKILL)
            p.wait()


@contextlib.contextmanager
def engines(variants: list[Variant], model: str | None, workdir: Path) -> Iterator[dict[str, str]]:
    """Every variant's engine, as name -> HTTP base URL; all stopped on exit."""
    with contextlib.ExitStack() as stack:
        urls = {}
        for v in variants:
            port = launch.free_port()
            saved = dict(os.environ)
            os.environ.update(v.env)  # the launcher, and through it the worker, inherits the environment
            try:
                flags = [*BASE_FLAGS, "--http-port", str(port), *v.flags]
                stack.enter_context(launch.rivulet_server(v.name, flags, workdir / v.name, model))
            finally:
                os.environ.clear()
                os.environ.update(saved)
            urls[v.name] = f"http://127.0.0.1:{port}"
        yield urls


def one_request(client: httpx.Client, base_url: str, prompt: str, max_tokens: int) -> float:
    model = client.get(f"{base_url}/v1/models", timeout=60.0).json()["data"][0]["id"]
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    started = time.perf_counter()
    reply = client.post(f"{base_url}/v1/completions", json=body, timeout=600.0)
    elapsed = time.perf_counter() - started
    reply.raise_for_status()
    assert reply.json()["usage"]["completion_tokens"] == max_tokens, reply.text
    return elapsed


def run_phase(
    args: argparse.Namespace, urls: dict[str, str], phase: str, rows: dict[tuple[str, str], Row]
) -> None:
    names = list(urls)
    with httpx.Client() as client, busy_load(args.load_procs if phase == "loaded" else 0):
        for r in range(args.requests):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                row = rows.setdefault((name, phase), Row(name, phase))
                prompt = f"Note {len(row.latencies_s)} of the {phase} {name} run: rivers and the sea"
                row.latencies_s.append(one_request(client, urls[name], prompt, args.max_tokens))
                row.loadavgs.append(loadavg_1min())
                print(
                    f"{phase} {name}: {row.latencies_s[-1]:.2f} s (load {row.loadavgs[-1]:.2f})",
                    file=sys.stderr,
                )


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def format_table(rows: list[Row]) -> str:
    lines = [
        f"# {cpu_model()}, {os.cpu_count()} CPUs, {cpu_features()}; commit {git_commit()[:12]}",
        "| variant | phase | requests | min s | p50 s | p90 s | max s | load avg (1 min) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lat = row.latencies_s
        lines.append(
            f"| {row.variant} | {row.phase} | {len(lat)} | {min(lat):.2f} | {statistics.median(lat):.2f} | "
            f"{quantile(lat, 0.9):.2f} | {max(lat):.2f} | {statistics.mean(row.loadavgs):.1f} |"
        )
    return "\n".join(lines)


def thread_changes(log_path: Path) -> list[str]:
    """The worker's "worker threads A -> B" lines in an engine's log."""
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    return [line.strip() for line in text.splitlines() if "worker threads" in line]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    variants = [parse_variant(s) for s in args.variant or DEFAULT_VARIANTS]
    rows: dict[tuple[str, str], Row] = {}
    with (
        tempfile.TemporaryDirectory(prefix="rivulet-contention-") as tmp,
        engines(variants, args.model, Path(tmp)) as urls,
    ):
        for name, url in urls.items():  # the first request of an engine pays one-time costs
            with httpx.Client() as client:
                one_request(client, url, f"warm-up of {name}", args.max_tokens)
        for _ in range(args.rounds):
            for phase in args.phases.split(","):
                run_phase(args, urls, phase, rows)
        changes = {v.name: thread_changes(Path(tmp) / v.name / "engine.log") for v in variants}
    ordered = sorted(
        rows.values(), key=lambda row: (row.phase, [v.name for v in variants].index(row.variant))
    )
    print(format_table(ordered), flush=True)
    for name, lines in changes.items():  # the worker's contention guard logs each change of threads
        print(f"{name}: {len(lines)} thread-count changes" + "".join(f"\n  {line}" for line in lines[:8]))
    if args.json is not None:
        payload = {"commit": git_commit(), "cpu": cpu_model(), "cpu_features": cpu_features(),
                   "config": {k: str(v) for k, v in vars(args).items()},
                   "rows": [vars(row) for row in ordered], "thread_changes": changes}  # fmt: skip
        args.json.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
