"""The OpenAI-compatible HTTP API, served from the tokenizer process (see README: why here)."""
