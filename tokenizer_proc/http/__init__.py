"""The OpenAI-compatible HTTP API, served from the tokenizer process (docs/architecture.md says why there)."""
