"""A Qwen3-style chat template (no Qwen3 tokenizer or template exists offline): ChatML turns, tools
in the system turn, ``<tool_call>`` calls, tool results as ``<tool_response>`` user turns, and a
think block that the generation prompt opens (``enable_thinking``, the default) or closes empty
(``enable_thinking=false``), as Qwen3's own template and its thinking variants do."""

from __future__ import annotations

QWEN3_STYLE_TEMPLATE = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- '# Tools\n\nYou may call functions. Their signatures are within <tools></tools>:\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\n\nReturn each call as <tool_call>\n{"name": <name>, "arguments": <object>}\n' }}
{{- '</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' + (message.content or '') }}
{%- for call in message.tool_calls or [] %}
{%- set args = call.function.arguments %}
{{- '\n<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' }}
{%- if args is string %}{{- args }}{%- else %}{{- args | tojson }}{%- endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
{%- elif message.role != 'system' %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}
{%- else %}{{- '<think>\n' }}{%- endif %}
{%- endif %}
""".strip()
