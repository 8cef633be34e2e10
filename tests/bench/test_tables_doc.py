"""bench.tables_doc: a tables.sh run's outputs land between their markers, the prose around kept."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench import tables_doc
from bench.tables_doc import begin_marker, end_marker

DOC = Path(tables_doc.__file__).resolve().parent.parent / "docs" / "benchmarks.md"
STEPS_RE = re.compile(r"^\s*\[(\w+)\]=", re.M)


def _run(tmp_path: Path, step: str, output: str, commit: str = "abc1234") -> Path:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    (out / f"{step}.txt").write_text(f"== {step}: python -m bench.{step} --rounds 3\n{output}")
    with (out / "done.txt").open("a") as done:
        done.write(f"{commit} 2026-11-28T18:00:00Z {step} done\n")
    return out


def test_every_tables_sh_step_but_the_sweep_has_its_markers() -> None:
    script = (DOC.parent.parent / "bench" / "tables.sh").read_text()
    steps = set(STEPS_RE.findall(script)) - {"sweep"}
    doc = DOC.read_text()
    assert steps, "tables.sh's STEPS were not found"
    for step in steps:
        begin, end = doc.find(begin_marker(step)), doc.find(end_marker(step))
        assert 0 <= begin < end, step


def test_a_step_is_written_between_its_markers_and_the_prose_kept(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"intro\n{begin_marker('choices')}\nold numbers\n{end_marker('choices')}\noutro\n")
    out = _run(tmp_path, "choices", "# a note\n| round | ms |\n|---|---|\n| 0 | 12 |\nmedian 12 ms\n")
    assert tables_doc.write(out, ["choices"], doc, "cpu kind avx2") == ["choices"]
    text = doc.read_text()
    assert text.startswith("intro\n") and text.endswith("\noutro\n")
    assert "old numbers" not in text
    block = text.split(begin_marker("choices"))[1].split(end_marker("choices"))[0]
    assert (
        "`python -m bench.choices --rounds 3` (commit `abc1234`, 2026-11-28T18:00:00Z; cpu kind avx2)"
        in block
    )
    assert "| round | ms |\n|---|---|\n| 0 | 12 |" in block  # tables stay tables
    assert "```text\n# a note\n```" in block and "```text\nmedian 12 ms\n```" in block


def test_a_failed_or_missing_step_is_left_alone(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    original = f"{begin_marker('tp_step')}\nkept\n{end_marker('tp_step')}\n"
    doc.write_text(original)
    out = _run(tmp_path, "tp_step", "Traceback ...\n!! tp_step failed\n")
    assert tables_doc.write(out, ["tp_step", "choices"], doc, "cpu") == []
    assert doc.read_text() == original


def test_a_step_without_markers_is_an_error_naming_it(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("no markers\n")
    out = _run(tmp_path, "quant_k", "| a |\n")
    with pytest.raises(KeyError, match="quant_k"):
        tables_doc.write(out, ["quant_k"], doc, "cpu")
    assert tables_doc.main([str(out), "quant_k", "--doc", str(doc)]) == 2
