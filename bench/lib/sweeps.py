"""The built-in sweeps, as data: which engines, which workload, what the reference runs measured.

A ``Variant`` is one row of a table: an engine configuration and the serving.py flags
of its workload. Variants that name the same ``EngineSpec`` share one running engine.
Workloads are scaled so one run takes ~20-40 s with SmolLM2-135M on a 2-core CPU;
``quick()`` shrinks them to a smoke test.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

CONCURRENCY_LEVELS = (1, 4, 16, 32, 64)
QUICK_LEVELS = (1, 4)


@dataclass(frozen=True)
class EngineSpec:
    """How to start one engine: rivulet's launcher with ``flags``, or an OpenAI server ``command``.

    In ``command``, ``{port}`` is replaced by a free port; the server is then reached at
    http://127.0.0.1:{port}.
    """

    label: str
    flags: tuple[str, ...] = ()
    command: tuple[str, ...] = ()  # set for an OpenAI-compatible peer

    @property
    def is_peer(self) -> bool:
        return bool(self.command)


@dataclass(frozen=True)
class Variant:
    """One row of a table: an engine and the serving.py flags of the workload run against it."""

    label: str
    engine: EngineSpec
    workload: tuple[str, ...]
    concurrency: int = 0  # the x value of a concurrency sweep


@dataclass(frozen=True)
class Sweep:
    """Variants measured together: their engines run side by side, their runs interleave."""

    name: str
    title: str
    expect: str  # what a reference run measured (roseinfer, SGLang), so a reader can compare
    variants: tuple[Variant, ...]
    kind: str = "pair"  # "pair": CDF plot per variant; "concurrency": curves vs concurrency


HOL = ("--prompt", "Hello", "--prompt-repeats", "512,1,1,1", "--unique-prompts", "--no-stop-on-eos")
BUDGET = ("--max-prefill-tokens", "256")
DEFAULT = EngineSpec("default")
RIVULET_ZMQ = EngineSpec("rivulet (ZMQ)")  # the same default engine, named for the peer plots


def _pair(
    name: str, title: str, expect: str, workload: tuple[str, ...], a: EngineSpec, b: EngineSpec
) -> Sweep:
    return Sweep(name, title, expect, (Variant(a.label, a, workload), Variant(b.label, b, workload)))


def scheduling_pairs() -> list[Sweep]:
    """The scheduling before/after pairs: pack, decode-first, max running, chunking, prefix cache."""
    fcfs = EngineSpec("fcfs, budget 256", BUDGET)
    return [
        _pair(
            "pack", "FIFO vs pack admission",
            "roseinfer on GPT-2/CUDA, TTFT p99 1144 -> 690 ms with pack",
            (*HOL, "--num-requests", "16", "--max-new-tokens", "16"),
            fcfs, EngineSpec("pack, budget 256", (*BUDGET, "--schedule-policy", "pack")),
        ),
        _pair(
            "decode-first", "prefill-first vs decode-first",
            "roseinfer, ITL p99 164 -> 140 ms, TTFT p99 211 -> 222 ms with decode-first",
            ("--prompt", "Hello", "--prompt-repeats", "1,1,1,64", "--unique-prompts", "--no-stop-on-eos",
             "--num-requests", "48", "--max-new-tokens", "16", "--submit-interval-ms", "50"),
            DEFAULT, EngineSpec("decode-first", ("--decode-first",)),
        ),
        _pair(
            "max-running", "uncapped vs --max-running-requests 8",
            "roseinfer, ITL p99 218 -> 130 ms, TTFT p99 684 -> 2428 ms with a cap of 64 (128 requests)",
            (*HOL, "--num-requests", "16", "--max-new-tokens", "16"),
            fcfs, EngineSpec("max running 8, budget 256", (*BUDGET, "--max-running-requests", "8")),
        ),
        _pair(
            "chunked-prefill", "chunked prefill 256 vs off",
            "SGLang, chunking bounds the decode stall a long prompt causes (ITL tail)",
            (*HOL, "--num-requests", "16", "--max-new-tokens", "24", "--submit-interval-ms", "150"),
            EngineSpec("chunk 256", ("--chunked-prefill-size", "256")),
            EngineSpec("no chunking", ("--chunked-prefill-size", "-1")),
        ),
        _pair(
            "prefix-cache", "prefix cache on vs off (shared prefixes)",
            "roseinfer, hits skip prefill; TTFT drops with the share of cached prompt tokens",
            ("--workload", "shared-prefix", "--groups", "4", "--questions", "4", "--system-len", "160",
             "--question-len", "16", "--max-new-tokens", "16", "--max-concurrency", "4"),
            DEFAULT, EngineSpec("cache off", ("--disable-radix-cache",)),
        ),
    ]  # fmt: skip


def concurrency_workload(level: int) -> tuple[str, ...]:
    """Random 16-token prompts, 16 new tokens, closed loop at ``level`` streams (1.5x level requests)."""
    requests = max(4, 2 * level) if level < 16 else 3 * level // 2
    return ("--workload", "random", "--input-len", "16", "--output-len", "16",
            "--num-requests", str(requests), "--max-concurrency", str(level))  # fmt: skip


def concurrency_sweep(engines: list[EngineSpec], levels: tuple[int, ...] = CONCURRENCY_LEVELS) -> Sweep:
    variants = tuple(
        Variant(f"{e.label} @ {c}", e, concurrency_workload(c), concurrency=c)
        for c in levels
        for e in engines
    )
    return Sweep(
        "concurrency", "throughput and TTFT vs concurrency",
        "HF fp32 generate on a 2-vCPU AMD Zen 5 (reference numbers, not measured here), "
        "16-20 / 92 / 195 tok/s at batch 1 / 8 / 32",
        variants, kind="concurrency",
    )  # fmt: skip


def _shrink(workload: tuple[str, ...]) -> tuple[str, ...]:
    """Quick mode: at most 8 requests of at most 8 new tokens, long prompts at 64 repeats."""
    caps = {"--num-requests": 8, "--max-new-tokens": 8, "--output-len": 8, "--questions": 2, "--groups": 2}
    out = list(workload)
    for i, flag in enumerate(out[:-1]):
        if flag in caps:
            out[i + 1] = str(min(int(out[i + 1]), caps[flag]))
        elif flag == "--prompt-repeats":
            out[i + 1] = ",".join(str(min(int(r), 64)) for r in out[i + 1].split(","))
        elif flag == "--system-len":
            out[i + 1] = "64"
    return tuple(out)


def quick(sweep: Sweep) -> Sweep:
    variants = tuple(
        dataclasses.replace(v, workload=_shrink(v.workload))
        for v in sweep.variants
        if sweep.kind != "concurrency" or v.concurrency in QUICK_LEVELS
    )
    return dataclasses.replace(sweep, variants=variants)


def default_sweeps(peers: list[EngineSpec]) -> list[Sweep]:
    return [*scheduling_pairs(), concurrency_sweep([RIVULET_ZMQ, *peers])]
