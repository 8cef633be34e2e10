"""N-gram speculative decoding's scheduler half: drafts by prompt lookup, and when a request stops
drafting. Pure: plain lists and dicts, no tensors.

A request's draft is the continuation of the latest earlier occurrence of its last n tokens in its
own prompt and output (n from ``max_n`` down to ``min_n``, the longest match first; prompt lookup
decoding, as vLLM's ``ngram`` and llama.cpp's ``ngram-*`` speculation). The continuation is read
through the draft itself, so a match that ends the sequence repeats its period ("a b a b" drafts
"a b a b ..."). The worker verifies the drafts in one forward (a verify row: the request's last
token and its drafts, one extend row) and returns the longest prefix equal to what it draws there,
plus the token it draws after it.

Drafting stops for a request whose drafts do not pay (``DraftState``): a lookup that finds
nothing several steps in a row, or an acceptance rate under ``acceptance_floor``, turns it off for
a number of steps that doubles each time it turns off again. The floor grows with the batch: on a
CPU a step's cost is a fixed part (streaming the weights) plus a part per token row (the matmuls'
arithmetic, each row's attention), so a drafted token costs ``row_cost`` of a one-row step, and in a
batch of B rows each row's token is 1/B of the step's output. Drafting pays while accepted / drafted
exceeds the share of the step that grows with its rows, B r / (1 + B r): about 0.2 for one stream,
0.9 for 32, where only a request copying its prompt word for word keeps drafting. While a request
drafts, it is not overlapped: its next row waits for its last result (the draft needs every
token). Under the overlap schedule it skips the batch built meanwhile, so beside other requests it
has a row in every other batch, and its drafts pay only if a verify keeps more than one of them.
"""

from __future__ import annotations

from dataclasses import dataclass

NO_DRAFT_LIMIT = 4  # lookups in a row that find nothing before drafting pauses
ACCEPTANCE_WEIGHT = 0.5  # of the newest verify in the smoothed rate
FIRST_PAUSE_STEPS = 16  # decode steps of the first pause; each pause in a row doubles it
MAX_PAUSE_STEPS = 1024


def first_draft_length(max_tokens: int, rows: int, row_cost: float) -> int:
    """A request's first draft in a batch of ``rows`` token rows: all ``max_tokens`` for one stream,
    where drafts pay at a low acceptance, and shorter as acceptance_floor rises with the rows (a
    first try that misses costs more than it may gain): in proportion to 1 - floor, at least 1."""
    one, floor = acceptance_floor(1, row_cost), acceptance_floor(rows, row_cost)
    return min(max_tokens, max(1, round(max_tokens * (1 - floor) / (1 - one))))


def acceptance_floor(rows: int, row_cost: float, drafted: int = 1, skips: bool = False) -> float:
    """The acceptance rate under which drafting slows a batch of ``rows`` token rows down: the share
    of its step's cost that grows with its rows, one more row costing ``row_cost`` of a one-row
    step's fixed part. ``skips``: the request skips every other batch while it drafts (the overlap
    schedule with other requests running), so its ``drafted`` tokens must also bring more than the
    one token a skipped batch would have: at least 1 / drafted."""
    floor = rows * row_cost / (1 + rows * row_cost)
    return max(floor, 1 / drafted) if skips else floor


class NgramIndex:
    """Where each n-gram (``min_n <= n <= max_n``) of a token sequence last occurred, followed by a
    known token: the n-gram -> the index just past that occurrence.

    The n-grams ending at index e are registered once the token at e + 1 is known, so a lookup of the
    sequence's own last n tokens finds an earlier occurrence, never itself.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        assert 1 <= min_n <= max_n, f"n-gram sizes must be 1 <= min <= max, got {min_n}, {max_n}"
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: list[int]) -> None:
        """Append tokens; the n-grams they complete (with a follower) are registered."""
        first_end = len(self.tokens) - 1  # its n-grams gain a follower now
        self.tokens.extend(tokens)
        seq = self.tokens
        for end in range(max(first_end, 0), len(seq) - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self._next[tuple(seq[end - n + 1 : end + 1])] = end + 1

    def draft(self, max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` tokens following the latest earlier occurrence of the longest
        matching suffix; [] when no suffix of ``min_n`` or more tokens occurred before."""
        seq = self.tokens
        if max_tokens <= 0:
            return []
        for n in range(min(self.max_n, len(seq)), self.min_n - 1, -1):
            start = self._next.get(tuple(seq[len(seq) - n :]))
            if start is not None:
                return self._continuation(start, max_tokens)
        return []

    def _continuation(self, start: int, max_tokens: int) -> list[int]:
        seq, out = self.tokens, list[int]()
        for i in range(start, start + max_tokens):  # past the end: the draft itself goes on
            out.append(seq[i] if i < len(seq) else out[i - len(seq)])
        return out


@dataclass(frozen=True)
class DraftTotals:
    """Verify rows' counts over a span (since start, or between two log lines): drafts checked,
    drafts kept, and the rows."""

    drafted: int = 0
    accepted: int = 0
    verify_rows: int = 0

    def __sub__(self, earlier: DraftTotals) -> DraftTotals:
        return DraftTotals(
            self.drafted - earlier.drafted,
            self.accepted - earlier.accepted,
            self.verify_rows - earlier.verify_rows,
        )

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def accept_length(self) -> float:
        """Tokens a verify row gave on average: its kept drafts and the token drawn after them (a
        decode row gives 1); 0.0 over no rows."""
        return 1 + self.accepted / self.verify_rows if self.verify_rows else 0.0


@dataclass
class DraftState:
    """One request's drafting: its n-gram index over the tokens known so far, and whether it drafts
    now (``pause_steps == 0``) or waits out a pause after its drafts were not taken."""

    index: NgramIndex
    pause_steps: int = 0  # decode steps left before it drafts again
    next_pause_steps: int = FIRST_PAUSE_STEPS
    no_draft_streak: int = 0  # lookups in a row that found nothing
    acceptance: float = 1.0  # smoothed accepted / drafted; starts hopeful
    num_drafted: int = 0  # totals, for the logs and tests
    num_accepted: int = 0
    num_verifies: int = 0
    length: int | None = None  # tokens it drafts next (at first first_length): +2 after all kept, else -1

    @property
    def drafting(self) -> bool:
        return self.pause_steps == 0

    @property
    def num_known(self) -> int:
        """Tokens of the request the index holds: ``propose`` takes the ones after them."""
        return len(self.index.tokens)

    def propose(self, new_tokens: list[int], max_tokens: int, first_length: int | None = None) -> list[int]:
        """A draft of up to ``max_tokens`` after the request's tokens, ``new_tokens`` being those
        after ``num_known``; [] when it finds none (which may pause drafting). Its first draft has
        at most ``first_length`` tokens (default: ``max_tokens``)."""
        self.index.extend(new_tokens)
        if self.length is None:
            self.length = max_tokens if first_length is None else first_length
        draft = self.index.draft(min(max_tokens, self.length))
        if draft:
            self.no_draft_streak = 0
        elif max_tokens > 0:
            self.no_draft_streak += 1
            if self.no_draft_streak >= NO_DRAFT_LIMIT:
                self._pause()
        return draft

    def on_verified(self, drafted: int, accepted: int, floor: float) -> None:
        """A verify row came back: ``accepted`` of its ``drafted`` tokens were taken; drafting pauses
        when the smoothed rate falls under ``floor`` (acceptance_floor of the batch)."""
        assert 0 <= accepted <= drafted and drafted > 0, f"accepted {accepted} of {drafted} drafts"
        self.num_drafted += drafted
        self.num_accepted += accepted
        self.num_verifies += 1
        self.length = drafted + 2 if accepted == drafted else max(drafted - 1, 1)
        rate = accepted / drafted
        self.acceptance = (1 - ACCEPTANCE_WEIGHT) * self.acceptance + ACCEPTANCE_WEIGHT * rate
        if self.acceptance < floor:
            self._pause()
        elif rate > floor:
            self.next_pause_steps = FIRST_PAUSE_STEPS  # drafts pay again: a later pause starts short

    def on_decode_step(self) -> None:
        """One more decode step of its request (while paused, one step nearer drafting again)."""
        if self.pause_steps > 0:
            self.pause_steps -= 1

    def _pause(self) -> None:
        self.pause_steps = self.next_pause_steps
        self.next_pause_steps = min(2 * self.next_pause_steps, MAX_PAUSE_STEPS)
        self.no_draft_streak = 0
        self.acceptance = 1.0  # the next try is judged afresh
