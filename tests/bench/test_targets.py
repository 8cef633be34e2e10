"""bench/targets.py: its pure parts on fixed inputs, and one tiny end-to-end round (no timing assertions)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from bench import targets
from bench.launch import pid_alive
from bench.metrics import RequestResult
from bench.records import read_records

METRICS_TEXT = """\
# HELP rivulet_num_requests_running Requests holding KV in the scheduler.
# TYPE rivulet_num_requests_running gauge
rivulet_num_requests_running 32
# HELP rivulet_worker_busy_seconds_total Seconds the worker spent on batches, by its own clock.
# TYPE rivulet_worker_busy_seconds_total counter
rivulet_worker_busy_seconds_total 12.5
# TYPE rivulet_worker_clock_seconds gauge
rivulet_worker_clock_seconds 1234.75
rivulet_requests_finished_total{finish_reason="length"} 7
rivulet_time_to_first_token_seconds_bucket{le="+Inf"} 7
rivulet_prefix_cache_hit_rate NaN
"""


def test_parse_prometheus_keeps_unlabelled_samples() -> None:
    m = targets.parse_prometheus(METRICS_TEXT)
    assert m[targets.BUSY_COUNTER] == 12.5 and m[targets.BUSY_CLOCK] == 1234.75
    assert m["rivulet_num_requests_running"] == 32
    assert not any("{" in name or name.startswith("#") for name in m)


def _sample(t: float, busy: float, clock: float) -> targets.Sample:
    return t, {targets.BUSY_COUNTER: busy, targets.BUSY_CLOCK: clock}


def test_busy_share_uses_worker_reports_inside_the_window_only() -> None:
    samples = [
        _sample(10.0, 1.0, 100.0),  # before the window: prefill
        _sample(10.3, 1.2, 100.4),  # in the window's first STATS_LAG_S: may predate it
        _sample(11.0, 2.0, 101.0),
        _sample(11.2, 2.0, 101.0),  # the same report polled twice
        _sample(13.0, 3.8, 103.0),
        _sample(14.0, 4.0, 104.0),  # after the window
    ]
    assert targets.busy_share(samples, (10.2, 13.5)) == pytest.approx(0.9)
    assert targets.busy_share(samples[:3], (10.2, 13.5)) is None  # one report: no interval
    assert targets.busy_share([(11.0, {"other": 1.0})], (10.0, 12.0)) is None  # metrics absent: n/a


def test_steady_window_runs_from_the_last_first_token_to_the_first_finish() -> None:
    results = [
        RequestResult(0.0, [1.0, 2.0, 3.0], finish_s=3.0),
        RequestResult(0.0, [1.5, 2.5, 4.0], finish_s=4.0),
        RequestResult(3.0, [5.0], finish_s=5.0),  # the next wave
    ]
    assert targets.steady_window_s(results, 2) == (1.5, 3.0)
    assert targets.steady_window_s(results[:1], 2) is None


def test_cpu_percent_counts_the_tree_and_new_processes() -> None:
    hz = os.sysconf("SC_CLK_TCK")
    before = {1: (5, 100), 2: (6, 50), 3: (7, 10)}
    after = {1: (5, 100 + hz), 2: (9, hz), 4: (8, hz // 2)}  # pid 2 reused; pid 3 gone; pid 4 new
    assert targets.cpu_percent(before, after, 10.0) == pytest.approx(25.0, abs=1.0)
    mine = targets.tree_cpu_ticks(os.getpid())
    assert os.getpid() in mine and mine[os.getpid()][1] >= 0


def test_summary_and_table_report_medians_and_na() -> None:
    runs: list[dict[str, Any]] = [
        {"startup_s": 4.0, "busy_pct": None},
        {"startup_s": 6.5},
        {"startup_s": 5.0},
    ]
    summary = targets.summarize_runs(runs)
    assert summary["startup_s"]["median"] == 5.0 and summary["startup_s"]["runs"] == [4.0, 6.5, 5.0]
    assert "median" not in summary["busy_pct"]
    machine = {"cpu": "Test CPU", "cores": 2, "torch": "9.9"}
    table = targets.format_table({"bfloat16": summary}, machine, 3)
    assert "Test CPU, 2 cores" in table and "torch 9.9" in table
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines() if line.startswith("| ")}
    assert rows["start-up to Ready s, warm weight cache"].split(" | ")[2:4] == ["5 (4-6.5)", "yes"]
    assert rows["worker busy % of wall, steady decode at 32 streams"].split(" | ")[2:4] == ["n/a", "n/a"]
    assert "issue's anchor, AMD Zen 5" in rows["target"] and "397-434" in rows["32 streams: output tok/s"]


@pytest.mark.timeout(300)
def test_one_round_measures_every_target_on_a_real_engine(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record = tmp_path / "targets.jsonl"
    argv = ["--model", str(tiny_llama_dir), "--dtype", "float32", "--repeats", "1", "--streams", "3",
            "--stream-requests", "6", "--single-requests", "2", "--input-len", "8", "--output-len", "4",
            "--offline-prompts", "6", "--hf-batch-sizes", "6", "--hf-threads", "1", "--idle-s", "1",
            "--engine-flags", "--num-threads 1 --kv-cache-tokens 2048",
            "--result-file", str(record)]  # fmt: skip
    assert targets.main(argv) == 0
    out = capsys.readouterr().out
    assert "| 32 streams: output tok/s | >= 900 |" in out and "Machine: " in out
    (rec,) = read_records(record)
    assert rec["kind"] == "targets" and rec["config"]["command"].startswith("python -m bench.targets")
    (run,) = rec["metrics"]["runs"]["float32"]
    for key in ("out32_tps", "ttft32_ms", "decode1_tps", "out1_tps", "offline_tps", "offline_hf_tps"):
        assert run[key] > 0, key
    assert run["offline_ratio"] == pytest.approx(run["offline_tps"] / run["offline_hf_tps"])
    assert 0 < run["startup_s"] < 300 and run["idle_cpu_pct"] >= 0
    assert run["busy_pct"] is None or 0 <= run["busy_pct"] <= 101  # None until /metrics has the counters
    assert [pid for pid in targets.launch.descendants(os.getpid()) if pid_alive(pid)] == []
