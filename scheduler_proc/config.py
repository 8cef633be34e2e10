"""The scheduler's configuration: plain ints, built once by the launcher."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    """Budgets and sizes of the scheduler core.

    ``num_pages`` and ``context_len`` come from the worker's WorkerReady message;
    the launcher builds this config after the worker has reported them.
    """

    num_pages: int = 0
    context_len: int = 0
    page_size: int = 16
    max_running_requests: int = 128  # request slots in the worker's page table
    max_prefill_tokens: int = 4096  # rem_input_tokens of each PrefillAdder
    chunked_prefill_size: int = 512  # rem_chunk_tokens; <= 0 disables chunking
    enable_mixed_chunk: bool = False  # prefill chunk + running decodes in one forward
    clip_max_new_tokens: int = 4096  # cap on one request's reserved future tokens
    new_token_ratio: float = 1.0  # share of that reservation counted against free KV
    decode_log_interval: int = 40  # log a decode line every N decode steps

    def __post_init__(self) -> None:
        assert self.page_size >= 1, "page_size must be >= 1"
        assert self.max_running_requests >= 1, "max_running_requests must be >= 1"
        assert self.max_prefill_tokens >= 1, "max_prefill_tokens must be >= 1"

    @property
    def chunk_tokens(self) -> int | None:
        """The chunk budget, or None when chunked prefill is disabled."""
        return self.chunked_prefill_size if self.chunked_prefill_size > 0 else None

    @property
    def total_tokens(self) -> int:
        return self.num_pages * self.page_size
