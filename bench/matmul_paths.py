"""Time each matmul path of a bf16 model per row count on this CPU kind, and print the plan they give.

    python -m bench.matmul_paths                          # this CPU as it is
    RIVULET_CPU_KIND=avx2 python -m bench.matmul_paths    # acting as an AVX2-only CPU

One pass multiplies x [rows, in] by the 120 distinct weights of SmolLM2's 30 layers (qkv, o, gate_up,
down), so the weights come from memory as in a real step, not from cache.
Paths (gpu_worker/backends/cpu/matmul.py):
``c`` (our few-row kernel on plain bf16 weights), ``onednn`` (bf16 packed, AVX-512 kinds only),
``onednn_fp32`` (an fp32 packed copy; the input cast to fp32 and the output back to bf16 included).
Best of ``--repeats`` passes each, interleaved. The printed plan is what
gpu_worker/backends/cpu/matmul.py's PLANS should say for this kind; the table is committed there
by hand, with the numbers in its comments.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

from gpu_worker.backends.cpu.kind import apply_to_environ, describe

KIND = apply_to_environ()  # before torch loads

import torch  # noqa: E402

from gpu_worker.backends.cpu import kernels as cpu_kernels  # noqa: E402
from gpu_worker.backends.cpu.matmul import can_pack, onednn_blocked, onednn_linear  # noqa: E402

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # SmolLM2: qkv, o, gate_up, down [out, in]
LAYERS = 30
ROWS = (1, 2, 4, 8, 12, 16, 24, 32, 64, 256)


def _paths(kernels: cpu_kernels.CpuKernels | None) -> dict[str, Callable[[torch.Tensor], object]]:
    """Each path available on this kind, as a function of x [rows, 576] running one 30-layer pass."""
    torch.manual_seed(0)
    plain = [torch.randn(out, inp).bfloat16() for _ in range(LAYERS) for out, inp in SHAPES]
    xs: dict[int, torch.Tensor] = {}

    def x_for(x: torch.Tensor, inp: int) -> torch.Tensor:
        key = x.shape[0] * 10_000 + inp
        if key not in xs:
            xs[key] = torch.randn(x.shape[0], inp).bfloat16()
        return xs[key]

    paths: dict[str, Callable[[torch.Tensor], object]] = {}
    if kernels is not None:
        paths["c"] = lambda x: [kernels.matmul(x_for(x, w.shape[1]), w) for w in plain]
    if can_pack(torch.bfloat16, KIND):
        packed = [onednn_blocked(w) for w in plain]
        paths["onednn"] = lambda x: (
            [onednn_linear(x_for(x, w.shape[1]), p, None) for w, p in zip(plain, packed, strict=True)]
        )
    if can_pack(torch.float32, KIND):
        fp32 = [onednn_blocked(w.float()) for w in plain]
        paths["onednn_fp32"] = lambda x: (
            [
                onednn_linear(x_for(x, w.shape[1]).float(), p, None).bfloat16()
                for w, p in zip(plain, fp32, strict=True)
            ]
        )
    return paths


def measure(rows: tuple[int, ...], repeats: int) -> dict[int, dict[str, float]]:
    """Best ms per 30-layer pass, per row count and path."""
    kernels = cpu_kernels.load(KIND)
    paths = _paths(kernels)
    best: dict[int, dict[str, float]] = {m: dict.fromkeys(paths, float("inf")) for m in rows}
    for m in rows:
        x = torch.empty(m, 1)
        for fn in paths.values():
            fn(x)  # warm-up: oneDNN builds its kernels, x buffers are made
        for _ in range(repeats):
            for name, fn in paths.items():
                started = time.perf_counter()
                fn(x)
                best[m][name] = min(best[m][name], (time.perf_counter() - started) * 1e3)
    return best


def plan_of(best: dict[int, dict[str, float]]) -> tuple[int, int | None]:
    """(c_max_rows, fp32_min_rows): C while it is the fastest from one row on, fp32 from where it
    beats every bf16 path at that count and every larger one."""
    c_max = 0
    for m in sorted(best):
        if "c" in best[m] and best[m]["c"] <= min(best[m].values()):
            c_max = m
        else:
            break
    fp32_min = None
    for m in sorted(best, reverse=True):
        if m <= c_max or "onednn_fp32" not in best[m] or best[m]["onednn_fp32"] > min(best[m].values()):
            break
        fp32_min = m
    return c_max, fp32_min


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated row counts")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    ap.add_argument("--json", help="write the table here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = tuple(int(r) for r in args.rows.split(","))
    best = measure(rows, args.repeats)
    names = list(next(iter(best.values())))
    print(f"# {describe(KIND)}; torch threads {torch.get_num_threads()}")
    print("| rows | " + " | ".join(f"{n} ms" for n in names) + " | fastest |")
    print("|---" * (len(names) + 2) + "|")
    for m, times in best.items():
        cells = " | ".join(f"{times[n]:.2f}" for n in names)
        print(f"| {m} | {cells} | {min(times, key=lambda n: times[n])} |")
    c_max, fp32_min = plan_of(best)
    print(f"plan for {KIND.value}: MatmulPlan(c_max_rows={c_max}, fp32_min_rows={fp32_min})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kind": KIND.value, "cpu": describe(KIND), "ms": best}, f, indent=1)


if __name__ == "__main__":
    main()
