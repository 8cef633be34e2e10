"""The C kernels of Gated DeltaNet layers (csrc/gated_delta.c) on every CPU kind this CPU runs: the
decode step and the chunked prefill against the float64 recurrence and transformers' torch
references, and the causal conv1d against transformers' own."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from gpu_worker.backends.cpu import gated_delta
from gpu_worker.backends.cpu import kernels as cpu_kernels
from tests.gpu_worker.gated_delta_reference import (
    RuleCase,
    RuleInputs,
    assert_rule_close,
    reference,
    rule_inputs,
)

pytestmark = pytest.mark.cpu_kinds

F32, BF16 = torch.float32, torch.bfloat16
# Odd lengths, one token, a block exactly, one past it, several blocks; GQA groups 1, 2, 3, 4.
PREFILL_CASES = [
    RuleCase((1,), 1, 1, 16, 16, F32),
    RuleCase((65, 7), 2, 4, 32, 48, F32),
    RuleCase((64, 129, 3), 2, 6, 48, 32, BF16),
    RuleCase((150,), 2, 4, 128, 128, F32),
    RuleCase((31, 0, 90), 1, 4, 128, 64, BF16),
]
DECODE_CASES = [
    RuleCase((1,) * 5, 2, 2, 32, 32, F32),
    RuleCase((1,) * 3, 2, 6, 64, 16, BF16),
    RuleCase((1,) * 4, 16, 32, 128, 128, BF16),
]


@pytest.fixture(scope="module")
def gd(kernels: cpu_kernels.CpuKernels) -> gated_delta.GatedDeltaKernels:
    return gated_delta.load(kernels.path)


@functools.cache
def _case(case: RuleCase, seed: int) -> tuple[RuleInputs, tuple[torch.Tensor, torch.Tensor]]:
    """A case's inputs and their float64 reference, once for every CPU kind (read-only)."""
    inputs = rule_inputs(case, seed)
    return inputs, reference(inputs)


def _pool(states: torch.Tensor, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A pool with each row's state at its slot, NaN elsewhere (a kernel that read another slot
    would show it), and the slots."""
    pool = torch.full((max(slots) + 2, *states.shape[1:]), float("nan"))
    pool[slots] = states
    return pool, torch.tensor(slots, dtype=torch.int64)


@pytest.mark.parametrize("case", PREFILL_CASES, ids=str)
def test_prefill_is_the_recurrence(gd: gated_delta.GatedDeltaKernels, case: RuleCase) -> None:
    """All rows in one call from their slots (in no order): outputs and final states."""
    inputs, (want_out, want_states) = _case(case, seed=len(case.lens))
    slots = list(range(len(case.lens)))[::-1]
    pool, slot_t = _pool(inputs.states, slots)
    out = gd.prefill(inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta, pool, slot_t, inputs.cu_seqlens)
    assert out.dtype == case.dtype
    assert_rule_close(out, want_out, case.dtype, "out")
    assert_rule_close(pool[slots], want_states, F32, "final states")


@pytest.mark.parametrize("case", DECODE_CASES, ids=str)
def test_decode_steps_are_the_recurrence(gd: gated_delta.GatedDeltaKernels, case: RuleCase) -> None:
    """Three decode steps of every row, the pool advanced in place; q/k/v as strided views of one
    projection, g float32 and beta in the activations' dtype (as a layer has them)."""
    rows, steps = len(case.lens), 3
    inputs = [_case(case, seed=s)[0] for s in range(steps)]
    slots = [2 * r + 1 for r in range(rows)]
    pool, slot_t = _pool(inputs[0].states, slots)
    state = inputs[0].states
    for fresh_step in inputs:
        step = dataclasses.replace(fresh_step, states=state)
        mixed = torch.cat([step.q.flatten(1), step.k.flatten(1), step.v.flatten(1)], 1)
        q, k, v = mixed.split([step.q[0].numel(), step.k[0].numel(), step.v[0].numel()], 1)
        q, k, v = q.view(step.q.shape), k.view(step.k.shape), v.view(step.v.shape)
        out = gd.decode(q, k, v, step.g, step.beta, pool, slot_t)
        want_out, state = reference(step)
        assert_rule_close(out, want_out, case.dtype, "out")
    assert_rule_close(pool[slots], state, F32, "states after 3 steps")


@pytest.mark.parametrize("lens", [(5, 9), (1, 1)], ids=["prefill", "decode"])
def test_fresh_rows_start_from_zeros(gd: gated_delta.GatedDeltaKernels, lens: tuple[int, ...]) -> None:
    """A fresh row ignores its slot's old state (NaN here) and starts from zeros."""
    case = RuleCase(lens, 2, 4, 32, 32, F32)
    inputs = rule_inputs(case, seed=3)
    pool, slots = _pool(inputs.states, [0, 1])
    pool[0] = float("nan")
    fresh = torch.tensor([True, False])
    ins = (inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta)
    if lens == (1, 1):
        out = gd.decode(*ins, pool, slots, fresh=fresh)
    else:
        out = gd.prefill(*ins, pool, slots, inputs.cu_seqlens, fresh=fresh)
    inputs.states[0] = 0
    want_out, want_states = reference(inputs)
    assert_rule_close(out, want_out, F32, "out")
    assert_rule_close(pool[:2], want_states, F32, "states")


def test_prefill_then_decode_is_one_prefill(gd: gated_delta.GatedDeltaKernels) -> None:
    """A row's prompt in two prefill chunks (70 = not a block multiple), then two decode tokens,
    equals one prefill of all of it: the state hands over between calls."""
    case = RuleCase((74,), 2, 4, 64, 64, BF16)
    inputs, (want_out, want_state) = _case(case, seed=5)
    whole_pool, slot = _pool(inputs.states, [0])
    whole = gd.prefill(
        inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta, whole_pool, slot, inputs.cu_seqlens
    )
    pool, _ = _pool(inputs.states, [0])
    parts = []
    for span in (slice(0, 41), slice(41, 72)):
        cu = torch.tensor([0, span.stop - span.start])
        ins = (inputs.q[span], inputs.k[span], inputs.v[span], inputs.g[span], inputs.beta[span])
        parts.append(gd.prefill(*ins, pool, slot, cu))
    for t in (72, 73):
        span = slice(t, t + 1)
        parts.append(
            gd.decode(
                inputs.q[span], inputs.k[span], inputs.v[span], inputs.g[span], inputs.beta[span], pool, slot
            )
        )
    assert_rule_close(torch.cat(parts), want_out, BF16, "split out")
    assert_rule_close(whole, want_out, BF16, "whole out")
    assert_rule_close(pool[0], want_state[0], F32, "split state")
    torch.testing.assert_close(pool[0], whole_pool[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["float32", "bfloat16"])
def test_against_transformers(gd: gated_delta.GatedDeltaKernels, dtype: torch.dtype) -> None:
    """transformers' torch_chunk_gated_delta_rule and torch_recurrent_gated_delta_rule, called as
    Qwen3.5's layer calls them (unnormed q, k; l2norm in the rule), on the same inputs."""
    case = RuleCase((67,), 2, 6, 32, 32, dtype)
    inputs = _case(case, seed=11)[0]
    pool, slot = _pool(inputs.states, [0])
    args = (inputs.q[None], inputs.k[None], inputs.v[None], inputs.g[None], inputs.beta[None])
    hf_out, hf_state = hf.torch_chunk_gated_delta_rule(
        *args, initial_state=inputs.states, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    out = gd.prefill(inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta, pool, slot, inputs.cu_seqlens)
    tol = 1e-4 if dtype == F32 else 2**-7
    torch.testing.assert_close(out.float(), hf_out[0].float(), rtol=tol, atol=tol)
    torch.testing.assert_close(pool[0], hf_state[0], rtol=1e-4, atol=1e-4)
    step = slice(66, 67)
    pool, slot = _pool(inputs.states, [0])
    hf_out, hf_state = hf.torch_recurrent_gated_delta_rule(
        *(a[:, step] for a in args), initial_state=inputs.states, output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    ins = (inputs.q[step], inputs.k[step], inputs.v[step], inputs.g[step], inputs.beta[step])
    out = gd.decode(*ins, pool, slot)
    torch.testing.assert_close(out.float(), hf_out[0].float(), rtol=tol, atol=tol)
    torch.testing.assert_close(pool[0], hf_state[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["float32", "bfloat16"])
def test_conv1d_is_transformers(gd: gated_delta.GatedDeltaKernels, dtype: torch.dtype) -> None:
    """Prefill rows of 1, 6 and 70 tokens from their conv states (HF's width K), then one decode
    step of each, against causal_conv1d_fn / causal_conv1d_update with SiLU."""
    gen = torch.Generator().manual_seed(7)
    channels, width, lens = 80, 4, [1, 6, 70]
    weight = (torch.randn(channels, width, generator=gen) * 0.5).to(dtype)
    x = torch.randn(sum(lens), channels * 2, generator=gen).to(dtype)[:, :channels]  # strided rows
    states = torch.randn(len(lens), channels, width, generator=gen).to(dtype)
    pool, slots = states.clone(), torch.tensor([2, 0, 1])
    pool = pool[[1, 2, 0]].contiguous()  # row i at slot slots[i]
    cu = torch.tensor([0, 1, 7, 77])
    out = gd.conv1d(x, weight, pool, slots, cu)
    for row, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        window = torch.cat([states[row], x[start:end].t()], -1)[None]
        want = hf.causal_conv1d_fn(window, weight, None, activation="silu")[0, :, width:].t()
        _assert_conv_close(out[start:end], want, dtype)
        torch.testing.assert_close(pool[slots[row]], window[0, :, -width:], rtol=0, atol=0)
    step = torch.randn(3, channels, generator=gen).to(dtype)
    want_state = pool[slots].clone()
    want = hf.causal_conv1d_update(step[:, :, None], want_state, weight, None, "silu")[:, :, 0]
    got = gd.conv1d(step, weight, pool, slots, torch.arange(4))
    _assert_conv_close(got, want, dtype)
    torch.testing.assert_close(pool[slots], want_state, rtol=0, atol=0)


def _assert_conv_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """float32: the sum's order; bfloat16: one ulp of the conv's rounding, carried through SiLU."""
    tol = 1e-6 if dtype == F32 else 2**-7
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_conv1d_fresh_and_narrow_state(gd: gated_delta.GatedDeltaKernels) -> None:
    """A state of K - 1 inputs (no spare one), a fresh row from zeros, no SiLU, a bias."""
    gen = torch.Generator().manual_seed(9)
    weight, bias = torch.randn(24, 4, generator=gen), torch.randn(24, generator=gen)
    x, pool = torch.randn(5, 24, generator=gen), torch.randn(1, 24, 3, generator=gen)
    out = gd.conv1d(
        x,
        weight,
        pool,
        torch.tensor([0]),
        torch.tensor([0, 5]),
        bias=bias,
        silu=False,
        fresh=torch.tensor([True]),
    )
    want = F.conv1d(F.pad(x.t()[None], (3, 0)), weight[:, None], bias, groups=24)[0].t()
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pool[0], x[-3:].t(), rtol=0, atol=0)


def test_misfits_are_refused(gd: gated_delta.GatedDeltaKernels) -> None:
    case = RuleCase((4,), 2, 4, 16, 16, F32)
    inputs = _case(case, seed=1)[0]
    pool, slot = _pool(inputs.states, [0])
    ins = (inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta)
    with pytest.raises(ValueError, match="no multiple"):
        gd.prefill(
            inputs.q,
            inputs.k,
            inputs.v[:, :3],
            inputs.g[:, :3],
            inputs.beta[:, :3],
            pool,
            slot,
            inputs.cu_seqlens,
        )
    with pytest.raises(ValueError, match="slots must lie"):
        gd.prefill(*ins, pool, torch.tensor([pool.shape[0]]), inputs.cu_seqlens)
    with pytest.raises(ValueError, match="state must be contiguous float32"):
        gd.prefill(*ins, pool.to(BF16), slot, inputs.cu_seqlens)
    with pytest.raises(ValueError, match="cu_seqlens must run"):
        gd.prefill(*ins, pool, slot, torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="heads must be contiguous"):
        strided_q = torch.randn(4, 2, 32)[:, :, :16]
        gd.decode(strided_q, inputs.k, inputs.v, inputs.g, inputs.beta, pool, slot.repeat(4))


@pytest.mark.parametrize("tokens", [1, 37], ids=["decode", "prefill"])
def test_transformers_signature(gd: gated_delta.GatedDeltaKernels, tokens: int) -> None:
    """HfDeltaRule, what a GatedDeltaNet's slots hold, returns what transformers' functions do for
    three rows in one call, and leaves the caller's initial states as they were."""
    case = RuleCase((tokens,) * 3, 2, 4, 16, 24, F32)
    inputs = _case(case, seed=13)[0]
    batched = [t.view(3, tokens, *t.shape[1:]) for t in (inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta)]
    initial = inputs.states.clone()
    reference_rule = hf.torch_chunk_gated_delta_rule if tokens > 1 else hf.torch_recurrent_gated_delta_rule
    rule = gated_delta.HfDeltaRule(gd, chunked=tokens > 1)
    kw: dict[str, Any] = dict(initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, state = rule(*batched, **kw)
    want_out, want_state = reference_rule(*batched, **kw)
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, want_state, rtol=1e-4, atol=1e-4)
    assert torch.equal(initial, inputs.states)
