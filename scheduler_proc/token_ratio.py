"""SGLang's ``new_token_ratio``: how much of their remaining budget running requests are expected to use.

Admission keeps ``min(max_new_tokens - generated, clip) * ratio`` tokens of free KV
per running request. Most requests stop (EOS) long before ``max_new_tokens``, so a
ratio of 1 wastes KV that could run more requests; a ratio too low over-commits
the pool and decode has to retract. The ratio therefore starts cautious, decays a
little with every decode step that needed no retraction, and is raised again
whenever a retraction proves it too low.
"""

from __future__ import annotations

from scheduler_proc.config import SchedulerConfig

RETRACT_RATIO_BUMP = 0.1  # a retraction raises the ratio by at least this much


class NewTokenRatio:
    """The current ratio; the scheduler reports decode steps, retractions and idleness to it."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.init = config.init_new_token_ratio
        self.min = config.min_new_token_ratio
        steps = config.new_token_ratio_decay_steps
        self.decay = (self.init - self.min) / steps if steps > 0 else 0.0
        self.value = self.init

    def on_decode_step(self) -> None:
        self.value = max(self.value - self.decay, self.min)

    def on_retract(self) -> None:
        """Back to the cautious start at least, and higher each time retractions come back to back."""
        self.value = min(max(self.init, self.value + RETRACT_RATIO_BUMP), 1.0)

    def on_idle(self) -> None:
        """Nothing runs: what the last requests used says little about the next ones."""
        self.value = self.init
