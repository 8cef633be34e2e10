"""Where the wall clock of a 32-stream run goes, step by step (the engine's own step trace).

    python -m bench.step_timeline --model ~/.cache/rivulet/bench-models/qwen35_4b-q4_k_m-shape-v1.gguf
    python -m bench.step_timeline --model M --zmq --rounds 3 --steps

One engine (``--engine-flags`` more launcher flags) runs with ``RIVULET_STEP_TRACE``
(protocol/step_trace.py) and gets ``bench.targets``' 32-stream phase ``--rounds`` times (``--streams``
concurrent streamed requests of ``--input-len`` random prompt tokens and ``--output-len`` new tokens,
EOS ignored; POST /v1/completions, or the ZMQ client with ``--zmq``). Per round, from the first
submit to the last finish: the head (until the first step's frame reaches the worker, with when the
scheduler got the first and the last request), the worker's forwards and its time around and
between them, the tail (its last reply to the client's last finish), the steps' rows and tokens
(how the prompts were split into steps), and the worker's thread count and CPU. ``--steps`` lists
every step. Times are one monotonic clock for every process; on a busy machine compare the shares.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.lib import launch, serving
from bench.lib.metrics import RequestResult
from protocol.step_trace import TRACE_DIR_ENV


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="the worker's steps against the wall clock at 32 streams")
    add = p.add_argument
    add("--model", default=None, help="model dir, GGUF, or bench model name (default: the embedded model)")
    add("--zmq", action="store_true", help="the ZMQ client instead of POST /v1/completions")
    add("--rounds", type=int, default=1)
    add("--streams", type=int, default=32, help="concurrent streams (and requests of a round)")
    add("--input-len", type=int, default=32)
    add("--output-len", type=int, default=64, help="new tokens per request (EOS ignored)")
    add("--engine-flags", default="", help="more launcher flags")
    add("--steps", action="store_true", help="list every step of each round")
    add("--trace-dir", type=Path, default=None, help="keep the trace files here (default: a temp dir)")
    return p


def _serving_args(args: argparse.Namespace, address: str, seed: int) -> argparse.Namespace:
    model = ["--model", args.model] if args.model else []
    target = ["--endpoint", address] if args.zmq else ["--backend", "openai", "--base-url", address]
    argv = [*target, *model, "--workload", "random", "--num-requests", str(args.streams),
            "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--max-concurrency", str(args.streams), "--warmup-requests", "2", "--seed", str(seed),
            "--no-progress", "--no-record"]  # fmt: skip
    return serving.build_parser().parse_args(argv)


def read_trace(trace_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """Every event of the trace files, by event name, in file order."""
    events: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(trace_dir.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                event = json.loads(line)
                events.setdefault(event["event"], []).append(event)
    return events


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f}"


def _split(steps: list[dict[str, Any]]) -> str:
    """How the steps' rows ran: runs of equal (rows, tokens), e.g. '1x(16r,512t) 62x(32r,32t)'."""
    runs: list[list[Any]] = []
    for s in steps:
        shape = (s["rows"], s["tokens"])
        if runs and runs[-1][1] == shape:
            runs[-1][0] += 1
        else:
            runs.append([1, shape])
    return " ".join(f"{n}x({r}r,{t}t)" for n, (r, t) in runs)


def analyse(events: dict[str, list[dict[str, Any]]], results: list[RequestResult]) -> dict[str, Any]:
    """One round's wall-clock split (seconds) between its first submit and its last finish."""
    start = min(r.submit_s for r in results)
    end = max(r.finish_s for r in results if r.finish_s is not None)
    steps = [s for s in events.get("step", []) if start <= s["recv"] <= end]
    adds = [a["t"] for a in events.get("add", []) if start <= a["t"] <= end]
    assert steps and adds, "no step or request of this round in the trace (was RIVULET_STEP_TRACE set?)"
    pairs = list(zip(steps, steps[1:], strict=False))
    gaps = [b["recv"] - a["reply"] for a, b in pairs]
    wall = sum(s["reply"] - s["recv"] for s in steps)
    first_tokens = sorted(r.token_times_s[0] for r in results if r.token_times_s)
    return {
        "wall": end - start,
        "first_add": min(adds) - start,
        "last_add": max(adds) - start,
        "head": steps[0]["recv"] - start,
        "forward": sum(s["forward_s"] for s in steps),
        "around": wall - sum(s["forward_s"] for s in steps),
        "idle": sum(gaps),
        "reply_send": sum(s["sent"] - s["reply"] for s in steps),
        "max_gap": max(gaps, default=0.0),
        "tail": end - steps[-1]["reply"],
        "last_first_token": first_tokens[-1] - start,
        "steps": len(steps),
        "split": _split(steps),
        "reduced": sum(1 for s in steps if s["threads"] < max(t["threads"] for t in steps)),
        "waited_in_steps": sum(s["delay_s"] for s in steps),
        "waited_between": sum(b["delay_before_s"] - a["delay_before_s"] - a["delay_s"] for a, b in pairs),
        "thread_cpu": sum(s["cpu_s"] for s in steps) / wall,
        "proc_cpu": sum(s["proc_cpu_s"] for s in steps) / wall,
        "tokens": sum(r.output_tokens for r in results),
        "rows": steps,
        "start": start,
    }


def report(run: dict[str, Any], list_steps: bool) -> str:
    lines = [
        f"wall {_ms(run['wall'])} ms ({run['tokens'] / run['wall']:.1f} tok/s), {run['steps']} steps: "
        f"head {_ms(run['head'])} (requests reached the scheduler {_ms(run['first_add'])}-"
        f"{_ms(run['last_add'])}), forwards {_ms(run['forward'])}, around them {_ms(run['around'])}, "
        f"between steps {_ms(run['idle'])} (longest {_ms(run['max_gap'])}; sending the replies "
        f"{_ms(run['reply_send'])}), tail {_ms(run['tail'])}; "
        f"last first token at {_ms(run['last_first_token'])}",
        f"  steps: {run['split']}",
        f"  worker: main thread CPU {100 * run['thread_cpu']:.1f}% of its steps' wall, process "
        f"{100 * run['proc_cpu']:.1f}%; steps on fewer threads: {run['reduced']}; main thread waited "
        f"for a core {_ms(run['waited_in_steps'])} in steps (to its reply sent), "
        f"{_ms(run['waited_between'])} between them",
    ]
    if list_steps:
        for s in run["rows"]:
            lines.append(
                f"  step {s['step']}: recv +{_ms(s['recv'] - run['start'])} forward {_ms(s['forward_s'])} "
                f"around {_ms(s['reply'] - s['recv'] - s['forward_s'])} rows {s['rows']} tokens "
                f"{s['tokens']} threads {s['threads']} cpu {_ms(s['cpu_s'])}/{_ms(s['proc_cpu_s'])} "
                f"waited {_ms(s['delay_s'])}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from bench.lib import gguf_models

    args.model = gguf_models.resolve(args.model)
    runs = []
    with tempfile.TemporaryDirectory(prefix="rivulet-step-timeline-") as tmp:
        trace_dir = args.trace_dir or Path(tmp) / "trace"
        port = launch.free_port()
        flags = [*args.engine_flags.split(), "--http-port", str(port)]
        env = {TRACE_DIR_ENV: str(trace_dir)}
        with launch.rivulet_server("engine", flags, Path(tmp) / "engine", args.model, env=env) as server:
            address = server.address if args.zmq else f"http://127.0.0.1:{port}"
            for r in range(args.rounds):
                summary, results = asyncio.run(serving.benchmark(_serving_args(args, address, 5000 + r)))
                assert summary.num_failed == 0, f"{summary.num_failed} requests failed"
                runs.append(analyse(read_trace(trace_dir), results))
                print(f"round {r + 1}: " + report(runs[-1], args.steps), flush=True)
    if len(runs) > 1:
        keys = ("wall", "head", "forward", "around", "idle", "tail")
        print("medians, ms: " + ", ".join(f"{k} {_ms(statistics.median(r[k] for r in runs))}" for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
