"""Which waiting requests a round offers to the PrefillAdder, and in what order.

Policies (``--schedule-policy``):

- ``fcfs``: arrival order; the round stops at the first request that does not
  fit the input or chunk budget (a head larger than the budget goes alone, or
  as the chunked_req).
- ``pack`` (seed 000): over the first ``admission_lookahead`` waiting requests,
  greedily take the cheapest (fewest prompt tokens still to compute) that fit
  the round's budgets whole; the rest keep their queue order. If none fits,
  the head goes as fcfs would take it. Every ``force_fifo_every``-th round is fcfs.

Under every policy a request that does not fit the free KV right now (its
reservation included) lets the ones behind it try, so it never blocks smaller
requests for long; a request passed over ``max_overtakes`` times becomes
urgent: it is offered first, and if it still does not fit nobody else is
admitted, so the running requests drain until it does. Starvation is thus
bounded for every policy; one that could never fit was rejected on arrival.
"""

from __future__ import annotations

from collections import deque
from itertools import islice

from scheduler_proc.config import SchedulerConfig
from scheduler_proc.prefill_adder import AddResult, PrefillAdder
from scheduler_proc.request import Req


class Admission:
    """Runs the admission part of each round over the waiting queue; counts rounds for force_fifo_every."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.num_rounds = 0

    def is_fifo_round(self) -> bool:
        every = self.config.force_fifo_every
        return self.config.schedule_policy == "fcfs" or (every > 0 and self.num_rounds % every == 0)

    def admit(self, adder: PrefillAdder, waiting: deque[Req]) -> list[Req]:
        """Offer waiting requests to ``adder``; the admitted leave ``waiting``, returned in arrival order."""
        if not waiting:
            return []
        self.num_rounds += 1
        fifo = self.is_fifo_round()
        window = list(waiting) if fifo else list(islice(waiting, self.config.admission_lookahead))
        position = {id(req): i for i, req in enumerate(window)}
        admitted = self._offer(adder, self._order(window, fifo), fifo)
        if not admitted and not fifo and not self._has_urgent(window):
            # Pack found nothing that fits whole: the head goes as fcfs would take it.
            self._offer(adder, window[:1], fifo=True)
            admitted = [window[0]] if self._took(adder, window[0]) else []
        admitted.sort(key=lambda req: position[id(req)])
        self._count_overtakes(window, admitted, position)
        self._remove(waiting, len(window), admitted)
        return admitted

    def _has_urgent(self, window: list[Req]) -> bool:
        return any(req.num_overtaken >= self.config.max_overtakes for req in window)

    def _order(self, window: list[Req], fifo: bool) -> list[Req]:
        """Urgent requests first (oldest first), then the policy's order."""
        urgent = [req for req in window if req.num_overtaken >= self.config.max_overtakes]
        rest = [req for req in window if req.num_overtaken < self.config.max_overtakes]
        if not fifo:  # pack: cheapest first; sorted() is stable, so ties keep arrival order
            rest = sorted(rest, key=lambda req: req.extend_input_len)
        return urgent + rest

    @staticmethod
    def _took(adder: PrefillAdder, req: Req) -> bool:
        return bool(adder.can_run_list) and adder.can_run_list[-1][0] is req

    def _offer(self, adder: PrefillAdder, order: list[Req], fifo: bool) -> list[Req]:
        """Offer ``order`` one by one; returns the admitted, in the order offered."""
        cap = self.config.prefill_max_requests or len(order)
        admitted: list[Req] = []
        num_passed = 0
        for req in order:
            if len(admitted) >= cap:
                break
            urgent = req.num_overtaken >= self.config.max_overtakes
            result = adder.add_one_req(req, whole_only=not (fifo or urgent))
            if self._took(adder, req):
                admitted.append(req)
            elif urgent:
                break  # still not in: everyone waits for it
            elif result is AddResult.NO_TOKEN or (result is AddResult.OTHER and not fifo):
                num_passed += 1  # let the ones behind try; bounded per request by max_overtakes
                if num_passed >= self.config.admission_lookahead:
                    break
                continue
            if result is not AddResult.CONTINUE:
                break
        return admitted

    @staticmethod
    def _count_overtakes(window: list[Req], admitted: list[Req], position: dict[int, int]) -> None:
        if not admitted:
            return
        last = position[id(admitted[-1])]
        taken = {id(req) for req in admitted}
        for req in window[:last]:
            if id(req) not in taken:
                req.num_overtaken += 1

    @staticmethod
    def _remove(waiting: deque[Req], window_len: int, admitted: list[Req]) -> None:
        """Drop ``admitted`` from the first ``window_len`` of ``waiting``; the others keep their order."""
        taken = {id(req) for req in admitted}
        head = [waiting.popleft() for _ in range(window_len)]
        waiting.extendleft(reversed([req for req in head if id(req) not in taken]))
