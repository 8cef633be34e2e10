"""The thread-count tuner against a simulated machine whose best count flips."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import pytest

from gpu_worker.backends.cpu.threads import (
    MAX_RETRY_EVERY,
    OPENMP_WAIT_VARS,
    RETRY_STEPS,
    ThreadTuner,
    openmp_env,
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


def test_openmp_waits_passively_unless_the_user_chose() -> None:
    assert openmp_env({"PATH": "/bin"}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert openmp_env({"OMP_WAIT_POLICY": "active"}) == {}
    assert openmp_env({"GOMP_SPINCOUNT": "10000"}) == {}


# libgomp's spin count shows the policy it took: 0 passive, 300000 with none set, 3e10 active.
@pytest.mark.parametrize(("user", "spins"), [({}, "0"), ({"OMP_WAIT_POLICY": "active"}, "30000000000")])
def test_the_worker_sets_the_wait_policy_before_torch_loads_libgomp(user: dict[str, str], spins: str) -> None:
    """libgomp reads its environment once, as torch loads it: OMP_DISPLAY_ENV makes it print what it read."""
    inherited = {k: v for k, v in os.environ.items() if k not in OPENMP_WAIT_VARS}
    env = inherited | user | {"OMP_DISPLAY_ENV": "VERBOSE"}
    code = (
        "import sys, gpu_worker.process as p; assert 'torch' not in sys.modules, 'torch loaded too early'; "
        "p._set_openmp_env(); import torch; torch.ones(4).sum()"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"GOMP_SPINCOUNT = '{spins}'" in done.stderr, done.stderr[-2000:]
