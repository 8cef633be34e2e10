"""bench/targets.py's targets (goal and the reference anchors per row) and the markdown table of a run."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bench.lib.probes import BUSY_CLOCK, BUSY_COUNTER
from bench.lib.report import cell

if TYPE_CHECKING:
    from bench.lib.llama_cpp import Peer

ANCHOR_HEADERS = ("HF generate fp32", "HF generate bf16", "llama.cpp Q4_1 -np 32", "roofline bf16")


@dataclass(frozen=True)
class Target:
    """One row: what is measured (``key`` in a round's dict), the goal, and the reference anchors."""

    key: str
    label: str
    goal: str
    met: Callable[[float], bool] | None
    anchors: tuple[str, str, str, str] = ("-", "-", "-", "-")  # ANCHOR_HEADERS' order


TARGETS = (
    Target("out32_tps", "32 streams: output tok/s", ">= 900", lambda x: x >= 900,
           ("195", "397-434", "199-204", "2630")),
    Target("ttft32_ms", "32 streams: TTFT p50 ms", "< 1000", lambda x: x < 1000, ("-", "-", "2800", "-")),
    Target("decode1_tps", "1 stream: decode tok/s (1 / TPOT p50)", ">= 100", lambda x: x >= 100,
           ("16-20", "31-34", "97-126", "152")),
    Target("out1_tps", "1 stream: output tok/s", "-", None),
    Target("offline_ratio", "offline: rivulet / HF generate (--hf-dtype)", ">= 2", lambda x: x >= 2),
    Target("offline_tps", "offline: rivulet output tok/s", "-", None),
    Target("offline_hf_tps", "offline: HF generate output tok/s (measured here)", "-", None),
    Target("busy_pct", "worker busy % of wall, steady decode at 32 streams", ">= 95", lambda x: x >= 95),
    Target("idle_cpu_pct", "idle CPU %, launcher + children (100 = one core)", "< 1", lambda x: x < 1),
    Target("startup_s", "start-up to Ready s, warm weight cache", "< 10", lambda x: x < 10),
)  # fmt: skip
# With --peer-llama-cpp: both engines over HTTP, same prompts; a ratio is rivulet / llama.cpp per round.
PEER_TARGETS = (
    Target("http_out32_tps", "32 streams over HTTP: rivulet output tok/s", "-", None),
    Target("llama_out32_tps", "32 streams over HTTP: llama.cpp output tok/s", "-", None,
           ("-", "-", "199-204", "-")),
    Target("out32_ratio", "32 streams: rivulet / llama.cpp output tok/s (HTTP both)", "-", None),
    Target("http_decode1_tps", "1 stream over HTTP: rivulet decode tok/s", "-", None),
    Target("llama_decode1_tps", "1 stream over HTTP: llama.cpp decode tok/s", "-", None,
           ("-", "-", "97-126", "-")),
    Target("decode1_ratio", "1 stream: rivulet / llama.cpp decode tok/s (HTTP both)", "-", None),
    Target("http_decode1_floor_x",
           "1 stream over HTTP: rivulet ms a token / floor (weight bytes / read GB/s)", "<= 1.1",
           lambda x: x <= 1.1),
    Target("llama_decode1_floor_x", "1 stream over HTTP: llama.cpp ms a token / floor", "-", None),
    Target("http_read_gbps", "memory read GB/s before rivulet's 1 stream (torch sum, 256 MB)", "-", None),
    Target("paired_decode1_tps", "1 stream, paired requests: rivulet decode tok/s", "-", None),
    Target("llama_paired_decode1_tps", "1 stream, paired requests: llama.cpp decode tok/s", "-", None),
    Target("paired_decode1_ratio", "1 stream, paired requests: rivulet / llama.cpp (median of pairs)", "-",
           None),
    Target("paired_decode1_floor_x",
           "1 stream, paired requests: rivulet ms a token / floor (the read pace probed around each request)",
           "<= 1.1", lambda x: x <= 1.1),
    Target("llama_paired_decode1_floor_x", "1 stream, paired requests: llama.cpp ms a token / floor", "-",
           None),
)  # fmt: skip
RATIOS = {  # ratio key -> (rivulet's key, llama.cpp's key in its round)
    "out32_ratio": ("http_out32_tps", "out32_tps"),
    "decode1_ratio": ("http_decode1_tps", "decode1_tps"),
}
PEER_COPIED = ("decode1_floor_x",)  # llama.cpp's own numbers of its round, shown as llama_<key>


def summarize_runs(
    runs: list[dict[str, Any]], targets: Sequence[Target] = TARGETS
) -> dict[str, dict[str, Any]]:
    """Per target: every round's value (None: not measured) and the median/min/max of the measured ones."""
    out = {}
    for t in targets:
        xs = [float(v) for run in runs if (v := run.get(t.key)) is not None]
        stats = {"median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else {}
        out[t.key] = {"runs": [run.get(t.key) for run in runs], **stats}
    return out


def _verdict(t: Target, s: dict[str, Any]) -> str:
    if t.met is None:
        return "-"
    if "median" not in s:
        return "n/a"
    return "yes" if t.met(s["median"]) else "no"


def _ratio_cell(xs: list[float]) -> str:
    """A ratio with two decimals: median (min-max) of the rounds."""
    if len(xs) == 1:
        return f"{xs[0]:.2f}"
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def format_table(
    by_dtype: dict[str, dict[str, dict[str, Any]]],
    machine: dict[str, Any],
    repeats: int,
    cpu_line: str,
    peer: Peer | None = None,
) -> str:
    """The markdown table, with the CPU line and notes above it; a target's row when it was summarized."""
    dtypes = list(by_dtype)
    head = ["target", "goal", *(f"rivulet {d}" for d in dtypes), *(f"met ({d})" for d in dtypes)]
    head += [f"{a} (reference, AMD Zen 5)" for a in ANCHOR_HEADERS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in (t for t in (*TARGETS, *PEER_TARGETS) if t.key in by_dtype[dtypes[0]]):
        values = [by_dtype[d][t.key] for d in dtypes]
        show = _ratio_cell if t.key.endswith(("_ratio", "_floor_x")) else cell
        cells = [show([x for x in s["runs"] if x is not None]) if "median" in s else "n/a" for s in values]
        lines.append(
            "| " + " | ".join([t.label, t.goal, *cells, *(_verdict(t, s) for s in values), *t.anchors]) + " |"
        )
    notes = [
        f"CPU: {cpu_line}",
        f"Machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}",
        f"Cells: median of {repeats} interleaved round(s) with (min-max); n/a: not measured (the busy share "
        f"needs {BUSY_COUNTER} and {BUSY_CLOCK} on /metrics, and a steady window with 2 reports in it).",
        "Anchor columns: reference numbers on a 2-vCPU AMD Zen 5 (AVX-512 BF16, no AMX), not measured here",
    ]
    if peer is not None:
        notes += [
            'Rows without "over HTTP" measure rivulet through its ZMQ client. The llama.cpp rows and the '
            "ratios measure both engines through POST /v1/completions "
            "(python -m bench.serving --backend openai), same prompts; each round runs rivulet, then "
            "llama.cpp; a ratio cell is the median of the per-round ratios. The paired rows start both "
            "servers together after the round and send one request to each in turn (--paired-requests "
            "each, the first of a pair alternating): a pair meets the machine at one memory pace; that "
            "ratio is the median of a round's pairs.",
            f"llama.cpp: `{peer.shown()}` (the same GGUF; rivulet per --weight-dtype)",
        ]
        notes += [peer.warning] if peer.warning else []
    return "\n".join(["", *notes, "", *lines])
