"""The thread-count tuner against a simulated machine whose best count flips."""

from __future__ import annotations

from collections.abc import Callable

from gpu_worker.backends.cpu.threads import MAX_RETRY_EVERY, RETRY_STEPS, ThreadTuner, shape_class

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
