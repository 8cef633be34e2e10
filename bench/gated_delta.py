"""The gated delta rule's kernels alone against transformers' torch code, at Qwen3.5-4B's linear
layers (32 value heads, 16 key heads, d_k = d_v = 128; conv over 8192 channels): ms per call of one
layer for the decode step, the chunked prefill and the conv1d's decode step, at given rows.

    python -m bench.gated_delta                                    # the C kernels (this CPU's kind)
    python -m bench.gated_delta --rows 1,32 --prefill-tokens 512 --dtype bfloat16 --repeats 10
    python -m bench.gated_delta --backend triton                   # the Triton kernels on a CUDA device

The reference is what a layer runs without the kernels: transformers' ``torch_recurrent_gated_delta_rule``
(decode) and ``torch_chunk_gated_delta_rule`` (prefill; every row ``--prefill-tokens`` long, batched as
one [rows, T] call) on the same inputs, and ``causal_conv1d_update``. The kernels update a state pool
in place; the reference returns new states. Runs alternate, repetition by repetition; medians.
Timings need a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from gpu_worker.backends.cpu import kind as cpu_kind

V_HEADS, K_HEADS, HEAD_DIM, CONV_KERNEL = 32, 16, 128, 4


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,32", help="comma list of rows per call")
    p.add_argument("--prefill-tokens", type=int, default=512, help="tokens of each prefill row")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="activations")
    p.add_argument("--repeats", type=int, default=10, help="timed calls per kernel and shape")
    p.add_argument("--backend", choices=("cpu", "triton"), default="cpu", help="C kernels or Triton (CUDA)")
    return p


def _inputs(tokens: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, ...]:
    """q, k, v, g, beta of ``tokens`` tokens (g float32, beta in the activations' dtype, as HF's)."""
    q, k = (torch.randn(tokens, K_HEADS, HEAD_DIM, device=device).to(dtype) for _ in range(2))
    v = torch.randn(tokens, V_HEADS, HEAD_DIM, device=device).to(dtype)
    g = -torch.rand(tokens, V_HEADS, device=device)
    beta = torch.rand(tokens, V_HEADS, device=device).to(dtype)
    return q, k, v, g, beta


def _median_ms(fns: list[Callable[[], object]], repeats: int, device: str) -> list[float]:
    """Median ms of each of ``fns``, run in turn each repetition (after one untimed call each)."""
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()
    for _ in range(repeats):
        for fn, ts in zip(fns, times, strict=True):
            if device == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            ts.append(1e3 * (time.perf_counter() - started))
    return [statistics.median(ts) for ts in times]


def _rule_calls(
    rows: int, tokens: int, dtype: torch.dtype, backend: object, device: str
) -> tuple[Callable[[], object], Callable[[], object]]:
    """(kernel, reference) for ``rows`` rows of ``tokens`` tokens (1: the decode step)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    q, k, v, g, beta = _inputs(rows * tokens, dtype, device)
    pool = torch.randn(rows, V_HEADS, HEAD_DIM, HEAD_DIM, device=device) * 0.1
    slots = torch.arange(rows, device=device)
    group = V_HEADS // K_HEADS  # repeated here: older transformers' functions take Hk == Hv only
    batched = [t.view(rows, tokens, *t.shape[1:]) for t in (q.repeat_interleave(group, 1),
               k.repeat_interleave(group, 1), v, g, beta)]  # fmt: skip
    initial = pool.clone()
    kw = dict(initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True)
    if tokens == 1:
        return (
            lambda: backend.decode(q, k, v, g, beta, pool, slots),  # type: ignore[attr-defined]
            lambda: hf.torch_recurrent_gated_delta_rule(*batched, **kw),
        )
    cu = torch.arange(0, rows * tokens + 1, tokens, device=device)
    return (
        lambda: backend.prefill(q, k, v, g, beta, pool, slots, cu),  # type: ignore[attr-defined]
        lambda: hf.torch_chunk_gated_delta_rule(*batched, **kw),
    )


def _conv_calls(
    rows: int, dtype: torch.dtype, kernels: object
) -> tuple[Callable[[], object], Callable[[], object]]:
    """(kernel, reference) of the conv1d's decode step over Qwen3.5-4B's 8192 channels."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    channels = 2 * K_HEADS * HEAD_DIM + V_HEADS * HEAD_DIM
    x = torch.randn(rows, channels).to(dtype)
    weight = torch.randn(channels, CONV_KERNEL).to(dtype)
    pool, ref_state = (torch.randn(rows, channels, CONV_KERNEL).to(dtype) for _ in range(2))
    slots, cu = torch.arange(rows), torch.arange(rows + 1)
    return (
        lambda: kernels.conv1d(x, weight, pool, slots, cu),  # type: ignore[attr-defined]
        lambda: hf.causal_conv1d_update(x[:, :, None], ref_state, weight, None, "silu"),
    )


def _max_diff(kernel: Callable[[], object], reference: Callable[[], object]) -> float:
    """The largest difference of the two outputs, from the same states (before any timed call)."""
    got, want = kernel(), reference()
    assert isinstance(got, torch.Tensor) and isinstance(want, tuple)
    return float((got.float() - want[0].float().reshape(got.shape)).abs().max())


def _backend(name: str) -> tuple[object, str, str]:
    """(the kernels, their device, a line saying what runs)."""
    if name == "triton":
        from gpu_worker.backends.triton import gated_delta as triton_gated_delta

        assert torch.cuda.is_available(), "--backend triton times a CUDA device"
        return triton_gated_delta, "cuda", f"# Triton on {torch.cuda.get_device_name()}"
    from gpu_worker.backends.cpu import gated_delta
    from gpu_worker.backends.cpu.kernels import load

    acting = cpu_kind.apply_to_environ()
    kernels = load(acting)
    if kernels is None:
        raise SystemExit("error: the C kernels did not build (see the log line above)")
    line = f"# {cpu_kind.describe(acting)}; torch threads {torch.get_num_threads()}"
    return gated_delta.load(kernels.path), "cpu", line


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    backend, device, line = _backend(args.backend)
    dtype = getattr(torch, args.dtype)
    print(f"{line}; {args.dtype} activations, {V_HEADS}/{K_HEADS} heads of {HEAD_DIM}, one layer")
    print("| op | rows | tokens/row | kernel ms | torch ms | speed-up | max abs diff |")
    print("|---|---|---|---|---|---|---|")
    for rows in (int(x) for x in args.rows.split(",")):
        shapes = [("decode", 1), ("prefill", args.prefill_tokens)]
        for op, tokens in shapes:
            calls = _rule_calls(rows, tokens, dtype, backend, device)
            diff = _max_diff(*calls)
            ms = _median_ms(list(calls), args.repeats, device)
            cells = f"{ms[0]:.3f} | {ms[1]:.3f} | {ms[1] / ms[0]:.1f}x | {diff:.2e}"
            print(f"| {op} | {rows} | {tokens} | {cells} |", flush=True)
        if device == "cpu":
            ms = _median_ms(list(_conv_calls(rows, dtype, backend)), args.repeats, device)
            cells = f"{ms[0]:.3f} | {ms[1]:.3f} | {ms[1] / ms[0]:.1f}x | -"
            print(f"| conv1d decode | {rows} | 1 | {cells} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
