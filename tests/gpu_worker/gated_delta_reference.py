"""The gated delta rule token by token in float64, and random inputs for it: what the CPU and Triton
kernels of Gated DeltaNet layers are checked against."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RuleCase:
    """One call's shapes: rows of ``lens`` tokens, ``k_heads`` key heads serving ``v_heads``."""

    lens: tuple[int, ...]
    k_heads: int
    v_heads: int
    dk: int
    dv: int
    dtype: torch.dtype

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        lens = "+".join(map(str, self.lens))
        return f"{dtype}-T{lens}-h{self.k_heads}x{self.v_heads}-d{self.dk}x{self.dv}"


@dataclass
class RuleInputs:
    """Packed tokens of all rows (q, k unnormed, as a layer has them), and each row's initial state."""

    q: torch.Tensor  # [N, Hk, Dk]
    k: torch.Tensor
    v: torch.Tensor  # [N, Hv, Dv]
    g: torch.Tensor  # [N, Hv] float32
    beta: torch.Tensor  # [N, Hv], the activations' dtype
    states: torch.Tensor  # [B, Hv, Dk, Dv] float32
    cu_seqlens: torch.Tensor  # int64 [B + 1]


def rule_inputs(case: RuleCase, seed: int) -> RuleInputs:
    gen = torch.Generator().manual_seed(seed)
    n, rows = sum(case.lens), len(case.lens)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    return RuleInputs(
        q=randn(n, case.k_heads, case.dk).to(case.dtype),
        k=randn(n, case.k_heads, case.dk).to(case.dtype),
        v=randn(n, case.v_heads, case.dv).to(case.dtype),
        # HF's g = -exp(A_log) softplus(a + dt_bias): mostly small decays, a few strong ones
        g=-torch.rand(n, case.v_heads, generator=gen) * torch.rand(n, case.v_heads, generator=gen).pow(3) * 8,
        beta=torch.rand(n, case.v_heads, generator=gen).to(case.dtype),
        states=randn(rows, case.v_heads, case.dk, case.dv) * 0.2,
        cu_seqlens=torch.tensor([0, *torch.tensor(case.lens).cumsum(0).tolist()], dtype=torch.int64),
    )


def l2_normed(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One row's T tokens in float64: q, k [T, Hk, Dk] (L2-normed here, q scaled), v [T, Hv, Dv],
    g, beta [T, Hv], state [Hv, Dk, Dv] -> (out [T, Hv, Dv], final state)."""
    group = v.shape[1] // k.shape[1]
    q, k = (l2_normed(t.double().repeat_interleave(group, 1)) for t in (q, k))
    q = q * q.shape[-1] ** -0.5
    s = state.double().clone()
    out = [v.new_empty((0, *v.shape[1:]), dtype=torch.float64)]
    for t in range(v.shape[0]):
        s = s * g[t].double().exp()[:, None, None]
        delta = (v[t].double() - torch.einsum("hkv,hk->hv", s, k[t])) * beta[t].double()[:, None]
        s = s + k[t][:, :, None] * delta[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", s, q[t]))
    return torch.cat([out[0], *(o[None] for o in out[1:])]), s


def reference(inputs: RuleInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row of ``inputs`` from its state: (out [N, Hv, Dv], final states [B, Hv, Dk, Dv]) in float64."""
    outs, finals = [], []
    cu = inputs.cu_seqlens.tolist()
    for row, (start, end) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        span = slice(start, end)
        out, final = recurrence(
            inputs.q[span],
            inputs.k[span],
            inputs.v[span],
            inputs.g[span],
            inputs.beta[span],
            inputs.states[row],
        )
        outs.append(out)
        finals.append(final)
    return torch.cat(outs), torch.stack(finals)


def assert_rule_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """float32 math: errors of a few float32 roundings of the largest value; bfloat16 outputs also
    their own rounding (2^-9 relative)."""
    scale = float(want.abs().max()) + 1e-30
    tol = 2e-5 * scale + (2**-8 * want.abs() if dtype == torch.bfloat16 else 0)
    err = (got.double() - want).abs() - tol
    worst = float(err.max()) if err.numel() else 0.0
    assert worst <= 0, f"{what}: off by {worst + 0:.3g} past the tolerance (largest value {scale:.3g})"
