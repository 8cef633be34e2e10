"""new_token_ratio: starts cautious, decays with decode steps, jumps up on retraction, resets when idle."""

from __future__ import annotations

import logging
import random

import pytest

from scheduler_proc.config import SchedulerConfig
from scheduler_proc.token_ratio import RETRACT_RATIO_BUMP, NewTokenRatio
from tests.scheduler_proc.harness import Driver


def test_ratio_lifecycle() -> None:
    cfg = SchedulerConfig(schedule_conservativeness=1.0, new_token_ratio_decay_steps=10)
    ratio = NewTokenRatio(cfg)
    assert ratio.value == pytest.approx(0.7) and ratio.min == pytest.approx(0.7 * 0.14)
    for _ in range(5):
        ratio.on_decode_step()
    assert ratio.value == pytest.approx((0.7 + ratio.min) / 2), "half way after half the steps"
    for _ in range(50):
        ratio.on_decode_step()
    assert ratio.value == pytest.approx(ratio.min), "never below the minimum"
    ratio.on_retract()
    assert ratio.value == pytest.approx(0.7), "a retraction goes back to the cautious start"
    ratio.on_retract()
    assert ratio.value == pytest.approx(0.7 + RETRACT_RATIO_BUMP), "and higher when they come back to back"
    for _ in range(10):
        ratio.on_retract()
    assert ratio.value == 1.0
    ratio.on_idle()
    assert ratio.value == pytest.approx(0.7)
    assert NewTokenRatio(SchedulerConfig(schedule_conservativeness=2.0)).value == 1.0, "capped at 1"
    fixed = NewTokenRatio(SchedulerConfig(schedule_conservativeness=0.5, new_token_ratio_decay_steps=0))
    fixed.on_decode_step()
    assert fixed.value == pytest.approx(0.35), "decay steps <= 0: the ratio stays put"


def test_the_scheduler_decays_raises_and_resets_the_ratio(caplog: pytest.LogCaptureFixture) -> None:
    # 16 requests of up to 60 output tokens in a 256-token pool: over-commits once the ratio has decayed.
    cfg = SchedulerConfig(num_pages=256, context_len=256, page_size=1, new_token_ratio_decay_steps=20)
    d = Driver(cfg)
    rng = random.Random(0)
    for rid in range(16):
        d.submit(rid, [rng.randrange(1000) for _ in range(20)], 60)
    seen: list[float] = []
    with caplog.at_level(logging.WARNING, logger="rivulet.scheduler"):
        while d.sched.has_work:
            d.step()
            seen.append(d.sched.new_token_ratio.value)
    assert d.sched.num_retracted > 0
    assert min(seen) == pytest.approx(cfg.min_new_token_ratio), "decayed to the minimum"
    assert any(b > a for a, b in zip(seen, seen[1:], strict=False)), "raised after a retraction"
    raised = [r.getMessage() for r in caplog.records if "new_token_ratio raised" in r.getMessage()]
    assert raised, "a retraction logs the new ratio"
    assert d.sched.schedule() is None
    assert d.sched.new_token_ratio.value == pytest.approx(cfg.init_new_token_ratio), "reset when idle"
    d.assert_no_leak()
