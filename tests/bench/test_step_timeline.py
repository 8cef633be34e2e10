"""python -m bench.step_timeline: RIVULET_STEP_TRACE off and on, and a real run on the tiny model whose
trace accounts for every prompt and generated token; no timing assertions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import step_timeline
from protocol.step_trace import TRACE_DIR_ENV, StepTrace, run_delay_s


def test_the_trace_is_off_unless_the_variable_names_a_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TRACE_DIR_ENV, raising=False)
    assert StepTrace.open("worker0") is None
    monkeypatch.setenv(TRACE_DIR_ENV, str(tmp_path / "trace"))
    trace = StepTrace.open("worker0")
    assert trace is not None
    trace.write("step", step=3, rows=2)
    (path,) = (tmp_path / "trace").glob("worker0-*.jsonl")
    line = {"event": "step", "step": 3, "rows": 2}
    assert [json.loads(text) for text in path.read_text().splitlines()] == [line]
    assert step_timeline.read_trace(tmp_path / "trace") == {"step": [line]}
    assert (run_delay_s() or 0.0) >= 0.0


@pytest.mark.timeout(300)
def test_a_traced_engine_accounts_for_every_token(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace_dir = tmp_path / "trace"
    argv = ["--model", str(tiny_llama_dir), "--zmq", "--streams", "4", "--input-len", "12",
            "--output-len", "5", "--engine-flags", "--num-threads 1 --kv-cache-tokens 2048",
            "--trace-dir", str(trace_dir), "--steps"]  # fmt: skip
    assert step_timeline.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("round 1: wall ") and "  step " in out
    events = step_timeline.read_trace(trace_dir)
    adds = [a for a in events["add"] if a["prompt"] == 12]  # the warm-up's prompts are shorter
    assert len(adds) == 4
    steps = {s["step"]: s for s in events["step"]}
    sent = {s["step"]: s for s in events["send"]}
    assert steps.keys() == sent.keys() == {r["step"] for r in events["result"]}
    for step, s in steps.items():
        assert s["tokens"] == sent[step]["prefill_tokens"] + sent[step]["decode_rows"]
        assert s["recv"] <= s["reply"] <= s["sent"] and s["forward_s"] > 0 and s["threads"] == 1
    # The measured round's steps hold its 4 prompts and 4 rows for each of their 4 later tokens
    # (the first comes from the prompt's own row; none ends early: EOS is ignored).
    first = min(a["t"] for a in adds)
    measured = [s for s in steps.values() if s["recv"] >= first]
    assert sum(sent[s["step"]]["prefill_tokens"] for s in measured) == 4 * 12
    assert sum(sent[s["step"]]["decode_rows"] for s in measured) == 4 * 4
