"""Before/after sweeps: one engine per configuration, the same workload against each, interleaved.

    python -m bench.sweep                      # the scheduling pairs + concurrency + offline vs HF
    python -m bench.sweep --quick              # a smoke run: tiny workloads, 2 repeats
    python -m bench.sweep --sweeps pack,concurrency --repeats 5
    python -m bench.sweep --report-from bench/results/sweep-latest.json   # redo tables and plots

Each sweep starts every engine it needs (its own launcher on its own endpoint), then runs
its variants A B A B A B (``--repeats`` rounds), then stops them all by pid. A configuration
whose flags the launcher rejects is reported as "n/a (flag not available)". The results go
to a JSON manifest, the per-run records to a JSON Lines file, and docs/benchmarks.md plus
PNG plots are written from the manifest (bench/lib/writeup.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.lib import serving, sweeps, writeup
from bench.lib.records import git_commit, machine_info
from bench.lib.sweep_runner import SweepOptions, merge, run_sweep

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "bench" / "results"
EMBEDDED_MODEL = "SmolLM2-135M-Instruct, the embedded Q4_1 GGUF (computed in its blocks: --weight-dtype auto)"


def build_parser() -> argparse.ArgumentParser:
    names = [s.name for s in sweeps.default_sweeps([])]
    p = argparse.ArgumentParser(description="rivulet sweeps: scheduling pairs, concurrency, offline vs HF")
    add = p.add_argument
    add("--sweeps", default="all", help=f"comma list of {', '.join([*names, 'offline'])}; or all")
    add("--repeats", type=int, default=3, help="rounds per configuration, interleaved")
    add("--quick", action="store_true", help="tiny workloads and 2 repeats: a smoke run")
    add("--model", default=None, help="model dir or GGUF for every rivulet engine (default: embedded)")
    add("--engine-flags", default="", help='launcher flags for every rivulet engine, e.g. "--num-threads 1"')
    add("--peer", action="append", default=[], help="LABEL=COMMAND of an OpenAI server ({port} filled in)")
    add("--out-dir", type=Path, default=REPO / "docs", help="where benchmarks.md and the PNGs go")
    add("--manifest", type=Path, default=RESULTS_DIR / "sweep-latest.json")
    add("--records", type=Path, default=RESULTS_DIR / "sweep.jsonl", help="per-run JSON Lines records")
    add("--report-from", type=Path, default=None, help="only rewrite the docs from this manifest")
    add("--merge-into", type=Path, default=None, help="replace these sweeps in an earlier manifest")
    add("--peer-note", default="", help="a sentence on the peers for the docs (also with --report-from)")
    add("--note", default="other processes may share the CPU; compare rows within one table, not across runs")
    return p


def parse_peer(spec: str) -> sweeps.EngineSpec:
    label, sep, command = spec.partition("=")
    assert sep and label and command, f"--peer wants LABEL=COMMAND, got {spec!r}"
    return sweeps.EngineSpec(label, command=tuple(shlex.split(command)))


def selected(args: argparse.Namespace) -> tuple[list[sweeps.Sweep], bool]:
    """The sweeps to run and whether to run the offline comparison."""
    chosen = sweeps.default_sweeps([parse_peer(p) for p in args.peer])
    names = {s.name for s in chosen} | {"offline"}
    wanted = names if args.sweeps == "all" else set(args.sweeps.split(","))
    assert wanted <= names, f"unknown sweeps {sorted(wanted - names)}; known: {sorted(names)}"
    chosen = [sweeps.quick(s) if args.quick else s for s in chosen if s.name in wanted]
    return chosen, "offline" in wanted


def run_offline_for(args: argparse.Namespace, repeats: int) -> dict[str, Any]:
    from bench.lib import offline

    size = ["--num-prompts", "8", "--output-len", "8", "--hf-batch-sizes", "4,8"] if args.quick else []
    model = ["--model", args.model] if args.model else []
    flags = shlex.split(args.engine_flags)
    # HF gets as many torch threads as the engine's worker, so the two compete on equal terms
    threads = flags[flags.index("--num-threads") + 1] if "--num-threads" in flags[:-1] else "0"
    argv = [*model, "--baseline", "hf", "--repeats", str(repeats), "--engine-flags", args.engine_flags,
            "--hf-threads", threads, "--hf-batch-sizes", "16,32,64", *size]  # fmt: skip
    res = offline.run_offline(offline.build_parser().parse_args(argv))
    print(offline.format_result(res), flush=True)
    return {**asdict(res), "ratio": res.ratio}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.report_from is not None:
        saved = json.loads(args.report_from.read_text())
        saved["peer_note"] = args.peer_note or saved.get("peer_note", "")
        print(writeup.write_docs(saved, args.out_dir))
        return 0
    repeats = 2 if args.quick and args.repeats == 3 else args.repeats
    todo, with_offline = selected(args)
    opts = SweepOptions(repeats, args.model, tuple(shlex.split(args.engine_flags)), records=args.records,
                        progress=serving.show_progress(argparse.Namespace(no_progress=False)))  # fmt: skip
    manifest: dict[str, Any] = {
        "schema": 1, "git_commit": git_commit(), "machine": machine_info(), "repeats": repeats,
        "command": shlex.join(["python", "-m", "bench.sweep", *(argv if argv is not None else sys.argv[1:])]),
        "model": args.model or EMBEDDED_MODEL,
        "engine_flags": list(opts.engine_flags), "quick": args.quick, "note": args.note, "sweeps": [],
        "peers": [parse_peer(p).label for p in args.peer], "peer_note": args.peer_note,
    }  # fmt: skip
    manifest["time"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    if with_offline:
        manifest["offline"] = run_offline_for(args, repeats)
    for sweep in todo:
        print(f"== {sweep.title}", flush=True)
        result = run_sweep(sweep, opts)
        manifest["sweeps"].append({k: v for k, v in asdict(result).items() if k != "pids"})
        args.manifest.parent.mkdir(parents=True, exist_ok=True)
        args.manifest.write_text(json.dumps(manifest, indent=1))  # after each sweep: a crash keeps the rest
    if args.merge_into is not None:
        manifest = merge(json.loads(args.merge_into.read_text()), manifest)
    args.manifest.parent.mkdir(parents=True, exist_ok=True)
    args.manifest.write_text(json.dumps(manifest, indent=1))
    print(f"manifest: {args.manifest}\nreport: {writeup.write_docs(manifest, args.out_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
