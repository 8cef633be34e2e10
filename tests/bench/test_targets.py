"""bench/targets.py: its pure parts on fixed inputs, and one tiny end-to-end round (no timing assertions)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import targets
from bench.lib import llama_cpp, probes, targets_rounds
from bench.lib.launch import pid_alive
from bench.lib.metrics import RequestResult
from bench.lib.records import read_records
from gpu_worker.backends.cpu import kind as cpu_kind

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
    m = probes.parse_prometheus(METRICS_TEXT)
    assert m[probes.BUSY_COUNTER] == 12.5 and m[probes.BUSY_CLOCK] == 1234.75
    assert m["rivulet_num_requests_running"] == 32
    assert not any("{" in name or name.startswith("#") for name in m)


def _sample(t: float, busy: float, clock: float) -> probes.Sample:
    return t, {probes.BUSY_COUNTER: busy, probes.BUSY_CLOCK: clock}


def test_busy_share_uses_worker_reports_inside_the_window_only() -> None:
    samples = [
        _sample(10.0, 1.0, 100.0),  # before the window: prefill
        _sample(10.3, 1.2, 100.4),  # in the window's first STATS_LAG_S: may predate it
        _sample(11.0, 2.0, 101.0),
        _sample(11.2, 2.0, 101.0),  # the same report polled twice
        _sample(13.0, 3.8, 103.0),
        _sample(14.0, 4.0, 104.0),  # after the window
    ]
    assert probes.busy_share(samples, (10.2, 13.5)) == pytest.approx(0.9)
    assert probes.busy_share(samples[:3], (10.2, 13.5)) is None  # one report: no interval
    assert probes.busy_share([(11.0, {"other": 1.0})], (10.0, 12.0)) is None  # metrics absent: n/a


def test_steady_window_runs_from_the_last_first_token_to_the_first_finish() -> None:
    results = [
        RequestResult(0.0, [1.0, 2.0, 3.0], finish_s=3.0),
        RequestResult(0.0, [1.5, 2.5, 4.0], finish_s=4.0),
        RequestResult(3.0, [5.0], finish_s=5.0),  # the next wave
    ]
    assert probes.steady_window_s(results, 2) == (1.5, 3.0)
    assert probes.steady_window_s(results[:1], 2) is None


def test_cpu_percent_counts_the_tree_and_new_processes() -> None:
    hz = os.sysconf("SC_CLK_TCK")
    before = {1: (5, 100), 2: (6, 50), 3: (7, 10)}
    after = {1: (5, 100 + hz), 2: (9, hz), 4: (8, hz // 2)}  # pid 2 reused; pid 3 gone; pid 4 new
    assert probes.cpu_percent(before, after, 10.0) == pytest.approx(25.0, abs=1.0)
    mine = probes.tree_cpu_ticks(os.getpid())
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
    table = targets.format_table({"bfloat16": summary}, machine, 3, "cpu kind avx2; avx2=yes")
    assert "Test CPU, 2 cores" in table and "torch 9.9" in table
    assert table.strip().splitlines()[0] == "CPU: cpu kind avx2; avx2=yes"
    assert "over HTTP" not in table and "rivulet / llama.cpp" not in table  # no peer: no peer rows
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines() if line.startswith("| ")}
    assert rows["start-up to Ready s, warm weight cache"].split(" | ")[2:4] == ["5 (4-6.5)", "yes"]
    assert rows["worker busy % of wall, steady decode at 32 streams"].split(" | ")[2:4] == ["n/a", "n/a"]
    assert "reference, AMD Zen 5" in rows["target"] and "397-434" in rows["32 streams: output tok/s"]


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


def _rows(table: str) -> dict[str, list[str]]:
    return {
        line.split(" | ")[0].strip("| "): line.strip("| ").split(" | ")
        for line in table.splitlines()
        if line.startswith("| ")
    }


def test_peer_ratios_pair_each_round_with_llama_cpps_round() -> None:
    rivulet = {"http_out32_tps": 900.0, "http_decode1_tps": 100.0, "out32_tps": 1000.0}
    peer = {"out32_tps": 200.0, "decode1_tps": 125.0, "ttft32_ms": 50.0, "decode1_floor_x": 1.3}
    assert targets_rounds.peer_ratios(rivulet, peer) == {
        "llama_out32_tps": 200.0, "out32_ratio": 4.5, "llama_decode1_tps": 125.0, "decode1_ratio": 0.8,
        "llama_decode1_floor_x": 1.3,
    }  # fmt: skip
    missing = targets_rounds.peer_ratios({"http_out32_tps": 900.0}, {"out32_tps": 0.0})
    assert missing["out32_ratio"] is None and missing["decode1_ratio"] is None


def test_table_rows_with_a_peer_and_fake_numbers() -> None:
    runs: list[dict[str, Any]] = []
    for mine32, theirs32, mine1, theirs1 in ((900.0, 200.0, 100.0, 125.0), (1000.0, 250.0, 90.0, 100.0)):
        run = {"out32_tps": mine32 + 10, "http_out32_tps": mine32, "http_decode1_tps": mine1}
        runs.append(run | targets_rounds.peer_ratios(run, {"out32_tps": theirs32, "decode1_tps": theirs1}))
    summary = targets.summarize_runs(runs, (*targets.TARGETS, *targets.PEER_TARGETS))
    peer = llama_cpp.Peer(Path("/cache/llama-server"), Path("/m/x.gguf"), threads=2, parallel=32)
    machine = {"cpu": "Test CPU", "cores": 2, "torch": "9.9"}
    table = targets.format_table({"bfloat16": summary}, machine, 2, "cpu kind avx2; avx2=yes", peer)
    rows = _rows(table)
    assert rows["32 streams over HTTP: rivulet output tok/s"][2:4] == ["950 (900-1000)", "-"]
    llama32 = rows["32 streams over HTTP: llama.cpp output tok/s"]
    assert llama32[2] == "225 (200-250)" and llama32[6] == "199-204"  # the reference llama.cpp anchor
    assert rows["32 streams: rivulet / llama.cpp output tok/s (HTTP both)"][2] == "4.25 (4.00-4.50)"
    assert rows["1 stream: rivulet / llama.cpp decode tok/s (HTTP both)"][2] == "0.85 (0.80-0.90)"
    assert rows["1 stream over HTTP: llama.cpp decode tok/s"][2] == "112 (100-125)"
    assert rows["32 streams: output tok/s"][2] == "960 (910-1010)"  # the ZMQ row stays
    assert table.strip().splitlines()[0] == "CPU: cpu kind avx2; avx2=yes"
    assert "/cache/llama-server -m /m/x.gguf --port {port} -np 32 -c 8192 -t 2" in table
    assert 'Rows without "over HTTP" measure rivulet through its ZMQ client' in table


def test_main_interleaves_rivulet_and_llama_cpp_rounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """main's order, ratios, table and record, with the measurements faked (no engine, no llama.cpp)."""
    import gpu_worker.weights.model_files

    calls: list[str] = []

    def fake_round(args: Any, dtype: str, r: int, http: bool = False) -> dict[str, Any]:
        calls.append(f"rivulet {dtype} {r} http={http}")
        assert args.decode_bytes == 1234
        return {"startup_s": 3.0, "http_out32_tps": 400.0 + 100 * r, "http_decode1_tps": 50.0,
                "http_decode1_floor_x": 1.05 + r / 100}  # fmt: skip

    def fake_peer(args: Any, peer: llama_cpp.Peer, r: int) -> dict[str, Any]:
        calls.append(f"llama.cpp {r} {peer.binary.name} -t {peer.threads}")
        return {"out32_tps": 200.0, "decode1_tps": 100.0, "decode1_floor_x": 1.4}

    def fake_paired(args: Any, peer: llama_cpp.Peer, dtype: str, r: int) -> dict[str, Any]:
        calls.append(f"paired {dtype} {r}")
        ratio = 1.5 + r / 10
        return {"paired_decode1_tps": 60.0, "llama_paired_decode1_tps": 40.0, "paired_decode1_ratio": ratio}

    monkeypatch.setattr(targets, "measure_round", fake_round)
    monkeypatch.setattr(targets, "measure_peer", fake_peer)
    monkeypatch.setattr(targets, "measure_paired", fake_paired)
    monkeypatch.setattr(gpu_worker.weights.model_files, "resolve_model", lambda model: tmp_path)
    monkeypatch.setattr(targets, "decode_bytes", lambda path: 1234 if path.name == "m.gguf" else 0)
    binary = tmp_path / "my-llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    record = tmp_path / "targets.jsonl"
    argv = ["--model", str(gguf), "--dtype", "float32,bfloat16", "--repeats", "2", "--peer-llama-cpp",
            str(binary), "--peer-threads", "3", "--result-file", str(record)]  # fmt: skip
    assert targets.main(argv) == 0
    assert calls == [
        "rivulet float32 0 http=True", "rivulet bfloat16 0 http=True", "llama.cpp 0 my-llama-server -t 3",
        "paired float32 0",
        "rivulet float32 1 http=True", "rivulet bfloat16 1 http=True", "llama.cpp 1 my-llama-server -t 3",
        "paired float32 1",
    ]  # fmt: skip
    out = capsys.readouterr().out
    acting = cpu_kind.requested_kind()
    assert f"CPU: {cpu_kind.describe(acting)}" in out
    ratio32 = _rows(out)["32 streams: rivulet / llama.cpp output tok/s (HTTP both)"]
    assert ratio32[2:4] == ["2.25 (2.00-2.50)", "2.25 (2.00-2.50)"]  # float32, bfloat16
    floor = _rows(out)["1 stream over HTTP: rivulet ms a token / floor (weight bytes / read GB/s)"]
    assert floor[1] == "<= 1.1" and floor[2] == "1.06 (1.05-1.06)" and floor[4] == "yes"
    assert _rows(out)["1 stream over HTTP: llama.cpp ms a token / floor"][2] == "1.40 (1.40-1.40)"
    paired = _rows(out)["1 stream, paired requests: rivulet / llama.cpp (median of pairs)"]
    assert paired[2:4] == ["1.55 (1.50-1.60)", "n/a"]  # the first dtype's engine only
    (rec,) = read_records(record)
    assert rec["machine"]["cpu_kind"] == acting.value
    assert set(rec["machine"]["cpu_flags"]) == set(cpu_kind.REPORTED_FLAGS)
    peer_run = {"out32_tps": 200.0, "decode1_tps": 100.0, "decode1_floor_x": 1.4}
    assert rec["metrics"]["peer"]["runs"] == [peer_run] * 2
    assert rec["metrics"]["peer"]["command"].endswith(f"-m {gguf} --port {{port}} -np 32 -c 8192 -t 3")
    assert [run["out32_ratio"] for run in rec["metrics"]["runs"]["float32"]] == [2.0, 2.5]
    assert rec["metrics"]["targets"]["bfloat16"]["decode1_ratio"]["median"] == 0.5


def test_auto_without_a_build_says_how_to_build_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RIVULET_CACHE_DIR", str(tmp_path))
    with pytest.raises(SystemExit) as exc:
        targets.main(["--peer-llama-cpp", "auto", "--no-record"])
    acting = cpu_kind.requested_kind()
    if acting is cpu_kind.CpuKind.PORTABLE:
        assert "portable" in str(exc.value)
    else:
        assert llama_cpp.build_command(acting.value) in str(exc.value)


def test_importing_targets_leaves_torch_unloaded() -> None:
    """main applies RIVULET_CPU_KIND first: nothing imported with the module may have loaded torch."""
    code = "import sys, bench.targets; assert 'torch' not in sys.modules, 'torch loaded on import'"
    root = Path(targets.__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True)


FAKE_LLAMA_SERVER = """\
#!{python}
# Stands in for llama-server: takes its command line, serves rivulet's HTTP API on --port instead.
import argparse, os, sys
p = argparse.ArgumentParser()
for flag in ("-m", "--port", "-np", "-c", "-t"):
    p.add_argument(flag, required=True)
a = p.parse_args()
open({argv_file!r}, "w").write(" ".join(sys.argv[1:]))
os.execv(sys.executable, [sys.executable, {launcher!r}, "--model", {model!r}, "--http-port", a.port,
         "--endpoint", "ipc://{tmp}/fake.sock", "--num-threads", "1", "--kv-cache-tokens", "2048"])
"""


@pytest.mark.timeout(300)
def test_a_peer_round_on_a_fake_llama_server(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """measure_peer for real: starts the command llama-server gets, measures it over HTTP, stops it."""
    argv_file = tmp_path / "argv"
    script = tmp_path / "llama-server"
    launcher = Path(targets.__file__).resolve().parents[1] / "launcher.py"
    script.write_text(FAKE_LLAMA_SERVER.format(
        python=sys.executable, argv_file=str(argv_file), launcher=str(launcher), model=str(tiny_llama_dir),
        tmp=tmp_path,
    ))  # fmt: skip
    script.chmod(0o755)
    argv = ["--model", str(tiny_llama_dir), "--streams", "3", "--stream-requests", "6",
            "--single-requests", "2", "--input-len", "8", "--output-len", "4"]  # fmt: skip
    args = targets.build_parser().parse_args(argv)
    args.decode_bytes = 50_000_000  # as main sets it for a GGUF: the floor is measured too
    peer = llama_cpp.Peer(script, Path("/m/x.gguf"), threads=2, parallel=32, fields={})  # rivulet: no extras
    run = targets_rounds.measure_peer(args, peer, 0)
    for key in ("out32_tps", "ttft32_ms", "decode1_tps", "out1_tps", "startup_s", "read_gbps"):
        assert run[key] > 0, key
    floor_ms = args.decode_bytes / run["read_gbps"] / 1e6
    assert run["decode1_floor_x"] == pytest.approx(1e3 / run["decode1_tps"] / floor_ms)
    assert argv_file.read_text().split()[2:] == ["--port", argv_file.read_text().split()[3], "-np", "32",
                                                 "-c", "8192", "-t", "2"]  # fmt: skip
    assert [pid for pid in targets.launch.descendants(os.getpid()) if pid_alive(pid)] == []


@pytest.mark.timeout(300)
def test_paired_requests_on_both_servers_at_once(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """measure_paired for real: rivulet and the stand-in llama-server up together, requests to each in
    turn, each engine's TPOT and the pairs' ratio; every process stopped after."""
    script = tmp_path / "llama-server"
    launcher = Path(targets.__file__).resolve().parents[1] / "launcher.py"
    script.write_text(FAKE_LLAMA_SERVER.format(
        python=sys.executable, argv_file=str(tmp_path / "argv"), launcher=str(launcher),
        model=str(tiny_llama_dir), tmp=tmp_path,
    ))  # fmt: skip
    script.chmod(0o755)
    argv = ["--model", str(tiny_llama_dir), "--paired-requests", "3", "--input-len", "8", "--output-len", "6",
            "--engine-flags", "--num-threads 1 --kv-cache-tokens 2048"]  # fmt: skip
    args = targets.build_parser().parse_args(argv)
    args.decode_bytes = 50_000_000  # as main sets it for a GGUF: the floor is probed around each request
    peer = llama_cpp.Peer(script, Path("/m/x.gguf"), threads=2, parallel=32, fields={})  # rivulet: no extras
    run = targets_rounds.measure_paired(args, peer, "float32", 0)
    assert set(run) == {"paired_decode1_tps", "llama_paired_decode1_tps", "paired_decode1_ratio",
                        "paired_decode1_floor_x", "llama_paired_decode1_floor_x"}  # fmt: skip
    assert all(v > 0 for v in run.values())
    assert [pid for pid in targets.launch.descendants(os.getpid()) if pid_alive(pid)] == []
