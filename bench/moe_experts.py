"""Time a mixture of experts' experts in one C call (csrc/moe.c's moe_experts) against the dense
matmul's pace on the same bytes, on a GGUF's real stacked experts.

    python -m bench.moe_experts --model ~/.cache/rivulet/bench-models/deepseekv2lite-shape-q4_k_m-v1.gguf
    python -m bench.moe_experts --model M --rows 1,32 --repeats 5 --num-threads 2
    python -m bench.moe_experts --model M --against ~/.cache/rivulet/kernels/OLD.so
    RIVULET_CPU_KIND=avx2 python -m bench.moe_experts --model M

Per row count, one pass runs every MoE layer of the file once (each row routed to ``top_k`` random
experts, new ones each pass, so the weights come from memory as in a real step). ``moe`` is the one
call; ``gate``, ``up`` and ``down`` multiply as many bytes of one projection by quant_matmul, the dense
kernels' pace (``top_k`` adjacent experts from a random first one: one contiguous matrix a layer). At
one row each streams every weight byte once: GB/s = those bytes / time. Best of ``--repeats``
passes, the paths interleaved. ``--against OLD.so`` (another build of the kernels library) runs its
moe call too (``moe@against``) and gives the ratio of the two, the only way to compare builds on a
machine whose pace moves.
"""

from __future__ import annotations

from gpu_worker.backends.cpu.kind import apply_to_environ, describe

KIND = apply_to_environ()  # before torch loads

import argparse  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gpu_worker.backends.cpu import kernels as cpu_kernels  # noqa: E402
from gpu_worker.backends.cpu.experts import QuantExperts, interleave_experts  # noqa: E402
from gpu_worker.backends.cpu.layouts import kernel_type  # noqa: E402
from gpu_worker.models.moe import ExpertGroups  # noqa: E402
from gpu_worker.weights.formats import QuantBlocks, QuantizedExperts  # noqa: E402

PARTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
AGAINST = "@against"  # the --against build's path


def read_experts(path: Path) -> list[QuantizedExperts]:
    """Every MoE layer's stacked experts, in the worker's layout (rows interleaved by 8 where it is)."""
    reader = gguf.GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors}
    layers = []
    for i in range(len(reader.tensors)):
        names = [f"blk.{i}.{part}.weight" for part in PARTS]
        if not all(n in by_name for n in names):
            continue
        blocks = []
        for n in names:
            t = by_name[n]
            cols, rows, experts = (int(d) for d in t.shape)
            data = torch.from_numpy(np.asarray(t.data).reshape(experts * rows, -1).copy())
            blocks.append(QuantBlocks(int(t.tensor_type), data, cols))
        gate, up, down = blocks
        layers.append(interleave_experts(QuantizedExperts(gate, up, down, experts)))
    return layers


def expert_bytes(weight: QuantizedExperts, count: int) -> int:
    return sum(p.data.shape[1] * p.rows // weight.num_experts * count for p in weight.projections)


def groups(rows: int, top_k: int, experts: int, dtype: torch.dtype, rng: np.random.Generator) -> ExpertGroups:
    """Each of ``rows`` rows routed to ``top_k`` random experts."""
    ids = torch.stack([torch.from_numpy(rng.permutation(experts)[:top_k]) for _ in range(rows)])
    return ExpertGroups.of(ids, torch.rand(rows, top_k).to(dtype), experts)


def passes(
    args: argparse.Namespace,
    libs: dict[str, cpu_kernels.CpuKernels],
    layers: list[QuantizedExperts],
    rows: int,
) -> dict[str, Callable[[], float]]:
    """name -> one pass over every layer, returning its time (the inputs made before the clock starts)."""
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    kernels = libs["moe"]
    dtype, num_experts, rng = getattr(torch, args.dtype), layers[0].num_experts, np.random.default_rng(0)
    hidden, inner = layers[0].down.rows // num_experts, layers[0].gate.rows // num_experts
    x, act = torch.randn(rows, hidden).to(dtype), torch.randn(rows, inner).to(dtype)

    def moe(lib: cpu_kernels.CpuKernels) -> Callable[[], float]:
        impls = [QuantExperts(w, lib, F.silu, lambda t: t) for w in layers]

        def run() -> float:
            routed = [groups(rows, args.top_k, num_experts, dtype, rng) for _ in impls]
            t0 = clock()
            for impl, g in zip(impls, routed, strict=True):
                impl(x, g)
            return clock() - t0

        return run

    def matmul(part: int) -> Callable[[], float]:
        def run() -> float:
            todo = []
            for w in layers:
                first = int(rng.integers(0, num_experts - args.top_k + 1))
                blocks = w.experts_of(first, args.top_k).projections[part]
                a = x if blocks.cols == hidden else act
                todo.append((kernel_type(blocks), blocks.data, blocks.cols, a))
            t0 = clock()
            for call in todo:
                kernels.quant_matmul(*call)
            return clock() - t0

        return run

    return {name: moe(lib) for name, lib in libs.items()} | {
        name: matmul(i) for i, name in enumerate(("gate", "up", "down"))
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a GGUF with stacked experts (ffn_*_exps)")
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32])
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--num-threads", type=int, default=0)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="cpu: this process's CPU time")
    p.add_argument("--against", default="", help="another build of the kernels library: its moe call too")
    args = p.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    kernels = cpu_kernels.load(KIND)
    assert kernels is not None, "no CPU kernels"
    layers = read_experts(Path(args.model).expanduser())
    num_experts = layers[0].num_experts
    print(f"{describe(KIND)}; {len(layers)} MoE layers, {num_experts} experts, top {args.top_k}")
    for rows in args.rows:
        libs = {"moe": kernels}
        if args.against:
            libs["moe" + AGAINST] = cpu_kernels.CpuKernels(Path(args.against), KIND)
        paths = passes(args, libs, layers, rows)
        best = {name: run() for name, run in paths.items()}  # warm-up passes
        best = dict.fromkeys(paths, float("inf"))
        for _ in range(args.repeats):
            for name, run in paths.items():
                best[name] = min(best[name], run())
        used = min(num_experts, args.top_k * rows)
        moved = dict.fromkeys(libs, sum(expert_bytes(w, used) for w in layers))
        for i, name in enumerate(("gate", "up", "down")):
            moved[name] = sum(w.projections[i].data.nbytes // num_experts * args.top_k for w in layers)
        for name, sec in best.items():
            note = f"  {moved[name] / sec / 1e9:6.1f} GB/s" if rows == 1 else ""
            print(f"rows {rows:3d}  {name:12s} {sec / len(layers) * 1e3:7.3f} ms a layer{note}")
        if args.against:
            print(f"rows {rows:3d}  moe / moe{AGAINST}: {best['moe'] / best['moe' + AGAINST]:.3f}")


if __name__ == "__main__":
    main()
