"""The tables of docs/benchmarks.md, from a sweep manifest (a plain dict, see bench/sweep.py).

Each cell is the median over repeats with the spread (min-max) in parentheses. bench/lib/writeup.py
writes the file from these tables and bench/lib/plots.py's PNGs (CDFs of TTFT and ITL per
configuration; throughput and TTFT p99 against concurrency).
"""

from __future__ import annotations

import statistics
from typing import Any

PAIR_COLUMNS = (
    ("TTFT p50 ms", "ttft_ms.p50"), ("TTFT p99 ms", "ttft_ms.p99"), ("ITL p50 ms", "itl_ms.p50"),
    ("ITL p99 ms", "itl_ms.p99"), ("TPOT p99 ms", "tpot_ms.p99"), ("latency p99 ms", "e2e_ms.p99"),
    ("output tok/s", "output_throughput"), ("cached tokens", "cached_tokens"),
)  # fmt: skip
CONCURRENCY_COLUMNS = (
    ("output tok/s", "output_throughput"), ("TTFT p50 ms", "ttft_ms.p50"), ("TTFT p99 ms", "ttft_ms.p99"),
    ("ITL p50 ms", "itl_ms.p50"), ("ITL p99 ms", "itl_ms.p99"), ("TPOT p50 ms", "tpot_ms.p50"),
)  # fmt: skip
DELTA_KEYS = (
    ("TTFT p50", "ttft_ms.p50"), ("TTFT p99", "ttft_ms.p99"), ("ITL p50", "itl_ms.p50"),
    ("ITL p99", "itl_ms.p99"), ("throughput", "output_throughput"),
)  # fmt: skip


def metric(run: dict[str, Any], path: str) -> float | None:
    """``metric(run, "ttft_ms.p99")`` from a Summary dict; None when the run had no sample."""
    value: Any = run
    for key in path.split("."):
        value = value[key]
    return None if value is None else float(value)


def values(runs: list[dict[str, Any]], path: str) -> list[float]:
    return [v for run in runs if (v := metric(run, path)) is not None]


def _num(x: float) -> str:
    return f"{x:.0f}" if abs(x) >= 100 or x == int(x) else f"{x:.1f}"


def cell(xs: list[float]) -> str:
    """Median and (min-max) of the repeats; a single value alone; "-" for none."""
    if not xs:
        return "-"
    if len(xs) == 1:
        return _num(xs[0])
    return f"{_num(statistics.median(xs))} ({_num(min(xs))}-{_num(max(xs))})"


def one_line(m: dict[str, Any]) -> str:
    """A run in one line, for progress output."""
    parts = [f"{name} {_num(v)}" for name, path in PAIR_COLUMNS[:6] if (v := metric(m, path)) is not None]
    return ", ".join([*parts, f"{m['output_throughput']:.1f} tok/s", f"failed {m['num_failed']}"])


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def pair_table(sweep: dict[str, Any]) -> str:
    rows = []
    for v in sweep["variants"]:
        if v["status"] != "ok":
            rows.append([v["label"], *([v["status"]] + ["-"] * (len(PAIR_COLUMNS) - 1))])
            continue
        rows.append([v["label"], *(cell(values(v["runs"], path)) for _, path in PAIR_COLUMNS)])
    return _table(["configuration", *(name for name, _ in PAIR_COLUMNS)], rows)


def deltas(sweep: dict[str, Any]) -> list[str]:
    """ "B vs A: TTFT p99 -39%, ..." for every measured variant against the first measured one."""
    ok = [v for v in sweep["variants"] if v["status"] == "ok" and v["runs"]]
    out = []
    for v in ok[1:]:
        parts = []
        for name, path in DELTA_KEYS:
            a, b = values(ok[0]["runs"], path), values(v["runs"], path)
            if a and b and statistics.median(a):
                parts.append(f"{name} {100 * (statistics.median(b) / statistics.median(a) - 1):+.0f}%")
        out.append(f"{v['label']} vs {ok[0]['label']} (medians): " + ", ".join(parts))
    return out


def concurrency_table(sweep: dict[str, Any]) -> str:
    rows = []
    for v in sweep["variants"]:
        engine = v["label"].rsplit(" @ ", 1)[0]
        if v["status"] != "ok":
            rows.append([engine, str(v["concurrency"]), v["status"], *["-"] * (len(CONCURRENCY_COLUMNS) - 1)])
            continue
        cells = [cell(values(v["runs"], path)) for _, path in CONCURRENCY_COLUMNS]
        rows.append([engine, str(v["concurrency"]), *cells])
    return _table(["engine", "concurrency", *(name for name, _ in CONCURRENCY_COLUMNS)], rows)


def offline_table(off: dict[str, Any]) -> str:
    c = off["config"]
    rows = [["rivulet", cell([r["rivulet_output_tps"] for r in off["runs"]]),
             cell([r["rivulet_input_tps"] for r in off["runs"]]), "continuous batching"]]  # fmt: skip
    if off.get("hf_output_tps") is not None:
        tried = ", ".join(
            f"{bs}: {float(t):.0f}"
            for bs, t in sorted(off["hf_batch_rates"].items(), key=lambda x: int(x[0]))
        )
        rows.append(["HF generate", cell([r["hf_output_tps"] for r in off["runs"]]), "-",
                     f"static batch {off['hf_batch_size']} (tok/s by batch size: {tried})"])  # fmt: skip
    text = _table(["engine", "output tok/s", "input tok/s", "batching"], rows)
    head = f"{c['num_prompts']} prompts x {c['input_len']} tokens, {c['output_len']} new tokens each, "
    head += f"{c['dtype']}, all submitted at once"
    if off.get("hf_output_tps"):
        text += f"\n\n**rivulet / HF generate: {off['rivulet_output_tps'] / off['hf_output_tps']:.2f}x**"
    return head + "\n\n" + text
