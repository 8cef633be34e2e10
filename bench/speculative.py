"""Speculative decoding by n-gram lookup against none: output tok/s per workload and concurrency.

    python -m bench.speculative                                   # rewrite and compose, 1 stream
    python -m bench.speculative --workloads compose --concurrency 1,32 --rounds 3
    python -m bench.speculative --spec-flags "--speculative-num-draft-tokens 5"

Two engines run side by side (the same flags but ``--speculative-algorithm ngram`` and
``--spec-flags`` on one), each started once; each round runs every (workload, concurrency) on one,
then the other, in alternating order, so a noisy neighbour hits both alike. Workloads are
bench.serving's ``rewrite`` (chat prompts whose answers repeat the prompt: a list to number, code
to rewrite with one name changed) and ``compose`` (short stories); greedy, each request ending at
EOS or ``--max-new-tokens``. A cell is the median (min-max) output tok/s over the rounds, and the
ratio is speculative / plain of the same round. On a machine shared with other busy processes the
wall-clock rates swing with them, so each run also reports the engine's CPU time per output token
(every process of its tree, from /proc: what the work itself cost, whatever else ran); its ratio is
plain / speculative. The acceptance rate is the speculative engine's own count (its log lines),
per workload. Equal completion-token counts on both engines show the
outputs kept their lengths (greedy outputs are the same tokens: tests/exactness/test_speculative.py).

With ``--peer-llama-cpp PATH|auto`` (bench/llama_cpp.py builds llama-server per CPU kind) llama.cpp's
server runs beside them on the same GGUF, twice: plain, and with its n-gram speculation
(``--peer-spec-flags``, default ``--spec-type ngram-simple`` with a 2-token lookup and 3 drafted
tokens, as ours); every engine is then measured over HTTP (``POST /v1/completions``, streamed, the
same prompts as text), in the same rounds, and llama.cpp's acceptance comes from its log.

    python -m bench.speculative --workloads rewrite --peer-llama-cpp auto --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.lib import launch, llama_cpp, serving
from bench.lib.records import machine_info
from gpu_worker.backends.cpu import kind as cpu_kind

ACCEPT = re.compile(r"#drafted-token: (\d+), #accepted-token: (\d+)")
PEER_ACCEPT = re.compile(r"draft acceptance = [\d.]+ \(\s*(\d+) accepted /\s*(\d+) generated\)")
PEER_SPEC_FLAGS = (
    "--spec-type ngram-simple --spec-ngram-simple-size-n 2 --spec-ngram-simple-size-m 3 --spec-draft-n-max 3"
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = p.add_argument
    add("--model", default=None, help="model dir or GGUF (default: the embedded SmolLM2)")
    add("--workloads", default="rewrite,compose", help="comma list of bench.serving workloads")
    add("--concurrency", default="1", help="comma list of streams")
    add("--num-requests", type=int, default=8, help="requests per run (at least the concurrency)")
    add("--max-new-tokens", type=int, default=256)
    add("--rounds", type=int, default=3)
    add("--engine-flags", default="", help="flags of both engines")
    add("--spec-flags", default="", help="more flags of the speculative engine")
    add(
        "--peer-llama-cpp",
        default=None,
        help="llama-server PATH or auto: llama.cpp beside rivulet, all over HTTP",
    )
    add("--peer-spec-flags", default=PEER_SPEC_FLAGS, help="llama-server's flags for its n-gram speculation")
    return p


def cpu_s(server: launch.Server) -> float:
    """User + system CPU seconds of every live process of the engine's tree."""
    server.watch()
    total = 0
    for pid in server.alive_pids():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(") ", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
    return total / os.sysconf("SC_CLK_TCK")


def drafted(server: launch.Server) -> tuple[int, int]:
    """The engine's cumulative (drafted, accepted) tokens: rivulet's last log line, or the sum of
    llama-server's per-request lines."""
    text = server.log_path.read_text(errors="replace")
    if server.name.startswith("llama.cpp"):
        lines = PEER_ACCEPT.findall(text)
        return sum(int(g) for _, g in lines), sum(int(a) for a, _ in lines)
    found = ACCEPT.findall(text)
    return (int(found[-1][0]), int(found[-1][1])) if found else (0, 0)


def run(args: argparse.Namespace, server: launch.Server, workload: str, streams: int) -> dict[str, Any]:
    http = server.address.startswith("http")
    target = ["--backend", "openai", "--base-url", server.address] if http else ["--endpoint", server.address]
    argv = [*target, "--workload", workload, "--num-requests",
            str(max(args.num_requests, streams)), "--max-new-tokens", str(args.max_new_tokens),
            "--max-concurrency", str(streams), "--no-record", "--no-progress"]  # fmt: skip
    if args.model:
        argv += ["--model", args.model]
    cpu_before, drafts_before = cpu_s(server), drafted(server)
    summary, _ = asyncio.run(serving.benchmark(serving.build_parser().parse_args(argv)))
    assert summary.num_failed == 0, f"{summary.num_failed} requests failed"
    cpu = cpu_s(server) - cpu_before
    drafts = [after - before for after, before in zip(drafted(server), drafts_before, strict=True)]
    return {"tok_s": summary.output_throughput, "tokens": summary.completion_tokens,
            "cpu_ms": 1e3 * cpu / max(summary.completion_tokens, 1), "drafts": drafts}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    base = shlex.split(args.engine_flags) + ["--decode-log-interval", "8"]
    spec = base + ["--speculative-algorithm", "ngram", *shlex.split(args.spec_flags)]
    cells = [(w, int(c)) for w in args.workloads.split(",") for c in args.concurrency.split(",")]
    results: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    peer = None
    if args.peer_llama_cpp:
        peer = llama_cpp.make_peer(args.peer_llama_cpp, cpu_kind.requested_kind(), args.model)
        if peer.warning:
            print(peer.warning, file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="rivulet-spec-") as tmp, contextlib.ExitStack() as stack:
        servers = {}
        for name, flags in (("plain", base), ("ngram", spec)):
            if peer is None:
                servers[name] = stack.enter_context(
                    launch.rivulet_server(name, flags, Path(tmp, name), args.model)
                )
            else:
                port = launch.free_port()
                flags = [*flags, "--http-port", str(port)]
                server = stack.enter_context(launch.rivulet_server(name, flags, Path(tmp, name), args.model))
                server.address = f"http://127.0.0.1:{port}"
                servers[name] = server
        if peer is not None:
            for name, extra in (("llama.cpp", []), ("llama.cpp ngram", shlex.split(args.peer_spec_flags))):
                port = launch.free_port()
                url, work = f"http://127.0.0.1:{port}", Path(tmp, name.replace(" ", "-"))
                servers[name] = stack.enter_context(
                    launch.openai_server(name, peer.command(port) + extra, url, work)
                )
        names = list(servers)
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]
            for workload, streams in cells:
                for name in order:
                    res = run(args, servers[name], workload, streams)
                    results.setdefault((workload, streams, name), []).append(res)
                    print(f"round {r} {workload} x{streams} {name}: {res['tok_s']:.1f} tok/s, "
                          f"{res['cpu_ms']:.1f} CPU ms/token", flush=True)  # fmt: skip
    info = machine_info()
    print(f"\n# {info.get('cpu', '')}: {info.get('cpu_features', '')}; {info.get('cores')} cores")
    print(f"# engine flags: {' '.join(base)}; speculative: {' '.join(spec)}")
    print("| workload | streams | plain tok/s | ngram tok/s | ngram / plain | plain CPU ms/token | ngram CPU "
          "ms/token | plain / ngram CPU | accepted | tokens (plain, ngram) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for workload, streams in cells:
        a, b = results[(workload, streams, "plain")], results[(workload, streams, "ngram")]
        rate = ratio([y["tok_s"] / x["tok_s"] for x, y in zip(a, b, strict=True)])
        cpu = ratio([x["cpu_ms"] / y["cpu_ms"] for x, y in zip(a, b, strict=True)])
        made, kept = (sum(r["drafts"][k] for r in b) for k in (0, 1))
        accepted = f"{100 * kept / made:.0f}% of {made}" if made else "-"
        cells_out = [workload, str(streams), cell(a, "tok_s"), cell(b, "tok_s"), rate, cell(a, "cpu_ms"),
                     cell(b, "cpu_ms"), cpu, accepted, f"{a[0]['tokens']}, {b[0]['tokens']}"]  # fmt: skip
        print("| " + " | ".join(cells_out) + " |")
    if peer is not None:
        print(f"\n# llama.cpp: {peer.shown()}; ngram: {args.peer_spec_flags}; every engine over HTTP")
        head = ["workload", "streams", "llama.cpp tok/s", "llama.cpp ngram tok/s", "its ngram / plain",
                "its accepted", "rivulet ngram / its ngram", "rivulet plain / its plain"]  # fmt: skip
        print("| " + " | ".join(head) + " |")
        print("|---|---|---|---|---|---|---|---|")
        for workload, streams in cells:
            mine, plain = results[(workload, streams, "ngram")], results[(workload, streams, "plain")]
            a, b = results[(workload, streams, "llama.cpp")], results[(workload, streams, "llama.cpp ngram")]
            made, kept = (sum(r["drafts"][k] for r in b) for k in (0, 1))
            accepted = f"{100 * kept / made:.0f}% of {made}" if made else "-"
            cells_out = [workload, str(streams), cell(a, "tok_s"), cell(b, "tok_s"),
                         ratio([y["tok_s"] / x["tok_s"] for x, y in zip(a, b, strict=True)]), accepted,
                         ratio([x["tok_s"] / y["tok_s"] for x, y in zip(mine, b, strict=True)]),
                         ratio([x["tok_s"] / y["tok_s"] for x, y in zip(plain, a, strict=True)])]  # fmt: skip
            print("| " + " | ".join(cells_out) + " |")
    return 0


def cell(runs: list[dict[str, Any]], key: str) -> str:
    values = [r[key] for r in runs]
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def ratio(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


if __name__ == "__main__":
    sys.exit(main())
