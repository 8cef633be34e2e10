"""How the worker samples a request's tokens, as the tokenizer sends it on (inside TokenizedRequest)
and the scheduler passes it to the worker (inside ForwardBatch): msgpack arrays, as every message
between rivulet's processes (messages.py)."""

from __future__ import annotations

import msgspec


class WorkerPenalties(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """A request's logit adjustments, applied in the worker before temperature and filters, in
    this order: repetition (logit > 0 divided by it, < 0 multiplied, for every token in the prompt
    or the output), then ``- frequency * count - presence * (count > 0)`` over the generated
    tokens plus ``logit_bias``, then ``-inf`` on ``min_tokens_ids`` while fewer than
    ``min_tokens`` tokens were generated. Positions from ``prompt_len`` on are generated tokens.
    """

    prompt_len: int
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    bias_ids: list[int] = []
    bias_values: list[float] = []
    min_tokens: int = 0
    min_tokens_ids: list[int] = []  # EOS (unless ignore_eos) and the client's stop token ids


class WorkerGrammar(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """A request's grammar as the worker needs it (gpu_worker/sampling/grammar.py).

    ``compiled`` is xgrammar's compiled grammar as its own JSON text (``CompiledGrammar.serialize_json``:
    the grammar and its token-mask cache, not the vocabulary, which the worker builds once from the
    model's tokenizer). ``key`` names it, so the worker deserializes a grammar once and keeps it by key.
    The grammar's end allows only ``stop_token_ids`` (the EOS ids, which end the request); positions
    from ``prompt_len`` on are generated tokens, the ones the worker's matcher follows.
    """

    key: str
    compiled: str
    stop_token_ids: list[int]
    prompt_len: int


class WorkerSampling(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """What the worker needs to sample one request's tokens: the client's SamplingParams less what
    the tokenizer and scheduler handle (stopping, lengths), with the seed resolved.

    ``seed`` is always set (the tokenizer draws one when the client gave none):
    sampling noise is a pure function of (seed, position), so a request's tokens
    do not depend on which other requests share its batch.
    """

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    logprobs: bool = False  # the client wants each token's logprob (else the worker skips them)
    top_logprobs: int = 0  # and the N most likely tokens at each position (0: none)
    penalties: WorkerPenalties | None = None  # None: the request changes no logit (the fast path)
    grammar: WorkerGrammar | None = None  # None: free text (no token mask)

    @property
    def needs_prefix_ids(self) -> bool:
        """The worker's per-request state of this request (indexed by its req_pool_idx) follows its
        tokens (penalty counts, a grammar's matcher), so a req_pool_idx given to it past position 0
        needs the cached prefix's ids."""
        return self.penalties is not None or self.grammar is not None
