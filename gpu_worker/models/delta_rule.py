"""The gated delta rule in torch: the reference a backend's kernels (the ``GatedDeltaNet`` slots) are
tested against, and what runs where no kernel is attached.

Per value head, with a state S [d_k, d_v] (float32 whatever the activations' dtype), each token
decays the state, corrects it towards the token's value along its key, and reads it with its query:

    S <- exp(g) S;    S <- S + k (beta (v - S^T k))^T;    o = S^T q

q and k are L2-normed first (``use_qk_l2norm_in_kernel``) and q scaled by 1/sqrt(d_k). Key heads
fewer than value heads are repeated onto consecutive value heads (value head h reads key head
h // (H_v / H_k)).

Both functions take and return what transformers' ``torch_recurrent_gated_delta_rule`` and
``torch_chunk_gated_delta_rule`` do: q, k [B, T, H_k, d_k], v [B, T, H_v, d_v], g and beta
[B, T, H_v], ``initial_state`` [B, H_v, d_k, d_v] or None; out [B, T, H_v, d_v] in q's dtype and
the final state (float32) when ``output_final_state``.

The chunked form (prefill) is matrix work over chunks of C tokens. Within a chunk, with cumulative
log-decays c_t (so the decay from s to t is exp(c_t - c_s)) and the state S0 at its start, the
corrections u_t = beta_t (v_t - exp(c_t) S0^T k_t - sum_{s<t} exp(c_t - c_s) (k_t . k_s) u_s) solve
one unit lower-triangular system (I + A) U = beta V - beta exp(c) K S0; then
O = exp(c) Q S0 + (decay-masked Q K^T) U and S = exp(c_C) S0 + (exp(c_C - c) K)^T U.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def l2_normed(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _heads_first(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    normalize: bool,
) -> tuple[torch.Tensor, ...]:
    """float32 [B, H_v, T, ...] of every input, key heads repeated onto their value heads, q and k
    normed (if asked) and q scaled."""
    repeat = value.shape[2] // key.shape[2]
    if repeat > 1:
        query, key = query.repeat_interleave(repeat, dim=2), key.repeat_interleave(repeat, dim=2)
    query, key, value, g, beta = (
        x.transpose(1, 2).to(torch.float32).contiguous() for x in (query, key, value, g, beta)
    )
    if normalize:
        query, key = l2_normed(query), l2_normed(key)
    return query * query.shape[-1] ** -0.5, key, value, g, beta


def _start_state(initial_state: torch.Tensor | None, value: torch.Tensor, d_k: int) -> torch.Tensor:
    batch, heads, _, d_v = value.shape
    if initial_state is None:
        return value.new_zeros((batch, heads, d_k, d_v))
    return initial_state.to(torch.float32).clone()


def recurrent_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token by token (a decode step: T = 1)."""
    dtype = query.dtype
    q, k, v, g32, b32 = _heads_first(query, key, value, g, beta, use_qk_l2norm_in_kernel)
    state = _start_state(initial_state, v, k.shape[-1])
    out = torch.empty_like(v)
    for t in range(v.shape[2]):
        state = state * g32[:, :, t].exp()[..., None, None]
        recalled = torch.einsum("bhkv,bhk->bhv", state, k[:, :, t])
        delta = (v[:, :, t] - recalled) * b32[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        out[:, :, t] = torch.einsum("bhkv,bhk->bhv", state, q[:, :, t])
    return out.transpose(1, 2).contiguous().to(dtype), state if output_final_state else None


def chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunk by chunk of ``chunk_size`` tokens (a prefill); the last chunk may be shorter."""
    dtype = query.dtype
    q, k, v, g32, b32 = _heads_first(query, key, value, g, beta, use_qk_l2norm_in_kernel)
    state = _start_state(initial_state, v, k.shape[-1])
    out = torch.empty_like(v)
    for start in range(0, v.shape[2], chunk_size):
        span = slice(start, start + chunk_size)
        out[:, :, span], state = _chunk(q[:, :, span], k[:, :, span], v[:, :, span],
                                        g32[:, :, span], b32[:, :, span], state)  # fmt: skip
    return out.transpose(1, 2).contiguous().to(dtype), state if output_final_state else None


def _chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk [B, H, C, ...] from ``state``: its outputs and the state after it (module docstring)."""
    length = q.shape[2]
    cum = g.cumsum(dim=-1)  # [B, H, C]
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    # exp(c_t - c_s) where s <= t; the rest masked before the exp (it would overflow).
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kk = (k @ k.transpose(-1, -2)) * decay * beta[..., :, None]
    system = kk.tril(-1) + torch.eye(length, dtype=q.dtype, device=q.device)
    rhs = torch.cat((v, k * cum.exp()[..., None]), dim=-1) * beta[..., None]
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    fresh, carried = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    corrections = fresh - carried @ state  # U [B, H, C, d_v]
    out = (q * cum.exp()[..., None]) @ state + ((q @ k.transpose(-1, -2)) * decay) @ corrections
    last = cum[..., -1:]
    weighted_keys = k * (last - cum).exp()[..., None]
    new_state = state * last.exp()[..., None] + weighted_keys.transpose(-1, -2) @ corrections
    return out, new_state


def causal_conv(window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv1d then SiLU: ``window`` [B, C, K - 1 + L] (the K - 1 earlier inputs
    first), ``weight`` [C, 1, K] -> [B, C, L]."""
    return F.silu(F.conv1d(window, weight, groups=weight.shape[0]))
