"""The scheduler's configuration: plain ints, built once by the launcher."""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULE_POLICIES = ("fcfs", "pack", "lpm")


@dataclass(frozen=True)
class SchedulerConfig:
    """Budgets, sizes and policies of the scheduler core.

    ``num_pages`` and ``context_len`` come from the worker's WorkerReady message;
    the launcher builds this config after the worker has reported them.
    """

    num_pages: int = 0
    context_len: int = 0
    page_size: int = 16
    max_running_requests: int = 128  # request slots: the cap on admitted, unfinished requests
    max_prefill_tokens: int = 4096  # rem_input_tokens of each PrefillAdder
    chunked_prefill_size: int = 512  # rem_chunk_tokens; <= 0 disables chunking
    enable_mixed_chunk: bool = False  # prefill chunk + running decodes in one forward
    overlap_schedule: bool = True  # build the next batch while the worker runs this one
    disable_radix_cache: bool = False  # no prefix cache: every request computes its whole prompt
    # Admission (see scheduler_proc/admission.py).
    schedule_policy: str = "fcfs"  # fcfs | pack (cheapest first in a window) | lpm (longest cached prefix)
    admission_lookahead: int = 64  # waiting requests pack and lpm look at per round
    force_fifo_every: int = 0  # every N-th admission round is FIFO; 0: never
    prefill_max_requests: int = 0  # new requests admitted per round; 0: no cap
    max_overtakes: int = 16  # rounds a waiting request may be overtaken before all wait for it
    # Prefill vs decode when mixed chunk is off (see Scheduler._next_rows).
    decode_first: bool = False  # with running requests, a decode batch precedes each prefill batch
    max_consecutive_prefills: int = 1  # prefill batches in a row while running requests wait to decode
    # KV reservation for running requests (SGLang's new_token_ratio, see token_ratio.py).
    clip_max_new_tokens: int = 4096  # cap on one request's reserved future tokens
    schedule_conservativeness: float = 1.0  # scales the reservation ratio; > 1 admits more cautiously
    new_token_ratio_decay_steps: int = 600  # decode steps from the initial ratio to the minimum; <= 0: fixed
    decode_log_interval: int = 40  # log a decode line every N decode steps

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

    @property
    def chunk_tokens(self) -> int | None:
        """The chunk budget, or None when chunked prefill is disabled."""
        return self.chunked_prefill_size if self.chunked_prefill_size > 0 else None

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
