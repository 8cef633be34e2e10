"""Stop strings: find them in streamed text, and never emit a stop string or what follows it."""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Filters one request's text deltas against its stop strings.

    ``feed`` returns the text that is safe to emit now. It holds back the
    longest tail of the text that is still the beginning of some stop string,
    because the next delta may complete it. Invariant: every occurrence of a
    stop string starts inside ``_held`` + the new delta, never in emitted text.
    With no stop strings it passes text straight through.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        assert all(stop), "stop strings must be non-empty (validation rejects empty ones)"
        self._stop = tuple(stop)
        self._held = ""
        self.matched: str | None = None  # the stop string that ended the text, once found

    def feed(self, text: str) -> str:
        """Add a delta; return what may be emitted. Sets ``matched`` on a stop string."""
        assert self.matched is None, f"text fed after stop string {self.matched!r} matched"
        if not self._stop:
            return text
        buffer = self._held + text
        hit = self._earliest_match(buffer)
        if hit is not None:
            start, self.matched = hit
            self._held = ""
            return buffer[:start]
        keep = self._partial_match_len(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """The held-back tail: at finish it can no longer become a stop string."""
        held, self._held = self._held, ""
        return held

    def _earliest_match(self, buffer: str) -> tuple[int, str] | None:
        """(start, stop string) of the stop string occurring first in ``buffer``."""
        best: tuple[int, str] | None = None
        for stop in self._stop:
            start = buffer.find(stop)
            if start >= 0 and (best is None or start < best[0]):
                best = (start, stop)
        return best

    def _partial_match_len(self, buffer: str) -> int:
        """Length of the longest tail of ``buffer`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stop:
            for length in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:length]):
                    longest = length
                    break
        return longest
