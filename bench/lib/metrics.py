"""Latency and throughput metrics from client-side timestamps (pure: no I/O, no clocks).

Definitions follow roseinfer's benchmark_streaming:

- TTFT: first token's arrival - submit time.
- ITL: every gap between consecutive tokens of one request, pooled over requests.
- TPOT: per request, (last token - first token) / (completion tokens - 1).
- E2E latency: the final reply's arrival - submit time.

A token's time is the arrival of the chunk that carried it, so tokens that reach
the client in one chunk share a timestamp and add zero gaps to ITL: what the
client saw, queueing and batching included.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class RequestResult:
    """One request as the client saw it; times are seconds on one monotonic clock."""

    submit_s: float
    token_times_s: list[float] = field(default_factory=list)
    finish_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # the engine's usage count; 0 until the final reply
    cached_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_s is not None

    @property
    def output_tokens(self) -> int:
        """The engine's count when it gave one, else the tokens the client counted."""
        return self.completion_tokens or len(self.token_times_s)

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] - self.submit_s if self.token_times_s else None

    @property
    def e2e_s(self) -> float | None:
        return self.finish_s - self.submit_s if self.finish_s is not None else None

    @property
    def itls_s(self) -> list[float]:
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2 or len(self.token_times_s) < 1:
            return None
        return (self.token_times_s[-1] - self.token_times_s[0]) / (self.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics."""
    assert values, "percentile of an empty sequence"
    assert 0.0 <= q <= 100.0, f"q must be in [0, 100], got {q}"
    ordered = sorted(values)
    rank = q / 100.0 * (len(ordered) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


@dataclass(frozen=True)
class Dist:
    """p50/p95/p99/mean of one metric in milliseconds; None when there were no samples."""

    p50: float | None
    p95: float | None
    p99: float | None
    mean: float | None

    @staticmethod
    def of_seconds(values_s: Sequence[float]) -> Dist:
        if not values_s:
            return Dist(None, None, None, None)
        ms = [v * 1e3 for v in values_s]
        return Dist(percentile(ms, 50), percentile(ms, 95), percentile(ms, 99), sum(ms) / len(ms))


@dataclass(frozen=True)
class Summary:
    """Everything one benchmark run reports; the JSON record's "metrics" is this, as a dict."""

    num_requests: int
    num_failed: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    duration_s: float  # first submit to last finish
    submit_wall_s: float  # first submit to last submit
    request_throughput: float  # completed requests / s
    output_throughput: float  # completion tokens / s
    total_throughput: float  # (prompt + completion) tokens / s
    ttft_ms: Dist
    tpot_ms: Dist
    itl_ms: Dist
    e2e_ms: Dist


def summarize(results: Sequence[RequestResult]) -> Summary:
    """Aggregate per-request results; failed requests are counted but kept out of latencies."""
    assert results, "no results to summarize"
    done = [r for r in results if r.ok]
    start = min(r.submit_s for r in results)
    ends = [r.finish_s for r in results if r.finish_s is not None]
    duration_s = max(ends) - start if ends else 0.0
    prompt = sum(r.prompt_tokens for r in done)
    completion = sum(r.output_tokens for r in done)

    def per_s(n: float) -> float:
        return n / duration_s if duration_s > 0 else 0.0

    return Summary(
        num_requests=len(results),
        num_failed=len(results) - len(done),
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=sum(r.cached_tokens for r in done),
        duration_s=duration_s,
        submit_wall_s=max(r.submit_s for r in results) - start,
        request_throughput=per_s(len(done)),
        output_throughput=per_s(completion),
        total_throughput=per_s(prompt + completion),
        ttft_ms=Dist.of_seconds([t for r in done if (t := r.ttft_s) is not None]),
        tpot_ms=Dist.of_seconds([t for r in done if (t := r.tpot_s) is not None]),
        itl_ms=Dist.of_seconds([gap for r in done for gap in r.itls_s]),
        e2e_ms=Dist.of_seconds([t for r in done if (t := r.e2e_s) is not None]),
    )


def samples_ms(results: Sequence[RequestResult]) -> dict[str, list[float]]:
    """Raw TTFT and ITL samples (ms, rounded to 0.01) of the completed requests, for CDF plots."""
    done = [r for r in results if r.ok]
    return {
        "ttft_ms": [round(t * 1e3, 2) for r in done if (t := r.ttft_s) is not None],
        "itl_ms": [round(g * 1e3, 2) for r in done for g in r.itls_s],
    }


def _fmt(d: Dist) -> str:
    if d.p50 is None or d.p95 is None or d.p99 is None or d.mean is None:
        return "n/a"
    return f"{d.p50:.2f}/{d.p95:.2f}/{d.p99:.2f} (mean {d.mean:.2f})"


def format_block(s: Summary, header: dict[str, str]) -> str:
    """benchmark_streaming's "=== streaming benchmark ===" block, plus mean, request rate and cached
    tokens."""
    lines = ["=== streaming benchmark ==="]
    lines += [f"{k}: {v}" for k, v in header.items()]
    lines += [
        f"Requests: {s.num_requests} (failed {s.num_failed})",
        f"Prompt tokens (total): {s.prompt_tokens}",
        f"Completion tokens (total): {s.completion_tokens}",
        f"Cached prompt tokens (total): {s.cached_tokens}",
        f"Submit wall: {s.submit_wall_s:.6f} s",
        f"TTFT p50/p95/p99: {_fmt(s.ttft_ms)} ms",
        f"TPOT p50/p95/p99: {_fmt(s.tpot_ms)} ms/token",
        f"ITL p50/p95/p99: {_fmt(s.itl_ms)} ms",
        f"Latency p50/p95/p99: {_fmt(s.e2e_ms)} ms",
        f"Throughput (completion,total): {s.output_throughput:.2f} / {s.total_throughput:.2f} tokens/s",
        f"Request throughput: {s.request_throughput:.3f} req/s over {s.duration_s:.2f} s",
    ]
    return "\n".join(lines)
