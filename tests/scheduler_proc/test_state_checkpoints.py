"""The scheduler's state checkpoints (scheduler_proc/state_checkpoints.py) under random workloads: a
fake worker that keeps each slot's "recurrent state" as the hash of every token fed to it checks
that every row resumes from exactly the state its KV prefix stands for (zeroed, its slot's, or a
loaded checkpoint), with chunked prefill, mixed batches, the overlap schedule, tiny pools (eviction,
retraction), prefix hits, n > 1 and aborts; and no checkpoint is lost."""

from __future__ import annotations

import random

import pytest

from protocol.messages import PENDING, ForwardBatch, ForwardResult
from scheduler_proc.config import SchedulerConfig
from scheduler_proc.state_checkpoints import HybridKVManager
from tests.scheduler_proc.harness import Driver, FakeWorker, next_hash, reference_output, small_config

STOP_IDS = (3, 5)


class StateCheck:
    """Runs the fake worker, and beside it the recurrent states as the real worker keeps them
    (gpu_worker/recurrent_state.py): loads before the rows, saves after a row's first n tokens,
    forks' copies after the batch."""

    def __init__(self, worker: FakeWorker) -> None:
        self.worker, self.run_kv = worker, worker.run
        self.slots: dict[int, int] = {}
        self.saved: dict[int, int] = {}
        self.loads = 0

    def run(self, batch: ForwardBatch) -> ForwardResult:
        last = dict(self.worker.last_token)  # PENDING's token, before this batch draws
        loads = dict(zip(batch.state_load_rows, batch.state_load_ids, strict=True))
        planned = zip(batch.state_save_rows, batch.state_save_lens, batch.state_save_ids, strict=True)
        saves = {r: (n, c) for r, n, c in planned}
        self.loads += len(loads)
        result = self.run_kv(batch)
        offset = 0
        for i, idx in enumerate(batch.req_pool_idx):
            prefix, ext = batch.prefix_lens[i], batch.extend_lens[i]
            h = self.saved[loads[i]] if i in loads else 0 if prefix == 0 else self.slots[idx]
            assert h == self.worker._check_prefix(idx, prefix), f"row {i} resumes a state its KV is not"
            ids = batch.input_ids[offset : offset + ext]
            offset += ext
            for k, tok in enumerate(ids, start=1):
                h = next_hash(h, last.get(idx, 0) if tok == PENDING else tok)
                if i in saves and saves[i][0] == k:
                    self.saved[saves[i][1]] = h
            self.slots[idx] = h
        for row, fork in zip(batch.fork_rows, batch.fork_req_pool_idx, strict=True):
            self.slots[fork] = self.slots[batch.req_pool_idx[row]]
        return result


def random_config(rng: random.Random) -> SchedulerConfig:
    page_size = rng.choice([1, 2, 16])
    return SchedulerConfig(
        num_pages=rng.choice([128, 256, 2048]) // page_size, context_len=200, page_size=page_size,
        max_running_requests=rng.choice([2, 8, 64]), max_prefill_tokens=rng.choice([16, 100, 4096]),
        chunked_prefill_size=rng.choice([-1, 7, 32, 100]), enable_mixed_chunk=rng.random() < 0.5,
        schedule_conservativeness=rng.choice([0.15, 0.7]), overlap_schedule=rng.random() < 0.75,
        state_checkpoints=rng.choice([1, 3, 16, 64]),
    )  # fmt: skip


@pytest.mark.parametrize("seed", range(12))
def test_random_workload_resumes_exact_states(seed: int) -> None:
    rng = random.Random(seed)
    cfg = random_config(rng)
    d = Driver(cfg)
    check = StateCheck(d.worker)
    d.worker.run = check.run  # type: ignore[method-assign]
    assert isinstance(d.sched.kv, HybridKVManager)
    reqs: dict[int, tuple[list[int], int, int]] = {}
    shared = [[rng.randrange(1000) for _ in range(120)] for _ in range(2)]
    next_rid = 0
    for _ in range(5000):
        if next_rid < 40 and rng.random() < 0.3:
            p = [rng.randrange(1000) for _ in range(rng.randint(1, 150))]
            if rng.random() < 0.6:  # shared prefixes, and turns extending earlier prompts
                p = (shared[rng.randrange(2)] + p)[: len(p)]
            max_new, n = rng.randint(1, 200 - len(p)), rng.choice([1, 1, 2])
            if d.submit(next_rid, p, max_new, stop=STOP_IDS, n=n) is None:
                reqs.update({next_rid + i: (p, max_new, i) for i in range(n)})
            next_rid += n
        if d.sched.reqs and rng.random() < 0.01:
            rid = rng.choice(sorted(d.sched.reqs))
            reqs.pop(rid, None)
            for fork in d.sched.reqs[rid].forks:
                reqs.pop(fork.rid, None)
            d.abort(rid)
        if d.step() is None and next_rid >= 40:
            break
    d.run()
    for rid, (p, max_new, choice) in reqs.items():
        assert (d.tokens[rid], d.finished[rid]) == reference_output(
            p, max_new, STOP_IDS, cfg.context_len, choice
        )
    assert isinstance(d.sched.kv, HybridKVManager)
    d.sched.kv.check_checkpoints()
    d.assert_no_leak()
    assert check.loads > 0 or cfg.state_checkpoints < 16, "some hit must resume from a checkpoint"


@pytest.mark.parametrize("overlap", [False, True])
def test_a_long_chat_resumes_each_turn_from_its_last_answer(overlap: bool) -> None:
    """Few checkpoints, a chat of many turns: every checkpoint ends up on the conversation's path,
    which the running turn holds, and the shallow ones must make room for the deepest, so each turn
    resumes past the last one's prompt, not where the budget ran out."""
    cfg = small_config(state_checkpoints=3, overlap_schedule=overlap, chunked_prefill_size=32)
    d = Driver(cfg)
    check = StateCheck(d.worker)
    d.worker.run = check.run  # type: ignore[method-assign]
    rng = random.Random(7)
    prompt = [rng.randrange(10, 1000) for _ in range(40)]
    previous = 0  # the last turn's prompt tokens
    for turn in range(10):
        assert d.submit(turn, prompt, 12) is None
        d.run()
        assert d.cached.get(turn, 0) >= previous, (turn, d.cached.get(turn), previous)
        previous = len(prompt)
        prompt = prompt + d.tokens[turn] + [rng.randrange(10, 1000) for _ in range(9)]
    assert isinstance(d.sched.kv, HybridKVManager)
    d.sched.kv.check_checkpoints()
    d.assert_no_leak()
