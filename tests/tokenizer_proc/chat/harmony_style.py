"""A gpt-oss-style chat template and tokenizer (no gpt-oss tokenizer exists offline): SmolLM2's
vocabulary with harmony's markers added as special tokens, and a template that renders harmony as
gpt-oss's own does: a system message (reasoning effort, the channels), a developer message (the
instructions, the tools as a TypeScript namespace), past calls as ``<|start|>assistant
to=functions.NAME<|channel|>commentary json<|message|>ARGS<|call|>`` (one per assistant message),
results as ``<|start|>functions.NAME to=assistant<|channel|>commentary<|message|>"JSON"<|end|>``,
and a generation prompt of ``<|start|>assistant``."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizer_proc.chat.harmony_tokens import CALL, MARKERS, RETURN

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

GPT_OSS_STYLE_TEMPLATE = r"""
{%- macro ts_type(p) -%}
{%- if p.enum is defined -%}{{ p.enum | map('tojson') | join(' | ') }}
{%- elif p.type == 'string' -%}string
{%- elif p.type in ['number', 'integer'] -%}number
{%- elif p.type == 'boolean' -%}boolean
{%- elif p.type == 'array' -%}{{ ts_type(p['items']) if p['items'] is defined else 'any' }}[]
{%- else -%}any
{%- endif -%}
{%- endmacro -%}
{%- macro render_tools(tools) -%}
{{- "## functions\n\nnamespace functions {\n\n" }}
{%- for tool in tools %}
{%- set fn = tool.function if tool.function is defined else tool %}
{%- if fn.description %}{{- "// " + fn.description + "\n" }}{%- endif %}
{{- "type " + fn.name + " = " }}
{%- set params = fn.parameters if fn.parameters is defined and fn.parameters else {} %}
{%- set props = params.properties if params.properties is defined and params.properties else {} %}
{%- if params %}
{{- "(_: {\n" }}
{%- for name, p in props.items() %}
{%- if p.description is defined %}{{- "// " + p.description + "\n" }}{%- endif %}
{{- name }}{%- if name not in (params.required or []) %}{{- "?" }}{%- endif %}
{{- ": " + ts_type(p) + ",\n" }}
{%- endfor %}
{{- "}) => any;\n\n" }}
{%- else %}
{{- "() => any;\n\n" }}
{%- endif %}
{%- endfor %}
{{- "} // namespace functions" }}
{%- endmacro -%}
{{- "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n" }}
{{- "Knowledge cutoff: 2024-06\n\nReasoning: " + (reasoning_effort | default("medium")) + "\n\n" }}
{{- "# Valid channels: analysis, commentary, final. Channel must be included for every message." }}
{%- if tools %}{{- "\nCalls to these tools must go to the commentary channel: 'functions'." }}{%- endif %}
{{- "<|end|>" }}
{%- if messages and messages[0].role in ['system', 'developer'] %}
{%- set developer_message = messages[0].content %}
{%- set loop_messages = messages[1:] %}
{%- else %}
{%- set developer_message = "" %}
{%- set loop_messages = messages %}
{%- endif %}
{%- if developer_message or tools %}
{{- "<|start|>developer<|message|>" }}
{%- if developer_message %}{{- "# Instructions\n\n" + developer_message }}{%- endif %}
{%- if developer_message and tools %}{{- "\n\n" }}{%- endif %}
{%- if tools %}{{- "# Tools\n\n" + render_tools(tools) }}{%- endif %}
{{- "<|end|>" }}
{%- endif %}
{%- set last_tool_call = namespace(name=none) %}
{%- for message in loop_messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{%- if message.tool_calls | length > 1 %}
{{- raise_exception("Assistant messages with more than one tool call are not supported") }}
{%- endif %}
{%- set call = message.tool_calls[0] %}
{%- set call = call.function if call.function is defined else call %}
{%- for said in [message.thinking, message.content] if said %}
{{- "<|start|>assistant<|channel|>analysis<|message|>" + said + "<|end|>" }}
{%- endfor %}
{{- "<|start|>assistant to=functions." + call.name + "<|channel|>commentary json<|message|>" }}
{%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}{%- endif %}
{{- "<|call|>" }}
{%- set last_tool_call.name = call.name %}
{%- elif message.role == 'assistant' %}
{{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}
{%- elif message.role == 'tool' %}
{%- if last_tool_call.name is none %}
{{- raise_exception("Message has tool role, but there was no previous assistant message with a tool call!") }}
{%- endif %}
{{- "<|start|>functions." + last_tool_call.name + " to=assistant<|channel|>commentary<|message|>" }}
{{- message.content | tojson + "<|end|>" }}
{%- elif message.role == 'user' %}
{{- "<|start|>user<|message|>" + message.content + "<|end|>" }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- "<|start|>assistant" }}{%- endif %}
""".strip()


def harmony_tokenizer(base: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """``base`` (SmolLM2's) with harmony's markers as special tokens and the gpt-oss-style template."""
    tok = copy.deepcopy(base)
    tok.add_special_tokens({"additional_special_tokens": list(MARKERS)})
    tok.chat_template = GPT_OSS_STYLE_TEMPLATE
    return tok


# What the scripted model's head favours, by how much: harmony's markers above everything (the end
# ids apart, so the grammar's end is one of them), then the word "analysis".
_FAVOURED = {"<|call|>": 60.0, "<|return|>": 55.0, "analysis": 20.0}
_MARKER_LOGIT = 50.0


def save_harmony_model(base: PreTrainedTokenizerBase, out: Path) -> Path:
    """A tiny Llama with the harmony tokenizer and template, scripted so that a grammar decides its
    reply: wherever a grammar allows one of harmony's markers it writes the marker (never the same
    text spelled in ordinary tokens), it prefers the word "analysis" to any other ordinary token,
    and it ties every other token (greedy decoding then takes the lowest id the grammar allows).

    How: hidden dimension 0 of the residual stream is 1 for every token (embedding column 0 set,
    nothing writes to it), so it stays positive through the final norm; the head reads only that
    dimension, and only for the favoured tokens."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tok = harmony_tokenizer(base)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0].zero_()
            layer.mlp.down_proj.weight[0].zero_()
        model.lm_head.weight.zero_()
        for marker in MARKERS:
            model.lm_head.weight[tok.convert_tokens_to_ids(marker), 0] = _MARKER_LOGIT
        for word, logit in _FAVOURED.items():
            (token,) = tok.encode(word, add_special_tokens=False)
            model.lm_head.weight[token, 0] = logit
    model.generation_config = GenerationConfig(
        eos_token_id=[tok.convert_tokens_to_ids(m) for m in (RETURN, CALL)]
    )
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out
