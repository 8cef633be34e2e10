"""Chat requests in the tokenizer: the prompt through the model's chat template with tools and tool
history (``template.py``), the checks of tools and the grammar of a forced call
(``tool_checks.py``), and the reply split into content, reasoning and tool calls (``output.py``,
over ``reasoning.py`` and ``tool_parsers.py``)."""
