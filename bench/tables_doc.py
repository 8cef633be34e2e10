"""Write bench/tables.sh's outputs into docs/benchmarks.md, each between its step's markers.

    python -m bench.tables_doc /tmp/tables                 # every step with an output there
    python -m bench.tables_doc /tmp/tables quant_k one_call

A step's place in the file is ``<!-- tables.sh STEP: begin -->`` ... ``<!-- tables.sh STEP: end -->``;
what lies between is replaced by the command, its commit, date and CPU (from the run's done.txt and
STEP.txt), and the command's output: its markdown table lines as they are, every other line in a
text block. The prose around the markers (what a table measures, why) is kept. A step whose output
is missing is left as it was; a step without markers in the file is an error naming it, so a run is
never silently left out.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


@dataclass(frozen=True)
class StepOutput:
    """One step of a tables.sh run: its command, when and where it ran, and what it printed."""

    step: str
    command: str
    commit: str
    date: str
    lines: list[str]


def begin_marker(step: str) -> str:
    return f"<!-- tables.sh {step}: begin -->"


def end_marker(step: str) -> str:
    return f"<!-- tables.sh {step}: end -->"


def read_step(out_dir: Path, step: str) -> StepOutput | None:
    """The step's output in ``out_dir`` (None if it did not run there, or failed)."""
    path = out_dir / f"{step}.txt"
    if not path.exists():
        return None
    first, *lines = path.read_text().splitlines()
    if any(line.startswith(f"!! {step} failed") for line in lines):
        return None
    command = first.partition(": ")[2] if first.startswith(f"== {step}") else "(not recorded)"
    commit, date = "(not recorded)", "(not recorded)"
    done = out_dir / "done.txt"
    for line in done.read_text().splitlines() if done.exists() else []:
        parts = line.split()
        if len(parts) >= 3 and parts[2] == step:
            commit, date = parts[0], parts[1]  # the last run of the step wins
    return StepOutput(step, command, commit, date, lines)


def render(out: StepOutput, cpu: str) -> list[str]:
    """The block between a step's markers: provenance, then tables as tables and the rest as text."""
    block = [f"`{out.command}` (commit `{out.commit}`, {out.date}; {cpu}):", ""]
    text: list[str] = []
    for line in [*out.lines, ""]:
        if line.startswith("|") or not line.strip():
            if text:
                block += ["```text", *text, "```", ""]
                text = []
            if line.startswith("|"):
                block.append(line)
            elif block[-1] != "":
                block.append("")
        else:
            text.append(line.rstrip())
    return block


def replace_block(doc: str, step: str, block: list[str]) -> str:
    """``doc`` with the text between ``step``'s markers replaced by ``block``."""
    pattern = re.compile(re.escape(begin_marker(step)) + r"\n.*?" + re.escape(end_marker(step)), re.S)
    if not pattern.search(doc):
        raise KeyError(f"docs/benchmarks.md has no markers for step {step!r} ({begin_marker(step)})")
    body = "\n".join([begin_marker(step), *block, end_marker(step)])
    return pattern.sub(lambda _: body, doc, count=1)


def write(out_dir: Path, steps: list[str], doc_path: Path, cpu: str) -> list[str]:
    """Rewrite ``doc_path``'s blocks for ``steps`` from ``out_dir``; returns the steps written."""
    doc = doc_path.read_text()
    written = []
    for step in steps:
        out = read_step(out_dir, step)
        if out is not None:
            doc = replace_block(doc, step, render(out, cpu))
            written.append(step)
    doc_path.write_text(doc)
    return written


def steps_in(out_dir: Path) -> list[str]:
    return sorted(p.stem for p in out_dir.glob("*.txt") if p.stem != "done")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out_dir", type=Path, help="the folder bench/tables.sh wrote")
    parser.add_argument("steps", nargs="*", help="the steps to write (default: every output there)")
    parser.add_argument("--doc", type=Path, default=DOC)
    args = parser.parse_args(argv)
    from gpu_worker.backends.cpu.kind import describe, requested_kind

    steps = args.steps or [s for s in steps_in(args.out_dir) if s != "sweep"]  # the sweep writes its own
    try:
        written = write(args.out_dir, steps, args.doc, describe(requested_kind()))
    except KeyError as exc:
        print(f"bench.tables_doc: {exc.args[0]}", file=sys.stderr)
        return 2
    print(f"wrote {', '.join(written) or 'nothing'} into {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
