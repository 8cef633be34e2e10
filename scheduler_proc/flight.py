"""A request's overlap state: what the worker was sent for it and what came back."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from protocol.messages import PENDING

if TYPE_CHECKING:
    from scheduler_proc.batch import Row
    from scheduler_proc.request import Req


@dataclass(eq=False)
class Flight:
    """What the worker was sent for one request and what came back: the overlap scheduler's state.

    Over the positions of ``fill_ids``:

        [0, computed_len)        KV written by batches that returned (only these may be cached)
        [computed_len, kv_len)   KV of the rows in ``rows``: sent, not returned, in send order
        [kv_len, seq_len)        not scheduled yet: the next row starts at kv_len

    A row changes this state only through ``launch`` (when its batch is sent), then ``land``
    (its result) or ``drop`` (a result that is void: the request ended, or the forward failed).
    While the request lives, ``check`` holds after every step: the rows are contiguous from
    computed_len to kv_len, and ``output_ids`` ends with exactly one PENDING per sampling row
    out, at that row's ``out_index``. The wire form of a row is built before it is launched
    (``build_forward_batch`` asserts it): launching advances kv_len, which the row starts from.
    """

    kv_len: int = 0
    computed_len: int = 0
    worker_pages: int = 0  # leading page-table entries the worker holds as they are here
    final_scheduled: bool = False  # the row drawing the request's last possible token is sent
    rows: deque[Row] = field(default_factory=deque)

    def reset(self, kv_len: int = 0) -> None:
        """A waiting request's KV: none, or a cached prefix of ``kv_len`` tokens (all computed)."""
        assert not self.rows, "KV reset with rows in flight"
        self.kv_len = self.computed_len = kv_len

    def launch(self, row: Row, context_len: int) -> None:
        """Apply a row as its batch is sent: its KV is scheduled; a sampling row adds a PENDING token."""
        req = row.req
        assert not row.launched, f"rid {req.rid}: row launched twice"
        assert row.start == self.kv_len, (
            f"rid {req.rid}: a row built at kv_len {row.start} launched at kv_len {self.kv_len}"
        )
        row.launched = True
        self.kv_len += row.extend_len
        if row.sample:
            row.out_index = len(req.output_ids)
            req.output_ids.append(PENDING)
            self.final_scheduled = req.hits_length_limit(len(req.output_ids), context_len)
        elif req.max_new_tokens == 0 and self.kv_len == req.seq_len:
            self.final_scheduled = True  # a prompt-only request: it ends when this row lands
        self.rows.append(row)
        self.check(req)

    def land(self, row: Row, token: int | None) -> None:
        """``row``'s result: its KV is written and, if it sampled, ``token`` replaces its PENDING."""
        self._pop(row)
        self.computed_len += row.extend_len
        if token is not None:
            row.req.output_ids[row.out_index] = token
        self.check(row.req)

    def drop(self, row: Row) -> None:
        """A result to ignore: the request ended while ``row`` was out, or its forward failed."""
        self._pop(row)

    def land_verified(self, row: Row, tokens: list[int]) -> None:
        """A verify row's result: ``tokens`` (its first ``len(tokens) - 1`` drafts, then its draw)
        replace its PENDING, and the KV of the drafts after them is void: kv_len falls back. Nothing
        of the request was sent after it (a drafting request waits for its result)."""
        self._pop(row)
        assert not self.rows, f"rid {row.req.rid}: a row was sent after a verify row"
        assert 1 <= len(tokens) <= len(row.draft) + 1, f"rid {row.req.rid}: {len(tokens)} tokens verified"
        void = len(row.draft) + 1 - len(tokens)
        self.kv_len -= void
        self.computed_len += row.extend_len - void
        row.req.output_ids[row.out_index : row.out_index + 1] = tokens
        self.check(row.req)

    def end_at(self, row: Row) -> None:
        """The request ends with ``row``'s token: the tokens later rows are drawing are void."""
        del row.req.output_ids[row.out_index + 1 :]

    def _pop(self, row: Row) -> None:
        assert self.rows and self.rows[0] is row, f"rid {row.req.rid}: a result out of send order"
        self.rows.popleft()

    def check(self, req: Req) -> None:
        """The invariants of a live request's flight (see the class docstring); a verify row's drafts
        have KV scheduled past seq_len until its result.

        One pass over the rows in flight (one or two at a step), no lists or generators built: it
        runs at every row's launch and landing, and was a fifth of the scheduler's CPU at 32
        streams as the sums and comprehensions it was (docs/benchmarks-history.md). The sampling
        rows drawing the last outputs in order, each still PENDING, is checked as their out_index
        rising by one from row to row up to the last output."""
        outputs = req.output_ids
        num_outputs = len(outputs)
        end = self.computed_len
        drafted = 0
        drawing = -1  # out_index of the last sampling row seen; -1: none yet
        first = num_outputs  # the first output a row in flight draws
        for row in self.rows:
            assert row.start == end, f"rid {req.rid}: rows in flight are not contiguous at {end}"
            end += row.extend_len
            if row.draft:
                drafted += len(row.draft)
            if row.sample:
                index = row.out_index
                if drawing < 0:
                    first = index
                else:
                    assert index == drawing + 1, (
                        f"rid {req.rid}: sampling rows in flight draw {drawing} then {index}"
                    )
                assert 0 <= index < num_outputs and outputs[index] == PENDING, (
                    f"rid {req.rid}: output {index}, which a row in flight draws, is not PENDING: "
                    "a drawn token is lost"
                )
                drawing = index
        assert 0 <= self.computed_len <= self.kv_len <= len(req.input_ids) + num_outputs + drafted, (
            f"rid {req.rid}: computed {self.computed_len}, kv {self.kv_len}, seq {req.seq_len}"
        )
        assert self.worker_pages <= len(req.page_table), f"rid {req.rid}: the worker has pages we lack"
        assert end == self.kv_len, f"rid {req.rid}: rows in flight end at {end}, kv_len is {self.kv_len}"
        assert drawing < 0 or drawing == num_outputs - 1, (
            f"rid {req.rid}: sampling rows in flight draw up to output {drawing} of {num_outputs}"
        )
        assert first == 0 or outputs[first - 1] != PENDING, f"rid {req.rid}: a PENDING token no row draws"
