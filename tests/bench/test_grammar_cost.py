"""bench/grammar_cost.py's table, from made-up numbers (no engine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import grammar_cost
from bench.grammar_cost import SCHEMAS, format_table, schema_grammar
from bench.lib.records import read_records


def test_the_table_gives_the_ratio_and_the_ttft_added() -> None:
    result = {
        "rounds": [
            {"off": {"out_tps": 200.0, "mean_tokens": 128.0}, "on": {"out_tps": 180.0, "mean_tokens": 60.0}}
        ],
        "ttft_s": {
            "none": [0.050, 0.060, 0.055],
            "new": [0.100, 0.120, 0.110],
            "cached": [0.058, 0.057, 0.056],
        },
    }
    table = format_table(result)
    assert "| 0 | 200.0 | 180.0 | 0.900 | 128.0 | 60.0 |" in table
    assert "median with / without: 0.900" in table
    assert "added by a new schema: 55.0 ms" in table and "by a cached one: 2.0 ms" in table


def test_every_schema_is_a_json_schema_grammar() -> None:
    assert all(schema_grammar(s).kind == "json_schema" for s in SCHEMAS)


@pytest.mark.timeout(240)
def test_the_bench_runs_against_a_real_engine(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No timing assertions: the runs happen, the free run repeats the schema run's lengths."""
    records = tmp_path / "grammar.jsonl"
    argv = ["--model", str(tiny_llama_dir), "--streams", "3", "--output-len", "4", "--rounds", "2",
            "--ttft-requests", "1", "--engine-flags", "--num-threads 1 --kv-cache-tokens 2048",
            "--result-file", str(records)]  # fmt: skip
    assert grammar_cost.main(argv) == 0
    assert "median with / without" in capsys.readouterr().out
    (record,) = read_records(records)
    rounds = record["metrics"]["rounds"]
    assert len(rounds) == 2 and all(run["on"]["mean_tokens"] == run["off"]["mean_tokens"] for run in rounds)
    assert {k: len(v) for k, v in record["metrics"]["ttft_s"].items()} == {"none": 1, "new": 1, "cached": 1}
