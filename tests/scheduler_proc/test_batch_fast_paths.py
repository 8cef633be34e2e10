"""The decode step's shortcuts in batch.py against the general code they skip: a batch of plain rows
leaves out the fields only some rows need (they would all be empty), and a plain result is taken
token by token (``row_results`` would make the same tokens and logprobs, nothing else). Run over
mixed traffic: plain requests beside prompt logprobs, forks (n > 1), stop tokens and aborts."""

from __future__ import annotations

from typing import Any

import pytest

import scheduler_proc.results as results_mod
import scheduler_proc.scheduler as scheduler_mod
from protocol.messages import ForwardBatch, ForwardResult
from scheduler_proc.batch import Row, RowResult, _with_row_needs, row_results
from tests.scheduler_proc.harness import Driver, random_prompt, reference_output, small_config


@pytest.mark.parametrize("overlap", [True, False])
def test_the_shortcuts_give_what_the_general_code_gives(
    monkeypatch: pytest.MonkeyPatch, overlap: bool
) -> None:
    build = scheduler_mod.build_forward_batch
    plain = results_mod.plain_logprobs
    seen = {"plain_batches": 0, "other_batches": 0, "plain_results": 0, "other_results": 0}

    def checked_build(step: int, rows: list[Row], page_size: int, prefetch: Any = None) -> ForwardBatch:
        batch = build(step, rows, page_size, prefetch)
        general = _with_row_needs(batch, rows, page_size)
        assert batch == general, f"step {step}: a field the shortcut left empty is not"
        plain_rows = all(
            not (r.draft or r.forks or r.prompt_logprob_len or r.pool is not None or r.req.images)
            for r in rows
        )
        seen["plain_batches" if plain_rows else "other_batches"] += 1
        return batch

    def checked_plain(rows: list[Row], result: ForwardResult) -> list[float] | None:
        logprobs = plain(rows, result)
        general = row_results(rows, result)
        if logprobs is None:
            seen["other_results"] += 1
            return None
        seen["plain_results"] += 1
        assert general == [RowResult(t, lp) for t, lp in zip(result.token_ids, logprobs, strict=True)]
        return logprobs

    monkeypatch.setattr(scheduler_mod, "build_forward_batch", checked_build)
    monkeypatch.setattr(results_mod, "plain_logprobs", checked_plain)
    driver = Driver(small_config(overlap_schedule=overlap))
    cfg = driver.config
    expected = {}
    for rid in range(0, 60, 3):
        prompt = random_prompt(5 + rid % 17, rid)
        stop = [7] if rid % 2 else []
        if rid % 9 == 3:
            assert driver.submit(rid, prompt, 12, stop, n=2) is None
            for choice in range(2):
                expected[rid + choice] = reference_output(prompt, 12, stop, cfg.context_len, choice)[0]
        else:
            assert driver.submit(rid, prompt, 9 + rid % 5, stop, prompt_logprobs=rid % 7 == 1) is None
            expected[rid] = reference_output(prompt, 9 + rid % 5, stop, cfg.context_len)[0]
        if rid % 12 == 6:
            driver.step()
    driver.run()
    assert driver.tokens == expected
    driver.assert_no_leak()
    assert min(seen.values()) > 0, seen  # both ways were taken, at both ends
