"""Time the quantized-weight matmul (csrc/quant.c) per GGUF type and row count on SmolLM2-135M's shapes,
beside the C bf16 matmul and torch's fp32 linear on the same shapes.

    python -m bench.quant_matmul                          # this CPU as it is
    RIVULET_CPU_KIND=avx2 python -m bench.quant_matmul    # acting as an AVX2-only CPU
    python -m bench.quant_matmul --against OLD.so         # this build against another, interleaved

One pass multiplies x [rows, in] by the 120 distinct weights of SmolLM2's 30 layers (qkv, o, gate_up,
down; ~106 M weights), so they come from memory as in a real step, not from cache; the 49152 x 576
head is timed on its own. Best of ``--repeats`` passes each, paths interleaved. At one row the pass
streams every weight byte once: GB/s = weight bytes / time, against the machine's memory bandwidth.
x is bfloat16 for the quantized and bf16 paths, float32 for torch's. Each quantized type runs its
integer path (``q4_1``) and its dequantized-panel path (``q4_1_dense``); the legacy types also in the
worker's layout, rows interleaved by 8 (``q4_1_x8``, ``q4_1_x8_dense``; csrc/quant_x8.c), and the
K-quants there with 8-bit activations where the build has them (``q4_k_x8_a8``; csrc/quant_kx8.c);
BF16 on vdpbf16ps where the build has it (``bf16_a8``, activations rounded to bf16; csrc/quant_bf16x.c).

``--against`` takes another build of the kernels library (an older commit's, from
~/.cache/rivulet/kernels): its paths run on the same weights, interleaved with this build's
(``NAME@against``), and each path gets the ratio this build / the other per row count. On a machine
whose bandwidth moves by the hour, only such interleaved ratios compare two builds.
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Callable
from pathlib import Path

from gpu_worker.backends.cpu.kind import apply_to_environ, describe

KIND = apply_to_environ()  # before torch loads

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.lib.floor import read_bandwidth  # noqa: E402
from bench.lib.gguf_blocks import random_blocks  # noqa: E402
from gpu_worker.backends.cpu import kernels as cpu_kernels  # noqa: E402
from gpu_worker.backends.cpu.layouts import A8, X8_TYPES, interleave_rows, kernel_type  # noqa: E402
from gpu_worker.weights.formats import QuantBlocks  # noqa: E402

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # SmolLM2: qkv, o, gate_up, down [out, in]
HEAD = (49152, 576)
LAYERS = 30
ROWS = (1, 8, 32, 256)
TYPES = {"q4_0": gguf.GGMLQuantizationType.Q4_0, "q4_1": gguf.GGMLQuantizationType.Q4_1,
         "q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_k": gguf.GGMLQuantizationType.Q4_K,
         "q5_k": gguf.GGMLQuantizationType.Q5_K, "q6_k": gguf.GGMLQuantizationType.Q6_K,
         "q5_0": gguf.GGMLQuantizationType.Q5_0, "q5_1": gguf.GGMLQuantizationType.Q5_1,
         "iq4_nl": gguf.GGMLQuantizationType.IQ4_NL, "iq4_xs": gguf.GGMLQuantizationType.IQ4_XS,
         "q2_k": gguf.GGMLQuantizationType.Q2_K, "q3_k": gguf.GGMLQuantizationType.Q3_K,
         "f16": gguf.GGMLQuantizationType.F16, "bf16": gguf.GGMLQuantizationType.BF16,
         "mxfp4": gguf.GGMLQuantizationType.MXFP4}  # fmt: skip
# Types gguf-py cannot quantize (or gives as values, not bytes): random blocks of a sane size.
RANDOM = {TYPES[name] for name in ("iq4_nl", "iq4_xs", "q2_k", "q3_k", "f16", "bf16")}
K_QUANTS = {gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K, gguf.GGMLQuantizationType.Q6_K}

Pass = Callable[[int], object]
AGAINST = "@against"  # the suffix of the --against build's paths


def quantized(
    shape: tuple[int, int], qtype: gguf.GGMLQuantizationType, rng: np.random.Generator
) -> torch.Tensor:
    """Random weights of ``shape`` in ``qtype``'s blocks, as uint8 [out, row bytes]. gguf-py cannot
    quantize to K-quants: theirs are random bytes with fp16 d (and dmin) of realistic size."""
    if qtype in K_QUANTS:
        size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, (shape[0] * shape[1] // size, block_bytes), dtype=np.uint8)
        d = rng.uniform(1e-5, 1e-3, (len(blocks), 2)).astype(np.float16).view(np.uint8)
        at = [208] if qtype == gguf.GGMLQuantizationType.Q6_K else [0, 2]  # d; dmin
        for i, off in enumerate(at):
            blocks[:, off : off + 2] = d[:, 2 * i : 2 * i + 2]
        return torch.from_numpy(blocks.reshape(shape[0], -1))
    if qtype in RANDOM:
        return torch.from_numpy(random_blocks(qtype, shape[0], shape[1], rng, std=0.05))
    if qtype == gguf.GGMLQuantizationType.MXFP4:  # random nibbles, exponents about gpt-oss's (2^-7 .. 2^-5)
        blocks = rng.integers(0, 256, (shape[0] * shape[1] // 32, 17), dtype=np.uint8)
        blocks[:, 0] = rng.integers(120, 123, len(blocks))
        return torch.from_numpy(blocks.reshape(shape[0], -1))
    w = rng.standard_normal(shape, dtype=np.float32) * 0.05
    return torch.from_numpy(gguf.quants.quantize(w, qtype))


def quant_pass(
    kernels: cpu_kernels.CpuKernels,
    qtype: int,
    ws: list[tuple[torch.Tensor, int]],
    x_for: Callable[[int, int, torch.dtype], torch.Tensor],
    dense: bool,
) -> Pass:
    """One pass of ``quant_matmul`` (its integer or its ``dense`` path) over the blocks ``ws`` ((w, in)
    each), bfloat16 x as the worker's."""
    return lambda m: [
        kernels.quant_matmul(qtype, w, k, x_for(m, k, torch.bfloat16), dense=dense) for w, k in ws
    ]


def paths(
    kernels: cpu_kernels.CpuKernels, shapes: list[tuple[int, int]], types: list[str], only: str = ""
) -> dict[str, Pass]:
    """Each path as a function of the row count, running one pass over ``shapes`` (distinct weights);
    ``only``: a regular expression the kept paths' names match (empty: all)."""
    rng = np.random.default_rng(0)
    xs: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}

    def x_for(rows: int, inp: int, dtype: torch.dtype) -> torch.Tensor:
        if (rows, inp, dtype) not in xs:
            xs[rows, inp, dtype] = torch.randn(rows, inp).to(dtype)
        return xs[rows, inp, dtype]

    out: dict[str, Pass] = {}
    for name in types:
        qtype = TYPES[name]
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        if not kernels.quant_supported(int(qtype)) or any(i % block for _, i in shapes):
            continue  # (K-quants need in % 256 == 0: not SmolLM2's 576; see --shapes)
        ws = [(quantized(s, qtype, rng), s[1]) for s in shapes]
        out[name] = quant_pass(kernels, int(qtype), ws, x_for, dense=False)
        out[f"{name}_dense"] = quant_pass(kernels, int(qtype), ws, x_for, dense=True)
        if int(qtype) in X8_TYPES:  # the layout the worker holds these in
            x8 = [interleave_rows(QuantBlocks(int(qtype), w, k)) for w, k in ws]
            ws8 = [(b.data, b.cols) for b in x8]
            out[f"{name}_x8"] = quant_pass(kernels, kernel_type(x8[0]), ws8, x_for, dense=False)
            out[f"{name}_x8_dense"] = quant_pass(kernels, kernel_type(x8[0]), ws8, x_for, dense=True)
            if kernels.quant_supported(kernel_type(x8[0]) | A8):  # 8-bit activations (AVX-512 builds)
                out[f"{name}_x8_a8"] = quant_pass(kernels, kernel_type(x8[0]) | A8, ws8, x_for, dense=False)
        elif kernels.quant_supported(int(qtype) | A8):  # BF16 on vdpbf16ps (csrc/quant_bf16x.c)
            out[f"{name}_a8"] = quant_pass(kernels, int(qtype) | A8, ws, x_for, dense=False)
    bf16 = [torch.randn(s).bfloat16() * 0.05 for s in shapes]
    out["c_bf16"] = lambda m: [kernels.matmul(x_for(m, w.shape[1], torch.bfloat16), w) for w in bf16]
    fp32 = [torch.randn(s) * 0.05 for s in shapes]
    out["torch_fp32"] = lambda m: [F.linear(x_for(m, w.shape[1], torch.float32), w) for w in fp32]
    return {name: fn for name, fn in out.items() if re.fullmatch(only, name)} if only else out


def weight_bytes(name: str, shapes: list[tuple[int, int]]) -> int:
    """Bytes one pass of path ``name`` streams from its weights."""
    elems = sum(o * i for o, i in shapes)
    base = name.removesuffix(AGAINST).removesuffix("_a8").removesuffix("_dense").removesuffix("_x8")
    if base in TYPES:
        size, block_bytes = gguf.GGML_QUANT_SIZES[TYPES[base]]
        return elems // size * block_bytes
    return elems * (2 if name == "c_bf16" else 4)


def measure(fns: dict[str, Pass], rows: tuple[int, ...], repeats: int) -> dict[int, dict[str, float]]:
    """Best ms per pass, per row count and path, the paths interleaved within each repeat."""
    best = {m: dict.fromkeys(fns, float("inf")) for m in rows}
    for m in rows:
        for fn in fns.values():
            fn(m)  # warm-up: x buffers made, pages touched
        for _ in range(repeats):
            for name, fn in fns.items():
                started = time.perf_counter()
                fn(m)
                best[m][name] = min(best[m][name], (time.perf_counter() - started) * 1e3)
    return best


def table(title: str, best: dict[int, dict[str, float]], shapes: list[tuple[int, int]]) -> None:
    names = list(next(iter(best.values())))
    print(f"\n## {title}")
    print("| rows | " + " | ".join(f"{n} ms" for n in names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for m, times in best.items():
        print(f"| {m} | " + " | ".join(f"{times[n]:.2f}" for n in names) + " |")
    if 1 in best:
        cells = [f"{n} {weight_bytes(n, shapes) / best[1][n] / 1e6:.1f}" for n in names]
        mb = [f"{n} {weight_bytes(n, shapes) / 1e6:.0f}" for n in names]
        print(f"GB/s at 1 row: {', '.join(cells)}  (MB per pass: {', '.join(mb)})")
    for n in names:
        if n + AGAINST in names:
            ratios = ", ".join(f"{m} rows {times[n] / times[n + AGAINST]:.3f}" for m, times in best.items())
            print(f"{n}: this build / --against: {ratios}")
    macs = sum(o * i for o, i in shapes)
    for m in best:
        if m > 1:
            fast = min(best[m], key=lambda n: best[m][n])
            print(f"{m} rows: best {fast}, {2 * macs * m / best[m][fast] / 1e6:.1f} GFLOP/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated row counts")
    ap.add_argument("--types", default=",".join(TYPES), help="comma-separated quantized types")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    ap.add_argument("--no-head", action="store_true", help="skip the 49152 x 576 head")
    ap.add_argument("--shapes", help="one layer's weights as OUTxIN,... (K-quants: IN %% 256 == 0)")
    ap.add_argument("--layers", type=int, default=LAYERS, help="layers of --shapes per pass")
    ap.add_argument("--paths", default="", help="a regular expression: only the paths it matches (q4_k_x8.*)")
    ap.add_argument("--against", type=Path, default=None, help="another build of the kernels library")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = cpu_kernels.load(KIND)
    if kernels is None:
        raise SystemExit("the C kernels did not build")
    rows = tuple(int(r) for r in args.rows.split(","))
    types = args.types.split(",")
    print(f"# {describe(KIND)}; torch threads {torch.get_num_threads()}")
    print(f"# memory read: {read_bandwidth():.1f} GB/s (torch sum over 256 MB, every thread)")
    shapes: tuple[tuple[int, int], ...] = SHAPES
    if args.shapes:
        shapes = tuple((int(s.split("x")[0]), int(s.split("x")[1])) for s in args.shapes.split(","))
    layers = [(o, i) for _ in range(args.layers) for o, i in shapes]
    other = cpu_kernels.CpuKernels(args.against, KIND) if args.against else None

    def both(weights: list[tuple[int, int]]) -> dict[str, Pass]:
        """This build's paths, then the other's on the same weights (``paths`` seeds its draws)."""
        fns = paths(kernels, weights, types, args.paths)
        if not fns:
            raise SystemExit(f"no path of {types} matches --paths {args.paths!r} (a match of the whole name)")
        if other is not None:
            fns |= {name + AGAINST: fn for name, fn in paths(other, weights, types, args.paths).items()}
        return fns

    title = f"{args.layers} layers ({', '.join(f'{o}x{i}' for o, i in shapes)})"
    table(title, measure(both(layers), rows, args.repeats), layers)
    if not args.no_head:
        head = [HEAD]
        table("head 49152 x 576", measure(both(head), rows, args.repeats), head)


if __name__ == "__main__":
    main()
