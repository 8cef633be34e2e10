"""The real launcher with --speculative-algorithm ngram on the embedded SmolLM2, beside a plain one:
a chat prompt whose answer repeats its words gives the plain engine's greedy tokens, and the
speculating engine's log and /metrics say drafts were kept."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from client import Client
from protocol import FinishReason, GenerateOutput
from tests.integration.engine import RunningEngine, launched
from tests.tokenizer_proc.http.server import free_port, wait_idle_and_free

LINES = "Number these lines:\napples\nbananas\ncherries\ndates\nelderberries\nfigs\ngrapes\n"
# the scheduler's counts since start, logged with every --decode-log-interval'th decode line and
# when the engine goes idle
ACCEPTED = re.compile(
    r"Speculative decoding\. #drafted-token: (\d+), #accepted-token: (\d+), #verify-row: (\d+)"
)
FLAGS = ("--chunked-prefill-size", "256", "--decode-log-interval", "1")


def answer(engine: RunningEngine) -> GenerateOutput:
    with Client(engine.endpoint, timeout_s=240) as client:
        messages = [{"role": "user", "content": LINES}]
        return client.generate(
            messages=messages, max_new_tokens=64, temperature=0, logprobs=True, top_logprobs=2
        )


def logged_drafts(engine: RunningEngine) -> tuple[int, int, int]:
    """(drafted, accepted, verify rows) of the last speculation line."""
    found = ACCEPTED.findall(engine.log())
    assert found, "the speculating engine logged no line with its drafts"
    drafted, accepted, rows = found[-1]
    return int(drafted), int(accepted), int(rows)


def metered_drafts(base_url: str) -> tuple[int, int, int]:
    """(drafted, accepted, verify rows) from /metrics once the engine is idle (its last count sent),
    the two ratios checked against them."""
    m = wait_idle_and_free(base_url, 30.0)
    names = ("draft_tokens", "accepted_tokens", "verify_rows")
    drafted, accepted, rows = (int(m[f"rivulet_spec_{name}_total"]) for name in names)
    assert 0 < rows <= drafted, f"{rows} verify rows carried {drafted} drafts"
    assert m["rivulet_spec_acceptance_ratio"] == pytest.approx(accepted / drafted)
    assert m["rivulet_spec_accept_length"] == pytest.approx(1 + accepted / rows)
    return drafted, accepted, rows


@pytest.mark.timeout(600)
def test_the_launcher_speculating_gives_the_plain_engines_greedy_tokens(tmp_path: Path) -> None:
    """Float32 activations on GGUF blocks: a verify row's positions take other matmul row counts
    than decode rows, so a near tie may flip (docs/speculative.md); the tokens are equal, or equal
    up to a position where both are the plain engine's top 2."""
    (tmp_path / "plain").mkdir()
    (tmp_path / "ngram").mkdir()
    port = free_port()
    ngram_flags = (*FLAGS, "--speculative-algorithm", "ngram", "--http-port", str(port))
    with (
        launched(None, tmp_path / "plain", *FLAGS) as plain,
        launched(None, tmp_path / "ngram", *ngram_flags) as ngram,
    ):
        plain.wait_ready()
        ngram.wait_ready()
        want, got = answer(plain), answer(ngram)
        metered = metered_drafts(f"http://127.0.0.1:{port}")
        drafted, accepted, rows = logged_drafts(ngram)
        assert not ACCEPTED.search(plain.log()), "the plain engine drafts nothing"
        assert "accept len" not in plain.log() and "accept len: " in ngram.log()
    assert metered == (drafted, accepted, rows), "/metrics and the log count the same drafts"
    assert want.text.count("grapes") > 2, f"the answer must repeat its words: {want.text!r}"
    assert accepted > drafted / 2 > 0, f"{accepted} of {drafted} drafts kept"
    assert got.finish_reason is want.finish_reason is not FinishReason.ERROR
    ours, theirs = got.token_ids, want.token_ids
    k = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
    assert got.logprobs is not None and want.logprobs is not None and want.top_logprobs is not None
    assert got.logprobs[:k] == pytest.approx(want.logprobs[:k], abs=1e-3), "the kept drafts' logprobs"
    if k is None:
        assert (ours, got.text) == (theirs, want.text)
    else:
        top2 = set(want.top_logprobs[k].token_ids)
        assert {ours[k], theirs[k]} <= top2, f"token {k}: {got.text!r} vs {want.text!r}"
