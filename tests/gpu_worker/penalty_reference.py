"""The penalties as their definitions read, one row at a time in float64: what the worker's batched
tables (gpu_worker/sampling/penalties.py) must equal.

repetition (HF's RepetitionPenaltyLogitsProcessor, vLLM, SGLang): every token in the prompt or
the output, logit > 0 divided by it, otherwise multiplied; then OpenAI's
``logit - frequency * count - presence * (count > 0)`` over the generated tokens; then
logit_bias added; then -inf on the stop ids while fewer than min_tokens were generated.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch

from protocol.sampling import WorkerPenalties


def penalized(logits: torch.Tensor, prompt: list[int], output: list[int], p: WorkerPenalties) -> torch.Tensor:
    """One row of logits [vocab] with ``p`` applied, given the prompt and the tokens generated so far."""
    x = logits.to(torch.float64).clone()
    for t in set(prompt) | set(output):
        value = float(x[t])
        x[t] = value / p.repetition if value > 0 else value * p.repetition
    for t, count in Counter(output).items():
        x[t] -= p.frequency * count + p.presence
    for t, bias in zip(p.bias_ids, p.bias_values, strict=True):
        x[t] += bias
    if len(output) < p.min_tokens:
        for t in p.min_tokens_ids:
            x[t] = float("-inf")
    return x


def greedy(
    next_logits: Callable[[list[int]], torch.Tensor],
    prompt: list[int],
    new_tokens: int,
    p: WorkerPenalties | None,
    stop_ids: tuple[int, ...] = (),
) -> list[int]:
    """Greedy decoding with ``p`` applied before each argmax; ``next_logits(seq)`` is the model's
    last-position logits. Ends after a stop id, as the scheduler does."""
    output: list[int] = []
    for _ in range(new_tokens):
        logits = next_logits(prompt + output)
        if p is not None:
            logits = penalized(logits, prompt, output, p)
        output.append(int(logits.argmax()))
        if output[-1] in stop_ids:
            break
    return output
