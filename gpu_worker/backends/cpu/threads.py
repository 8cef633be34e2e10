"""How many CPU threads each forward uses, chosen from measured step times.

On a small shared CPU the best thread count flips with what else runs: with the
other cores idle more threads are faster at every shape, and with one busy process
beside the worker (the scheduler, the tokenizer, a client, or another tenant) they
are slower, because every op waits at a barrier for the thread that lost its core
(docs/benchmarks-history.md, "Worker threads"). A fixed choice is wrong half the time,
so the worker keeps the recent step times per (batch shape class, thread count),
uses the count with the lower median, and re-tries the other for a few steps now
and then, less and less often while it keeps losing. Medians, not means: a
neighbour's burst makes single steps slow.

Opt-in (``--tune-threads``): on an idle machine the re-tries and the many
shape classes of a serving mix cost more than they find (docs/benchmarks-history.md).

By default (neither ``--num-threads`` nor ``--tune-threads``) a ``ContentionGuard`` watches
how long the worker's thread waited for a core during each step (the kernel's run-queue delay):
with every core free that is near zero, and libgomp's spinning threads at all cores are the
fastest choice; once other work takes the cores, a spinning thread holds the core its sibling
needs to reach the barrier and every parallel region waits a time slice (docs/benchmarks-history.md,
"A shared CPU"), so the guard drops to half the cores and comes back once the waits are gone,
waiting longer each time the machine sends it back.

This module is pure: no torch, no clock. The runner measures and applies.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

WINDOW = 5  # recent step times kept per (class, thread count)
RETRY_STEPS = 3  # consecutive steps a re-try runs the other count
FIRST_RETRY_EVERY = 8  # steps of the used count between re-tries, at first
MAX_RETRY_EVERY = 512  # the interval doubles on every lost re-try up to this


CONTENDED_SHARE = 0.3  # steps that waited for a core this share of their time: the cores are shared
# Windows in a row above CONTENDED_SHARE before halving: the engine's own tokenizer and scheduler
# make one-window spikes (a burst of arrivals), other work on the cores a lasting share.
CONTENDED_WINDOWS = 2
CALM_SHARE = 0.05  # below this the machine is the worker's again
WINDOW_S = 0.05  # the guard judges the waits of at least this much stepping at once
FIRST_CALM_WINDOWS = 4  # calm windows before all cores again, doubled on every return that fails
MAX_CALM_WINDOWS = 256


class ContentionGuard:
    """All cores while the worker's steps do not wait for one; half of them while they do.

    ``record(step_s, waited_s)`` takes a step's wall time and its run-queue delay and returns the
    thread count for the next step. The judgement is per window of ``WINDOW_S`` seconds of steps,
    and halving takes ``CONTENDED_WINDOWS`` of them in a row, so one burst decides nothing. A
    return to all cores that meets contention again at once doubles the calm windows the next
    return needs: a machine with one busy neighbour does not make the worker flip every few steps.
    """

    def __init__(self, cores: int) -> None:
        assert cores >= 2, "one core has nothing to give back"
        self.full, self.reduced = cores, max(1, cores // 2)
        self.threads = cores
        self._step_s = self._waited_s = 0.0
        self._calm = 0  # calm windows in a row while reduced
        self._contended = 0  # contended windows in a row at all cores
        self._calm_needed = FIRST_CALM_WINDOWS
        self._just_returned = False  # the first window after a return to all cores

    def record(self, step_s: float, waited_s: float) -> int:
        self._step_s += step_s
        self._waited_s += waited_s
        if self._step_s < WINDOW_S:
            return self.threads
        share = self._waited_s / self._step_s
        self._step_s = self._waited_s = 0.0
        if self.threads == self.full:
            self._contended = self._contended + 1 if share > CONTENDED_SHARE else 0
            if self._contended >= CONTENDED_WINDOWS:
                if self._just_returned:
                    self._calm_needed = min(2 * self._calm_needed, MAX_CALM_WINDOWS)
                self.threads, self._calm, self._contended = self.reduced, 0, 0
                self._just_returned = False
            elif self._contended == 0 and self._just_returned:
                self._calm_needed = FIRST_CALM_WINDOWS  # the return held: the next one is quick again
                self._just_returned = False
            return self.threads
        self._calm = self._calm + 1 if share < CALM_SHARE else 0
        if self._calm >= self._calm_needed:
            self.threads, self._just_returned = self.full, True
        return self.threads


def shape_class(rows: int, tokens: int) -> tuple[str, int]:
    """Batches that cost about the same: decode batches by rows, others by tokens, in powers of 2."""
    if rows == tokens:
        return ("decode", max(rows - 1, 0).bit_length())
    return ("extend", max(tokens - 1, 0).bit_length())


@dataclass
class _ClassState:
    """Recent step times of one shape class per thread count, and the re-try schedule."""

    preferred: int
    times: dict[int, deque[float]] = field(default_factory=dict)
    trying: int | None = None  # the count a running re-try uses
    tries_left: int = 0
    steps_since_retry: int = 0
    retry_every: int = RETRY_STEPS  # the first re-try comes right after a short first look

    def median(self, threads: int) -> float:
        times = self.times.get(threads)
        return statistics.median(times) if times else float("inf")


class ThreadTuner:
    """Picks a thread count per step among ``choices``; ``record`` feeds back the step's time.

    Each shape class starts on the largest count; every ``retry_every`` steps the
    best other count runs ``RETRY_STEPS`` steps in a row, and the lower median
    wins. A lost re-try doubles the interval, a won one resets it, and a used
    count whose median climbs above the other's brings the next re-try forward.
    """

    def __init__(self, choices: tuple[int, ...]) -> None:
        assert len(set(choices)) >= 2 and all(c >= 1 for c in choices), f"bad thread choices {choices}"
        self.choices = tuple(sorted(set(choices), reverse=True))
        self._classes: dict[tuple[str, int], _ClassState] = {}

    def choose(self, key: tuple[str, int]) -> int:
        state = self._state(key)
        if state.trying is None and state.steps_since_retry >= state.retry_every:
            others = [c for c in self.choices if c != state.preferred]
            untried = [c for c in others if c not in state.times]
            state.trying = untried[0] if untried else min(others, key=state.median)
            state.times[state.trying] = deque(maxlen=WINDOW)  # older times of it are stale
            state.tries_left = RETRY_STEPS
        return state.preferred if state.trying is None else state.trying

    def record(self, key: tuple[str, int], threads: int, seconds: float) -> None:
        state = self._state(key)
        state.times.setdefault(threads, deque(maxlen=WINDOW)).append(seconds)
        if threads == state.trying:
            state.tries_left -= 1
            if state.tries_left == 0:
                self._judge_retry(state, threads)
        elif threads == state.preferred:
            state.steps_since_retry += 1
            others = [c for c in state.times if c != threads]
            if others and state.median(threads) > min(state.median(c) for c in others):
                state.steps_since_retry = max(state.steps_since_retry, state.retry_every)

    def preferred(self, key: tuple[str, int]) -> int | None:
        """The count this class uses now (None before its first step)."""
        state = self._classes.get(key)
        return None if state is None else state.preferred

    def _state(self, key: tuple[str, int]) -> _ClassState:
        return self._classes.setdefault(key, _ClassState(preferred=self.choices[0]))

    @staticmethod
    def _judge_retry(state: _ClassState, tried: int) -> None:
        won = state.median(tried) < state.median(state.preferred)
        if won:
            state.preferred, state.retry_every = tried, FIRST_RETRY_EVERY
        else:
            state.retry_every = min(max(2 * state.retry_every, FIRST_RETRY_EVERY), MAX_RETRY_EVERY)
        state.trying, state.steps_since_retry = None, 0
