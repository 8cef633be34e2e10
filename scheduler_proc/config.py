"""The scheduler's configuration: plain ints, built once by the launcher."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.flags import flag, given, max_running_requests_field

SCHEDULE_POLICIES = ("fcfs", "pack", "lpm")
SPECULATIVE_ALGORITHMS = ("none", "ngram")


@dataclass(frozen=True)
class SchedulerConfig:
    """Budgets, sizes and policies of the scheduler core.

    ``num_pages``, ``context_len`` and ``page_size`` come from the worker's WorkerReady
    message; the launcher builds this config after the worker has reported them. Every
    other field but ``clip_max_new_tokens`` is a launcher flag (protocol/flags.py).
    """

    num_pages: int = given(0, "the worker's WorkerReady: KV pages it allocated")
    context_len: int = given(0, "the worker's WorkerReady: the model's context length")
    page_size: int = given(16, "the worker's WorkerReady: tokens per KV page (--page-size)")
    replica: int = given(0, "the launcher: its data-parallel replica (--dp-size)")
    worker_endpoints: tuple[str, ...] = given(
        (), "the worker's WorkerReady (rank 0's): each tensor-parallel rank's batch socket; () for one rank"
    )
    state_checkpoints: int = given(
        -1,
        "the worker's WorkerReady: a hybrid model's recurrent-state checkpoints for the prefix cache "
        "(0: none, the prefix cache is off; -1: the model keeps no recurrent state)",
    )
    max_running_requests: int = max_running_requests_field()
    max_prefill_tokens: int = flag(4096, "prompt tokens one round may prefill (rem_input_tokens)")
    chunked_prefill_size: int = flag(512, "tokens per prefill chunk (rem_chunk_tokens); -1 disables")
    enable_mixed_chunk: bool = flag(
        False,
        "run a prefill chunk and the running decodes in one forward (default: on for a CPU worker, "
        "where every forward streams all weights and a separate prefill pass stalls each stream; "
        "off on GPU)",
        negatable=True,
        unset_default=None,  # unset: the launcher follows the worker's device
    )
    overlap_schedule: bool = flag(
        True,
        "send one batch at a time (default: the next batch is built while the worker runs one)",
        name="--disable-overlap-schedule",
    )
    disable_radix_cache: bool = flag(False, "no prefix cache: every request computes its whole prompt")
    # Admission (see scheduler_proc/admission.py).
    schedule_policy: str = flag(
        "fcfs",
        "fcfs | pack (cheapest first in a window) | lpm (longest cached prefix first)",
        choices=SCHEDULE_POLICIES,
    )
    admission_lookahead: int = flag(64, "waiting requests pack and lpm look at per round")
    force_fifo_every: int = flag(0, "every N-th admission round is FIFO; 0: never")
    prefill_max_requests: int = flag(0, "new requests admitted per round; 0: no cap")
    max_overtakes: int = flag(16, "rounds a waiting request may be overtaken before all wait for it")
    # Prefill vs decode when mixed chunk is off (see Scheduler._next_rows).
    decode_first: bool = flag(False, "with running requests, a decode batch precedes each prefill batch")
    max_consecutive_prefills: int = flag(1, "prefill batches in a row while running requests wait to decode")
    # KV reservation for running requests (SGLang's new_token_ratio, see token_ratio.py).
    clip_max_new_tokens: int = given(4096, "a constant: the cap on one request's reserved future tokens")
    schedule_conservativeness: float = flag(
        1.0, "scales the KV reservation ratio; > 1 admits more cautiously"
    )
    new_token_ratio_decay_steps: int = flag(
        600, "decode steps from the initial reservation ratio to the minimum; <= 0: fixed"
    )
    decode_log_interval: int = flag(40, "log a decode line every N decode steps")
    # Speculative decoding (see scheduler_proc/speculative.py).
    speculative_algorithm: str = flag(
        "none",
        "none | ngram: draft each running request's next tokens by looking its last n tokens up in its "
        "prompt and output, and verify the drafts in one forward (greedy output unchanged)",
        choices=SPECULATIVE_ALGORITHMS,
    )
    speculative_num_draft_tokens: int = flag(
        7,
        "the most tokens a request drafts a step (K); a request drafts 3 at first, 2 more after a verify "
        "that kept all and 1 fewer otherwise; 1 + 7 rows fit one pass of the AVX-512 Q4_0/Q4_1/Q8_0 tiles",
    )
    speculative_ngram_min_size: int = flag(1, "the shortest suffix (tokens) the n-gram lookup matches")
    speculative_ngram_max_size: int = flag(4, "the longest suffix (tokens) the n-gram lookup tries first")
    speculative_row_cost: float = given(
        0.25,
        "a constant: one more token row of a step as a share of a one-row step's fixed cost (the "
        "embedded model on a 2-core Zen 4, GGUF blocks); sets when drafting pays (speculative.py)",
    )

    def __post_init__(self) -> None:
        assert self.page_size >= 1, "page_size must be >= 1"
        assert self.max_running_requests >= 1, "max_running_requests must be >= 1"
        assert self.max_prefill_tokens >= 1, "max_prefill_tokens must be >= 1"
        assert self.schedule_policy in SCHEDULE_POLICIES, (
            f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}"
        )
        assert self.admission_lookahead >= 1, "admission_lookahead must be >= 1"
        assert self.force_fifo_every >= 0, "force_fifo_every must be >= 0"
        assert self.prefill_max_requests >= 0, "prefill_max_requests must be >= 0"
        assert self.max_overtakes >= 0, "max_overtakes must be >= 0"
        assert self.max_consecutive_prefills >= 1, "max_consecutive_prefills must be >= 1"
        assert self.clip_max_new_tokens >= 1, "clip_max_new_tokens must be >= 1"
        assert self.schedule_conservativeness > 0, "schedule_conservativeness must be > 0"
        assert self.speculative_algorithm in SPECULATIVE_ALGORITHMS, (
            f"speculative_algorithm must be one of {SPECULATIVE_ALGORITHMS}"
        )
        assert self.speculative_num_draft_tokens >= 1, "speculative_num_draft_tokens must be >= 1"
        assert 1 <= self.speculative_ngram_min_size <= self.speculative_ngram_max_size, (
            "speculative n-gram sizes must be 1 <= min <= max"
        )

    @property
    def chunk_tokens(self) -> int | None:
        """The chunk budget, or None when chunked prefill is disabled."""
        return self.chunked_prefill_size if self.chunked_prefill_size > 0 else None

    @property
    def prefix_cache(self) -> bool:
        """The radix cache is on: not disabled, and where the model keeps a recurrent state, with
        checkpoints of it (else a page hit would resume another request's state: wrong output)."""
        return not self.disable_radix_cache and self.state_checkpoints != 0

    @property
    def speculative(self) -> bool:
        return self.speculative_algorithm != "none"

    @property
    def total_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def init_new_token_ratio(self) -> float:
        """The ratio after idleness: 0.7 of each running request's remaining budget (SGLang's default)."""
        return min(0.7 * self.schedule_conservativeness, 1.0)

    @property
    def min_new_token_ratio(self) -> float:
        """Where the ratio settles after many decode steps without retraction."""
        return min(0.14 * self.init_new_token_ratio, 1.0)
