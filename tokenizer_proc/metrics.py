"""Serving metrics kept by the tokenizer process, and their Prometheus text exposition.

Token times are taken when the tokenizer turns a scheduler row into a client
reply, i.e. where the token leaves the engine toward the client, so queueing and
scheduling delays count, as they do for the client.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

from protocol.messages import EngineStats, FinishReason

TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Histogram:
    """A cumulative Prometheus histogram over fixed upper bounds (``+Inf`` implied)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        assert list(bounds) == sorted(bounds), f"bucket bounds must ascend: {bounds}"
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last bucket is +Inf
        self.total = 0.0

    @property
    def count(self) -> int:
        return sum(self.counts)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def render(self, name: str, help_text: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            cumulative += n
            le = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{name}_bucket{{le="{le}"}} {cumulative}')
        lines += [f"{name}_sum {self.total!r}", f"{name}_count {cumulative}"]
        return lines


@dataclass
class ServingMetrics:
    """Counters and latency histograms of every request the tokenizer served."""

    prompt_tokens: int = 0  # counted on admission
    generation_tokens: int = 0
    finished_prompt_tokens: int = 0  # prompt tokens of finished requests: the hit rate's denominator
    cached_prompt_tokens: int = 0
    finished: Counter[str] = field(default_factory=Counter)  # by finish_reason
    ttft_s: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS_S))
    itl_s: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS_S))
    e2e_s: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS_S))

    def on_finish(self, reason: FinishReason, prompt_tokens: int, cached_tokens: int, e2e_s: float) -> None:
        self.finished[reason.value] += 1
        self.finished_prompt_tokens += prompt_tokens
        self.cached_prompt_tokens += cached_tokens
        self.e2e_s.observe(e2e_s)

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.finished_prompt_tokens if self.finished_prompt_tokens else 0.0


def render_prometheus(m: ServingMetrics, stats: EngineStats | None, in_flight: int) -> str:
    """The Prometheus text format (version 0.0.4) of ``m`` and the scheduler's last EngineStats."""
    out: list[str] = []

    def one(name: str, kind: str, help_text: str, value: float) -> None:
        out.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value!r}"])

    if stats is not None:  # before the scheduler's first report there is no engine state to show
        used = stats.num_pages - stats.free_pages - stats.evictable_pages
        one(
            "rivulet_num_requests_running",
            "gauge",
            "Requests holding KV in the scheduler.",
            stats.num_running,
        )
        one("rivulet_num_requests_waiting", "gauge", "Requests queued in the scheduler.", stats.num_waiting)
        one("rivulet_kv_pages_total", "gauge", "KV pages in the pool.", stats.num_pages)
        one("rivulet_kv_pages_free", "gauge", "KV pages on the free list.", stats.free_pages)
        one(
            "rivulet_kv_pages_evictable",
            "gauge",
            "KV pages held only by the prefix cache.",
            stats.evictable_pages,
        )
        one("rivulet_kv_usage_ratio", "gauge", "Share of KV pages in use.", used / max(stats.num_pages, 1))
        one(
            "rivulet_worker_busy_seconds_total",
            "counter",
            "Seconds the worker spent on batches, by its own clock.",
            stats.worker_busy_s,
        )
        one(
            "rivulet_prefill_tokens_total",
            "counter",
            "Tokens computed by prefill rows (prompts and recomputes; cache hits and n > 1 forks skip it).",
            stats.prefill_tokens,
        )
        one(
            "rivulet_worker_clock_seconds",
            "gauge",
            "The worker's monotonic clock at its last reply (busy share = d busy / d clock).",
            stats.worker_clock_s,
        )
        out += speculation_samples(stats)
    one("rivulet_num_requests_in_flight", "gauge", "Requests the front door is serving.", in_flight)
    one("rivulet_prompt_tokens_total", "counter", "Prompt tokens admitted.", m.prompt_tokens)
    one("rivulet_generation_tokens_total", "counter", "Tokens generated.", m.generation_tokens)
    one(
        "rivulet_cached_prompt_tokens_total",
        "counter",
        "Prompt tokens whose KV was reused.",
        m.cached_prompt_tokens,
    )
    one(
        "rivulet_prefix_cache_hit_rate",
        "gauge",
        "Cached / prompt tokens of finished requests.",
        m.cache_hit_rate,
    )
    out += ["# HELP rivulet_requests_finished_total Requests ended, by finish_reason.",
            "# TYPE rivulet_requests_finished_total counter"]  # fmt: skip
    for reason in FinishReason:
        out.append(
            f'rivulet_requests_finished_total{{finish_reason="{reason.value}"}} {m.finished[reason.value]}'
        )
    out += m.ttft_s.render("rivulet_time_to_first_token_seconds", "Time from arrival to the first token.")
    out += m.itl_s.render(
        "rivulet_inter_token_latency_seconds", "Gap between consecutive tokens of a request."
    )
    out += m.e2e_s.render("rivulet_e2e_request_latency_seconds", "Time from arrival to the last reply.")
    return "\n".join(out) + "\n"


def speculation_samples(stats: EngineStats) -> list[str]:
    """Speculative decoding's counts (all 0 without ``--speculative-algorithm``), each counted as a
    verify row comes back, and the two ratios since start (a window's: the counters' rates)."""
    drafted, accepted, rows = stats.draft_tokens, stats.accepted_draft_tokens, stats.verify_rows
    series = [
        ("rivulet_spec_draft_tokens_total", "counter",
         "Draft tokens verified (the drafts of every verify row that came back).", drafted),
        ("rivulet_spec_accepted_tokens_total", "counter", "Draft tokens their verify rows kept.",
         accepted),
        ("rivulet_spec_verify_rows_total", "counter",
         "Verify rows: a drafting request's step, its last token and its drafts.", rows),
        ("rivulet_spec_acceptance_ratio", "gauge", "Accepted / draft tokens since start.",
         accepted / drafted if drafted else 0.0),
        ("rivulet_spec_accept_length", "gauge",
         "Tokens a verify row gave on average since start: its kept drafts and the token drawn after them.",
         1 + accepted / rows if rows else 0.0),
    ]  # fmt: skip
    out: list[str] = []
    for name, kind, help_text, value in series:
        out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value!r}"]
    return out


def render_replicas(replicas: list[EngineStats | None], routed: list[int]) -> str:
    """Per data-parallel replica (label ``replica``), with --dp-size > 1: its scheduler's load
    and the requests routed to it (the unlabeled metrics are the replicas' sums)."""
    if len(replicas) < 2:
        return ""
    out: list[str] = []
    series: list[tuple[str, str, str, list[float | None]]] = [
        ("rivulet_replica_requests_routed_total", "counter", "Requests routed to the replica.", [*routed]),
        ("rivulet_replica_num_requests_running", "gauge", "Requests holding KV in the replica.",
         [s.num_running if s else None for s in replicas]),
        ("rivulet_replica_num_requests_waiting", "gauge", "Requests queued in the replica.",
         [s.num_waiting if s else None for s in replicas]),
        ("rivulet_replica_kv_pages_free", "gauge", "KV pages on the replica's free list.",
         [s.free_pages if s else None for s in replicas]),
        ("rivulet_replica_kv_pages_evictable", "gauge", "KV pages held only by the replica's prefix cache.",
         [s.evictable_pages if s else None for s in replicas]),
        ("rivulet_replica_prefill_tokens_total", "counter", "Tokens the replica's prefill rows computed.",
         [s.prefill_tokens if s else None for s in replicas]),
    ]  # fmt: skip
    for name, kind, help_text, values in series:
        out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        out += [f'{name}{{replica="{i}"}} {v!r}' for i, v in enumerate(values) if v is not None]
    return "\n".join(out) + "\n"
