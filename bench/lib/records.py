"""One JSON record per benchmark run: what ran (config), where (machine, git commit), and the numbers.

Records are appended one per line (JSON Lines) so runs accumulate in one file and a
sweep can be re-plotted later. ``SCHEMA_VERSION`` changes whenever a key changes.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
RECORD_KEYS = ("schema", "kind", "time", "git_commit", "machine", "config", "metrics", "samples")
REPO = Path(__file__).resolve().parents[2]


def git_commit() -> str:
    """HEAD's hash, with "+dirty" when tracked files differ from it; "unknown" outside a checkout."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "diff", "--quiet", "HEAD", "--"], cwd=REPO, capture_output=True, timeout=10
        ).returncode
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:  # not Linux: platform.processor() is the best we have
        return platform.processor() or "unknown"
    return platform.processor() or "unknown"


def cpu_features() -> str:
    """The CPU kind rivulet acts as and the flags that decide its kernels (backends/cpu/kind.py)."""
    from gpu_worker.backends.cpu.kind import describe, requested_kind

    return describe(requested_kind())


def machine_info() -> dict[str, Any]:
    """What the numbers depend on: CPU, cores, memory, Python and torch versions."""
    try:
        import torch

        torch_version = str(torch.__version__)
        cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        torch_version, cuda = "not installed", None
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "host": platform.node(),
        "cpu": cpu_model(),
        "cpu_features": cpu_features(),
        "cores": os.cpu_count(),
        "mem_gib": round(mem_gib, 1),
        "gpu": cuda,
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch_version,
    }


def make_record(
    kind: str,
    config: dict[str, Any],
    metrics: Any,
    samples: dict[str, list[float]] | None = None,
    machine: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A record with every key of RECORD_KEYS; ``metrics`` is a dataclass (e.g. Summary) or a dict."""
    return {
        "schema": SCHEMA_VERSION,
        "kind": kind,
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "machine": machine if machine is not None else machine_info(),
        "config": config,
        "metrics": dict(metrics) if isinstance(metrics, dict) else dataclasses.asdict(metrics),
        "samples": samples or {},
    }


def append_record(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")


def read_records(path: Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
