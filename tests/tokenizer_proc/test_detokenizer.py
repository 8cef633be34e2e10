"""The incremental detokenizer against the real SmolLM2 (byte-level BPE) tokenizer."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from tokenizer_proc.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, direct_decode

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TEXTS = [
    "Hello, world! The quick brown fox.",
    "Emoji: 🌍🚀 and a family 👨‍👩‍👧 done",
    "中文测试：你好，世界。日本語もあります",
    "Accents: café, naïve, Ångström, ñandú",
    "  leading spaces\n\n\tand tabs\n  trailing   ",
    "mixed 🎉 中 é\n x",
]


def _stream(tokenizer: PreTrainedTokenizerBase, ids: list[int], group: int) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add(ids[i : i + group]) for i in range(0, len(ids), group)]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("group", [1, 2, 3, 7])
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_add_up_to_the_full_decode(tokenizer: PreTrainedTokenizerBase, text: str, group: int) -> None:
    ids = tokenizer.encode(text)
    deltas = _stream(tokenizer, ids, group)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert not any(REPLACEMENT_CHAR in d for d in deltas), deltas


def test_multibyte_characters_are_held_until_complete(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer.encode("🌍")
    assert len(ids) > 1, "the test needs an emoji split over several byte tokens"
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.add([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1:]) == "🌍"


def test_special_tokens_are_not_shown(tokenizer: PreTrainedTokenizerBase) -> None:
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("Paris") + [eos]
    deltas = _stream(tokenizer, ids, 1)
    assert "".join(deltas) == "Paris"
    assert detok_full(tokenizer, ids) == "Paris"


def detok_full(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    detok = IncrementalDetokenizer(tokenizer)
    detok.add(ids)
    return detok.full_text()


def test_flush_emits_a_truncated_character(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer.encode("a🌍")[:-1]  # the emoji's last byte never comes
    detok = IncrementalDetokenizer(tokenizer)
    streamed = "".join(detok.add([t]) for t in ids)
    assert REPLACEMENT_CHAR not in streamed
    assert streamed + detok.flush() == tokenizer.decode(ids, skip_special_tokens=True)


def test_random_token_soup_still_adds_up(tokenizer: PreTrainedTokenizerBase) -> None:
    """A model can emit any ids, broken UTF-8 included; the deltas must still add up."""
    import random

    rng = random.Random(7)
    byte_tokens = tokenizer.encode("🌍中é")  # partial-byte tokens make broken sequences likely
    for _ in range(20):
        ids = [
            rng.choice(byte_tokens) if rng.random() < 0.5 else rng.randrange(len(tokenizer))
            for _ in range(30)
        ]
        for group in (1, 4):
            assert "".join(_stream(tokenizer, ids, group)) == tokenizer.decode(ids, skip_special_tokens=True)


def test_the_direct_route_gives_transformers_text(tokenizer: PreTrainedTokenizerBase) -> None:
    direct = direct_decode(tokenizer)
    assert direct is not None, "the embedded model's fast tokenizer only forwards to its Rust object"
    ids = [i for text in TEXTS for i in tokenizer.encode(text)] + [tokenizer.eos_token_id]
    for start in range(0, len(ids), 5):  # short windows, as the detokenizer decodes them
        for end in range(start + 1, min(start + 6, len(ids)) + 1):
            assert direct(ids[start:end]) == tokenizer.decode(ids[start:end], skip_special_tokens=True)


def test_no_direct_route_where_transformers_would_change_the_text(
    tokenizer: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    assert direct_decode(tokenizer) is None
    detok = IncrementalDetokenizer(tokenizer)  # then the tokenizer's own decode serves
    assert detok.add(tokenizer.encode("Hello, world")) == tokenizer.decode(tokenizer.encode("Hello, world"))
    assert direct_decode(object()) is None
