"""Retraction (SGLang): when the next decode step cannot get its pages, running requests go back.

A retracted request gives back its KV (cached first, so its recompute may hit the
prefix cache), keeps its output, and waits at the front of the queue; it is
recomputed as one prefill of prompt + output when admitted again. Retraction needs
every token of the request back, so it runs only with no batch in flight.
"""

from __future__ import annotations

import logging
from collections import deque

from scheduler_proc.kv_manager import KVManager
from scheduler_proc.request import Req, ReqStatus

log = logging.getLogger("rivulet.scheduler")


def pick_victim(running: list[Req]) -> Req:
    """SGLang's order: least progress lost first; ties: the longest prompt frees most."""
    return min(running, key=lambda r: (len(r.output_ids), -len(r.input_ids)))


def retract(req: Req, running: list[Req], waiting: deque[Req], kv: KVManager) -> None:
    """Move a running request back to the front of ``waiting``, its KV given back."""
    running.remove(req)
    kv.release(req, cache=True)
    req.flight.reset()
    req.status = ReqStatus.WAITING
    req.num_retractions += 1
    waiting.appendleft(req)
    log.warning(
        "KV pool exhausted: retracted rid %d (%d output tokens kept, will recompute %d tokens); "
        "#running-req: %d, #queue-req: %d",
        req.rid,
        len(req.output_ids),
        req.seq_len,
        len(running),
        len(waiting),
    )
