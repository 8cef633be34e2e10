"""Workload generators: reproducible with a seed, exact token lengths, the repeated-prompt workload's
prompt shapes (repeats cycled over requests, numbered unique prompts)."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import pytest

from bench.lib.workloads import (
    WordPool,
    arrival_offsets_s,
    parse_repeats,
    random_workload,
    repeated_prompt_workload,
    shared_prefix_workload,
)


@pytest.fixture(scope="module")
def pool(smollm2_dir: Path) -> WordPool:
    return WordPool(smollm2_dir / "tokenizer.json")


def test_repeated_prompts_cycle_the_repeats_and_are_unique() -> None:
    items = repeated_prompt_workload("Hello", parse_repeats("512,1,1,1"), 8, True, 32, True)
    assert [it.text.count("Hello") for it in items] == [512, 1, 1, 1, 512, 1, 1, 1]
    assert len({it.text for it in items}) == 8
    assert items[0].text.startswith("0.0: Hello Hello") and items[5].text == "0.5: Hello"
    reseeded = repeated_prompt_workload("Hello", [1], 2, True, 8, True, seed=3)
    assert [it.text for it in reseeded] == ["3.0: Hello", "3.1: Hello"]
    assert all(it.input_ids is None and it.max_new_tokens == 32 and it.ignore_eos for it in items)
    plain = repeated_prompt_workload("Hi", [2], 3, False, 8, False)
    assert [it.text for it in plain] == ["Hi Hi"] * 3 and not plain[0].ignore_eos


def test_random_prompts_have_exact_token_lengths_and_repeat_with_the_seed(pool: WordPool) -> None:
    items = random_workload(pool, 20, input_len=40, output_len=16, range_ratio=0.5, seed=3)
    for it in items:
        assert it.input_ids is not None
        assert pool.encode(it.text) == it.input_ids  # the tokenizer agrees on the exact tokens
        assert 20 <= len(it.input_ids) <= 40 and 8 <= it.max_new_tokens <= 16
    assert len({len(it.input_ids or []) for it in items}) > 1
    assert random_workload(pool, 20, 40, 16, 0.5, seed=3) == items
    assert random_workload(pool, 20, 40, 16, 0.5, seed=4) != items
    fixed = random_workload(pool, 5, 33, 7, 1.0, seed=0)
    assert {len(it.input_ids or []) for it in fixed} == {33} and {it.max_new_tokens for it in fixed} == {7}


def test_shared_prefix_groups_share_exactly_the_system_prompt(pool: WordPool) -> None:
    items = shared_prefix_workload(
        pool, groups=3, questions=4, system_len=50, question_len=10, output_len=8, seed=1
    )
    assert len(items) == 12
    ids = [it.input_ids or [] for it in items]
    assert all(len(x) == 60 for x in ids)
    prefixes = {tuple(x[:50]) for x in ids}
    assert len(prefixes) == 3
    assert all(sum(tuple(x[:50]) == p for x in ids) == 4 for p in prefixes)
    assert [pool.encode(it.text) for it in items] == ids
    assert shared_prefix_workload(pool, 3, 4, 50, 10, 8, seed=1) == items


def test_arrivals_at_once_spaced_and_poisson() -> None:
    assert arrival_offsets_s(3, 0.0, float("inf"), 0) == [0.0, 0.0, 0.0]
    assert arrival_offsets_s(3, 250.0, float("inf"), 0) == pytest.approx([0.0, 0.25, 0.5])
    poisson = arrival_offsets_s(2000, 0.0, 10.0, seed=5)
    assert poisson == arrival_offsets_s(2000, 0.0, 10.0, seed=5)
    gaps = [b - a for a, b in zip(poisson, poisson[1:], strict=False)]
    assert all(g >= 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.15)  # seeded: the same draw every run
    with pytest.raises(AssertionError):
        arrival_offsets_s(3, 10.0, 5.0, 0)


def test_word_pool_samples_are_seeded(pool: WordPool) -> None:
    a = pool.sample(random.Random(9), 12)
    assert a == pool.sample(random.Random(9), 12) and len(a[1]) == 12
    with pytest.raises(AssertionError):
        parse_repeats("3,0")
