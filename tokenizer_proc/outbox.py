"""What handling one message makes the tokenizer process send: replies to clients, messages to the
scheduler, and ZMQ requests to compile before they start."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from protocol.messages import FinishReason, GenerateOutput, ToScheduler

if TYPE_CHECKING:
    from tokenizer_proc.intake import Admitting

Reply = tuple[bytes, GenerateOutput]  # (client identity, reply)


@dataclass
class Outbox:
    """What one incoming message makes the process send."""

    replies: list[Reply] = field(default_factory=list)
    to_scheduler: list[ToScheduler] = field(default_factory=list)
    # ZMQ requests with something to compile: the process compiles it off its event loop, then
    # starts them (Frontend.admit_after_compile).
    to_compile: list[Admitting] = field(default_factory=list)


def error_output(rid: str, message: str, index: int = 0) -> GenerateOutput:
    return GenerateOutput(rid=rid, finish_reason=FinishReason.ERROR, error=message, index=index)
