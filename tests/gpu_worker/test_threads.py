"""The thread-count tuner and the contention guard against simulated machines whose best count flips."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

from gpu_worker.backends.cpu.threads import (
    CALM_SHARE,
    CONTENDED_SHARE,
    CONTENDED_WINDOWS,
    FIRST_CALM_WINDOWS,
    MAX_CALM_WINDOWS,
    MAX_RETRY_EVERY,
    RETRY_STEPS,
    WINDOW_S,
    ContentionGuard,
    ThreadTuner,
    shape_class,
)

DECODE = shape_class(32, 32)


def run(tuner: ThreadTuner, cost: Callable[[int], float], steps: int) -> list[int]:
    """Drive ``steps`` steps of one shape class; return the thread count each used."""
    used = []
    for _ in range(steps):
        threads = tuner.choose(DECODE)
        tuner.record(DECODE, threads, cost(threads))
        used.append(threads)
    return used


def quiet(threads: int) -> float:
    return {2: 0.030, 1: 0.041}[threads]


def contended(threads: int) -> float:
    return {2: 0.120, 1: 0.042}[threads]


def test_looks_at_both_then_keeps_the_faster_and_retries_ever_less_often() -> None:
    tuner = ThreadTuner((1, 2))
    used = run(tuner, quiet, 2000)
    assert used[: 2 * RETRY_STEPS] == [2] * RETRY_STEPS + [1] * RETRY_STEPS, "a first look at each"
    assert tuner.preferred(DECODE) == 2
    starts = [i for i in range(1, len(used)) if used[i] == 1 and used[i - 1] == 2]
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert gaps == sorted(gaps) and gaps[-1] == MAX_RETRY_EVERY + RETRY_STEPS, gaps
    assert used.count(1) < 0.03 * len(used), "the loser runs a few percent of the steps"


def test_follows_the_machine_when_contention_comes_and_goes() -> None:
    tuner = ThreadTuner((2, 1))
    run(tuner, quiet, 3000)  # the retry interval is at its longest now
    under_load = run(tuner, contended, 300)
    assert under_load[:10].count(1) >= RETRY_STEPS, "a slow spell brings the re-try forward"
    assert under_load[20:].count(2) <= 5 * RETRY_STEPS, "then 2 threads only in ever rarer re-tries"
    assert tuner.preferred(DECODE) == 1
    recovered = run(tuner, quiet, 600)
    assert recovered.index(2) <= 2 * 128, "re-tries still come"
    assert recovered[-100:] == [2] * 100 or recovered[-100:].count(1) <= RETRY_STEPS
    assert tuner.preferred(DECODE) == 2


def test_a_single_slow_step_changes_nothing() -> None:
    calm, bumped = ThreadTuner((2, 1)), ThreadTuner((2, 1))
    run(calm, quiet, 100)
    run(bumped, quiet, 100)
    spike = iter([0.500])
    used = run(bumped, lambda t: next(spike, None) or quiet(t), 200)  # one 500 ms hiccup on 2 threads
    assert used == run(calm, quiet, 200) and bumped.preferred(DECODE) == 2


def test_shape_classes_split_decode_from_prefill_by_size() -> None:
    assert shape_class(1, 1) != shape_class(2, 2) != shape_class(32, 32)
    assert shape_class(20, 20) == shape_class(32, 32)
    assert shape_class(1, 256)[0] == "extend" and shape_class(1, 256) == shape_class(3, 200)
    assert shape_class(4, 4) != shape_class(1, 4)


# The contention guard: steps of 10 ms, a window of WINDOW_S; a step waits ``share`` of its time.
STEP_S = 0.01


def guard_run(guard: ContentionGuard, share: float, seconds: float) -> list[int]:
    """The thread counts the guard returns over ``seconds`` of steps that waited ``share``."""
    return [guard.record(STEP_S, share * STEP_S) for _ in range(round(seconds / STEP_S))]


def test_guard_keeps_every_core_while_the_steps_do_not_wait() -> None:
    guard = ContentionGuard(4)
    assert set(guard_run(guard, CALM_SHARE / 2, 10.0)) == {4}
    assert set(guard_run(guard, CONTENDED_SHARE * 0.9, 10.0)) == {4}, "a busy but workable machine"


def test_guard_halves_after_windows_of_contention_and_comes_back_when_calm() -> None:
    guard = ContentionGuard(2)
    used = guard_run(guard, 0.6, 1.0)
    window = round(WINDOW_S / STEP_S)
    assert used.index(1) == CONTENDED_WINDOWS * window - 1, "halved at the end of the windows in a row"
    assert set(used[CONTENDED_WINDOWS * window :]) == {1}, "and it stays down while the waits go on"
    calm = guard_run(guard, 0.0, 1.0)
    assert calm.index(2) == FIRST_CALM_WINDOWS * window - 1
    assert set(calm[calm.index(2) :]) == {2}


def test_guard_lets_a_burst_of_one_window_pass() -> None:
    """The engine's own tokenizer and scheduler: a window of waiting now and then, never two in a row."""
    guard = ContentionGuard(2)
    for _ in range(50):
        assert set(guard_run(guard, 0.9, WINDOW_S)) == {2}
        assert set(guard_run(guard, 0.0, WINDOW_S)) == {2}


def test_guard_waits_ever_longer_before_returning_into_contention() -> None:
    """One busy neighbour: half the cores look calm, all of them contended at once."""
    guard = ContentionGuard(2)
    used = []
    for _ in range(round(60.0 / STEP_S)):
        share = 0.5 if guard.threads == 2 else 0.0
        used.append(guard.record(STEP_S, share * STEP_S))
    returns = [i for i in range(1, len(used)) if used[i] == 2 and used[i - 1] == 1]
    gaps = [b - a for a, b in zip(returns, returns[1:], strict=False)]
    assert gaps == sorted(gaps) and len(gaps) >= 4, gaps
    assert gaps[-1] >= MAX_CALM_WINDOWS * WINDOW_S / STEP_S, "the calm needed doubles up to its cap"
    assert used.count(2) < 0.02 * len(used), "all cores only in rarer and rarer tries"


def test_guard_returns_quickly_again_once_a_return_held() -> None:
    guard = ContentionGuard(2)
    for _ in range(3):  # returns into contention: the calm needed grows
        guard_run(guard, 0.6, 0.2)
        guard_run(guard, 0.0, 5.0)
    guard_run(guard, 0.0, 1.0)  # a return that held
    guard_run(guard, 0.6, 0.1)
    back = guard_run(guard, 0.0, 1.0)
    assert back.index(2) == FIRST_CALM_WINDOWS * WINDOW_S / STEP_S - 1


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the guard needs two cores to give one back")
def test_the_cpu_backend_guards_by_default_and_not_where_the_user_chose_threads() -> None:
    from gpu_worker.backends.cpu.backend import CpuBackend, run_delay_s
    from gpu_worker.config import WorkerConfig

    delay = run_delay_s()
    assert delay is not None and delay >= 0.0, "Linux tells a thread's run-queue delay"
    cores = len(os.sched_getaffinity(0))
    try:
        guarded = CpuBackend(WorkerConfig(model_path="."))._guard
        assert guarded is not None and guarded.full == cores
        assert CpuBackend(WorkerConfig(model_path=".", num_threads=cores))._guard is None
        assert CpuBackend(WorkerConfig(model_path=".", tune_threads=True))._guard is None
    finally:
        torch.set_num_threads(cores)
