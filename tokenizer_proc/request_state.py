"""One in-flight request as the tokenizer process sees it: its tokens become text, the text is
checked for stop strings and parsed (chat), and replies are made from it."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from protocol.logprobs import TopTokens
from protocol.messages import FinishReason, GenerateOutput, Usage
from tokenizer_proc.chat.output import ChatPiece, merge_calls
from tokenizer_proc.chat.reply_parser import ReplyParser
from tokenizer_proc.detokenizer import IncrementalDetokenizer
from tokenizer_proc.echo import EchoPrompt, to_client
from tokenizer_proc.stop import StopMatcher


@dataclass
class RequestState:
    """One in-flight request as the tokenizer process sees it.

    ``incremental`` is False for a non-streaming request without stop strings:
    nobody looks at its text before the end, so it is decoded once at finish.
    """

    rid: int
    client_id: bytes
    client_rid: str
    prompt_tokens: int
    stream: bool
    want_logprobs: bool
    detokenizer: IncrementalDetokenizer
    stop: StopMatcher
    incremental: bool
    arrival_s: float
    last_token_s: float | None = None  # None until the first token
    logprobs: list[float] = field(default_factory=list)
    text: str = ""  # text emitted so far (kept for the non-streaming reply)
    cached_tokens: int = 0
    want_top: bool = False  # the client asked for top-N alternatives
    top: list[TopTokens] = field(default_factory=list)  # one per output token when want_top
    echo: EchoPrompt | None = None
    chat: ReplyParser | None = None  # chat replies: reasoning and tool calls parsed out
    index: int = 0  # its choice (n > 1: the choices are rids rid - index .. rid - index + n - 1)
    num_choices: int = 1
    embedding: list[float] | None = None  # an embedding request's vector, normalized, once it came

    @property
    def output_ids(self) -> list[int]:
        return self.detokenizer.token_ids

    def advance(self, new_ids: list[int], *, final: bool) -> str:
        """Take new tokens; return the text now safe to show. ``stop.matched`` tells a stop string."""
        if not self.incremental:
            self.output_ids.extend(new_ids)
            return ""  # final_output decodes the whole text once
        delta = self.detokenizer.add(new_ids)
        if final:
            delta += self.detokenizer.flush()
        shown = self.stop.feed(delta)
        if final and self.stop.matched is None:
            shown += self.stop.flush()
        self.text += shown
        return shown

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=len(self.output_ids),
            cached_tokens=self.cached_tokens,
        )

    def final_output(self, delta: str, new_ids: list[int], reason: FinishReason) -> GenerateOutput:
        """The last reply: the delta when streaming, else the whole text and tokens."""
        if self.stream:
            return self._output(delta, new_ids, reason)
        text = self.text if self.incremental else self.detokenizer.full_text()
        return self._output(text, list(self.output_ids), reason)

    def _chat_piece(self, text: str, ids: list[int], final: bool) -> ChatPiece:
        """The reply text (and its tokens ``ids``, for harmony) as content, reasoning and tool calls
        (all content for non-chat requests)."""
        if self.chat is None:
            return ChatPiece(text)
        piece = self.chat.feed(text, final=final, ids=ids)
        if not self.stream:
            piece.tool_calls = merge_calls(piece.tool_calls)
        return piece

    def _output(self, text: str, ids: list[int], reason: FinishReason | None) -> GenerateOutput:
        """A reply with ``ids``, the last tokens so far, and their logprobs where asked."""
        first = len(self.logprobs) - len(ids)
        piece = self._chat_piece(text, ids, final=reason is not None)
        if reason is FinishReason.STOP and self.chat is not None and self.chat.made_calls:
            reason = FinishReason.TOOL_CALLS
        out = GenerateOutput(
            rid=self.client_rid,
            text=piece.content,
            reasoning_text=piece.reasoning,
            tool_calls=piece.tool_calls or None,
            token_ids=ids,
            logprobs=self.logprobs[first:] if self.want_logprobs else None,
            finish_reason=reason,
            usage=self.usage() if reason is not None else None,
            top_logprobs=[to_client(t) for t in self.top[first:]] if self.want_top else None,
            index=self.index,
            embedding=self.embedding if reason is not None else None,
        )
        echo = self.echo
        if echo is None or echo.sent:
            return out
        echo.sent = True
        return msgspec.structs.replace(
            out,
            prompt_token_ids=echo.token_ids,
            prompt_text=echo.text,
            prompt_logprobs=echo.logprobs,
            prompt_top_logprobs=echo.top,
        )

    def stream_output(self, delta: str, new_ids: list[int]) -> GenerateOutput:
        return self._output(delta, new_ids, None)
