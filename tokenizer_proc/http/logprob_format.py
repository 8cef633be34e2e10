"""Logprobs in OpenAI's two response shapes: the legacy completions object and chat's content list.

Completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``; each
``top_logprobs`` entry maps token strings to logprobs, the N most likely plus the chosen token
(so up to N + 1 entries, as OpenAI documents), None for an echoed prompt's first token, and the
whole list is None when the request asked for logprobs=0. Chat: one ``{"token", "logprob",
"bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}`` per token.
"""

from __future__ import annotations

from typing import Any

from protocol.logprobs import TopLogprobs
from tokenizer_proc.token_bytes import TokenTexts


def completion_logprobs(
    texts: TokenTexts,
    ids: list[int],
    logprobs: list[float | None],
    tops: list[TopLogprobs | None] | None,
    offset: int,
) -> tuple[dict[str, Any], int]:
    """The legacy object for ``ids``, whose text starts at character ``offset``; and the offset
    after them."""
    tokens = [texts.text_of(t) for t in ids]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    top_dicts = None
    if tops is not None:
        top_dicts = [
            None if top is None else _top_dict(texts, top, token_id, logprob)
            for top, token_id, logprob in zip(tops, ids, logprobs, strict=True)
        ]
    body = {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top_dicts, "text_offset": offsets}
    return body, offset


def _top_dict(
    texts: TokenTexts, top: TopLogprobs, chosen: int, chosen_logprob: float | None
) -> dict[str, float]:
    """Most likely first; where two tokens show as the same string the likelier one's logprob stays."""
    out: dict[str, float] = {}
    for token_id, logprob in zip(top.token_ids, top.logprobs, strict=True):
        out.setdefault(texts.text_of(token_id), logprob)
    if chosen_logprob is not None:
        out.setdefault(texts.text_of(chosen), chosen_logprob)
    return out


def chat_logprobs(
    texts: TokenTexts, ids: list[int], logprobs: list[float], tops: list[TopLogprobs] | None
) -> dict[str, Any]:
    content = []
    for i, (token_id, logprob) in enumerate(zip(ids, logprobs, strict=True)):
        alternatives = [] if tops is None else [
            _chat_entry(texts, t, lp) for t, lp in zip(tops[i].token_ids, tops[i].logprobs, strict=True)
        ]  # fmt: skip
        content.append({**_chat_entry(texts, token_id, logprob), "top_logprobs": alternatives})
    return {"content": content, "refusal": None}


def _chat_entry(texts: TokenTexts, token_id: int, logprob: float) -> dict[str, Any]:
    return {"token": texts.text_of(token_id), "logprob": logprob, "bytes": list(texts.bytes_of(token_id))}
