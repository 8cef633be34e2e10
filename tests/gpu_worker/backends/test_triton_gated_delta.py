"""The Triton kernels of the gated delta rule (backends/triton/gated_delta.py) against the float64
recurrence, under Triton's interpreter where no CUDA device is: the decode step of several rows,
and the chunked prefill of rows of odd lengths (past one block, one token, none) with GQA groups.

Tolerances: the kernels' math is float32 ("ieee" dots on GPU too), so a few float32 roundings of
the largest value; bfloat16 outputs add their own rounding, and the interpreter's float32 ->
bfloat16 store truncates (the GPU rounds to nearest): up to one ulp, 2^-7 relative.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.gpu_worker.gated_delta_reference import RuleCase, reference, rule_inputs

triton = pytest.importorskip("triton")
from gpu_worker.backends.triton import gated_delta  # noqa: E402

pytestmark = pytest.mark.triton_interpreter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F32, BF16 = torch.float32, torch.bfloat16


def _assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    scale = float(want.abs().max()) + 1e-30
    tol = 2e-5 * scale + (2**-7 * want.abs() if dtype == BF16 else 0)
    worst = float(((got.double().cpu() - want).abs() - tol).max())
    assert worst <= 0, f"{what}: off by {worst:.3g} past the tolerance (largest value {scale:.3g})"


def _on_device(t: torch.Tensor) -> torch.Tensor:
    return t.to(DEVICE)


@pytest.mark.parametrize(
    "case",
    [RuleCase((70, 1, 0, 5), 1, 2, 32, 40, F32), RuleCase((33,), 1, 3, 16, 32, BF16)],
    ids=str,
)
def test_prefill_is_the_recurrence(case: RuleCase) -> None:
    """All rows in one launch from slots in no order (the unused ones NaN: a kernel reading them
    would show it); row 0 starts fresh, its slot's old state ignored."""
    inputs = rule_inputs(case, seed=len(case.lens))
    rows = len(case.lens)
    slots = list(range(rows, 0, -1))
    pool = torch.full((rows + 2, *inputs.states.shape[1:]), float("nan"))
    pool[slots] = inputs.states
    fresh = torch.zeros(rows, dtype=torch.bool)
    fresh[0] = True
    pool[slots[0]] = 7.0
    pool = _on_device(pool)
    q, k, v, g, beta = (_on_device(t) for t in (inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta))
    slot_t, cu = _on_device(torch.tensor(slots)), _on_device(inputs.cu_seqlens)
    out = gated_delta.prefill(q, k, v, g, beta, pool, slot_t, cu, fresh=_on_device(fresh))
    states = inputs.states.clone()
    states[0] = 0
    want_out, want_states = reference(dataclasses.replace(inputs, states=states))
    assert out.dtype == case.dtype
    _assert_close(out, want_out, case.dtype, "out")
    _assert_close(pool[slots], want_states, F32, "final states")


@pytest.mark.parametrize(
    "case", [RuleCase((1,) * 3, 2, 6, 32, 40, BF16), RuleCase((1,) * 2, 4, 4, 64, 32, F32)], ids=str
)
def test_decode_steps_are_the_recurrence(case: RuleCase) -> None:
    """Two decode steps of each row, row 0 fresh at the first; q, k, v as strided views of one
    projection."""
    rows = len(case.lens)
    steps = [rule_inputs(case, seed=s) for s in range(2)]
    slots = [2 * r + 1 for r in range(rows)]
    pool = torch.full((2 * rows + 1, *steps[0].states.shape[1:]), float("nan"))
    pool[slots] = steps[0].states
    pool = _on_device(pool)
    pool[slots[0]] = float("nan")  # row 0 starts fresh at the first step
    state = steps[0].states.clone()
    state[0] = 0
    fresh = _on_device(torch.arange(rows) == 0)
    for step, inputs in enumerate(steps):
        mixed = torch.cat([inputs.q.flatten(1), inputs.k.flatten(1), inputs.v.flatten(1)], 1)
        parts = mixed.split([inputs.q[0].numel(), inputs.k[0].numel(), inputs.v[0].numel()], 1)
        q, k, v = (
            _on_device(p).view(t.shape) for p, t in zip(parts, (inputs.q, inputs.k, inputs.v), strict=True)
        )
        g, beta, slot_t = _on_device(inputs.g), _on_device(inputs.beta), _on_device(torch.tensor(slots))
        out = gated_delta.decode(q, k, v, g, beta, pool, slot_t, fresh=fresh if step == 0 else None)
        want_out, state = reference(dataclasses.replace(inputs, states=state))
        _assert_close(out, want_out, case.dtype, "out")
    _assert_close(pool[slots], state, F32, "states after 2 steps")


def test_prefill_chunk_sizes_agree() -> None:
    """The block of tokens (a launch choice) changes only the sums' rounding."""
    case = RuleCase((40,), 1, 1, 16, 32, F32)
    inputs = rule_inputs(case, seed=4)
    want_out, want_state = reference(inputs)
    for chunk in (32, 64):
        pool = _on_device(inputs.states.clone())
        q, k, v, g, beta = (_on_device(t) for t in (inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta))
        slot, cu = _on_device(torch.tensor([0])), _on_device(inputs.cu_seqlens)
        out = gated_delta.prefill(q, k, v, g, beta, pool, slot, cu, chunk=chunk, num_warps=4)
        _assert_close(out, want_out, F32, f"out, chunk {chunk}")
        _assert_close(pool, want_state, F32, f"state, chunk {chunk}")
