"""Offline throughput: N prompts submitted at once, input and output tokens/s end to end.

    python -m bench.offline --num-prompts 64 --input-len 32 --output-len 32 --baseline hf

Without --endpoint it starts its own engine (bench/lib/launch.py; always torn down) with
``--dtype`` (auto: the worker's own CPU default) and --engine-flags. ``--baseline hf`` runs
HF transformers ``generate`` on the CPU on the same model, prompts, dtype and max tokens in
this process (static batches; the best of a few batch sizes), interleaved with rivulet over
``--repeats`` rounds, and prints the ratio rivulet/HF.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shlex
import statistics
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.lib import launch
from bench.lib.backends import ZmqBackend
from bench.lib.hf_baseline import DTYPES, HFGenerate
from bench.lib.metrics import summarize
from bench.lib.serving import run_requests, warm_up
from bench.lib.workloads import WordPool, WorkItem, random_workload

DEFAULT_RESULTS = Path(__file__).resolve().parents[1] / "results" / "offline.jsonl"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="rivulet offline throughput, optionally against HF generate")
    add = p.add_argument
    add("--model", default=None, help="model dir or GGUF (default: the embedded SmolLM2)")
    add("--endpoint", default=None, help="a running engine; default: start one")
    add("--engine-flags", default="", help="extra launcher flags for the engine this starts")
    add("--dtype", choices=("auto", *DTYPES), default="auto", help="for both; auto: the engine's CPU default")
    add("--hf-dtype", choices=("same", *DTYPES), default="same", help="HF generate's dtype; same: --dtype's")
    add("--num-prompts", type=int, default=64)
    add("--input-len", type=int, default=32)
    add("--output-len", type=int, default=32)
    add("--seed", type=int, default=0)
    add("--baseline", choices=("none", "hf"), default="none")
    add("--hf-batch-sizes", default="8,16,32,64", help="static batch sizes tried; the fastest is kept")
    add("--hf-threads", type=int, default=0, help="torch threads for HF; 0: torch's default")
    add("--repeats", type=int, default=1, help="rounds, rivulet and HF interleaved")
    add("--result-file", type=Path, default=DEFAULT_RESULTS)
    add("--no-record", action="store_true")
    return p


@dataclass
class OfflineResult:
    """Medians over the repeats; ``runs`` keeps every round's numbers."""

    config: dict[str, Any]
    rivulet_output_tps: float = 0.0
    rivulet_input_tps: float = 0.0
    hf_output_tps: float | None = None
    hf_batch_size: int | None = None
    hf_batch_rates: dict[int, float] = field(default_factory=dict)
    runs: list[dict[str, float]] = field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        return self.rivulet_output_tps / self.hf_output_tps if self.hf_output_tps else None


def resolve_dtype(name: str, model: str | None = None) -> str:
    """``auto`` -> what the engine's worker picks on this CPU for ``model`` (None: the embedded GGUF):
    float32 for a GGUF's blocks, else bfloat16 where the CPU kind streams bf16 weights."""
    if name != "auto":
        return name

    from gpu_worker.backends.cpu.backend import auto_dtype
    from gpu_worker.weights.model_files import source_gguf

    return auto_dtype(gguf_blocks=source_gguf(model) is not None)


def _source_gguf(model: str | None) -> Path | None:
    from gpu_worker.weights.model_files import source_gguf

    return source_gguf(model)


def _model_dir(model: str | None) -> Path:
    from gpu_worker.weights.model_files import resolve_model

    return resolve_model(model)


@contextlib.contextmanager
def _engine(args: argparse.Namespace) -> Iterator[str]:
    if args.endpoint:
        yield args.endpoint
        return
    flags = ["--dtype", args.dtype, *shlex.split(args.engine_flags)]
    with tempfile.TemporaryDirectory(prefix="rivulet-offline-") as tmp:
        with launch.rivulet_server("offline", flags, Path(tmp), args.model) as server:
            yield server.address


async def _rivulet_round(endpoint: str, items: list[WorkItem], warmup: bool) -> tuple[float, float]:
    """(input tok/s, output tok/s) of all ``items`` submitted at once, non-streaming."""
    backend = ZmqBackend(endpoint, temperature=0.0, stream=False)
    try:
        if warmup:
            await warm_up(backend, 1)
        results = await run_requests(backend, items, [0.0] * len(items), 0, progress=False)
    finally:
        await backend.close()
    s = summarize(results)
    assert s.num_failed == 0, f"{s.num_failed} offline requests failed: {results[0].error}"
    return s.prompt_tokens / s.duration_s, s.output_throughput


def run_offline(args: argparse.Namespace) -> OfflineResult:
    """Rivulet (and HF) over ``args.repeats`` interleaved rounds; medians in the result."""
    model_dir = _model_dir(args.model)
    args.dtype = resolve_dtype(args.dtype, args.model)
    items = random_workload(
        WordPool(model_dir / "tokenizer.json"),
        args.num_prompts,
        args.input_len,
        args.output_len,
        1.0,
        args.seed,
    )
    prompts = [list(it.input_ids or []) for it in items]
    config = {k: v for k, v in vars(args).items() if k not in ("result_file", "no_record")}
    result = OfflineResult(config=config)
    hf_dtype = args.dtype if args.hf_dtype == "same" else args.hf_dtype
    hf = (
        HFGenerate(model_dir, hf_dtype, args.hf_threads, _source_gguf(args.model))
        if args.baseline == "hf"
        else None
    )
    if hf is not None:
        sizes = [int(x) for x in args.hf_batch_sizes.split(",")]
        result.hf_batch_rates = hf.best_batch_size(prompts, args.output_len, sizes)
        result.hf_batch_size = max(result.hf_batch_rates, key=lambda bs: result.hf_batch_rates[bs])
    with _engine(args) as endpoint:
        for r in range(args.repeats):
            in_tps, out_tps = asyncio.run(_rivulet_round(endpoint, items, warmup=r == 0))
            run = {"rivulet_input_tps": in_tps, "rivulet_output_tps": out_tps}
            if hf is not None and result.hf_batch_size is not None:
                seconds, tokens = hf.run(prompts, args.output_len, result.hf_batch_size)
                run["hf_output_tps"] = tokens / seconds
            result.runs.append(run)
            print(
                f"round {r + 1}/{args.repeats}: " + ", ".join(f"{k} {v:.1f}" for k, v in run.items()),
                flush=True,
            )
    result.rivulet_input_tps = statistics.median(r["rivulet_input_tps"] for r in result.runs)
    result.rivulet_output_tps = statistics.median(r["rivulet_output_tps"] for r in result.runs)
    if hf is not None:
        result.hf_output_tps = statistics.median(r["hf_output_tps"] for r in result.runs)
    return result


def format_result(res: OfflineResult) -> str:
    c = res.config
    lines = [
        "=== offline throughput ===",
        f"Prompts: {c['num_prompts']} x {c['input_len']} tokens in, {c['output_len']} out, {c['dtype']}",
        f"rivulet: {res.rivulet_output_tps:.1f} output tok/s, {res.rivulet_input_tps:.1f} input tok/s "
        f"(median of {len(res.runs)})",
    ]
    if res.hf_output_tps is not None:
        rates = ", ".join(f"bs {bs}: {tps:.1f}" for bs, tps in sorted(res.hf_batch_rates.items()))
        lines += [
            f"HF generate: {res.hf_output_tps:.1f} output tok/s at batch {res.hf_batch_size} (tried {rates})",
            f"ratio rivulet/HF: {res.ratio:.2f}x",
        ]
    return "\n".join(lines)
