"""PNG plots of a sweep manifest: CDFs of TTFT and ITL per configuration, curves vs concurrency."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from bench.lib.report import values


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on a server
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax: Any, samples: list[float], label: str) -> None:
    xs = sorted(samples)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=f"{label} (n={len(xs)})")


def plot_cdfs(sweep: dict[str, Any], path: Path) -> bool:
    """TTFT and ITL CDFs side by side, one line per measured configuration; False if nothing to plot."""
    measured = [v for v in sweep["variants"] if v["status"] == "ok" and v["samples"]["ttft_ms"]]
    if not measured:
        return False
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, name in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "itl_ms", "ITL")):
        for v in measured:
            if v["samples"][key]:
                _cdf(ax, v["samples"][key], v["label"])
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.set_title(f"{name} CDF")
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
        if max(max(v["samples"][key] or [1.0]) for v in measured) > 20 * statistics.median(
            [statistics.median(v["samples"][key]) for v in measured if v["samples"][key]] or [1.0]
        ):
            ax.set_xscale("log")  # long tails: a log axis keeps the body readable
    fig.suptitle(f"{sweep['title']}, samples pooled over repeats")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _curve(variants: list[dict[str, Any]], path: str) -> tuple[list[int], list[float], list[list[float]]]:
    xs: list[int] = []
    mids: list[float] = []
    spans: list[list[float]] = [[], []]
    for v in sorted(variants, key=lambda v: v["concurrency"]):
        ys = values(v["runs"], path)
        if not ys:
            continue
        mid = statistics.median(ys)
        xs.append(v["concurrency"])
        mids.append(mid)
        spans[0].append(mid - min(ys))
        spans[1].append(max(ys) - mid)
    return xs, mids, spans


def plot_concurrency(sweep: dict[str, Any], path: Path) -> bool:
    """Output throughput and TTFT p99 against concurrency, one line per engine."""
    engines: dict[str, list[dict[str, Any]]] = {}
    for v in sweep["variants"]:
        if v["status"] == "ok" and v["runs"]:
            engines.setdefault(v["label"].rsplit(" @ ", 1)[0], []).append(v)
    if not engines:
        return False
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    panels = ((axes[0], "output_throughput", "output tokens/s"), (axes[1], "ttft_ms.p99", "TTFT p99 (ms)"))
    for ax, key, ylabel in panels:
        for engine, vs in engines.items():
            xs, mids, spans = _curve(vs, key)
            ax.errorbar(xs, mids, yerr=spans, marker="o", capsize=3, label=engine)
        levels = sorted({v["concurrency"] for vs in engines.values() for v in vs})
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, labels=[str(c) for c in levels])
        ax.set_xlabel("concurrent streams (closed loop)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{ylabel.split(' (')[0]} vs concurrency")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_ylim(bottom=0)
    fig.suptitle(f"{sweep['title']}: median of repeats, bars span min to max")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
