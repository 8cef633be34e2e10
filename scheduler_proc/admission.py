"""Which waiting requests a round offers to the PrefillAdder, and in what order.

Policies (``--schedule-policy``):

- ``fcfs``: arrival order; the round stops at the first request that does not
  fit the input or chunk budget (a head larger than the budget goes alone, or
  as the chunked_req).
- ``pack``: over the first ``admission_lookahead`` waiting requests,
  greedily take the cheapest (fewest prompt tokens still to compute, cache hits
  excluded) that fit the round's budgets whole; the rest keep their queue
  order. If none fits, the head goes as fcfs would take it.
- ``lpm``: longest cached prefix first (as fcfs otherwise), over the first
  ``LPM_MAX_QUEUE`` waiting requests; with a longer queue, fcfs (SGLang's rule:
  matching every request each round would cost more than it saves).

Every ``force_fifo_every``-th round is fcfs. Under every policy a request that
does not fit the free KV right now (its reservation included) lets the ones
behind it try, so it never blocks smaller requests for long; a request passed
over ``max_overtakes`` times becomes urgent: it is offered first, and if it
still does not fit nobody else is admitted, so the running requests drain
until it does. Starvation is thus bounded for every policy; one that could
never fit was rejected on arrival.

Each offered request first gets its cached prefix (locked, so admitting others
cannot evict it); a request that is not admitted gives it back. A request whose
uncomputed prompt shares ``IN_BATCH_SHARE_TOKENS`` or more with a request this
round computes waits a round (unless urgent): by then that prefix is cached and
it is computed once (identical prompts included).
"""

from __future__ import annotations

from collections import deque
from itertools import islice

from scheduler_proc.config import SchedulerConfig
from scheduler_proc.kv_manager import KVManager
from scheduler_proc.prefill_adder import AddOutcome, AddResult, Admitted, PrefillAdder
from scheduler_proc.radix_cache import RadixCache
from scheduler_proc.request import Req

LPM_MAX_QUEUE = 128
IN_BATCH_SHARE_TOKENS = 32


class Admission:
    """Runs the admission part of each round over the waiting queue; counts rounds for force_fifo_every."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.num_rounds = 0
        self.share_tokens = max(IN_BATCH_SHARE_TOKENS, config.page_size)

    def admit(
        self, adder: PrefillAdder, waiting: deque[Req], kv: KVManager, continued: Req | None = None
    ) -> list[Admitted]:
        """Offer waiting requests to ``adder``; the admitted leave ``waiting``, returned in arrival order.

        ``continued`` is the chunked_req the adder already took this round, if any.
        """
        if not waiting:
            return []
        self.num_rounds += 1
        policy = self._policy(len(waiting))
        window = list(waiting) if policy == "fcfs" else list(islice(waiting, self.config.admission_lookahead))
        if policy == "lpm" and len(waiting) <= LPM_MAX_QUEUE:
            window = list(waiting)
        round_tree = self._round_tree(kv, continued)
        admitted = self._offer(adder, kv, round_tree, self._order(window, policy, kv), policy)
        if not admitted and policy == "pack" and not self._has_urgent(window):
            # Pack found nothing that fits whole: the head goes as fcfs would take it.
            admitted = self._offer(adder, kv, None, [(0, window[0])], "fcfs")
        admitted.sort()  # arrival order
        self._count_overtakes(window, {pos for pos, _ in admitted})
        self._remove(waiting, len(window), {pos for pos, _ in admitted})
        return [entry for _, entry in admitted]

    def _policy(self, queue_len: int) -> str:
        every, policy = self.config.force_fifo_every, self.config.schedule_policy
        if every > 0 and self.num_rounds % every == 0:
            return "fcfs"
        if policy == "lpm" and queue_len > LPM_MAX_QUEUE:
            return "fcfs"
        return policy

    def _urgent(self, req: Req) -> bool:
        return req.num_overtaken >= self.config.max_overtakes

    def _has_urgent(self, window: list[Req]) -> bool:
        return any(self._urgent(req) for req in window)

    def _order(self, window: list[Req], policy: str, kv: KVManager) -> list[tuple[int, Req]]:
        """(queue position, request), urgent first (oldest first), then the policy's order
        (sorted() is stable: ties by arrival)."""
        urgent = [(i, req) for i, req in enumerate(window) if self._urgent(req)]
        rest = [(i, req) for i, req in enumerate(window) if not self._urgent(req)]
        if policy == "pack":
            rest = sorted(rest, key=lambda e: e[1].seq_len - kv.peek_prefix_len(e[1]))
        elif policy == "lpm":
            rest = sorted(rest, key=lambda e: -kv.peek_prefix_len(e[1]))
        return urgent + rest

    def _round_tree(self, kv: KVManager, continued: Req | None) -> RadixCache | None:
        """What this round computes, as a tree of fake pages (None without a prefix cache)."""
        if kv.cache is None:
            return None
        tree = RadixCache(self.config.page_size, lambda pages: None)
        if continued is not None:
            self._note_computed(tree, continued)
        return tree

    def _note_computed(self, tree: RadixCache, req: Req) -> None:
        num_pages = req.seq_len // self.config.page_size
        tree.insert(
            req.key_slice(0, num_pages * self.config.page_size), list(range(num_pages)), req.cache_salt
        )

    def _shares_with_round(self, tree: RadixCache | None, req: Req) -> bool:
        """True when ``req``'s uncomputed prompt starts with tokens this round already computes
        (never for one that needs every prompt position: it would not use the cached prefix)."""
        if tree is None or req.needs_every_prompt_position:
            return False
        match = tree.match_prefix(req.key_slice(0, req.seq_len - 1), req.cache_salt)
        return match.num_pages * self.config.page_size - req.kv_len >= self.share_tokens

    def _offer(
        self,
        adder: PrefillAdder,
        kv: KVManager,
        tree: RadixCache | None,
        order: list[tuple[int, Req]],
        policy: str,
    ) -> list[tuple[int, Admitted]]:
        """Offer ``order`` one by one; returns the admitted with their queue positions, as offered."""
        cap = self.config.prefill_max_requests or len(order)
        admitted: list[tuple[int, Admitted]] = []
        num_passed = 0
        for pos, req in order:
            if len(admitted) >= cap:
                break
            urgent = self._urgent(req)
            outcome = self._offer_one(
                adder, kv, tree, req, urgent, whole_only=policy == "pack" and not urgent
            )
            if outcome is None:
                continue  # next round its shared prefix is cached
            if outcome.admitted:
                admitted.append((pos, Admitted(req, outcome.extend_len)))
            elif urgent:
                break  # still not in: everyone waits for it
            elif outcome.result is AddResult.NO_TOKEN or (
                outcome.result is AddResult.NO_BUDGET and policy == "pack"
            ):
                num_passed += 1  # let the ones behind try; bounded per request by max_overtakes
                if num_passed >= self.config.admission_lookahead:
                    break
                continue
            if outcome.result is not AddResult.CONTINUE:
                break
        return admitted

    def _offer_one(
        self,
        adder: PrefillAdder,
        kv: KVManager,
        tree: RadixCache | None,
        req: Req,
        urgent: bool,
        *,
        whole_only: bool,
    ) -> AddOutcome | None:
        """Offer ``req`` with its cached prefix; None: held back, it shares a prefix with the round
        (unless urgent). A request not admitted gives its prefix back, to the cache and to the
        adder's count, so the round ends as if it had never been offered.
        """
        kv.attach_prefix(req, adder)
        held_back = not urgent and self._shares_with_round(tree, req)
        outcome = None if held_back else adder.add_one_req(req, whole_only=whole_only)
        if outcome is None or not outcome.admitted:
            kv.detach_prefix(req, adder)
        elif tree is not None:
            self._note_computed(tree, req)
        return outcome

    @staticmethod
    def _count_overtakes(window: list[Req], taken: set[int]) -> None:
        """Every request before the last admitted one that was not admitted was overtaken."""
        if not taken:
            return
        for pos in range(max(taken)):
            if pos not in taken:
                window[pos].num_overtaken += 1

    @staticmethod
    def _remove(waiting: deque[Req], window_len: int, taken: set[int]) -> None:
        """Drop the ``taken`` positions of the first ``window_len`` of ``waiting``; the others keep
        their order."""
        head = [waiting.popleft() for _ in range(window_len)]
        waiting.extendleft(reversed([req for pos, req in enumerate(head) if pos not in taken]))
