"""The data-parallel router: affinity for shared prefixes, balance, spreading misses, load accounting."""

from __future__ import annotations

import random

from tokenizer_proc.router import BALANCE_ABS_TOKENS, BALANCE_REL, BLOCK_TOKENS, LOAD_OUTPUT_TOKENS, Router


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50000) for _ in range(n)]


def test_one_replica_takes_everything() -> None:
    router = Router(1)
    assert router.route(0, 1, prompt(40, 0), None, 10) == 0 and router.load == [40 + 10]
    router.release(0)
    assert router.load == [0]


def test_round_robin_takes_turns() -> None:
    router = Router(3, "round_robin")
    assert [router.route(rid, 1, prompt(40, rid), None, 8) for rid in range(6)] == [0, 1, 2, 0, 1, 2]


def test_least_load_follows_the_load_and_its_release() -> None:
    router = Router(2, "least_load")
    assert router.route(0, 1, prompt(500, 0), None, 8) == 0
    assert router.route(1, 1, prompt(10, 1), None, 8) == 1
    assert router.route(2, 1, prompt(10, 2), None, 8) == 1, "replica 1 holds 18 tokens, replica 0 508"
    router.release(0)
    assert router.route(3, 1, prompt(10, 3), None, 8) == 0


def test_cache_aware_keeps_a_shared_prefix_on_one_replica_and_spreads_misses() -> None:
    router = Router(2)
    systems = [prompt(256, 100 + g) for g in range(4)]
    placed: dict[int, set[int]] = {g: set() for g in range(4)}
    rid = 0
    for _ in range(3):
        for g, system in enumerate(systems):
            placed[g].add(router.route(rid, 1, system + prompt(20, rid), None, 16))
            router.release(rid)  # finished: no load left to outweigh the affinity
            rid += 1
    assert all(len(replicas) == 1 for replicas in placed.values()), placed
    assert {next(iter(r)) for r in placed.values()} == {0, 1}, "new prefixes spread over both replicas"


def test_misses_on_an_idle_engine_do_not_pile_on_one_replica() -> None:
    router = Router(2)
    picks = []
    for rid in range(6):
        picks.append(router.route(rid, 1, prompt(64, rid), None, 8))
        router.release(rid)
    assert picks.count(0) == picks.count(1) == 3


def test_imbalance_beats_affinity() -> None:
    router = Router(2)
    system = prompt(BLOCK_TOKENS * 8, 7)
    home = router.route(0, 1, system + [1], None, 8)  # 137 tokens of load
    assert router.route(1, 1, prompt(2 * BALANCE_ABS_TOKENS, 8), None, 8) == 1 - home  # to the idle one
    assert router.route(2, 1, prompt(3 * BALANCE_ABS_TOKENS, 9), None, 8) == home  # the lighter one
    heavy, light = router.load[home], router.load[1 - home]
    assert heavy - light > BALANCE_ABS_TOKENS and heavy > BALANCE_REL * light, "out of balance"
    assert router.route(3, 1, system + [2], None, 8) == 1 - home, "load wins over the cached prefix"


def test_affinity_holds_while_the_load_is_in_balance() -> None:
    router = Router(2)
    system = prompt(BLOCK_TOKENS * 8, 7)
    home = router.route(0, 1, system + [1], None, 8)
    router.route(1, 1, prompt(BLOCK_TOKENS * 8, 8), None, 8)  # the other replica: a little busier
    assert router.route(2, 1, system + [2], None, 8) == home


def test_salts_do_not_share_prefixes() -> None:
    router = Router(2)
    system = prompt(128, 3)
    a = router.route(0, 1, system, "tenant-a", 8)
    router.release(0)
    b = router.route(1, 1, system, "tenant-b", 8)
    assert a != b, "the second salt's prefix is a miss: the idle turn goes to the other replica"


def test_choices_share_their_replica_and_count_their_output() -> None:
    router = Router(2, "least_load")
    replica = router.route(10, 4, prompt(100, 1), None, 1000)
    assert {router.replica_of(rid) for rid in range(10, 14)} == {replica}
    assert router.load[replica] == 100 + 4 * LOAD_OUTPUT_TOKENS
    for rid in range(10, 14):
        router.release(rid)
    assert router.load == [0, 0]
