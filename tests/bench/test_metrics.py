"""Metrics from known client-side timestamps: TTFT, ITL, TPOT, E2E, percentiles, throughput."""

from __future__ import annotations

import math

import pytest

from bench.lib.metrics import Dist, RequestResult, format_block, percentile, samples_ms, summarize


def test_percentile_interpolates_between_order_statistics() -> None:
    xs = [40.0, 10.0, 30.0, 20.0]  # sorted: 10 20 30 40
    assert percentile(xs, 0) == 10.0
    assert percentile(xs, 100) == 40.0
    assert percentile(xs, 50) == pytest.approx(25.0)
    assert percentile(xs, 95) == pytest.approx(30.0 + 0.85 * 10.0)  # rank 2.85
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(AssertionError):
        percentile([], 50)


def test_one_request_ttft_itl_tpot_e2e() -> None:
    # submitted at 10.0; tokens at 10.5, 10.6, 10.6 (one chunk of two), 10.9; final reply at 11.0
    r = RequestResult(
        submit_s=10.0, token_times_s=[10.5, 10.6, 10.6, 10.9], finish_s=11.0, completion_tokens=4
    )
    assert r.ttft_s == pytest.approx(0.5)
    assert r.itls_s == pytest.approx([0.1, 0.0, 0.3])
    assert r.tpot_s == pytest.approx((10.9 - 10.5) / 3)
    assert r.e2e_s == pytest.approx(1.0)


def test_tpot_uses_the_engines_token_count_when_chunks_are_coarser() -> None:
    # an HTTP server that sent 3 chunks for 5 tokens: the count comes from usage
    r = RequestResult(submit_s=0.0, token_times_s=[1.0, 2.0, 3.0], finish_s=3.0, completion_tokens=5)
    assert r.output_tokens == 5
    assert r.tpot_s == pytest.approx(2.0 / 4)
    single = RequestResult(submit_s=0.0, token_times_s=[1.0], finish_s=1.0, completion_tokens=1)
    assert single.tpot_s is None and single.itls_s == []


def test_summary_pools_itls_and_excludes_failures_from_latency() -> None:
    a = RequestResult(
        0.0, [1.0, 1.2, 1.6], finish_s=1.6, prompt_tokens=10, completion_tokens=3, cached_tokens=4
    )
    b = RequestResult(0.5, [2.5, 3.0], finish_s=3.0, prompt_tokens=20, completion_tokens=2)
    failed = RequestResult(0.7, [], finish_s=0.9, error="EngineError: no")
    s = summarize([a, b, failed])
    assert (s.num_requests, s.num_failed) == (3, 1)
    assert (s.prompt_tokens, s.completion_tokens, s.cached_tokens) == (30, 5, 4)
    assert s.duration_s == pytest.approx(3.0)  # first submit 0.0 -> last finish 3.0
    assert s.submit_wall_s == pytest.approx(0.7)
    assert s.output_throughput == pytest.approx(5 / 3.0)
    assert s.total_throughput == pytest.approx(35 / 3.0)
    assert s.request_throughput == pytest.approx(2 / 3.0)
    assert s.ttft_ms.p50 == pytest.approx(1500.0)  # TTFTs 1000 and 2000 ms
    assert s.ttft_ms.mean == pytest.approx(1500.0)
    itls = sorted([200.0, 400.0, 500.0])
    assert s.itl_ms.p50 == pytest.approx(itls[1])
    assert s.itl_ms.p99 == pytest.approx(percentile(itls, 99))
    assert s.tpot_ms.p50 == pytest.approx((300.0 + 500.0) / 2)
    assert s.e2e_ms.p95 == pytest.approx(percentile([1600.0, 2500.0], 95))


def test_no_samples_gives_none_not_nan() -> None:
    s = summarize([RequestResult(0.0, [], finish_s=None, error="TimeoutError: x")])
    assert s.ttft_ms == Dist(None, None, None, None)
    assert s.output_throughput == 0.0
    assert not any(isinstance(v, float) and math.isnan(v) for v in vars(s).values())
    assert "TTFT p50/p95/p99: n/a" in format_block(s, {})


def test_block_has_benchmark_streamings_lines_and_samples_are_in_ms() -> None:
    r = RequestResult(0.0, [0.25, 0.5], finish_s=0.5, prompt_tokens=3, completion_tokens=2)
    block = format_block(summarize([r]), {"Model": "tiny"})
    expected = ("=== streaming benchmark ===", "Model: tiny", "Prompt tokens (total): 3",
                "TTFT p50/p95/p99: 250.00", "TPOT p50/p95/p99:", "ITL p50/p95/p99: 250.00",
                "Latency p50/p95/p99: 500.00",
                "Throughput (completion,total): 4.00 / 10.00 tokens/s")  # fmt: skip
    for line in expected:
        assert line in block, line
    assert samples_ms([r]) == {"ttft_ms": [250.0], "itl_ms": [250.0]}
