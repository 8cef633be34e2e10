"""python -m bench.serving and bench.sweep against real engines on the tiny model (no timing assertions)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import serving as serving_script
from bench import sweep
from bench.lib import serving, sweep_runner, sweeps
from bench.lib.launch import pid_alive, rejected_flags
from bench.lib.records import read_records
from tests.integration.engine import running_engine

ENGINE_FLAGS = ("--num-threads", "1", "--kv-cache-tokens", "2048")


@pytest.mark.timeout(180)
def test_serving_counts_every_token_of_a_real_engine(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = tmp_path / "serving.jsonl"
    common = ["--model", str(tiny_llama_dir), "--result-file", str(records), "--no-progress"]
    with running_engine(tiny_llama_dir, tmp_path, "--kv-cache-tokens", "2048") as engine:
        target = ["--endpoint", engine.endpoint, *common]
        random_args = ["--workload", "random", "--num-requests", "6", "--input-len", "20",
                       "--output-len", "5", "--range-ratio", "0.5", "--max-concurrency", "3",
                       "--label", "r"]  # fmt: skip
        assert serving_script.main([*target, *random_args]) == 0
        repeated_args = ["--prompt-repeats", "40,1", "--unique-prompts", "--num-requests", "4",
                         "--max-new-tokens", "3", "--no-stop-on-eos",
                         "--submit-interval-ms", "20"]  # fmt: skip
        assert serving_script.main([*target, *repeated_args]) == 0
    out = capsys.readouterr().out
    assert out.count("=== streaming benchmark ===") == 2 and "Label: r" in out
    rand, repeated = read_records(records)
    items = serving.build_workload(serving.build_parser().parse_args([*common, *random_args]))
    m = rand["metrics"]
    assert (m["num_requests"], m["num_failed"]) == (6, 0)
    # exact prompt lengths reach the engine; EOS is ignored
    assert m["prompt_tokens"] == sum(len(it.input_ids or []) for it in items)
    assert m["completion_tokens"] == sum(it.max_new_tokens for it in items)
    assert len(rand["samples"]["ttft_ms"]) == 6
    assert len(rand["samples"]["itl_ms"]) == sum(it.max_new_tokens - 1 for it in items)
    assert rand["config"]["workload"] == "random" and rand["config"]["label"] == "r"
    assert repeated["config"]["workload"] == "repeated-prompt"  # the default
    assert repeated["metrics"]["completion_tokens"] == 12 and repeated["metrics"]["prompt_tokens"] > 2 * 40


@pytest.mark.timeout(240)
def test_sweep_interleaves_reports_na_and_stops_every_engine(tiny_llama_dir: Path, tmp_path: Path) -> None:
    workload = ("--workload", "random", "--num-requests", "3", "--input-len", "12", "--output-len", "3")
    a = sweeps.EngineSpec("chunk 16", ("--chunked-prefill-size", "16"))
    b = sweeps.EngineSpec("cap 1", ("--max-running-requests", "1"))
    missing = sweeps.EngineSpec("future", ("--no-such-flag-yet",))
    spec = sweeps.Sweep(
        "t", "test", "-", tuple(sweeps.Variant(e.label, e, workload) for e in (a, b, missing))
    )
    opts = sweep_runner.SweepOptions(repeats=2, model=str(tiny_llama_dir), engine_flags=ENGINE_FLAGS,
                              workdir=tmp_path / "w", records=tmp_path / "runs.jsonl")  # fmt: skip
    result = sweep_runner.run_sweep(spec, opts)
    status = {v.label: v.status for v in result.variants}
    assert status["chunk 16"] == status["cap 1"] == "ok"
    assert status["future"].startswith("n/a (flag not available") and "--no-such-flag-yet" in status["future"]
    for v in result.variants[:2]:
        assert len(v.runs) == 2 and all(r["num_failed"] == 0 and r["completion_tokens"] == 9 for r in v.runs)
    runs = [r["config"] for r in read_records(tmp_path / "runs.jsonl")]
    order = [(c["variant"], c["repeat"], c["seed"]) for c in runs]  # A B A B, one seed per round
    assert order == [("chunk 16", 1, 0), ("cap 1", 1, 0), ("chunk 16", 2, 1), ("cap 1", 2, 1)]
    assert len(result.pids) >= 2 * 4  # two launchers, three children each
    assert [pid for pid, start in result.pids.items() if pid_alive(pid, start)] == []


def test_flag_check_and_built_in_sweeps_are_well_formed() -> None:
    assert rejected_flags(["--chunked-prefill-size", "256"]) is None
    why = rejected_flags(["--definitely-not-a-flag"])
    assert why is not None and "--definitely-not-a-flag" in why
    args = sweep.build_parser().parse_args(["--quick", "--sweeps", "pack,concurrency,offline"])
    chosen, with_offline = sweep.selected(args)
    assert [s.name for s in chosen] == ["pack", "concurrency"] and with_offline
    assert {v.concurrency for v in chosen[1].variants} == set(sweeps.QUICK_LEVELS)
    for s in sweeps.default_sweeps([]):
        labels = [v.label for v in s.variants]
        assert len(labels) == len(set(labels)), f"{s.name}: variant labels must be unique"
        for v in sweeps.quick(s).variants:  # every workload parses; quick ones stay small
            ns = serving.build_parser().parse_args(list(v.workload))
            n = ns.groups * ns.questions if ns.workload == "shared-prefix" else ns.num_requests
            new = ns.output_len if ns.workload == "random" else ns.max_new_tokens
            assert n <= 8 and new <= 8, f"{s.name}: {v.workload}"
