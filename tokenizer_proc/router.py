"""Which data-parallel replica serves a request (``--dp-size``, ``--dp-routing``).

Each replica (a scheduler and its worker) has its own KV pool and radix cache, so a request
whose prompt starts like one sent to a replica before is cheapest there. The router keeps,
per replica, an approximate picture of what it routed there: the prompts' leading token
blocks as a chain of hashes (``BLOCK_TOKENS`` tokens each, the cache salt mixed in), at most
``MAX_BLOCKS`` per replica, least recently routed forgotten first. It cannot see the
replicas' evictions; it forgets on its own schedule instead.

Policies:

- ``cache_aware``: the replica holding the longest routed prefix of the prompt, when that
  covers at least ``CACHE_THRESHOLD`` of its blocks; otherwise, or when the load is out of
  balance (the busiest replica has ``BALANCE_ABS_TOKENS`` more than the idlest and
  ``BALANCE_REL`` times as much), the least loaded.
- ``least_load``: the least loaded.
- ``round_robin``: in turn.

Load is the tokenizer's own count: the prompt plus up to ``LOAD_OUTPUT_TOKENS`` output tokens
of every request routed to the replica that has not finished. Ties go to the next replica in
turn, so a run of cache misses on an idle engine spreads over the replicas instead of piling
on the first (the fault of sgl-project/sglang#32983). The n choices of a request go where
its first goes: they fork from its prefill.
"""

from __future__ import annotations

from collections import OrderedDict

BLOCK_TOKENS = 16
MAX_BLOCKS = 1 << 16  # per replica: ~1M prompt tokens remembered
CACHE_THRESHOLD = 0.5
BALANCE_ABS_TOKENS = 4096
BALANCE_REL = 1.5
LOAD_OUTPUT_TOKENS = 256
POLICIES = ("cache_aware", "least_load", "round_robin")


class Router:
    """Routes requests to replicas and counts each replica's load until its requests finish."""

    def __init__(self, dp_size: int = 1, policy: str = "cache_aware") -> None:
        assert dp_size >= 1 and policy in POLICIES, f"bad router: {dp_size} replicas, policy {policy!r}"
        self.dp_size = dp_size
        self.policy = policy
        self.load = [0] * dp_size
        self.routed = [0] * dp_size  # requests routed to each replica, since start
        self._live: dict[int, tuple[int, int]] = {}  # rid -> (replica, load it adds)
        self._blocks: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(dp_size)]
        self._turn = 0

    def route(self, rid: int, n: int, input_ids: list[int], salt: str | None, max_new_tokens: int) -> int:
        """Pick the replica of the request whose choices are rids ``rid .. rid + n - 1``."""
        blocks = block_hashes(input_ids, salt) if self.policy == "cache_aware" else []
        replica = self._pick(blocks)
        output = min(max_new_tokens, LOAD_OUTPUT_TOKENS)
        for i in range(n):
            load = output + (len(input_ids) if i == 0 else 0)
            self._live[rid + i] = (replica, load)
            self.load[replica] += load
        self.routed[replica] += 1
        seen = self._blocks[replica]
        for h in blocks:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > MAX_BLOCKS:
            seen.popitem(last=False)
        return replica

    def replica_of(self, rid: int) -> int:
        return self._live[rid][0]

    def release(self, rid: int) -> None:
        """``rid`` finished: its load leaves its replica (none when a fault on its way in stopped it
        before it was routed)."""
        if rid not in self._live:
            return
        replica, load = self._live.pop(rid)
        self.load[replica] -= load

    def _pick(self, blocks: list[int]) -> int:
        if self.dp_size == 1:
            return 0
        if self.policy == "round_robin":
            return self._in_turn(list(range(self.dp_size)))
        if self.policy == "cache_aware" and blocks and not self._imbalanced():
            matches = [self._matched(r, blocks) for r in range(self.dp_size)]
            best = max(matches)
            if best >= CACHE_THRESHOLD * len(blocks):
                return self._least_loaded([r for r in range(self.dp_size) if matches[r] == best])
        return self._least_loaded(list(range(self.dp_size)))

    def _imbalanced(self) -> bool:
        most, least = max(self.load), min(self.load)
        return most - least > BALANCE_ABS_TOKENS and most > BALANCE_REL * least

    def _matched(self, replica: int, blocks: list[int]) -> int:
        """Leading blocks of the prompt routed to ``replica`` before (a chain: each names its prefix)."""
        seen = self._blocks[replica]
        count = 0
        for h in blocks:
            if h not in seen:
                break
            count += 1
        return count

    def _least_loaded(self, candidates: list[int]) -> int:
        least = min(self.load[r] for r in candidates)
        return self._in_turn([r for r in candidates if self.load[r] == least])

    def _in_turn(self, candidates: list[int]) -> int:
        """The first of ``candidates`` at or after the turn; the turn moves past it."""
        pick = min(candidates, key=lambda r: (r - self._turn) % self.dp_size)
        self._turn = (pick + 1) % self.dp_size
        return pick


def block_hashes(input_ids: list[int], salt: str | None) -> list[int]:
    """One hash per whole block of ``BLOCK_TOKENS`` prompt tokens, each covering every token
    before it too (a chain), and the salt: prompts share a block hash only if they share the
    whole prefix up to it, in the same cache namespace."""
    out: list[int] = []
    h = hash(("rivulet-prefix", salt))
    for start in range(0, len(input_ids) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        h = hash((h, tuple(input_ids[start : start + BLOCK_TOKENS])))
        out.append(h)
    return out
