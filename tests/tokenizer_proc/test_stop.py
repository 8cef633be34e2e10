"""The stop-string matcher: held-back tails, spanning deltas, earliest match."""

from __future__ import annotations

from tokenizer_proc.stop import StopMatcher


def _feed_all(matcher: StopMatcher, deltas: list[str]) -> str:
    shown = ""
    for delta in deltas:
        shown += matcher.feed(delta)
        if matcher.matched is not None:
            return shown
    return shown + matcher.flush()


def test_stop_string_spanning_deltas_is_cut_with_what_follows() -> None:
    matcher = StopMatcher(["</end>"])
    shown = _feed_all(matcher, ["Hello </", "en", "d> tail", "more"])
    assert matcher.matched == "</end>"
    assert shown == "Hello "


def test_possible_prefix_is_held_back_then_flushed() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("abc ST") == "abc "  # "ST" may become STOP
    assert matcher.feed("O") == ""
    assert matcher.feed("P!") == ""
    assert matcher.matched == "STOP"

    matcher = StopMatcher(["STOP"])
    assert matcher.feed("abc ST") == "abc "
    assert matcher.feed("ar") == "STar"  # no longer a prefix: released
    assert matcher.feed("x S") == "x "
    assert matcher.flush() == "S"
    assert matcher.matched is None


def test_earliest_of_several_stop_strings_wins() -> None:
    matcher = StopMatcher(["world", "lo"])
    assert matcher.feed("hello world") == "hel"
    assert matcher.matched == "lo"

    matcher = StopMatcher(["cd", "abcdef"])
    shown = _feed_all(matcher, ["xab", "cdef"])
    assert (shown, matcher.matched) == ("x", "abcdef")  # starts first, though "cd" ends first


def test_no_stop_strings_pass_text_through() -> None:
    matcher = StopMatcher([])
    assert matcher.feed("anything at all") == "anything at all"
    assert matcher.flush() == ""


def test_text_without_match_is_fully_emitted() -> None:
    deltas = ["The answer", " is 4", "2.", " Done"]
    matcher = StopMatcher(["\n\n", "Question:"])
    assert _feed_all(matcher, deltas) == "".join(deltas)
    assert matcher.matched is None


def test_stop_string_inside_one_delta() -> None:
    matcher = StopMatcher(["\n"])
    assert matcher.feed("line one\nline two") == "line one"
    assert matcher.matched == "\n"
