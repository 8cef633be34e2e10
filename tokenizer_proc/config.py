"""The tokenizer process's configuration, built once by the launcher."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenizerConfig:
    """``model_path`` is the resolved HF directory holding the tokenizer files.

    ``http_port`` None serves no HTTP API (0 picks a free port, logged at start).
    On SIGTERM, requests in flight get up to ``shutdown_timeout_s`` to finish
    before they are failed; new ones are refused meanwhile.
    """

    model_path: str = ""
    seed: int = 0  # draws per-request sampling seeds when the client gives none
    http_host: str = "127.0.0.1"
    http_port: int | None = None
    api_key: str | None = None
    served_model_name: str = "rivulet"
    shutdown_timeout_s: float = 0.0

    def __post_init__(self) -> None:
        assert self.shutdown_timeout_s >= 0, f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}"
        assert self.http_port is None or 0 <= self.http_port < 65536, f"bad http_port {self.http_port}"
