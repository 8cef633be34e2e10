"""The worker's weight bytes and RSS per ``--weight-dtype``, in one run, against the GGUF's tensor bytes.

    python -m bench.weight_memory [--model FILE.gguf] [--weight-dtypes auto,float32] [--dtype auto]
        [--kv-cache-tokens 4096] [--kv-cache-dtype DTYPE] [--kv-budget-gib GIB]

Each engine is started in turn, idle after Ready: the worker logs the bytes of the weight tensors
it holds (every storage once: parameters and each copy a matmul path keeps), and its RSS is read
from /proc (RSS includes libtorch and the KV pool, so compare the rows with each other). The KV pool
(``--kv-cache-tokens``, 4096 by default) and a hybrid model's recurrent-state pool are read from the
worker's start log, and the last column is RSS over the file's tensors plus both pools (issue 53's
budget: <= 1.15). ``--kv-budget-gib`` adds a line a run: the pool's logged dtype and bytes a token,
its bytes in all, and whether they fit the budget (issue 56: 32 streams of 4096 tokens of the 27-layer
DeepSeek-V2-Lite file, ``--kv-cache-tokens 131072 --kv-cache-dtype fp8_e4m3``, in 2 GiB).

Issue 54's budget is a row's last columns: RSS <= held + the pools + 150 MB. Beside it, the runtime's
floor: the RSS of a process that imports what the worker does (the interpreter, torch, transformers,
rivulet's worker modules) and loads no model, and what the worker holds beyond that floor and its
weights (its tables, buffers and the pages of the pools it touched).
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.lib.launch import rivulet_server

HELD = re.compile(r"weights held: ([0-9.]+) MB")
PATHS = re.compile(r"matmul paths \(Linears\): ([^;]+);")
KV_POOL = re.compile(r"KV pool: (\d+) pages of (\d+) tokens, (\S+) \((\d+) bytes a token")
WORKER_PID = re.compile(r"pids:.*?\bgpu_worker=(\d+)")
STATE_POOL = re.compile(r"recurrent-state pool: .*?: ([0-9.]+) MiB at most")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


BUDGET_OVER_POOLS_MB = 150.0  # issue 54: RSS <= held + the pools + this

RUNTIME_PROBE = (
    "import pathlib, gpu_worker.process, gpu_worker.weights.loader, transformers; "
    "print(next(l.split()[1] for l in pathlib.Path('/proc/self/status').read_text().splitlines() "
    "if l.startswith('VmRSS:')))"
)


def runtime_floor_mb() -> float:
    """The RSS of a process importing what the worker imports, without a model (module docstring)."""
    out = subprocess.run([sys.executable, "-c", RUNTIME_PROBE], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1]) / 1024


def worker_pid(stdout: str) -> int | None:
    """The worker's pid from the launcher's ready line (``pids: gpu_worker=N ...``): not the largest
    process, which for a 262k-token vocabulary can be the tokenizer."""
    found = WORKER_PID.findall(stdout)
    return int(found[-1]) if found else None


def gguf_tensor_mb(path: Path) -> float:
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors) / 1e6


def measure(
    model: str | None, weight_dtype: str, dtype: str, workdir: Path, kv_flags: list[str]
) -> dict[str, object]:
    flags = ["--weight-dtype", weight_dtype, "--dtype", dtype, *kv_flags]
    with rivulet_server(weight_dtype, flags, workdir / weight_dtype, model=model) as server:
        time.sleep(1.0)  # Ready is sent after the weights are in place; let the worker settle
        server.watch()
        log = server.log_tail(200_000)
        held = HELD.findall(log)
        paths = PATHS.findall(log)
        kv = KV_POOL.findall(log)
        state = STATE_POOL.findall(log)
        ready_line = (workdir / weight_dtype / "engine.stdout").read_text(errors="replace")
        worker = worker_pid(ready_line) or max(server.alive_pids(), key=rss_mb)
        return {
            "weight_dtype": weight_dtype,
            "held_mb": float(held[-1]) if held else float("nan"),
            "worker_rss_mb": rss_mb(worker),
            "paths": paths[-1] if paths else "?",
            "kv_mb": math.prod(int(x) for i, x in enumerate(kv[-1]) if i != 2) / 1e6 if kv else float("nan"),
            "kv_pool": kv[-1] if kv else None,
            "state_mb": float(state[-1]) * 2**20 / 1e6 if state else 0.0,
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a .gguf file (default: the embedded SmolLM2)")
    p.add_argument("--weight-dtypes", default="auto,float32")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-tokens", type=int, default=4096)
    p.add_argument("--kv-cache-dtype", default=None, help="the engine's --kv-cache-dtype (default: its own)")
    p.add_argument("--kv-budget-gib", type=float, default=0.0, help="report whether the KV pool fits this")
    args = p.parse_args()
    kv_flags = ["--kv-cache-tokens", str(args.kv_cache_tokens)]
    if args.kv_cache_dtype:
        kv_flags += ["--kv-cache-dtype", args.kv_cache_dtype]
    from gpu_worker.weights.model_files import source_gguf

    path = source_gguf(args.model)
    if path is None:
        raise SystemExit("--model must be a .gguf file")
    file_mb = gguf_tensor_mb(path)
    floor = runtime_floor_mb()
    print(f"GGUF {path.name}: {file_mb:.1f} MB of tensors; --dtype {args.dtype}")
    print(f"runtime floor (the worker's imports, no model): {floor:.0f} MB RSS")
    print(
        f"{'--weight-dtype':<15} {'held MB':>9} {'x file':>7} {'worker RSS MB':>14} {'KV MB':>7} "
        f"{'state MB':>8} {'RSS / (file + pools)':>20} {'budget MB':>9} {'met':>4} "
        f"{'RSS - floor - held':>18}  matmul paths"
    )
    with tempfile.TemporaryDirectory(prefix="rivulet-mem-") as tmp:
        for weight_dtype in args.weight_dtypes.split(","):
            row = measure(args.model, weight_dtype, args.dtype, Path(tmp), kv_flags)
            held, rss = float(row["held_mb"]), float(row["worker_rss_mb"])  # type: ignore[arg-type]
            kv, state = float(row["kv_mb"]), float(row["state_mb"])  # type: ignore[arg-type]
            budget = held + kv + state + BUDGET_OVER_POOLS_MB
            print(
                f"{weight_dtype:<15} {held:>9.1f} {held / file_mb:>7.2f} {rss:>14.0f} {kv:>7.1f} "
                f"{state:>8.1f} {rss / (file_mb + kv + state):>20.3f} {budget:>9.0f} "
                f"{'yes' if rss <= budget else 'no':>4} {rss - floor - held:>18.0f}  {row['paths']}"
            )
            if args.kv_budget_gib:
                print(budget_line(row["kv_pool"], args.kv_budget_gib))  # type: ignore[arg-type]


def budget_line(pool: tuple[str, str, str, str] | None, budget_gib: float) -> str:
    """The start log's KV pool (pages, page size, dtype, bytes a token) against a budget in GiB."""
    if pool is None:
        return "KV budget: no 'KV pool' line in the worker's log"
    pages, page_size, dtype, per_token = pool
    tokens, total = int(pages) * int(page_size), int(pages) * int(page_size) * int(per_token)
    verdict = "fits" if total <= budget_gib * 2**30 else "does NOT fit"
    return (
        f"KV budget: {tokens} tokens x {per_token} bytes a token ({dtype}) = {total} bytes "
        f"({total / 2**30:.3f} GiB) {verdict} in {budget_gib:g} GiB"
    )


if __name__ == "__main__":
    main()
