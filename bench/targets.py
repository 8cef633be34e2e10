"""The serving targets in one run: every target measured, a markdown table printed.

    flock /tmp/rivulet-cpu.lock python -m bench.targets                  # the engine's default dtype
    flock /tmp/rivulet-cpu.lock python -m bench.targets --dtype float32,bfloat16 --repeats 3
    flock /tmp/rivulet-cpu.lock python -m bench.targets --peer-llama-cpp auto   # and llama.cpp beside it

Round r starts one fresh engine per dtype (``launcher.py --dtype D --http-port P``) and on it
measures, in order: start-up to the Ready line, 32 concurrent streams (with the worker's busy
counters sampled from GET /metrics while they decode), 1 stream, idle CPU of the whole process
tree, and ``python -m bench.offline``'s 256 prompts against HF generate of the same dtype in this process.
Every measurement of round r comes before round r+1; a cell is the median over rounds with
(min-max). Anchor columns are reference numbers from another machine, not measured here.

With ``--peer-llama-cpp PATH|auto`` (bench/llama_cpp.py builds and caches llama-server per CPU
kind) round r also measures rivulet's 32 streams and 1 stream over its HTTP API, then starts
llama.cpp's server on the same GGUF and measures the same two workloads (same prompts) through
the same client code, and the table gains rivulet / llama.cpp ratios of like with like (HTTP
both). The CPU kind rivulet acts as (``RIVULET_CPU_KIND``, applied here before torch loads and
inherited by every engine started) heads the table and is kept in the record.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from bench.lib import launch, llama_cpp, offline
from bench.lib.floor import decode_bytes
from bench.lib.records import append_record, machine_info, make_record
from bench.lib.targets_rounds import measure_paired, measure_peer, measure_round, peer_ratios
from bench.lib.targets_table import PEER_TARGETS, TARGETS, format_table, summarize_runs
from gpu_worker.backends.cpu import kind as cpu_kind

DEFAULT_RESULTS = Path(__file__).resolve().parent / "results" / "targets.jsonl"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="the serving targets, measured in one run")
    add = p.add_argument
    add(
        "--model",
        default=None,
        help="model dir, GGUF, or a bench model's name (bench/gguf_models.py: llama1b-q4_k_m, ...); "
        "default: the embedded SmolLM2-135M",
    )
    add("--dtype", default="auto", help="comma list of auto | float32 | bfloat16; auto: the engine's default")
    add("--repeats", type=int, default=3, help="rounds; every target is measured once per round and dtype")
    add("--engine-flags", default="", help="extra launcher flags for every engine")
    add("--streams", type=int, default=32, help="concurrent streams (the 32-stream targets)")
    add("--stream-requests", type=int, default=64, help="requests of the concurrent run")
    add("--single-requests", type=int, default=4, help="requests of the 1-stream run")
    add("--input-len", type=int, default=32, help="prompt tokens of every request")
    add("--output-len", type=int, default=64, help="new tokens of every request (EOS ignored)")
    add("--offline-prompts", type=int, default=256, help="0: no offline run (nor HF generate)")
    add(
        "--http-only",
        action="store_true",
        help="with --peer-llama-cpp: measure rivulet over HTTP only (no ZMQ streams, so no busy share)",
    )
    add("--hf-batch-sizes", default="32,64", help="HF generate's static batch sizes; the fastest is kept")
    add("--hf-threads", type=int, default=0, help="torch threads for HF; 0: torch's default")
    add("--hf-dtype", default="same", help="HF generate's dtype for the offline ratio; same: the engine's")
    add("--idle-s", type=float, default=10.0, help="how long idle CPU is measured")
    add("--result-file", type=Path, default=DEFAULT_RESULTS, help="JSON Lines file the record is appended to")
    add("--no-record", action="store_true")
    add(
        "--peer-llama-cpp",
        default=None,
        metavar="PATH|auto",
        help="also measure llama.cpp's llama-server (PATH, or auto: the build of the CPU kind rivulet acts "
        "as, from `python -m bench.llama_cpp build`) on the same GGUF, interleaved with rivulet",
    )
    add(
        "--paired-requests",
        type=int,
        default=8,
        help="with --peer-llama-cpp: 1-stream requests to each engine with both servers up, alternating "
        "(0: none)",
    )
    add(
        "--peer-threads",
        type=int,
        default=0,
        help="llama-server -t; 0: every core this process may use (like --num-threads 0)",
    )
    p.set_defaults(decode_bytes=None)  # set by main: the weight bytes a token reads (a GGUF), for the floor
    return p


# --------------------------------------------------------------------------
# the record
# --------------------------------------------------------------------------


def cpu_record(acting: cpu_kind.CpuKind) -> dict[str, Any]:
    """The CPU kind acted as, the native one, and the flags describe() reports, for the JSON record."""
    have = cpu_kind.cpu_flags()
    return {
        "cpu_kind": acting.value,
        "native_cpu_kind": cpu_kind.native_kind().value,
        "cpu_flags": {f: f in have for f in cpu_kind.REPORTED_FLAGS},
        "cpu_line": cpu_kind.describe(acting),
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:  # first, before anything imports torch; the engines started below inherit the environment
        acting = cpu_kind.apply_to_environ()
    except cpu_kind.CpuKindError as exc:
        raise SystemExit(f"error: {exc}") from None
    from bench.lib import gguf_models  # (numpy and gguf: after the kind is applied, to be safe)

    args.model = gguf_models.resolve(args.model)  # a bench model's name (llama1b-q4_k_m): made once
    from gpu_worker.weights.model_files import source_gguf

    gguf = source_gguf(args.model)
    args.decode_bytes = decode_bytes(gguf) if gguf is not None else None  # the one-stream floor's bytes
    peer = None
    if args.peer_llama_cpp:
        parallel = max(llama_cpp.PARALLEL, args.streams)
        peer = llama_cpp.make_peer(args.peer_llama_cpp, acting, args.model, parallel, args.peer_threads)
    if peer is not None and peer.warning:
        print(peer.warning, file=sys.stderr, flush=True)
    command = shlex.join(["python", "-m", "bench.targets", *(argv if argv is not None else sys.argv[1:])])
    dtypes = [offline.resolve_dtype(d.strip(), args.model) for d in args.dtype.split(",") if d.strip()]
    assert dtypes and len(set(dtypes)) == len(dtypes), f"--dtype wants distinct dtypes, got {args.dtype!r}"
    from gpu_worker.weights.model_files import resolve_model

    resolve_model(args.model)  # converts a GGUF once, so every start-up is timed with a warm cache
    launch.rejected_flags([])  # imports launcher here, outside the start-up timing
    runs: dict[str, list[dict[str, Any]]] = {d: [] for d in dtypes}
    peer_runs: list[dict[str, Any]] = []
    for r in range(args.repeats):
        for dtype in dtypes:
            runs[dtype].append(measure_round(args, dtype, r, http=peer is not None))
            print(f"round {r + 1}/{args.repeats} {dtype}: {_shown(runs[dtype][-1])}", flush=True)
        if peer is not None:  # after rivulet's round, before the next: interleaved
            peer_runs.append(measure_peer(args, peer, r))
            print(f"round {r + 1}/{args.repeats} llama.cpp: {_shown(peer_runs[-1])}", flush=True)
            for dtype in dtypes:
                runs[dtype][-1] |= peer_ratios(runs[dtype][-1], peer_runs[-1])
            if args.paired_requests > 0:  # both up, requests alternating: the one-stream ratio at one pace
                runs[dtypes[0]][-1] |= measure_paired(args, peer, dtypes[0], r)
                print(f"round {r + 1}/{args.repeats} paired: {_shown(runs[dtypes[0]][-1])}", flush=True)
    shown_targets = (*TARGETS, *PEER_TARGETS) if peer is not None else TARGETS
    by_dtype = {d: summarize_runs(rs, shown_targets) for d, rs in runs.items()}
    machine = machine_info() | cpu_record(acting)
    table = format_table(by_dtype, machine, args.repeats, machine["cpu_line"], peer)
    print(f"\nCommand: `{command}`" + table, flush=True)
    if not args.no_record:
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        config["command"] = command
        metrics: dict[str, Any] = {"targets": by_dtype, "runs": runs}
        if peer is not None:
            metrics["peer"] = {
                "name": "llama.cpp", "binary": str(peer.binary), "command": peer.shown(),
                "warning": peer.warning, "runs": peer_runs,
            }  # fmt: skip
        append_record(args.result_file, make_record("targets", config, metrics, machine=machine))
    return 0


def _shown(run: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in run.items())


if __name__ == "__main__":
    sys.exit(main())
