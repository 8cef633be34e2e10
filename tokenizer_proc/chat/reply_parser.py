"""The parser of a chat reply, chosen by its plan: harmony's (token ids, chat/harmony.py) for a
harmony model, else the text parser of reasoning and tool calls (chat/output.py); none for a reply
with nothing to split."""

from __future__ import annotations

from tokenizer_proc.chat.harmony import HarmonyParser
from tokenizer_proc.chat.output import ChatOutputParser, new_call_id
from tokenizer_proc.chat.template import ChatOutputPlan
from tokenizer_proc.detokenizer import TokenDecoder

ReplyParser = ChatOutputParser | HarmonyParser


def reply_parser(plan: ChatOutputPlan | None, decoder: TokenDecoder) -> ReplyParser | None:
    if plan is not None and plan.harmony is not None:
        return HarmonyParser(plan.harmony, decoder, plan.tool_names, new_call_id, plan.first_call_only)
    if plan is None or not (plan.reasoning or plan.tool_format is not None):
        return None
    return ChatOutputParser(plan)
