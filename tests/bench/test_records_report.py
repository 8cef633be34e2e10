"""The JSON record schema stays stable; docs/benchmarks.md and the PNGs are written from a manifest."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from bench.lib import report, writeup
from bench.lib.metrics import RequestResult, Summary, samples_ms, summarize
from bench.lib.records import RECORD_KEYS, SCHEMA_VERSION, append_record, make_record, read_records

SUMMARY_KEYS = {
    "num_requests", "num_failed", "prompt_tokens", "completion_tokens", "cached_tokens", "duration_s",
    "submit_wall_s", "request_throughput", "output_throughput", "total_throughput", "ttft_ms", "tpot_ms",
    "itl_ms", "e2e_ms",
}  # fmt: skip
DIST_KEYS = {"p50", "p95", "p99", "mean"}


def _summary(scale: float) -> tuple[Summary, list[RequestResult]]:
    results = [
        RequestResult(0.0, [scale * t for t in (1.0, 1.1, 1.3)], finish_s=scale * 1.3, prompt_tokens=5,
                      completion_tokens=3),
        RequestResult(0.0, [scale * t for t in (1.5, 1.6)], finish_s=scale * 1.6, prompt_tokens=7,
                      completion_tokens=2),
    ]  # fmt: skip
    return summarize(results), results


def test_record_schema_is_stable(tmp_path: Path) -> None:
    summary, results = _summary(1.0)
    path = tmp_path / "r.jsonl"
    append_record(path, make_record("serving", {"label": "a"}, summary, samples_ms(results)))
    append_record(path, make_record("offline", {"n": 1}, {"rivulet_output_tps": 1.0}))
    first, second = read_records(path)
    assert tuple(sorted(first)) == tuple(sorted(RECORD_KEYS))
    assert first["schema"] == SCHEMA_VERSION and first["kind"] == "serving"
    assert set(first["metrics"]) == SUMMARY_KEYS
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(first["metrics"][key]) == DIST_KEYS
    assert set(first["machine"]) >= {"cpu", "cores", "mem_gib", "python", "torch"}
    assert first["git_commit"] and first["samples"]["ttft_ms"] == [1000.0, 1500.0]
    assert set(second) == set(RECORD_KEYS) and second["metrics"] == {"rivulet_output_tps": 1.0}
    assert {f.name for f in dataclasses.fields(Summary)} == SUMMARY_KEYS


def _variant(label: str, scale: float, status: str = "ok", concurrency: int = 0) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    samples: dict[str, list[float]] = {"ttft_ms": [], "itl_ms": []}
    for k in range(3):
        summary, results = _summary(scale * (1 + 0.1 * k))
        runs.append(dataclasses.asdict(summary))
        for key, vals in samples_ms(results).items():
            samples[key] += vals
    if status != "ok":
        runs, samples = [], {"ttft_ms": [], "itl_ms": []}
    return {"label": label, "engine_flags": ["--x"], "workload": ["--num-requests", "2"],
            "concurrency": concurrency, "status": status, "runs": runs, "samples": samples}  # fmt: skip


def test_docs_have_tables_deltas_and_plots(tmp_path: Path) -> None:
    pair = {"name": "pack", "title": "FIFO vs pack", "expect": "pack wins", "kind": "pair",
            "variants": [_variant("fcfs", 1.0), _variant("pack", 0.5),
                         _variant("new", 1.0, status="n/a (flag not available: --new)")]}  # fmt: skip
    conc = {"name": "concurrency", "title": "throughput vs concurrency", "expect": "anchors",
            "kind": "concurrency",
            "variants": [_variant(f"default @ {c}", 1.0 / c, concurrency=c) for c in (1, 4, 16)]}  # fmt: skip
    offline = {"config": {"num_prompts": 4, "input_len": 8, "output_len": 8, "dtype": "float32"},
               "runs": [{"rivulet_output_tps": 20.0, "rivulet_input_tps": 30.0, "hf_output_tps": 10.0}],
               "rivulet_output_tps": 20.0, "hf_output_tps": 10.0, "hf_batch_size": 4,
               "hf_batch_rates": {"4": 10.0, "2": 6.0}}  # fmt: skip
    machine = {"cpu": "cpu", "cores": 2, "mem_gib": 1.0, "gpu": None, "python": "3", "torch": "2",
               "cpu_features": "cpu kind avx2; avx2=yes fma=yes"}  # fmt: skip
    manifest = {"time": "now", "git_commit": "abc", "machine": machine, "model": "tiny", "engine_flags": [],
                "repeats": 3, "note": "noisy", "command": "python -m bench.sweep", "sweeps": [pair, conc],
                "offline": offline}  # fmt: skip
    md = writeup.write_docs(json.loads(json.dumps(manifest)), tmp_path).read_text()
    # TTFTs are 1.0 s and 1.5 s times 1.0, 1.1, 1.2 over the repeats: p50 1250, 1375, 1500 ms
    assert "| fcfs | 1375 (1250-1500) |" in md
    assert "n/a (flag not available: --new)" in md
    assert "pack vs fcfs (medians): TTFT p50 -50%, TTFT p99 -50%" in md
    assert "rivulet / HF generate: 2.00x" in md
    assert "| default | 16 |" in md
    for png in ("bench_pack.png", "bench_concurrency.png"):
        assert f"]({png})" in md
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report.cell([]) == "-" and report.cell([3.0]) == "3" and report.cell([2.5]) == "2.5"
    assert md.count("Numbers from: commit `abc`, CPU cpu (2 cores, cpu kind avx2).") == 4, (
        "one per ## section"
    )
    assert "- CPU features: cpu kind avx2; avx2=yes" in md


def test_a_new_sweep_keeps_the_sections_measured_by_hand(tmp_path: Path) -> None:
    machine = {"cpu": "cpu", "cores": 2, "mem_gib": 1.0, "gpu": None, "python": "3", "torch": "2"}
    manifest = {"time": "now", "git_commit": "abc", "machine": machine, "model": "tiny", "engine_flags": [],
                "repeats": 3, "note": "noisy", "command": "c", "sweeps": []}  # fmt: skip
    path = writeup.write_docs(manifest, tmp_path)
    path.write_text(path.read_text() + "## Pasted by hand\n\nNumbers from: commit `def`.\n")
    again = writeup.write_docs({**manifest, "git_commit": "ghi"}, tmp_path).read_text()
    assert "commit `ghi`" in again and again.endswith("## Pasted by hand\n\nNumbers from: commit `def`.\n")
    assert again.count(writeup.BY_HAND) == 1


def test_a_later_sweep_replaces_its_namesake_and_says_when_it_ran() -> None:
    from bench.lib.sweep_runner import merge

    base: dict[str, Any] = {"time": "t0", "sweeps": [{"name": "a", "v": 1}, {"name": "b", "v": 1}]}
    later: dict[str, Any] = {"time": "t1", "git_commit": "c1", "command": "python -m bench.sweep --sweeps b",
             "sweeps": [{"name": "b", "v": 2}, {"name": "c", "v": 2}]}  # fmt: skip
    merged = merge(base, later)
    assert [(s["name"], s["v"]) for s in merged["sweeps"]] == [("a", 1), ("b", 2), ("c", 2)]
    assert "note" not in merged["sweeps"][0] and "t1" in merged["sweeps"][1]["note"]
    assert "c1" in merged["sweeps"][2]["note"] and merged["time"] == "t0"
    assert [s["v"] for s in base["sweeps"]] == [1, 1]  # the earlier manifest is not changed
