"""python -m bench.process_cpu: /proc read per process, windows interpolated, and a real run on the tiny
model with two variants (one under RIVULET_CPROFILE); no timing assertions."""

from __future__ import annotations

import json
import os
import pstats
import threading
import time
from pathlib import Path

import pytest

from bench import process_cpu
from bench.lib.proc_cpu import CpuSampler, Snapshot, cpu_between, process_cpu_s, ready_line_pids


def test_ready_line_names_each_child() -> None:
    line = "rivulet ready: endpoint=ipc:///c.sock pids: gpu_worker=12 tokenizer=13 scheduler.1=14"
    assert ready_line_pids(line) == {"gpu_worker": 12, "tokenizer": 13, "scheduler.1": 14}


def test_a_window_is_interpolated_between_snapshots() -> None:
    snaps = [
        Snapshot(0.0, {"a": 0.0}, {"w": {1: 0.0, 2: 1.0}}),
        Snapshot(1.0, {"a": 1.0}, {"w": {1: 0.5, 2: 1.0}}),
        Snapshot(2.0, {"a": 3.0}, {"w": {1: 1.5, 2: 3.0}}),
    ]
    cpu = cpu_between(snaps, 0.5, 1.5)
    assert cpu["a"] == pytest.approx(1.5)  # 0.5 -> 2.0
    assert cpu["w/1"] == pytest.approx(0.75) and cpu["w/2"] == pytest.approx(1.0)


def test_the_sampler_reads_this_process_and_its_threads() -> None:
    with CpuSampler({"me": os.getpid()}, threads_of=("me",), interval_s=0.01) as sampler:
        started = time.thread_time()
        while time.thread_time() - started < 0.1:  # 0.1 s of CPU on the main thread
            pass
    snaps = sampler.snapshots
    assert len(snaps) >= 2 and process_cpu_s(os.getpid()) is not None
    used = cpu_between(snaps, snaps[0].t, snaps[-1].t)
    assert used["client"] >= 0.09  # the main thread's, at schedstat's resolution
    assert used["me"] >= used["client"] - 0.02  # the whole process's, in clock ticks
    # the same thread read twice in one take: apart by what the main thread spends between the reads
    # (its last take runs on it; 0.12 ms seen on a loaded machine)
    assert used[f"me/{threading.get_native_id()}"] == pytest.approx(used["client"], abs=0.005)


@pytest.mark.timeout(300)
def test_a_profiled_engine_reports_every_process(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "runs.json"
    variant = f"profiled:RIVULET_CPROFILE={tmp_path / 'prof'} --num-threads 1 --kv-cache-tokens 2048"
    argv = ["--model", str(tiny_llama_dir), "--variant", variant, "--rounds", "1", "--streams", "4",
            "--requests", "6", "--input-len", "12", "--output-len", "8", "--json", str(out)]  # fmt: skip
    assert process_cpu.main(argv) == 0
    table = capsys.readouterr().out
    assert "| gpu_worker |" in table and "profiled steady" in table and "profiled whole" in table
    (run,) = json.loads(out.read_text())["runs"]["profiled"]
    assert run["window_tokens"] > 0 and run["step_ms"] > 0
    for part in ("steady", "whole"):
        assert {"tokenizer", "scheduler", "gpu_worker", "client", "worker_python_thread"} <= run[part].keys()
        assert all(v >= 0.0 for v in run[part].values())
    assert run["whole"]["gpu_worker"] > 0.0
    written = sorted(p.name.split("-")[0] for p in (tmp_path / "prof").glob("*.prof"))
    assert written == ["scheduler", "tokenizer"]  # written as the engine stopped
    for path in (tmp_path / "prof").glob("*.prof"):
        assert pstats.Stats(str(path)).total_calls > 0  # type: ignore[attr-defined]
