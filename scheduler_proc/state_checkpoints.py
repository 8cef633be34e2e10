"""An exact prefix cache for hybrid models: recurrent-state checkpoints in the radix tree.

A linear-attention layer's state folds in every earlier token, so cached KV pages alone cannot
resume a request: its state must be the one after exactly the tokens the hit skips. The worker keeps
``state_checkpoints`` copies of a request's whole state (every linear layer's conv and recurrent
state, gpu_worker/recurrent_state.py); this manager decides when one is taken and where it lives:

- taken (``plan``) where a row crosses a page boundary: at the last boundary inside the row. A
  prefill chunk's checkpoint (a long prompt's chunk boundaries, a short prompt's end) is kept; of a
  request's decode checkpoints the newest two (the end of its prompt + answer, to the page, is what
  the next chat turn extends; the newest may be a step past its end under the overlap schedule, a
  row whose result is dropped), older ones given back as newer ones are taken;
- attached, once the KV up to it is computed and cached, to the tree node ending exactly there
  (``cache_unfinished`` as prefill chunks land, ``release`` at finish or retraction); a node that has
  one already keeps its own;
- used by a hit clamped to the deepest node on the matched path that holds one (``attach_prefix``):
  the worker copies it into the request's slot before the request's first row;
- evicted with its node, or alone (its pages kept) when a new one is needed and none is free: first
  those on paths no request holds, least recently used first; else, for the request taking one, the
  shallowest on its own path before the point its hit resumed from that no other request holds (a
  long chat's earlier turns: its next turn extends the newest answer, so the checkpoints move with
  the conversation instead of stopping where the budget ran out); never one a hit has yet to load
  nor a running request's prompt end (a regenerated answer resumes there). None may go: the
  checkpoint is not taken (a later hit is shorter, never wrong).

A checkpoint given back while a batch in flight still writes it is safe: the worker runs batches in
order, so a later batch's write or read of the same id comes after.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from protocol.messages import ForwardBatch
from scheduler_proc.batch import Row
from scheduler_proc.config import SchedulerConfig
from scheduler_proc.kv_manager import EvictableAccount, KVManager
from scheduler_proc.radix_cache import RadixCache
from scheduler_proc.request import Req


@dataclass
class PendingCheckpoints:
    """A request's checkpoints taken but not yet in the tree: (position, id), its prefill chunks' and
    its newest decode steps'."""

    prefill: list[tuple[int, int]] = field(default_factory=list)
    decode: list[tuple[int, int]] = field(default_factory=list)

    def all(self) -> list[tuple[int, int]]:
        return self.prefill + self.decode


class HybridKVManager(KVManager):
    """``KVManager`` whose prefix cache hits resume from state checkpoints (module docstring)."""

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.num_checkpoints = config.state_checkpoints
        self.free_checkpoints = list(range(config.state_checkpoints))[::-1]
        if self.cache is not None:
            self.cache = RadixCache(config.page_size, self.pages.free, self.free_checkpoints.append)
        self._pending: dict[int, PendingCheckpoints] = {}  # by rid
        self._loads: dict[int, int] = {}  # rid -> the checkpoint its first row starts from
        self._prompt_ends: dict[int, int] = {}  # rid -> its newest prefill checkpoint (its prompt's end)
        self._resumed_at: dict[int, int] = {}  # rid -> the tokens its hit resumed from a checkpoint

    # ------------------------------------------------------------------ hits

    def attach_prefix(self, req: Req, account: EvictableAccount) -> None:
        """The longest cached prefix clamped to the deepest checkpoint on it (none: no prefix)."""
        super().attach_prefix(req, account)
        node = req.cache_node
        if self.cache is None or node is None or node.parent is None:
            return
        found, depth = RadixCache.deepest_checkpoint(node)
        self._resumed_at[req.rid] = depth
        if found is node:
            self._loads[req.rid] = _checkpoint(found)
            return
        account.on_evictable_change(self.cache.dec_lock_ref(node))
        req.cache_node = found
        if found is not None:
            account.on_evictable_change(self.cache.inc_lock_ref(found))
            self._loads[req.rid] = _checkpoint(found)
        del req.page_table[depth // self.page_size :]
        req.num_tree_pages = depth // self.page_size
        req.flight.reset(depth)

    def detach_prefix(self, req: Req, account: EvictableAccount) -> None:
        super().detach_prefix(req, account)
        self._loads.pop(req.rid, None)
        self._prompt_ends.pop(req.rid, None)
        self._resumed_at.pop(req.rid, None)

    # ------------------------------------------------------------------ taking checkpoints

    def plan(self, batch: ForwardBatch, rows: list[Row]) -> ForwardBatch:
        """``batch`` with its rows' checkpoint loads (a hit's first row) and saves."""
        loads: list[tuple[int, int]] = []
        saves: list[tuple[int, int, int]] = []
        for i, row in enumerate(rows):
            load = self._loads.pop(row.req.rid, None)
            if load is not None:
                assert row.start > 0 and row.new_req_pool_idx, f"rid {row.req.rid}: a load past its first row"
                loads.append((i, load))
            position = (row.start + row.extend_len) // self.page_size * self.page_size
            if self.cache is not None and position > row.start:
                checkpoint = self._take(row.req, position, decode=not row.is_prefill)
                if checkpoint is not None:
                    saves.append((i, position - row.start, checkpoint))
        if not loads and not saves:
            return batch
        return msgspec.structs.replace(
            batch,
            state_load_rows=[i for i, _ in loads],
            state_load_ids=[c for _, c in loads],
            state_save_rows=[i for i, _, _ in saves],
            state_save_lens=[n for _, n, _ in saves],
            state_save_ids=[c for _, _, c in saves],
        )

    def _take(self, req: Req, position: int, *, decode: bool) -> int | None:
        pending = self._pending.setdefault(req.rid, PendingCheckpoints())
        if decode and len(pending.decode) == 2:
            self.free_checkpoints.append(pending.decode.pop(0)[1])
        if not self.free_checkpoints:
            assert self.cache is not None
            protected = {*self._loads.values(), *self._prompt_ends.values()}
            resumed = self._resumed_at.get(req.rid, 0)
            dropped = self.cache.drop_lru_checkpoint(protected, req.cache_node, resumed)
            if dropped is None:
                return None
            self.free_checkpoints.append(dropped)
        checkpoint = self.free_checkpoints.pop()
        if decode:
            pending.decode.append((position, checkpoint))
        else:
            pending.prefill.append((position, checkpoint))
            self._prompt_ends[req.rid] = checkpoint
        return checkpoint

    # ------------------------------------------------------------------ into the tree

    def cache_unfinished(self, req: Req) -> None:
        super().cache_unfinished(req)
        self._attach(req, req.computed_len // self.page_size * self.page_size, keep_rest=True)

    def release(self, req: Req, *, cache: bool) -> None:
        cached = req.computed_len // self.page_size * self.page_size if cache else 0
        tokens = req.key_slice(0, cached)
        super().release(req, cache=cache)
        self._attach(req, cached, keep_rest=False, tokens=tokens)
        self._loads.pop(req.rid, None)
        self._prompt_ends.pop(req.rid, None)
        self._resumed_at.pop(req.rid, None)

    def _attach(self, req: Req, cached: int, *, keep_rest: bool, tokens: list[int] | None = None) -> None:
        """Each pending checkpoint of ``req`` at or before ``cached`` tokens (cached in the tree) onto
        the node ending there; the rest kept (an unfinished request) or given back."""
        pending = self._pending.get(req.rid)
        if pending is None:
            return
        tokens = req.key_slice(0, cached) if tokens is None else tokens
        kept: list[tuple[int, int]] = []
        for position, checkpoint in pending.all():
            if position > cached:
                kept.append((position, checkpoint))
            elif not self._into_tree(tokens[:position], req.cache_salt, checkpoint):
                self.free_checkpoints.append(checkpoint)
        if not keep_rest:
            self.free_checkpoints.extend(c for _, c in kept)
            del self._pending[req.rid]
            return
        pending.prefill = [k for k in kept if k not in pending.decode]
        pending.decode = [k for k in pending.decode if k in kept]

    def _into_tree(self, tokens: list[int], salt: str | None, checkpoint: int) -> bool:
        if self.cache is None:
            return False
        match = self.cache.match_prefix(tokens, salt)
        if match.num_pages * self.page_size != len(tokens) or match.node.checkpoint is not None:
            return False
        match.node.checkpoint = checkpoint
        return True

    def check_checkpoints(self) -> None:
        """Every checkpoint is exactly one of: free, in the tree, pending for a live request."""
        tree = self.cache.checkpoints() if self.cache is not None else []
        pending = [c for p in self._pending.values() for _, c in p.all()]
        held = self.free_checkpoints + tree + pending
        assert sorted(held) == list(range(self.num_checkpoints)), f"checkpoints lost or twice: {sorted(held)}"


def _checkpoint(node: object) -> int:
    checkpoint = getattr(node, "checkpoint", None)
    assert isinstance(checkpoint, int), "a clamped hit ends at a checkpoint"
    return checkpoint
