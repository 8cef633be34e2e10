"""Run one sweep: start every engine it needs, run its variants A B A B ... (``repeats`` rounds)
through bench/lib/serving.py, stop every engine by pid; and merge a later manifest's sweeps into an
earlier one."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shlex
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.lib import launch, report, serving, sweeps
from bench.lib.launch import free_port
from bench.lib.metrics import samples_ms
from bench.lib.records import append_record, make_record


@dataclass
class SweepOptions:
    """How to run any sweep: repeats, the model, flags every rivulet engine gets, where records go."""

    repeats: int = 3
    model: str | None = None
    engine_flags: tuple[str, ...] = ()  # added to every rivulet engine (e.g. --num-threads 1)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="rivulet-sweep-")))
    records: Path | None = None  # JSON Lines file for per-run records
    progress: bool = False


@dataclass
class VariantResult:
    """A variant's status ("ok", "n/a (...)", "failed to start: ...") and its runs' numbers."""

    label: str
    engine_flags: list[str]
    workload: list[str]
    concurrency: int
    status: str = "ok"
    runs: list[dict[str, Any]] = field(default_factory=list)  # Summary dicts, one per repeat
    samples: dict[str, list[float]] = field(default_factory=lambda: {"ttft_ms": [], "itl_ms": []})


@dataclass
class SweepResult:
    """What run_sweep measured, plus every process its engines ran (to check the teardown)."""

    name: str
    title: str
    expect: str
    kind: str
    variants: list[VariantResult]
    pids: dict[int, int] = field(default_factory=dict)  # every process the sweep's engines ran


def _start(stack: contextlib.ExitStack, spec: sweeps.EngineSpec, opts: SweepOptions, n: int) -> launch.Server:
    workdir = opts.workdir / f"engine{n}"
    if spec.is_peer:
        port = free_port()
        cmd = [part.format(port=port) for part in spec.command]
        return stack.enter_context(launch.openai_server(spec.label, cmd, f"http://127.0.0.1:{port}", workdir))
    flags = [*spec.flags, *opts.engine_flags]
    return stack.enter_context(launch.rivulet_server(spec.label, flags, workdir, opts.model))


def _serving_args(
    v: sweeps.Variant, server: launch.Server, opts: SweepOptions, round_: int
) -> argparse.Namespace:
    """serving.py's arguments for one run. Round r runs every variant with --seed r: A and B see
    the same requests, and a prefix cache cannot carry hits over from an earlier round."""
    target = (
        ["--backend", "openai", "--base-url", server.address]
        if v.engine.is_peer
        else ["--endpoint", server.address]
    )
    model = ["--model", opts.model] if opts.model else []
    return serving.build_parser().parse_args(
        [*v.workload, *target, *model, "--label", v.label, "--no-progress", "--seed", str(round_)]
    )


def _one_run(
    v: sweeps.Variant, vr: VariantResult, server: launch.Server, opts: SweepOptions, sweep: str
) -> None:
    args = _serving_args(v, server, opts, len(vr.runs))
    summary, results = asyncio.run(serving.benchmark(args))
    metrics = asdict(summary)
    vr.runs.append(metrics)
    for key, values in samples_ms(results).items():
        vr.samples[key].extend(values)
    if opts.records is not None:
        config = {"sweep": sweep, "variant": v.label, "engine_flags": vr.engine_flags, "repeat": len(vr.runs)}
        append_record(opts.records, make_record("sweep-run", {**config, **serving.run_config(args)}, summary))
    tqdm.write(f"  [{sweep}] {v.label} run {len(vr.runs)}: " + report.one_line(metrics))


def run_sweep(sweep: sweeps.Sweep, opts: SweepOptions) -> SweepResult:
    """Start the sweep's engines, run every variant ``opts.repeats`` times interleaved, stop them."""
    result = SweepResult(sweep.name, sweep.title, sweep.expect, sweep.kind, [])
    by_label = {}
    for v in sweep.variants:
        flags = [*v.engine.flags] if not v.engine.is_peer else [shlex.join(v.engine.command)]
        by_label[v.label] = VariantResult(v.label, flags, list(v.workload), v.concurrency)
        result.variants.append(by_label[v.label])
    engines = list(dict.fromkeys(v.engine for v in sweep.variants))
    servers: dict[sweeps.EngineSpec, launch.Server] = {}
    with contextlib.ExitStack() as stack:
        for n, spec in enumerate(engines):
            try:
                servers[spec] = _start(stack, spec, opts, n)
            except launch.FlagNotAvailable as exc:
                _mark(result, spec, sweep, f"n/a (flag not available: {exc})")
            except (RuntimeError, TimeoutError) as exc:
                _mark(result, spec, sweep, f"failed to start: {str(exc).splitlines()[0]}")
        runnable = [v for v in sweep.variants if v.engine in servers]
        bar = tqdm(total=len(runnable) * opts.repeats, desc=sweep.name, disable=not opts.progress, unit="run")
        for _ in range(opts.repeats):
            for v in runnable:
                _one_run(v, by_label[v.label], servers[v.engine], opts, sweep.name)
                bar.update(1)
        bar.close()
    for server in servers.values():
        result.pids |= server.pids
    return result


def _mark(result: SweepResult, spec: sweeps.EngineSpec, sweep: sweeps.Sweep, status: str) -> None:
    for v, vr in zip(sweep.variants, result.variants, strict=True):
        if v.engine == spec:
            vr.status = status
    tqdm.write(f"  [{sweep.name}] {spec.label}: {status}")


def merge(base: dict[str, Any], later: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``later``'s sweeps put in place of the ones of the same name, each saying when it ran."""
    merged = {**base, "sweeps": list(base["sweeps"])}
    for sweep in later["sweeps"]:
        note = f"measured in a later run ({later['time']}, commit `{later['git_commit']}`)"
        note += f": `{later['command']}`"
        names = [s["name"] for s in merged["sweeps"]]
        entry = {**sweep, "note": note}
        if sweep["name"] in names:
            merged["sweeps"][names.index(sweep["name"])] = entry
        else:
            merged["sweeps"].append(entry)
    return merged
