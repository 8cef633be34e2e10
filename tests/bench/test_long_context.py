"""bench/long_context.py: its table on fixed numbers, and one real round of rivulet (no timing assertions)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench import long_context
from bench.lib.launch import descendants, pid_alive
from bench.lib.records import read_records


def _run(tps32: float, ttft32: float, tps512: float, ttft512: float) -> dict[str, float]:
    return {"decode_tps_32": tps32, "ttft_ms_32": ttft32, "decode_tps_512": tps512, "ttft_ms_512": ttft512}


def test_table_pairs_each_round_and_takes_medians() -> None:
    args = long_context.build_parser().parse_args(["--input-lens", "32,512"])
    ours = [_run(150, 40, 120, 300), _run(160, 42, 100, 310)]
    theirs = [_run(100, 50, 120, 900), _run(200, 52, 50, 950)]
    lines = long_context.table(args, ours, theirs).splitlines()
    rows = {line.strip("| ").split(" | ")[0]: line.strip("| ").split(" | ") for line in lines[2:]}
    # round 1: 150 / 100, round 2: 160 / 200 -> ratios 1.5 and 0.8, median 1.15
    assert rows["32"] == [
        "32",
        "155 (150-160)",
        "150 (100-200)",
        "1.15 (0.80-1.50)",
        "41 (40-42)",
        "51 (50-52)",
    ]
    assert rows["512"][3] == "1.50 (1.00-2.00)"


def test_input_lens_must_be_positive() -> None:
    assert long_context.parse_lens("32, 512") == [32, 512]
    with pytest.raises(AssertionError):
        long_context.parse_lens("0,5")


@pytest.mark.timeout(300)
def test_one_round_on_a_real_engine(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record = tmp_path / "long.jsonl"
    argv = ["--model", str(tiny_llama_dir), "--input-lens", "8,40", "--output-len", "4", "--requests", "1",
            "--repeats", "1", "--engine-flags", "--num-threads 1 --kv-cache-tokens 2048",
            "--result-file", str(record)]  # fmt: skip
    assert long_context.main(argv) == 0
    out = capsys.readouterr().out
    assert "| 8 | " in out and "| 40 | " in out
    (rec,) = read_records(record)
    (run,) = rec["metrics"]["rivulet"]
    assert rec["kind"] == "long_context" and rec["metrics"]["llama_cpp"] == []
    for key in ("decode_tps_8", "ttft_ms_8", "decode_tps_40", "ttft_ms_40"):
        assert run[key] > 0, key
    assert [pid for pid in descendants(os.getpid()) if pid_alive(pid)] == []
