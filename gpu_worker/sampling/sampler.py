"""Batched sampling whose randomness is a pure function of (seed, position, token id).

Gumbel-max: token = argmax(logits / T + g) with g = -log(-log(u)) draws from
softmax(logits / T). u comes from a counter-based integer hash of (seed,
position, vocab index), so a request's draw depends on nothing else in the
batch and replays exactly. top_k / top_p / min_p remove tokens (-inf) first,
judged on the temperature-scaled probabilities.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from protocol.messages import ForwardBatch
from protocol.sampling import WorkerSampling

_MASK32 = 0xFFFFFFFF
# Multipliers below 2**31: a value < 2**32 times one stays < 2**63, so int64 never overflows.
_MUL_A = 0x7FEB352D
_MUL_B = 0x5BD1E995
_SEED_SALT = 0x2545F491


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters, all [R] tensors on the logits' device."""

    temperature: torch.Tensor  # float; 0 = greedy
    top_k: torch.Tensor  # int64; <= 0 = off
    top_p: torch.Tensor  # float; 1.0 = off
    min_p: torch.Tensor  # float; 0.0 = off
    seed: torch.Tensor  # int64, the low 32 bits
    seed_hi: torch.Tensor  # int64, the next 32 bits
    positions: torch.Tensor  # int64, position of the token being drawn
    all_greedy: bool
    any_filter: bool  # some row uses top_k, top_p or min_p
    want_logprobs: bool = True  # some row's client asked for logprobs


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit avalanche hash of int64 values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _MUL_A) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL_B) & _MASK32
    return x ^ (x >> 16)


def gumbel_noise(
    seed: torch.Tensor, seed_hi: torch.Tensor, positions: torch.Tensor, vocab: int
) -> torch.Tensor:
    """[R, vocab] float64 Gumbel noise, a pure function of (seed, position, vocab index)."""
    row_a = mix32(seed ^ mix32((positions + _SEED_SALT) & _MASK32))
    row_b = mix32(seed_hi ^ mix32((row_a + _SEED_SALT) & _MASK32))
    token = mix32(torch.arange(vocab, device=seed.device, dtype=torch.int64))
    bits = mix32(mix32(row_a[:, None] ^ token[None, :]) ^ row_b[:, None])
    u = (bits.to(torch.float64) + 0.5) / 2.0**32  # strictly inside (0, 1)
    return -torch.log(-torch.log(u))


def greedy_pick(logits: torch.Tensor) -> torch.Tensor:
    """The first maximal index of each row of the logits as they are: float32 holds every bf16/fp16
    value exactly, so this picks what the float32 path picks, without the copy and the logsumexp
    (docs/benchmarks-history.md has both times). A backend may pick faster (the CPU's C argmax:
    Backend.greedy)."""
    return logits.max(dim=-1).indices


def sample(logits: torch.Tensor, params: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token ids [R], and their logprobs [R] (log_softmax of the raw logits) where a row asked for
    them (else None)."""
    if params.all_greedy and not params.want_logprobs:
        return greedy_pick(logits), None
    logits = logits if logits.dtype == torch.float64 else logits.float()
    # max(dim) returns the first maximal index, as argmax does, and is faster on CPU.
    best, greedy = logits.max(dim=-1)
    log_total = torch.logsumexp(logits, dim=-1)  # logit - logsumexp: no whole log_softmax table
    if params.all_greedy:
        return greedy, best - log_total
    temperature = torch.where(params.temperature > 0, params.temperature, 1.0)
    scaled = logits / temperature[:, None].to(logits.dtype)
    if params.any_filter:
        scaled = _filter(scaled, params)
    noise = gumbel_noise(params.seed, params.seed_hi, params.positions, logits.shape[-1])
    drawn = (scaled.to(torch.float64) + noise).max(dim=-1).indices
    tokens = torch.where(params.temperature > 0, drawn, greedy)
    return tokens, logits.gather(1, tokens[:, None]).squeeze(1) - log_total


def _filter(scaled: torch.Tensor, params: SamplingBatch) -> torch.Tensor:
    """Set to -inf every token outside a row's top_k, top_p nucleus or min_p floor."""
    values, order = scaled.sort(dim=-1, descending=True)
    probs = torch.softmax(values, dim=-1)
    rank = torch.arange(values.shape[-1], device=values.device)[None, :]
    top_k = torch.where(params.top_k > 0, params.top_k, values.shape[-1])
    removed = rank >= top_k[:, None]
    # Mass strictly before a token already reaches top_p.
    nucleus = (probs.cumsum(dim=-1) - probs) >= params.top_p[:, None].to(probs.dtype)
    removed |= nucleus & (params.top_p < 1.0)[:, None]  # rounding must not cut a top_p=1 row's tail
    removed |= probs < (params.min_p[:, None].to(probs.dtype) * probs[:, :1])
    removed[:, 0] = False  # the likeliest token stays, however small top_p is in float32
    values = values.masked_fill(removed, float("-inf"))
    return torch.empty_like(scaled).scatter_(1, order, values)


class ReqPoolSamplerParams:
    """Sampler settings per request (by req_pool_idx), set when a req_pool_idx is (re)assigned.

    Kept on the CPU: choosing the greedy / filter paths then needs no device sync,
    and each step ships only its rows' values.
    """

    def __init__(self, max_requests: int) -> None:
        self.temperature = torch.zeros(max_requests, dtype=torch.float64)
        self.top_k = torch.zeros(max_requests, dtype=torch.int64)
        self.top_p = torch.ones(max_requests, dtype=torch.float64)
        self.min_p = torch.zeros(max_requests, dtype=torch.float64)
        self.seed = torch.zeros(max_requests, dtype=torch.int64)
        self.seed_hi = torch.zeros(max_requests, dtype=torch.int64)
        self.logprobs = [False] * max_requests
        self.greedy = [True] * max_requests  # temperature 0, as a list: plain_greedy needs no tensor op
        # Which req_pool_idx got settings: a sampling row of one that did not is refused before
        # its forward (batch_checks.py), so every row sampled here has its own.
        self.assigned = [False] * max_requests

    def on_batch(self, batch: ForwardBatch, input_ids: torch.Tensor) -> None:
        """ReqPoolState: the settings of the batch's rows and forks."""
        self.update(batch.req_pool_idx, batch.sampler)
        self.update(batch.fork_req_pool_idx, batch.fork_samplers)

    def on_drafts_taken(self, req_pool_idx: list[int], positions: list[int], tokens: list[int]) -> None:
        """ReqPoolState: settings do not follow tokens."""

    def update(self, req_pool_idx: list[int], params: Sequence[WorkerSampling | None]) -> None:
        for idx, p in zip(req_pool_idx, params, strict=True):
            if p is None:
                continue
            seed = p.seed & 0xFFFFFFFFFFFFFFFF  # any Python int, negative ones included
            self.temperature[idx] = p.temperature
            self.top_k[idx] = p.top_k
            self.top_p[idx] = p.top_p
            self.min_p[idx] = p.min_p
            self.seed[idx] = seed & _MASK32
            self.seed_hi[idx] = seed >> 32
            self.logprobs[idx] = p.logprobs
            self.greedy[idx] = p.temperature <= 0
            self.assigned[idx] = True

    def plain_greedy(self, req_pool_idx: list[int]) -> bool:
        """Every row greedy: ``greedy_pick`` is the whole draw, and the caller skips building a
        SamplingBatch (~15 small tensor ops a step); the rows that ask for logprobs get
        them computed alone (gpu_worker/sampling/logprobs.py), not the whole batch's."""
        return all(self.greedy[s] for s in req_pool_idx)

    def batch(self, req_pool_idx: list[int], positions: list[int], device: torch.device) -> SamplingBatch:
        """The requests ``req_pool_idx`` (drawing the tokens at ``positions``) as a SamplingBatch on
        ``device``."""
        index = torch.tensor(req_pool_idx, dtype=torch.int64)
        temperature, top_k = self.temperature[index], self.top_k[index]
        top_p, min_p = self.top_p[index], self.min_p[index]
        any_filter = bool((top_k > 0).any() or (top_p < 1.0).any() or (min_p > 0.0).any())
        return SamplingBatch(
            temperature=temperature.to(device),
            top_k=top_k.to(device),
            top_p=top_p.to(device),
            min_p=min_p.to(device),
            seed=self.seed[index].to(device),
            seed_hi=self.seed_hi[index].to(device),
            positions=torch.tensor(positions, dtype=torch.int64).to(device),
            all_greedy=bool((temperature <= 0).all()),
            any_filter=any_filter,
            want_logprobs=any(self.logprobs[s] for s in req_pool_idx),
        )
