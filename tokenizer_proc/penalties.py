"""Check a request's penalties, logit_bias and min_tokens, and turn them into WorkerPenalties.

The ranges are OpenAI's (presence and frequency in [-2, 2], logit_bias values in
[-100, 100], at most 300 entries) and vLLM's for the extensions (repetition > 0, here within
REPETITION_RANGE so float32 logits stay finite; min_tokens <= max_tokens). A request whose
penalties change no logit gets no WorkerPenalties at all, so the worker keeps its fast path for it.
"""

from __future__ import annotations

import math

from protocol.messages import SamplingParams
from protocol.sampling import WorkerPenalties
from tokenizer_proc.model_info import ModelInfo

MAX_LOGIT_BIAS = 300  # OpenAI's cap on logit_bias entries
PENALTY_LIMIT = 2.0  # presence and frequency lie in [-2, 2]
BIAS_LIMIT = 100.0  # logit_bias values lie in [-100, 100]
# repetition divides or multiplies float32 logits: kept where neither overflows nor reaches zero.
REPETITION_RANGE = (1e-6, 1e6)


def penalty_error(params: SamplingParams, info: ModelInfo) -> tuple[str, str] | None:
    """(field, what is wrong) for the first penalty field out of range, or None when all are fine.
    ``validation`` raises it as a RequestRejected."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not (math.isfinite(value) and -PENALTY_LIMIT <= value <= PENALTY_LIMIT):
            return f"sampling.{name}", f"must be in [-2, 2], got {value}"
    rep, (low, high) = params.repetition_penalty, REPETITION_RANGE
    if not low <= rep <= high:  # NaN fails both comparisons
        return "sampling.repetition_penalty", f"must be in [{low:g}, {high:g}], got {rep}"
    if not 0 <= params.min_tokens <= params.max_new_tokens:
        limit = params.max_new_tokens
        return "sampling.min_tokens", f"must be in [0, max_tokens = {limit}], got {params.min_tokens}"
    bias = params.logit_bias
    if len(bias) > MAX_LOGIT_BIAS:
        return "sampling.logit_bias", f"has {len(bias)} entries, at most {MAX_LOGIT_BIAS}"
    bad_ids = [t for t in bias if not 0 <= t < info.vocab_size]
    if bad_ids:
        vocab = info.vocab_size
        return "sampling.logit_bias", f"token ids {bad_ids[:8]} are outside the vocabulary [0, {vocab})"
    bad_values = [v for v in bias.values() if not (math.isfinite(v) and -BIAS_LIMIT <= v <= BIAS_LIMIT)]
    if bad_values:
        return "sampling.logit_bias", f"values must be in [-100, 100], got {bad_values[:8]}"
    return None


def worker_penalties(
    params: SamplingParams, prompt_len: int, stop_token_ids: list[int]
) -> WorkerPenalties | None:
    """What the worker applies for a checked request, or None when nothing changes a logit."""
    bias = {t: float(v) for t, v in params.logit_bias.items() if v != 0}
    min_tokens = params.min_tokens if stop_token_ids else 0  # nothing to mask: min_tokens is moot
    if (
        params.presence_penalty == 0
        and params.frequency_penalty == 0
        and params.repetition_penalty == 1
        and not bias
        and min_tokens == 0
    ):
        return None
    return WorkerPenalties(
        prompt_len=prompt_len,
        presence=float(params.presence_penalty),
        frequency=float(params.frequency_penalty),
        repetition=float(params.repetition_penalty),
        bias_ids=list(bias),
        bias_values=list(bias.values()),
        min_tokens=min_tokens,
        min_tokens_ids=list(stop_token_ids) if min_tokens else [],
    )
